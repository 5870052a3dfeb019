"""Growing a draft tree level by level, shared by every drafter that runs a model (draft model, EAGLE).

A drafter supplies one callable, ``feed(exp, nodes) -> logits [R, V']``: run its model on the
tokens of ``nodes`` (each attending to the context, its ancestors among the nodes fed so far and
itself; ``feed_mask`` builds that mask) and return the logits of the next token after each. The
expansion decides which nodes to grow. Each is a generator (``grow_*``) that yields the nodes it needs
fed and is sent their logits, so a batch can feed its rows' levels in one pass
(``Proposer.propose_steps``; EAGLE's ``StackedRows``); ``expand_*`` runs one with a feed (``drive``):

- ``expand_static``: a fixed tree (paths of top-k ranks). Greedy takes the rank-r candidate;
  sampling draws the children without replacement from the drafter's processed distribution q
  (Gumbel-top-k), which verification needs (SpecInfer, arXiv:2305.09781).
- ``expand_dynamic``: EAGLE-2 (Li et al., 2024, arXiv:2406.16858): per depth, expand the top-k
  children of the ``top_k`` best frontier nodes by cumulative log-probability, then rerank every
  candidate and keep the ``total_tokens`` best. Candidates are deterministic given the context
  (top-k), so verification treats them as one-hot drafts: lossless for greedy and sampling.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Generator, NamedTuple

import torch

from headway.heads.values import parse_bool
from headway.inference import vocab_reduce
from headway.inference.proposer import Draft, exact_float, sample_children
from headway.inference.tree import Tree, device_tree, shaped_tree
from headway.inference.verify import SamplingParams


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 dynamic tree settings (the paper: depth 6, top_k 10, total_tokens 60 on GPUs)."""

    depth: int = 5  # draft steps (levels grown)
    top_k: int = 4  # children per expanded node, and nodes expanded per level
    total_tokens: int = 10  # draft nodes kept after the rerank (verification width - 1)
    prune: bool = True  # skip frontier nodes that can have no kept descendant (the same tree, fewer draft rows)

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise ValueError(f"dynamic tree settings must be >= 1, got depth={self.depth}, top_k={self.top_k}, "
                             f"total_tokens={self.total_tokens}")

    @classmethod
    def from_spec(cls, spec: dict) -> "DynamicTree":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - names - {"total_token"})
        if unknown:
            raise ValueError(f"unknown dynamic tree setting(s) {unknown}; use {sorted(names)}")
        spec = dict(spec)
        if "total_token" in spec:  # EAGLE's own spelling
            spec.setdefault("total_tokens", spec.pop("total_token"))
        try:
            return cls(**{k: parse_bool(v, "prune") if k == "prune" else int(v) for k, v in spec.items()})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad dynamic tree settings {spec}: {exc}") from None

    @property
    def name(self) -> str:
        return f"dynamic-d{self.depth}-k{self.top_k}-n{self.total_tokens}" + ("" if self.prune else "-unpruned")


@dataclasses.dataclass
class Expansion:
    """The nodes grown so far this round (node 0 is the root) and the order they were fed in.

    A static tree's expansion keeps its tokens on the device (a long tensor [N], filled level by
    level, never read) and names its ``tree``, whose per-level masks are then built once; a dynamic
    one grows a host list."""

    parents: list[int]
    tokens: list[int] | torch.Tensor
    depths: list[int]
    fed: list[int] = dataclasses.field(default_factory=list)
    tree: Tree | None = None

    def token_ids(self, nodes: list[int], device) -> torch.Tensor:
        """The tokens of ``nodes`` [R] long on ``device`` (gathered there when the tokens live there)."""
        if isinstance(self.tokens, torch.Tensor):
            return self.tokens.index_select(0, self.long_tensor("nodes", nodes, lambda: nodes, self.tokens.device))
        return torch.tensor([self.tokens[n] for n in nodes], device=device)

    def node_depths(self, nodes: list[int], device) -> torch.Tensor:
        """The depths of ``nodes`` [R] long on ``device``."""
        return self.long_tensor("depths", nodes, lambda: [self.depths[n] for n in nodes], device)

    def positions(self, nodes: list[int], offset: int, device) -> torch.Tensor:
        """The depths of ``nodes`` plus ``offset`` [R] long on ``device``: one op (a static tree's depths are built
        once per level, a dynamic one's positions straight from the host)."""
        if self.tree is None:
            return torch.tensor([self.depths[n] + offset for n in nodes], dtype=torch.long, device=device)
        return self.node_depths(nodes, device) + offset

    def long_tensor(self, key: str, nodes: list[int], values: Callable[[], list[int]], device) -> torch.Tensor:
        """``values()`` (one int per node of ``nodes``) as a long tensor on ``device``: built once per level of
        a static tree (no host-to-device copy in later rounds), else each call."""
        def build() -> torch.Tensor:
            return torch.tensor(values(), dtype=torch.long, device=device)

        return build() if self.tree is None else self.tree.cached((key, tuple(nodes), str(device)), build)

    def add(self, parent: int, token: int) -> int:
        self.parents.append(parent)
        self.tokens.append(token)
        self.depths.append(self.depths[parent] + 1)
        return len(self.parents) - 1

    def ancestors(self, node: int) -> set[int]:
        out = set()
        while node > 0:
            out.add(node)
            node = self.parents[node]
        return out


