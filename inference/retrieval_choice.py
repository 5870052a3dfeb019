"""Several retrieval drafters, one drafting each round: the one that would have been accepted most so far
in this request.

    SpeculativeGenerator(target, [eagle_head, RetrievalChoice([SuffixDecoding(), PromptLookup()])])

Retrieval drafters differ by task: prompt lookup copies the latest long match whole (translation,
code), suffix decoding ranks continuations by frequency (retrieval-augmented answers, summaries).
Merging both trees widens every pass with nodes the weaker one adds (measured slower than either
alone, BENCHMARKS.md), so this drafter asks each one every round (both are nearly free and keep their
own indexes in step with the context) but hands on one draft: the one whose retriever has the most
tokens it *would have* accepted so far in this request. That judgment is free and counterfactual:
each round's drafts are kept and, once the text after them is known, walked along the tokens that did
follow (the accepted length a greedy verification of that draft would have reached). The choice
depends on past tokens only, so every output stays exact (greedy and sampled: the draft is
deterministic). A retriever that finds nothing this round gives way to one that does.
"""

from __future__ import annotations

import copy
import dataclasses

from headway.inference.proposer import Draft, DraftContext, Proposer, as_proposer


def matched_depth(parents: list[int], tokens: list[int], followed: list[int]) -> int | None:
    """How deep a draft's tree follows ``followed`` (the tokens after its root, as far as known): the accepted
    length of greedy verification if the target emits them. None: the walk reached the end of ``followed`` at a
    node with children, so more text is needed to judge it. parents [N] (parents[0] = -1), tokens [N] (node 0 the
    root's, unread)."""
    children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i}
    has_kids = set(parents[1:])
    node = depth = 0
    for tok in followed:
        nxt = children.get((node, tok))
        if nxt is None:
            return depth
        node, depth = nxt, depth + 1
    return depth if node not in has_kids else None


class RetrievalChoice(Proposer):
    """Retrieval drafters (no target features), one drafting each round; see the module docstring.

    Each request starts from no evidence with the first retriever (list the one whose drafts cost less first:
    measured, a new request that started with the last one's leader kept prompt lookup's wider passes on summaries,
    where both were accepted about as much, and ran 5% slower there; BENCHMARKS.md).

    Args:
        drafters: the retrieval drafters, in order of preference before any evidence (ties keep the earlier).
        margin: accepted tokens by which another retriever must lead the current one before it takes over
            (a switch on the first token of evidence would follow noise).
    """

    def __init__(self, drafters: list, margin: float = 2.0):
        self.drafters = [as_proposer(d) for d in drafters]
        if len(self.drafters) < 2:
            raise ValueError("RetrievalChoice needs at least two retrieval drafters to choose from")
        readers = [type(d).__name__ for d in self.drafters if d.feature_layers or d.reads_outputs
                   or d.shares_target_cache or d.gated]
        if readers:
            raise ValueError(f"RetrievalChoice chooses among retrieval drafters; {readers[0]} reads the target "
                             "(pass it to the hybrid list beside this one instead)")
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.margin = margin
        self.reset()

    def bind(self, target_model) -> None:
        for d in self.drafters:
            d.bind(target_model)

    def resolve_tree(self, spec):
        """Retrieval drafters read the generator's tree alike (a cap on the trees they build): the first one's."""
        return self.drafters[0].resolve_tree(spec)

    def check_tree(self, tree) -> None:
        for d in self.drafters:
            d.check_tree(tree)

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()
        self.accepted = [0] * len(self.drafters)  # tokens each would have had accepted in this request
        self.current = 0  # the retriever drafting now: the first one until another leads by ``margin``
        self.chosen = [0] * len(self.drafters)  # rounds each one's (non-empty) draft was handed on
        self._open: list[tuple[int, list]] = []  # (root position, [(parents, tokens) per retriever]) not yet judged

    def fork(self) -> "RetrievalChoice":
        clone = copy.copy(self)
        clone.drafters = [d.fork() for d in self.drafters]  # before the reset: this one's drafters keep their state
        clone.reset()
        return clone

    def propose(self, ctx: DraftContext) -> Draft:
        host = ctx.host_tokens if ctx.host_tokens is not None else ctx.tokens.tolist()
        self._judge(host)
        device = ctx.tokens.device
        if device.type != "cpu":  # the retrievers draft on the host, where their drafts are read for the judgment
            ctx = dataclasses.replace(ctx, host_tokens=host)
            ctx = dataclasses.replace(ctx, tokens=ctx.host_context())
        drafts = [d.propose(ctx) for d in self.drafters]
        shapes = [(list(d.tree.parents), d.tokens.tolist()) for d in drafts]
        if any(len(p) > 1 for p, _ in shapes):
            self._open.append((len(host), shapes))
        pick = self.current if drafts[self.current].tree.size > 1 else \
            next((i for i, d in enumerate(drafts) if d.tree.size > 1), self.current)
        draft = drafts[pick]
        self.chosen[pick] += draft.tree.size > 1
        # which retriever drafted: tree="auto" calibrates each one's scores apart (they mean different things)
        return dataclasses.replace(draft, tokens=draft.tokens.to(device), sources=[pick] * draft.tree.size)

    def _judge(self, host: list[int]) -> None:
        """Score the kept drafts whose outcome the text now shows; a retriever that leads by ``margin`` takes over."""
        still = []
        for start, shapes in self._open:
            depths = [matched_depth(p, t, host[start:]) if len(p) > 1 else 0 for p, t in shapes]
            if any(d is None for d in depths):
                still.append((start, shapes))
                continue
            for i, d in enumerate(depths):
                self.accepted[i] += d
        self._open = still
        best = max(range(len(self.accepted)), key=lambda i: (self.accepted[i], -i))
        if self.accepted[best] >= self.accepted[self.current] + self.margin:
            self.current = best
