"""Hybrid drafting: several drafters as one, for one verification pass (a list passed as the drafter).

    SpeculativeGenerator(target, [eagle_head, PromptLookup()])

Every drafter proposes each round; their trees are merged below the shared root into one trie
(a candidate two drafters share is one node), so retrieval's copied branch and a model drafter's
tree are verified together and the longest accepted path wins, whichever drafter it came from.
Merging is exact when every candidate is deterministic (greedy decoding; or drafters that rank
rather than sample, such as Medusa, EAGLE-2 dynamic trees, prompt lookup and suffix decoding): the
verifier then tries a node's children one by one against the residual of the target's distribution
(SpecInfer, arXiv:2305.09781). When a drafter sampled its candidates (``q``), sampled and copied
children cannot share a node, so that round verifies the first drafter's tree alone, or the first
non-empty one. The trie needs every draft's tokens on the host, a read a round; greedy decoding with a
fixed tree skips it: the drafts are stacked below the root unmerged (``stack_drafts``), and verification,
which takes the deepest accepted node, accepts what the trie would.

The first drafter is the primary: the generator's ``tree`` argument applies to it; the others draft
with their own defaults, their nodes capped by ``max_extra_nodes``. With ``tree="auto"`` the others
(retrieval, nearly free) draft first and the controller decides whether the primary drafts too this
round (``DraftContext.gate``): a model drafter that lately added nothing to what retrieval found sits
out, and the target features it reads are kept for it until it drafts again.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Generator

import torch

from headway.inference.proposer import (Draft, DraftContext, DraftRequest, Proposer, can_probe, exact_float,
                                        run_alone)
from headway.inference.tree import Tree, shaped_tree


class HybridProposer(Proposer):
    """Drafters proposing together; see the module docstring. At most one may read target features."""

    def __init__(self, drafters: list, max_extra_nodes: int = 16):
        from headway.inference.proposer import as_proposer

        if len(drafters) < 1:
            raise ValueError("a hybrid drafter needs at least one drafter")
        self.drafters = [as_proposer(d) for d in drafters]
        readers = [type(d).__name__ for d in self.drafters if d.reads_outputs]
        if readers and len(self.drafters) > 1:
            raise ValueError(f"{readers[0]} cannot join a hybrid list: it steps its own window with the target's "
                             "outputs at its own nodes, which a merged tree renumbers; run it alone")
        sharers = [type(d).__name__ for d in self.drafters if d.shares_target_cache]
        if sharers and len(self.drafters) > 1:
            raise ValueError(f"{sharers[0]} cannot join a hybrid list: it drafts with the target's own first layers "
                             "and verification resumes from their states, which a merged tree's other nodes lack; "
                             "run it alone")
        self.max_extra_nodes = max_extra_nodes
        self.gated = len(self.drafters) > 1  # tree="auto": retrieval drafts every round, the gate decides the rest
        self._others = [None] * (len(self.drafters) - 1)  # the other drafters' own trees (resolve_tree)
        self._pending = None

    def bind(self, target_model) -> None:
        for i, d in enumerate(self.drafters):
            try:
                d.bind(target_model)
            except ValueError as exc:
                raise ValueError(f"hybrid drafter {i} ({type(d).__name__}) does not fit the target: {exc}") from None
        readers = [d for d in self.drafters if d.feature_layers]  # known once bound (Medusa: the target's depth)
        if len(readers) > 1:
            raise ValueError(f"a hybrid list holds {len(readers)} drafters that read the target's features "
                             f"({', '.join(type(d).__name__ for d in readers)}); combine one model drafter with "
                             "retrieval drafters (PromptLookup, SuffixDecoding)")
        self.feature_layers = readers[0].feature_layers if readers else None

    def default_tree(self):
        return self.drafters[0].default_tree()

    def resolve_tree(self, spec):
        self._others = [d.resolve_tree(None) for d in self.drafters[1:]]
        return self.drafters[0].resolve_tree(spec)

    def check_tree(self, tree: Tree) -> None:
        self.drafters[0].check_tree(tree)

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()
        self._pending = None  # features of rounds the primary sat out (tree="auto"), oldest first

    def use_graphs(self, backend, strict: bool = False) -> str | None:
        why = [w for w in (d.use_graphs(backend, strict) for d in self.drafters) if w]
        return "; ".join(why) or None

    def batch_rows(self, ids, mask, capacity: int, max_new_tokens: int, tree):
        """The model drafter's shared batch state (a draft model's chains: one draft cache for every row), if any."""
        return self.drafters[0].batch_rows(ids, mask, capacity, max_new_tokens, tree)

    def use_rows(self, rows, row: int) -> None:
        self.drafters[0].use_rows(rows, row)

    def fork(self) -> "HybridProposer":
        clone = copy.copy(self)
        clone.drafters = [d.fork() for d in self.drafters]
        clone.reset()
        return clone

    def propose(self, ctx: DraftContext) -> Draft:
        return run_alone(self._propose(ctx, rows=False))

    def propose_steps(self, ctx: DraftContext) -> Generator[DraftRequest, object, Draft]:
        """A batch's row: the model drafter's steps run with the other rows' (its ``propose_steps``)."""
        return (yield from self._propose(ctx, rows=True))

    def _propose(self, ctx: DraftContext, rows: bool) -> Generator[DraftRequest, object, Draft]:
        primary, ids = self.drafters[0], list(range(len(self.drafters)))
        features = ctx.features
        if primary.feature_layers and self._pending is not None:
            features = self._pending if features is None else torch.cat([self._pending, features])
        others = []
        start = time.perf_counter()
        for d, tree in zip(self.drafters[1:], self._others):
            others.append(d.propose(dataclasses.replace(ctx, tree=tree, features=features if d.feature_layers else None)))
        if ctx.gate is not None and others:  # tree="auto": the controller sees retrieval's draft first
            retrieval = merge_drafts(others, self.max_extra_nodes, ids[1:])
            probed = []

            def probe(rows: int):  # the primary tested on the tokens made lately (it takes in the features)
                found = primary.probe(dataclasses.replace(ctx, features=features), rows)
                probed.append(found is not None)
                return found

            testable = ctx.sampling is None and can_probe(primary)  # greedy: probes judge first guesses
            go = ctx.gate(retrieval, time.perf_counter() - start, ctx.tokens.shape[0], probe if testable else None)
            if any(probed):  # every feature but the root's taken in
                features = features[-1:]
            if not go:
                self._pending = features if primary.feature_layers else None  # the primary reads them next time
                return retrieval
        self._pending = None
        own = dataclasses.replace(ctx, features=features if primary.feature_layers else None)
        drafts = [(yield from primary.propose_steps(own)) if rows else primary.propose(own)]
        drafts += others
        if any(d.q is not None for d in drafts):  # sampled candidates: one drafter's tree this round
            k = next((k for k, d in enumerate(drafts) if d.tree.size > 1), 0)
            return dataclasses.replace(drafts[k], sources=own_sources(drafts[k], ids[k]))
        if len(drafts) == 1:
            return drafts[0]
        if ctx.sampling is None and not ctx.scored and drafts[0].tree.pending_parents() is None:
            return stack_drafts(drafts, self.max_extra_nodes, ids)  # greedy: no read
        return merge_drafts(drafts, self.max_extra_nodes, ids)

    def propose_first(self, ctx: DraftContext) -> Draft:
        """Before the prompt's pass: the drafters that read no target features (retrieval) draft; a
        model drafter that reads them starts next round, with the prompt's features."""
        if not self.drafters[0].feature_layers:
            return self.propose(dataclasses.replace(ctx, gate=None))
        drafts = [d.propose_first(dataclasses.replace(ctx, tree=tree)) for d, tree in zip(self.drafters[1:], self._others)]
        return merge_drafts(drafts, self.max_extra_nodes, list(range(1, len(self.drafters)))) if drafts \
            else self.drafters[0].propose_first(ctx)


