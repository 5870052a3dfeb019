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
non-empty one.

The first drafter is the primary: the generator's ``tree`` argument applies to it; the others draft
with their own defaults, their nodes capped by ``max_extra_nodes``.
"""

from __future__ import annotations

import dataclasses

from headway.inference.drafter import Draft, DraftContext, Drafter
from headway.inference.tree import Tree


class HybridDrafter(Drafter):
    """Drafters proposing together; see the module docstring. At most one may read target features."""

    def __init__(self, drafters: list, max_extra_nodes: int = 16):
        from headway.inference.drafter import as_drafter

        if len(drafters) < 1:
            raise ValueError("a hybrid drafter needs at least one drafter")
        self.drafters = [as_drafter(d) for d in drafters]
        self.max_extra_nodes = max_extra_nodes
        self._others = [None] * (len(self.drafters) - 1)  # the other drafters' own trees (resolve_tree)

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

    def propose(self, ctx: DraftContext) -> Draft:
        drafts = [self.drafters[0].propose(ctx)]
        for d, tree in zip(self.drafters[1:], self._others):
            sub = dataclasses.replace(ctx, tree=tree, features=ctx.features if d.feature_layers else None)
            drafts.append(d.propose(sub))
        if any(d.q is not None for d in drafts):  # sampled candidates: one drafter's tree this round
            return next((d for d in drafts if d.tree.size > 1), drafts[0])
        return merge_drafts(drafts, self.max_extra_nodes) if len(drafts) > 1 else drafts[0]


def merge_drafts(drafts: list[Draft], max_extra_nodes: int) -> Draft:
    """One draft holding every path of ``drafts`` (deterministic, sharing the root): the first one's nodes
    as they are, then each other's that the trie lacks, at most ``max_extra_nodes`` of them per draft."""
    first = drafts[0]
    if all(d.tree.size == 1 for d in drafts[1:]):
        return first
    parents, tokens = list(first.tree.parents), first.tokens.tolist()
    scored = all(d.scores is not None for d in drafts)  # each node's best estimate when every drafter gives one
    scores = list(first.scores) if scored else None
    child = {(parents[i], tokens[i]): i for i in range(1, len(parents))}
    for d in drafts[1:]:
        own, ids, added = d.tree.parents, d.tokens.tolist(), 0
        where = [0] * len(own)  # node of d -> merged node (parents come before children); -1: left out
        for i in range(1, len(own)):
            key = (where[own[i]], ids[i])
            if key[0] < 0 or (key not in child and added >= max_extra_nodes):
                where[i] = -1
                continue
            if key not in child:
                child[key] = len(parents)
                parents.append(key[0])
                tokens.append(ids[i])
                added += 1
                if scored:
                    scores.append(0.0)
            where[i] = child[key]
            if scored:
                scores[where[i]] = max(scores[where[i]], d.scores[i])
    return Draft(Tree(parents, name="hybrid"), first.tokens.new_tensor(tokens), scores=scores)