Feed = Callable[[Expansion, list[int]], torch.Tensor]


def feed_mask(exp: Expansion, nodes: list[int], prefix: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, R, prefix + F + R] for feeding ``nodes`` after ``prefix`` cached context
    entries and the F nodes already fed: each row sees the context, its fed ancestors and itself.
    A static tree's block over the fed nodes is built once per level (its feeds never change)."""
    return additive_mask(feed_block(exp, nodes, device), prefix, dtype)


def feed_block(exp: Expansion, nodes: list[int], device) -> torch.Tensor:
    """[R, F + R] bool: True where a row of ``nodes`` must not look among the F nodes already fed (in feed
    order) and ``nodes`` (it sees its fed ancestors and itself); memoised per level of a static tree."""
    def blocked() -> torch.Tensor:
        cols = exp.fed + nodes
        rows = [[m not in anc for m in cols] for anc in map(exp.ancestors, nodes)]
        return torch.tensor(rows, dtype=torch.bool, device=device)

    return blocked() if exp.tree is None else exp.tree.cached(("feed", len(exp.fed), tuple(nodes), str(device)), blocked)


def static_feed_mask(exp: Expansion, nodes: list[int], device, dtype: torch.dtype) -> torch.Tensor | None:
    """A static tree's ``feed_block`` as an additive mask [1, 1, R, F + R] of 0 / finfo.min, built once per level
    (a feed pads it by its context's columns: one op a round where building it takes three); None for a dynamic
    tree (its levels are new each round)."""
    if exp.tree is None:
        return None
    return exp.tree.cached(("feed_mask", len(exp.fed), tuple(nodes), str(device), dtype),
                           lambda: additive_mask(feed_block(exp, nodes, device), 0, dtype))


def sees_all(exp: Expansion, nodes: list[int]) -> bool:
    """True when ``nodes`` is one node and every node fed before it is its ancestor (each level of a chain): its
    step sees the whole cache, so it needs no mask. Decided on the host (memoised per level of a static tree)."""
    def decide() -> bool:
        return len(nodes) == 1 and exp.ancestors(nodes[0]).issuperset(exp.fed)

    return decide() if exp.tree is None else exp.tree.cached(("sees_all", len(exp.fed), tuple(nodes)), decide)


def additive_mask(blocked: torch.Tensor, prefix: int, dtype: torch.dtype) -> torch.Tensor:
    """[R, F + R] bool (True: hidden) -> additive mask [1, 1, R, prefix + F + R] of 0 / finfo.min, the
    ``prefix`` cached context entries visible to every row."""
    r, cols = blocked.shape
    mask = torch.zeros((1, 1, r, prefix + cols), dtype=dtype, device=blocked.device)
    mask[0, 0, :, prefix:].masked_fill_(blocked, torch.finfo(dtype).min)
    return mask


# A growth: a generator that yields (exp, nodes) each time it needs ``nodes`` fed, is sent their logits
# [R, V'], and returns the Draft (``drive`` runs one with a feed; a batch runs its rows' side by side)
Growth = Generator[tuple[Expansion, list[int]], torch.Tensor, Draft]


def drive(growth: Growth, feed: Feed) -> Draft:
    """Run ``growth`` to its Draft, each of its feeds by ``feed``."""
    try:
        exp, nodes = next(growth)
        while True:
            exp, nodes = growth.send(feed(exp, nodes))
    except StopIteration as done:
        return done.value


