"""DFlash's runtime (arXiv:2602.06036; ``headway.heads.dflash``): B - 1 draft tokens from one drafter pass.

Each draft layer keeps the context's keys and values: the fused target features of every verified
position, fed once (a round feeds the positions accepted since the last one, the catch-up). A round
then runs one block: the root (the last accepted token, at position L-1) and B - 1 mask tokens at
L .. L+B-2, every one seeing the whole context and the whole block; slot k's distribution is the
drafter's for depth k. The block's entries are cropped off the caches afterwards.

The default tree is EAGLE-2's dynamic tree over the block's rows (depth B - 1, top-4, 7 nodes, as
EAGLE's CPU default; ``tree={"depth": d, "top_k": k, "total_tokens": n}`` sets it): every depth-d
node's children are the top-k of slot d + 1's row (the row that scores depth d + 1), the frontier the
k best paths by cumulative log-probability, the n best nodes kept (``grow_dynamic_tensors``: tensor
ops, the kept tree's shape read with the verification; candidates deterministic, verified as one-hot
drafts in greedy and sampled decoding alike), at no drafter cost beyond the block's one pass.
``tree="auto"`` cuts it per round (the eight task groups, 3 prompts x 2 repeats, BENCHMARKS.md: 1.09x
plain on average against 1.01x cutting the block's chain, ahead of it in every group). A static tree (a
chain, ``tree-7``, ...) takes its depth-d candidates from slot d's top-k (greedy) or draws (sampling, each
node's children drawn from q of its depth: the slots do not read the drawn tokens, so the verifier's q is
exactly what was drawn from and sampling stays exact).
"""

from __future__ import annotations

from typing import Generator

import torch

from headway.heads.dflash import DFlashHead
from headway.heads.eagle_layer import DraftCache
from headway.inference.cpu_gemm import few_rows_linear
from headway.inference.eagle import bind_head
from headway.inference.expand import DynamicTree, expand_dynamic_tensors, expand_static
from headway.inference.proposer import Draft, DraftContext, DraftRequest, Proposer, root_only
from headway.inference.tree import Tree


