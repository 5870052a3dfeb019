"""Growing a draft tree level by level, shared by every drafter that runs a model (draft model, EAGLE).

A drafter supplies one callable, ``feed(exp, nodes) -> logits [R, V']``: run its model on the
tokens of ``nodes`` (each attending to the context, its ancestors among the nodes fed so far and
itself; ``feed_mask`` builds that mask) and return the logits of the next token after each. The
expansion decides which nodes to grow:

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
from typing import Callable

import torch

from headway.heads.values import parse_bool
from headway.inference.proposer import Draft, sample_children
from headway.inference.tree import Tree
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
    """The nodes grown so far this round (node 0 is the root) and the order they were fed in."""

    parents: list[int]
    tokens: list[int]
    depths: list[int]
    fed: list[int] = dataclasses.field(default_factory=list)

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
    entries and the F nodes already fed: each row sees the context, its fed ancestors and itself."""
    cols = exp.fed + nodes
    allowed = torch.zeros((len(nodes), len(cols)), dtype=torch.bool)
    for r, n in enumerate(nodes):
        anc = exp.ancestors(n)
        for c, m in enumerate(cols):
            allowed[r, c] = m in anc
    mask = torch.zeros((1, 1, len(nodes), prefix + len(cols)), dtype=dtype)
    mask[0, 0, :, prefix:] = (~allowed).to(dtype) * torch.finfo(dtype).min
    return mask.to(device)


def _run_feed(feed: Feed, exp: Expansion, nodes: list[int]) -> torch.Tensor:
    logits = feed(exp, nodes)  # [R, V']
    exp.fed += nodes
    return logits


def expand_static(tree: Tree, root_token: int, root_logits: torch.Tensor, feed: Feed,
                  sampling: SamplingParams | None, generator: torch.Generator | None,
                  to_target: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                  widen: Callable[[torch.Tensor], torch.Tensor] = lambda q: q) -> Draft:
    """Fill ``tree`` level by level. root_logits: [V'] the drafter's logits after the root.

    ``to_target`` maps indices of the drafter's logits to target token ids, ``widen`` a [V']
    distribution to the target's [V] (both identity for a full vocabulary)."""
    exp = Expansion(list(tree.parents), [root_token] + [0] * (tree.size - 1), list(tree.depths))
    q = {}
    scores = [1.0] * tree.size  # a node's draft probability multiplied along its path (tree="auto" reads it)
    frontier, logits = [0], root_logits[None]  # nodes whose children are picked next, their logits [R, V']
    while frontier:
        most = max(len(tree.children[n]) for n in frontier)
        k = max(most, max(tree.ranks[c] for n in frontier for c in tree.children[n]) + 1)
        cand, dist = sample_children(logits, k, sampling, generator)  # [R, k], [R, V'] | None
        p = (dist if dist is not None else logits.float().softmax(-1)).gather(1, cand).tolist()  # [R, k]
        cand = to_target(cand).tolist()
        for row, node in enumerate(frontier):
            for j, child in enumerate(tree.children[node]):
                # greedy: the rank-r token; sampling: the j-th draw without replacement
                col = tree.ranks[child] if dist is None else j
                exp.tokens[child] = cand[row][col]
                scores[child] = scores[node] * p[row][col]
            if dist is not None:
                q[node] = widen(dist[row])
        frontier = [c for n in frontier for c in tree.children[n] if tree.children[c]]
        if frontier:
            logits = _run_feed(feed, exp, frontier)
    tokens = torch.tensor(exp.tokens, dtype=torch.long, device=root_logits.device)
    return Draft(tree, tokens, q if sampling is not None else None, scores=scores)


def expand_dynamic(settings: DynamicTree, max_depth: int, root_token: int, root_logits: torch.Tensor, feed: Feed,
                   to_target: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> Draft:
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
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)  # [R, k]
        ids = to_target(top.indices).tolist()
        cum = (top.values + torch.tensor([score[n] for n in frontier], device=logp.device)[:, None]).tolist()
        new = []
        for row, node in enumerate(frontier):
            for j in range(len(ids[row])):
                child = exp.add(node, ids[row][j])
                score.append(cum[row][j])
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
        logits = _run_feed(feed, exp, frontier)
    keep = sorted(range(1, len(exp.parents)), key=lambda n: (-score[n], exp.depths[n], n))[:total]
    keep_set = set(keep)
    # parents first: order by (depth, score) and renumber
    order = [0] + sorted(keep, key=lambda n: (exp.depths[n], -score[n], n))
    assert all(exp.parents[n] in keep_set or exp.parents[n] == 0 for n in keep), "dynamic tree lost an ancestor"
    index = {old: new for new, old in enumerate(order)}
    parents = [-1] + [index[exp.parents[n]] for n in order[1:]]
    tokens = torch.tensor([exp.tokens[n] for n in order], dtype=torch.long, device=root_logits.device)
    return Draft(Tree(parents, name=settings.name), tokens, None, scores=[math.exp(score[n]) for n in order])