def _fed(exp: Expansion, nodes: list[int]) -> Generator[tuple[Expansion, list[int]], torch.Tensor, torch.Tensor]:
    logits = yield exp, nodes  # [R, V']
    exp.fed += nodes
    return logits


def expand_static(tree: Tree, root_token: int, root_logits: torch.Tensor, feed: Feed,
                  sampling: SamplingParams | None, generator: torch.Generator | None,
                  to_target: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                  widen: Callable[[torch.Tensor], torch.Tensor] = lambda q: q, scored: bool = True) -> Draft:
    """``grow_static`` with its feeds run by ``feed``."""
    return drive(grow_static(tree, root_token, root_logits, sampling, generator, to_target, widen, scored), feed)


def grow_static(tree: Tree, root_token: int, root_logits: torch.Tensor, sampling: SamplingParams | None,
                generator: torch.Generator | None, to_target: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                widen: Callable[[torch.Tensor], torch.Tensor] = lambda q: q, scored: bool = True) -> Growth:
    """Fill ``tree`` level by level. root_logits: [V'] the drafter's logits after the root.

    ``to_target`` maps indices of the drafter's logits to target token ids, ``widen`` a [V']
    distribution to the target's [V] (both identity for a full vocabulary). Everything stays on the
    device: the tokens, and the scores (a node's draft probability multiplied along its path, which
    tree="auto" reads once; ``scored`` False: nothing reads them this round, none are computed)."""
    device = root_logits.device
    tokens = torch.empty(tree.size, dtype=torch.long, device=device)  # [N]
    tokens[0] = root_token
    scores = torch.ones(tree.size, dtype=torch.float32, device=device) if scored else None  # [N]
    exp = Expansion(list(tree.parents), tokens, list(tree.depths), tree=tree)
    q = {}
    logits = root_logits[None]  # [R, V'] the logits of this level's frontier
    for level in static_levels(tree, device):
        cand, dist = sample_children(logits, level.k, sampling, generator)  # [R, k], [R, V'] | None
        at = level.ranked if dist is None else level.drawn  # [C] in [R, k]: the rank-r token, or the j-th draw
        # flat gathers and index copies: a few microseconds each where tensor subscripts cost twice that
        tokens.index_copy_(0, level.kids, to_target(cand.take(at)))
        if scored:
            p = (dist if dist is not None else logits.float().softmax(-1)).gather(1, cand)  # [R, k]
            scores.index_copy_(0, level.kids, scores.index_select(0, level.parents) * p.take(at))
        if dist is not None:
            for row, node in enumerate(level.frontier):
                q[node] = widen(dist[row])
        if level.grow:
            logits = yield from _fed(exp, level.grow)
    return Draft(tree, tokens, q if sampling is not None else None, scores=scores)


class Level(NamedTuple):
    """One level of a static tree's expansion: its children picked from the frontier's candidates."""

    frontier: list[int]  # [R] nodes whose children are picked (their logits' rows, in order)
    k: int  # candidates drawn per frontier row
    kids: torch.Tensor  # [C] the children picked at this level
    parents: torch.Tensor  # [C] each child's parent node
    ranked: torch.Tensor  # [C] greedy: the child's place in the frontier's candidates [R, k] flattened (row, rank)
    drawn: torch.Tensor  # [C] sampling: the same for (row, the child's place among its siblings: the j-th draw)
    grow: list[int]  # the next frontier: this level's children that have children, fed after it


def static_levels(tree: Tree, device) -> list[Level]:
    """The levels ``expand_static`` runs for ``tree``, their index tensors on ``device`` (memoised)."""
    def build() -> list[Level]:
        levels, frontier = [], [0]
        while frontier:
            picks = [(row, node, j, c) for row, node in enumerate(frontier) for j, c in enumerate(tree.children[node])]
            k = max(max(len(tree.children[n]) for n in frontier), max(tree.ranks[c] for *_, c in picks) + 1)
            grow = [c for *_, c in picks if tree.children[c]]

            def col(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.long, device=device)

            levels.append(Level(frontier, k, col([c for *_, c in picks]), col([node for _, node, *_ in picks]),
                                col([row * k + tree.ranks[c] for row, _, _, c in picks]),
                                col([row * k + j for row, _, j, _ in picks]), grow))
            frontier = grow
        return levels

    return tree.cached(("static_levels", str(device)), build)


