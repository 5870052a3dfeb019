"""P-EAGLE's runtime (arXiv:2602.01469; ``headway.heads.peagle``): K draft tokens from one drafter pass.

A round is one drafter pass (a batch's rows: one pass over their stacked draft caches): it catches the
drafter's cache up on the newly accepted positions (as EAGLE does: the root's entry pairs the root token with the target's last feature, and its output scores depth 1)
with the K - 1 mask slots at the following positions in the same causal forward (slot j scores depth
j + 1), and crops the slots off the cache. The draft is a chain: greedy takes each row's argmax, sampling
draws each token from its own row's distribution q (the row does not depend on the tokens drawn before it,
which the verifier needs no more than q itself: the chain stays exact). ``tree="auto"`` may cut the chain, its
scores the running product of each depth's chosen probability.
"""

from __future__ import annotations

from typing import Generator

import torch

from headway.heads.peagle import PEagleHead
from headway.inference import vocab_reduce
from headway.inference.eagle import CatchUp, EagleProposer, Project
from headway.inference.proposer import Draft, DraftContext, DraftRequest, root_only
from headway.inference.tree import Tree, chain
from headway.inference.verify import probs


class PEagleProposer(EagleProposer):
    """Wraps a ``PEagleHead``; default tree: a chain of its ``parallel_depths`` tokens."""

    def __init__(self, head: PEagleHead):
        super().__init__(head)
        self.depths = head.config.parallel_depths

    def default_tree(self) -> Tree:
        return chain(self.depths)

    def use_graphs(self, backend, strict: bool = False) -> str | None:
        return "P-EAGLE's one-pass draft is not captured in a graph (its block grows with the round's depth)"

    def resolve_tree(self, spec):
        return super(EagleProposer, self).resolve_tree(spec)  # a static tree only (no EAGLE-2 settings)

    def check_tree(self, tree: Tree) -> None:
        if not tree.is_chain or tree.depth > self.depths:
            raise ValueError(f"P-EAGLE drafts a chain of at most parallel_depths={self.depths} tokens in one pass, got "
                             f"the tree {tree.name or tree.size} (depth {tree.depth}); pass chain-1 .. "
                             f"chain-{self.depths} or tree=None")

    def propose_steps(self, ctx: DraftContext) -> Generator[DraftRequest, object, Draft]:
        """The round's one drafter pass (a ``CatchUp`` with the depth - 1 mask slots) and the rows' projection: a
        batch's rows run each as one pass over their stacked caches (``catch_up_rows``) and one product."""
        tree = ctx.tree if isinstance(ctx.tree, Tree) else self.default_tree()
        depth = min(tree.depth, ctx.max_depth)
        if not self._new_positions(ctx):
            return root_only(ctx)  # nothing to draft from (a one-token prompt)
        if depth < 1:  # nothing asked: the context only
            yield CatchUp(self, ctx.tokens, ctx.features)
            return root_only(ctx)
        head = self.head
        rows = yield CatchUp(self, ctx.tokens, ctx.features, slots=depth - 1)  # [depth, H]: the root's, the slots'
        logits = (yield Project(head, rows)).float()  # [depth, V']
        if ctx.sampling is None:
            picked = vocab_reduce.argmax(logits)  # [depth]
            chosen = logits.softmax(-1).gather(1, picked[:, None])[:, 0] if ctx.scored else None
            q = None
        else:
            dist = probs(logits, ctx.sampling)  # [depth, V']
            picked = torch.multinomial(dist, 1, generator=ctx.generator)[:, 0]
            chosen = dist.gather(1, picked[:, None])[:, 0]
            q = {i: self._widen(dist[i]) for i in range(depth)}  # node i's child was drawn from q[i]
        tokens = torch.cat([ctx.tokens[-1:], head.to_target_ids(picked)])  # [depth + 1]
        scores = torch.cat([chosen.new_ones(1), chosen.cumprod(0)]) if ctx.scored else None
        return Draft(chain(depth), tokens, q=q, scores=scores)