def merge_drafts(drafts: list[Draft], max_extra_nodes: int, ids: list[int] | None = None) -> Draft:
    """One draft holding every path of ``drafts`` (deterministic, sharing the root): the first one's nodes
    as they are, then each other's that the trie lacks, at most ``max_extra_nodes`` of them per draft.
    ``ids`` [len(drafts)] name the drafters in ``Draft.sources`` (default 0, 1, ...; ``own_sources``): a node
    shared by several is credited to the one that scores it highest."""
    ids = list(range(len(drafts))) if ids is None else ids
    first = drafts[0]
    if all(d.tree.size == 1 for d in drafts[1:]):
        return dataclasses.replace(first, sources=own_sources(first, ids[0]))
    scored = all(d.scores is not None for d in drafts)  # each node's best estimate when every drafter gives one
    host_tokens, host_scores = read_drafts(drafts, scored)
    parents, tokens = list(first.tree.parents), host_tokens[0]
    scores = host_scores[0] if scored else None
    sources = own_sources(first, ids[0])
    child = {(parents[i], tokens[i]): i for i in range(1, len(parents))}
    for k, (d, source) in enumerate(zip(drafts[1:], ids[1:]), start=1):
        own, toks, added, named = d.tree.parents, host_tokens[k], 0, own_sources(d, source)
        theirs = host_scores[k] if scored else None
        where = [0] * len(own)  # node of d -> merged node (parents come before children); -1: left out
        for i in range(1, len(own)):
            key = (where[own[i]], toks[i])
            if key[0] < 0 or (key not in child and added >= max_extra_nodes):
                where[i] = -1
                continue
            if key not in child:
                child[key] = len(parents)
                parents.append(key[0])
                tokens.append(toks[i])
                sources.append(named[i])
                added += 1
                if scored:
                    scores.append(0.0)
            where[i] = child[key]
            if scored and theirs[i] > scores[where[i]]:
                scores[where[i]], sources[where[i]] = theirs[i], named[i]
    return Draft(shaped_tree(parents, name="hybrid"), first.tokens.new_tensor(tokens), scores=scores, sources=sources)