def expand_dynamic(settings: DynamicTree, max_depth: int, root_token: int, root_logits: torch.Tensor, feed: Feed,
                   to_target: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> Draft:
    """``grow_dynamic`` with its feeds run by ``feed``."""
    return drive(grow_dynamic(settings, max_depth, root_token, root_logits, to_target), feed)


def grow_dynamic(settings: DynamicTree, max_depth: int, root_token: int, root_logits: torch.Tensor,
                 to_target: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> Growth:
    """EAGLE-2's dynamic tree: grow ``settings.depth`` levels (at most ``max_depth``), expanding the
    ``top_k`` best nodes of each level by cumulative log-probability, then keep the
    ``total_tokens`` best of all candidates (a child never scores above its parent, so the kept set
    is closed under ancestors). Returns a Draft with deterministic candidates (q None).

    ``settings.prune``: do not feed a frontier node that already scores below ``total_tokens`` other
    candidates (none of its descendants could be kept), and stop once no frontier node is left.
    The kept tree is EAGLE-2's own (up to exact ties in score); only the wasted draft rows and
    levels go, which on a CPU, where every row costs, is most of a deep tree's drafting."""
    k, depth, total = settings.top_k, min(settings.depth, max_depth), settings.total_tokens
    exp = Expansion([-1], [root_token], [0])
    score = [0.0]  # cumulative log-probability per node
    frontier, logits = [0], root_logits[None]
    for level in range(depth):
        logp = logits.float().log_softmax(-1)  # [R, V']
        top = vocab_reduce.topk(logp, min(k, logp.shape[-1]))  # [R, k]
        # one read per level: token ids (exact in float64) and log-probabilities together, summed along the path on
        # the host (in float64: the tensor version's float32 sums may break a near-tie the other way)
        ids, logps = torch.stack([to_target(top.indices).double(), top.values.double()]).tolist()
        new = []
        for row, node in enumerate(frontier):
            for j in range(len(ids[row])):
                child = exp.add(node, int(ids[row][j]))
                score.append(score[node] + logps[row][j])
                new.append(child)
        if level + 1 == depth:
            break
        frontier = sorted(new, key=lambda n: (-score[n], n))[:k]  # the best k of this level grow on
        if settings.prune and len(score) > total:
            bar = sorted(score[1:], reverse=True)[total - 1]  # the total-th best candidate so far
            frontier = [n for n in frontier if score[n] >= bar]
            if not frontier:
                break
        frontier.sort()
        logits = yield from _fed(exp, frontier)
    keep = sorted(range(1, len(exp.parents)), key=lambda n: (-score[n], exp.depths[n], n))[:total]
    return kept_draft(settings, keep, exp.parents, exp.tokens, score, exp.depths, root_logits.device)


def kept_draft(settings: DynamicTree, keep: list[int], parents, tokens, score, depths, device) -> Draft:
    """The Draft of the kept nodes ``keep`` (node ids, the root 0 not among them; closed under
    ancestors), ordered parents first by (depth, -score, id) and renumbered. ``parents``,
    ``tokens``, ``score`` (cumulative log-probability) and ``depths`` are indexable by node id."""
    order = [0] + sorted(keep, key=lambda n: (depths[n], -score[n], n))
    index = {old: new for new, old in enumerate(order)}
    assert all(parents[n] in index for n in keep), "dynamic tree lost an ancestor"
    tree_parents = [-1] + [index[parents[n]] for n in order[1:]]
    ids = torch.tensor([tokens[n] for n in order], dtype=torch.long, device=device)
    # one Tree per shape (``shaped_tree``): a shape drafted before comes with its masks and verification tensors built
    return Draft(shaped_tree(tree_parents, name=settings.name), ids, None, scores=[math.exp(score[n]) for n in order])


# feed_rows(tokens [R] long, parent_rows [R] long: each row's parent among the previous feed's rows, -1 the root,
# depth: every row's depth, allowed [R, F + R] bool: the fed nodes (feed order) and these rows each row sees) -> [R, V']
FeedRows = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


def expand_dynamic_tensors(settings: DynamicTree, max_depth: int, root_token: int, root_logits: torch.Tensor,
                           feed: FeedRows, to_target: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> Draft:
    """``grow_dynamic_tensors`` run to its Draft, each of its feeds by ``feed``."""
    growth = grow_dynamic_tensors(settings, max_depth, root_token, root_logits, to_target)
    try:
        rows = next(growth)
        while True:
            rows = growth.send(feed(*rows))
    except StopIteration as done:
        return done.value


def grow_dynamic_tensors(settings: DynamicTree, max_depth: int, root_token: int, root_logits: torch.Tensor,
                         to_target: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
                         ) -> Generator[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor, Draft]:
    """``expand_dynamic`` as tensor ops with fixed shapes and no read: the kept tree stays on the device (a
    ``DeviceTree``, its scores a tensor), its shape read with the round's verification. A generator: it yields each
    feed's ``FeedRows`` arguments (tokens, parent_rows, depth, allowed), is sent their logits [R, V'] (or [1, V']:
    one row every node of the level shares, scored once), and returns the Draft (a
    batch runs its rows' feeds together).

    Every level feeds ``top_k`` rows (the level's best, ids ascending as the host version feeds
    them). Dropping a row takes a read, so there is no pruning: a row ``settings.prune`` would skip
    scores below the ``total_tokens``-th best candidate already, and so does every descendant
    (a child never scores above its parent), so it is fed and none of its outputs is kept. The kept
    tree is ``expand_dynamic``'s with or without pruning (up to exact ties in score). ``feed`` sees
    each row's parent as a row of the previous feed (``parent_rows``, -1 for the root) and the mask
    rows over the fed nodes as a bool [R, F + R]."""
    k, depth, total = settings.top_k, min(settings.depth, max_depth), settings.total_tokens
    device = root_logits.device
    tokens = torch.full((1,), root_token, dtype=torch.long, device=device)  # [M] every node's token, root first
    parents = torch.full((1,), -1, dtype=torch.long, device=device)  # [M]
    depths = torch.zeros(1, dtype=torch.long, device=device)  # [M]
    score = torch.zeros(1, dtype=torch.float32, device=device)  # [M] cumulative log-probability
    frontier = torch.zeros(1, dtype=torch.long, device=device)  # [R] the nodes whose logits these are
    allowed = torch.zeros((1, 0), dtype=torch.bool, device=device)  # [R, F] the rows' fed ancestors-or-self
    logits = root_logits[None]
    for level in range(depth):
        logp = logits.float().log_softmax(-1)  # [R, V'] (or [1, V'] shared by the R rows)
        top = vocab_reduce.topk(logp, min(k, logp.shape[-1]))  # [R or 1, k']
        values, indices = top.values.expand(frontier.shape[0], -1), top.indices.expand(frontier.shape[0], -1)
        width = indices.shape[1]
        cum = values + score[frontier][:, None]  # [R, k']
        base = tokens.shape[0]
        tokens = torch.cat([tokens, to_target(indices).flatten()])
        parents = torch.cat([parents, frontier.repeat_interleave(width)])
        depths = torch.cat([depths, depths.new_full((cum.numel(),), level + 1)])
        score = torch.cat([score, cum.flatten()])
        if level + 1 == depth:
            break
        best = torch.argsort(cum.flatten(), descending=True, stable=True)[:k]  # the best k of this level, ids ascending on ties
        best = best.sort().values  # fed in id order
        rows = best // width  # [R'] each new row's parent among this level's rows (the previous feed's)
        allowed = torch.cat([allowed[rows], torch.eye(best.shape[0], dtype=torch.bool, device=device)], 1)  # [R', F']
        frontier = base + best
        logits = yield tokens[frontier], rows if level else torch.full_like(rows, -1), level + 1, allowed
    return _kept_tensors(settings, tokens, parents, depths, score, depth)


def grow_shared_levels(settings: DynamicTree, root_token: int, logits: torch.Tensor,
                       to_target: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> Draft:
    """``grow_dynamic_tensors`` for a drafter whose next-token distribution depends on a node's depth only (a
    DFlash block's slot d: the slots never read the drafted tokens): logits [D, V'] (row d: after a depth-d node),
    no feeds. The same Draft (the same node ids, so the same ties), with every level's log-softmax and top-k taken
    at once and the node tensors concatenated once: about a third of the tensor calls."""
    k, depth = settings.top_k, min(settings.depth, logits.shape[0])
    device = logits.device
    top = vocab_reduce.topk(logits.float().log_softmax(-1), min(k, logits.shape[-1]))  # [D, k']
    values, ids = top.values, to_target(top.indices)  # [D, k'] the same candidates under every node of a depth
    width = values.shape[1]
    root = torch.full((1,), root_token, dtype=torch.long, device=device)
    tokens, parents, depths, score = [root], [root.new_full((1,), -1)], [root.new_zeros(1)], [values.new_zeros(1)]
    frontier, at, base = root.new_zeros(1), values.new_zeros(1), 1  # the rows' node ids, their scores [R]
    for level in range(depth):
        cum = (at[:, None] + values[level]).flatten()  # [R * k'], row-major as the generic growth numbers them
        rows = frontier.shape[0]
        tokens.append(ids[level].repeat(rows))
        parents.append(frontier.repeat_interleave(width))
        depths.append(frontier.new_full((cum.shape[0],), level + 1))
        score.append(cum)
        if level + 1 == depth:
            break
        best = torch.argsort(cum, descending=True, stable=True)[:k].sort().values  # ids ascending on ties, in id order
        frontier, at, base = base + best, cum[best], base + cum.shape[0]
    return _kept_tensors(settings, torch.cat(tokens), torch.cat(parents), torch.cat(depths), torch.cat(score), depth)


def grow_shared_levels_host(settings: DynamicTree, root_token: int, logits: torch.Tensor,
                            to_target: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> Draft:
    """``grow_shared_levels`` where a read costs no sync (a CPU): every level's log-softmax and top-k at once, one
    read of their ids and log-probabilities, the tree grown on the host as ``grow_dynamic`` grows it (float64 sums,
    ties to the lower node id) and kept by ``kept_draft`` (one Tree a shape). The tensor version's ops, each a few
    microseconds after the block's projection, are most of a round's own work there."""
    k, depth = settings.top_k, min(settings.depth, logits.shape[0])
    top = vocab_reduce.topk(logits[:depth].float().log_softmax(-1), min(k, logits.shape[-1]))  # [D, k']
    ids, logps = torch.stack([to_target(top.indices).double(), top.values.double()]).tolist()  # one read
    parents, tokens, depths, score = [-1], [root_token], [0], [0.0]
    frontier = [0]
    for level in range(depth):
        new = []
        for node in frontier:
            for token, logp in zip(ids[level], logps[level]):
                new.append(len(parents))
                parents.append(node)
                tokens.append(int(token))
                depths.append(level + 1)
                score.append(score[node] + logp)
        if level + 1 == depth:
            break
        frontier = sorted(sorted(new, key=lambda n: (-score[n], n))[:k])  # the best k grow on, in id order
    keep = sorted(range(1, len(parents)), key=lambda n: (-score[n], depths[n], n))[:settings.total_tokens]
    return kept_draft(settings, keep, parents, tokens, score, depths, logits.device)


def _kept_tensors(settings: DynamicTree, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                  score: torch.Tensor, depth: int) -> Draft:
    """The grown nodes (tokens, parents, depths, cumulative log-probabilities: [M], the root first) -> the Draft of
    the ``total_tokens`` best, ordered and renumbered as ``kept_draft`` does, still on the device."""
    k, total, device = settings.top_k, settings.total_tokens, tokens.device
    # the total best by (-score, depth, id): stable sorts, last key first
    ids = torch.arange(1, score.shape[0], device=device)
    ids = ids[torch.argsort(depths[ids], stable=True)]
    keep = ids[torch.argsort(score[ids], descending=True, stable=True)][:total]  # closed under parents (a child
    # never scores above its parent, which is shallower): [K]
    # ordered parents first by (depth, -score, id), as ``kept_draft`` orders them, and renumbered
    keep = keep.sort().values
    keep = keep[torch.argsort(score[keep], descending=True, stable=True)]
    order = torch.cat([keep.new_zeros(1), keep[torch.argsort(depths[keep], stable=True)]])  # [N] old ids, root first
    index = torch.zeros(score.shape[0], dtype=torch.long, device=device)
    index[order] = torch.arange(order.shape[0], device=device)  # old id -> new
    scores = score[order].to(exact_float(device)).exp()  # [N] (float64 as the host growth's, where there is one)
    n = order.shape[0]
    if k == 1 or total == 1:  # a chain, known without a read: verified under the causal mask as every chain is
        return Draft(shaped_tree(list(range(-1, n - 1)), name=settings.name), tokens[order], None, scores=scores)
    new_parents = index[parents[order].clamp(min=0)]
    new_parents[0] = -1
    tree = device_tree(new_parents, depths[order], depth, k, name=settings.name)
    return Draft(tree, tokens[order], None, scores=scores)