class DFlashProposer(Proposer):
    """Wraps a ``DFlashHead``; default tree: EAGLE-2's dynamic tree over the block (``default_tree``). It has no
    ``probe`` (its catch-up feeds contexts and scores nothing): under ``tree="auto"`` a round is tried instead."""

    def __init__(self, head: DFlashHead):
        self.head = head.eval()
        self.feature_layers = list(head.config.feature_layers)
        self.block = head.config.block_size
        self._device = torch.device("cpu")
        self.reset()

    def bind(self, target_model) -> None:
        self._device = bind_head(self.head, target_model)

    def use_graphs(self, backend, strict: bool = False) -> str | None:
        return "DFlash's block pass is not captured in a graph (its context grows every round)"

    def reset(self) -> None:
        self._caches = [DraftCache() for _ in self.head.layers]  # per draft layer: the context's k/v
        self._seen = 0  # context positions in the caches (0 .. seen-1)

    def default_tree(self) -> DynamicTree:
        """Depth B - 1 (the block's every slot), top-4, 7 nodes: one block pass drafts it."""
        return DynamicTree(depth=self.block - 1, top_k=4, total_tokens=7)

    def resolve_tree(self, spec):
        """A static tree as every drafter's, or EAGLE-2 dynamic settings (a dict or a ``DynamicTree``) of depth at
        most ``block_size - 1``."""
        if isinstance(spec, (dict, DynamicTree)):
            tree = spec if isinstance(spec, DynamicTree) else DynamicTree.from_spec(spec)
            if tree.depth > self.block - 1:
                raise ValueError(f"this DFlash drafter was trained on blocks of {self.block} tokens, so it drafts at "
                                 f"most {self.block - 1} per pass; the dynamic tree has depth {tree.depth}: pass "
                                 f"depth <= {self.block - 1}")
            return tree
        return super().resolve_tree(spec)

    def check_tree(self, tree: Tree) -> None:
        if tree.depth > self.block - 1:
            raise ValueError(f"this DFlash drafter was trained on blocks of {self.block} tokens, so it drafts at most "
                             f"{self.block - 1} per pass; the tree {tree.name or tree.size} has depth {tree.depth}: pass "
                             f"a tree of depth <= {self.block - 1} (e.g. chain-{self.block - 1}) or tree=None")
        tree.validate(top_k=self.head.config.output_size)

    def _catch_up(self, ctx: DraftContext) -> bool:
        """Feed the positions whose features are new into every layer's context; whether there is any context."""
        head, length = self.head, ctx.tokens.shape[0]
        new = 0 if ctx.features is None else ctx.features.shape[0]
        if self._seen + new != length - 1:
            raise RuntimeError(f"DFlash drafter saw features of {self._seen} positions and got {new} more, "
                               f"but the context has {length - 1} before the root")
        if new:
            positions = torch.arange(self._seen, length - 1, device=self._device)[None]  # [1, n]
            for cache, (k, v) in zip(self._caches, head.context_kv(head.context(ctx.features[None]), positions)):
                cache.crop(self._seen)
                cache.append(k, v)
            self._seen = length - 1
        return self._seen > 0

    def block_logits(self, ctx: DraftContext, depth: int) -> torch.Tensor:
        """One block at positions L-1 .. L+B-2 -> logits [depth, V'] of slots 1 .. depth (slot k: depth k)."""
        head, length = self.head, ctx.tokens.shape[0]
        ids = torch.full((1, self.block), head.config.mask_token_id, dtype=torch.long, device=self._device)
        ids[0, 0] = ctx.tokens[-1]
        positions = torch.arange(length - 1, length - 1 + self.block, device=self._device)[None]  # [1, B]
        h = head(ids, positions, self._caches)  # [1, B, H]; the block's k/v were appended to the caches
        for cache in self._caches:
            cache.crop(self._seen)
        return few_rows_linear(*head.projection(h[0, 1:depth + 1])).float()  # [depth, V']

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        tree = ctx.tree if ctx.tree is not None else self.default_tree()
        if isinstance(tree, DynamicTree):
            return self._dynamic(ctx, tree)
        tree = tree.truncate(ctx.max_depth)
        if not self._catch_up(ctx) or tree.size == 1:
            return root_only(ctx)
        logits = self.block_logits(ctx, tree.depth)  # [depth, V']: row d scores the children of depth-d nodes

        def feed(exp, nodes):  # a static level's frontier (one depth): its slot's logits, a row each
            return logits[exp.depths[nodes[0]]].expand(len(nodes), -1)

        head = self.head
        return expand_static(tree, ctx.root_token, logits[0], feed, ctx.sampling, ctx.generator, head.to_target_ids,
                             head.widen, ctx.scored)

    def _dynamic(self, ctx: DraftContext, tree: DynamicTree) -> Draft:
        """An EAGLE-2 dynamic tree over the block's rows: a level's every row is its depth's slot (the slots never
        read the drafted tokens, so a node's children do not depend on which node it is)."""
        depth = min(tree.depth, ctx.max_depth)
        if not self._catch_up(ctx) or depth < 1:
            return root_only(ctx)
        logits = self.block_logits(ctx, depth)  # [depth, V']

        def feed(tokens, parent_rows, level, allowed):  # every frontier row at depth ``level``: that slot's logits,
            return logits[level][None]  # [1, V'], scored once for all of them

        return expand_dynamic_tensors(tree, depth, ctx.root_token, logits[0], feed, self.head.to_target_ids)

    def propose_steps(self, ctx: DraftContext) -> Generator[DraftRequest, object, Draft]:
        """A batch's row drafts alone (its one pass needs no level-by-level batching)."""
        return self.propose(ctx)
        yield  # a generator (never reached)