def stack_drafts(drafts: list[Draft], max_extra_nodes: int, ids: list[int]) -> Draft:
    """One draft holding every path of ``drafts`` (deterministic, sharing the root) without a read: each other
    draft's first ``max_extra_nodes`` nodes hang below the root beside the first draft's tree, unmerged (a path
    two drafters share appears twice). Greedy verification takes the deepest accepted node, whichever copy, so
    the accepted tokens are ``merge_drafts``' (whose trie needs every draft's tokens on the host: a read a round);
    only the pass is wider by the shared nodes. ``ids`` name the drafters in ``Draft.sources``; a shape stacked
    before is the same tree (``shaped_tree``: its device tensors built once). Scores are dropped (tree="auto" merges)."""
    first = drafts[0]
    parents, sources, tokens = list(first.tree.parents), own_sources(first, ids[0]), [first.tokens]  # [N]
    for d, source in zip(drafts[1:], ids[1:]):
        n = min(d.tree.size, max_extra_nodes + 1)  # parents come before children: a prefix is a subtree
        base = len(parents) - 1  # d's node i > 0 becomes base + i, its root the shared root
        parents += [0 if p == 0 else p + base for p in d.tree.parents[1:n]]
        sources += own_sources(d, source)[1:n]
        tokens.append(d.tokens[1:n].to(first.tokens.device))
    return Draft(shaped_tree(parents, name="hybrid"), torch.cat(tokens), sources=sources)


def read_drafts(drafts: list[Draft], scored: bool) -> tuple[list[list[int]], list[list[float]] | None]:
    """Every draft's tokens, and its scores when ``scored``, on the host in one read (scores already on the host
    are taken as they are)."""
    on_device = [d.tokens for d in drafts] + [d.scores for d in drafts if scored and isinstance(d.scores, torch.Tensor)]
    shapes = [d.tree for d in drafts if d.tree.pending_parents() is not None]  # device trees: read beside them
    on_device += [t.pending_parents() for t in shapes]
    wide = exact_float(on_device[0].device)  # token ids exact beside the scores
    flat = torch.cat([t.reshape(-1).to(wide) for t in on_device]).tolist()
    for tree in reversed(shapes):  # their parents close the read
        tree.settle([int(p) for p in flat[len(flat) - tree.size:]])
        del flat[len(flat) - tree.size:]
    at, tokens = 0, []
    for d in drafts:
        n = d.tokens.numel()
        tokens.append([int(t) for t in flat[at:at + n]])
        at += n
    if not scored:
        return tokens, None
    scores = []
    for d in drafts:
        if isinstance(d.scores, torch.Tensor):
            n = d.scores.numel()
            scores.append(flat[at:at + n])
            at += n
        else:
            scores.append(list(d.scores))
    return tokens, scores


def own_sources(draft: Draft, source: int) -> list:
    """``Draft.sources`` of ``draft`` as drafter ``source`` of a hybrid: ``source`` for each node, or (source, its own
    source) where the draft names its own (a ``RetrievalChoice``: which retriever), so tree="auto" calibrates each
    retriever apart."""
    if draft.sources is None:
        return [source] * draft.tree.size
    return [(source, s) for s in draft.sources]


# The retrieval parts a model drafter's hybrid can carry, by name (``headway generate --retrieval``, ``headway bench
# --hybrid-retrieval``). Suffix decoding is the default: on the eight task groups (BENCHMARKS.md, issue 20) the
# hybrid that carries it falls at most 3.9% behind the best single method of a group, the one with prompt lookup
# 6-8% (on the long documents of rag), at the same speed overall.
RETRIEVAL_PARTS = ("suffix", "lookup", "lookup+suffix", "choice")
DEFAULT_RETRIEVAL = "suffix"


def retrieval_parts(kind: str = DEFAULT_RETRIEVAL) -> list[Proposer]:
    """Fresh retrieval drafters of ``kind``: "suffix" (suffix decoding over this request's prompt and output),
    "lookup" (prompt lookup), "lookup+suffix" (both, merged), "choice" (one of the two each round: the one that
    would have been accepted more so far in the request, ``RetrievalChoice``)."""
    from headway.inference.prompt_lookup import PromptLookup
    from headway.inference.retrieval_choice import RetrievalChoice
    from headway.inference.suffix_decoding import SuffixDecoding

    parts = {"suffix": lambda: [SuffixDecoding(cross_request=False)], "lookup": lambda: [PromptLookup()],
             "lookup+suffix": lambda: [PromptLookup(), SuffixDecoding(cross_request=False)],
             "choice": lambda: [RetrievalChoice([SuffixDecoding(cross_request=False), PromptLookup()])]}
    if kind not in parts:
        raise ValueError(f"unknown retrieval part {kind!r}; choose one of {list(RETRIEVAL_PARTS)}")
    return parts[kind]()
