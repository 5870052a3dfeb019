"""DFlash's runtime (arXiv:2602.06036; ``headway.heads.dflash``): B - 1 draft tokens from one drafter pass.

Each draft layer keeps the context's keys and values: the fused target features of every verified
position, fed once (a round feeds the positions accepted since the last one, the catch-up). A round
then runs one block: the root (the last accepted token, at position L-1) and B - 1 mask tokens at
L .. L+B-2, every one seeing the whole context and the whole block; slot k's distribution is the
drafter's for depth k. The block's entries are cropped off the caches afterwards.

The default tree is EAGLE-2's dynamic tree over the block's rows (depth B - 1, top-4, 7 nodes, as
EAGLE's CPU default; ``tree={"depth": d, "top_k": k, "total_tokens": n}`` sets it): every depth-d
node's children are the top-k of slot d + 1's row (the row that scores depth d + 1), the frontier the
k best paths by cumulative log-probability, the n best nodes kept (``grow_shared_levels``: tensor
ops, the kept tree's shape read with the verification, on CUDA; on a CPU, where a read is free, one read and the
tree grown on the host: ``grow_shared_levels_host``; candidates deterministic, verified as one-hot
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
from headway.inference.eagle import Project, bind_head
from headway.inference.expand import DynamicTree, expand_static, grow_shared_levels, grow_shared_levels_host
from headway.inference.kv_cache import hidden_where, step_mask
from headway.inference.proposer import (Draft, DraftContext, DraftRequest, Probe, Proposer, first_guesses, root_only,
                                       run_alone)
from headway.inference.ranked import ranked_draft
from headway.inference.tree import Tree


class DFlashProposer(Proposer):
    """Wraps a ``DFlashHead``; default tree: EAGLE-2's dynamic tree over the block (``default_tree``). Under
    ``tree="auto"`` a drafter that lost is tested by ``probe`` (a block at each of the last few tokens, one pass)
    before a round is tried again.

    ``tensor_rounds``: True grows the dynamic tree with tensor ops and no read, its shape read with the round's
    verification (``grow_shared_levels``); False reads the block's candidates once and grows the tree on the host
    (``grow_shared_levels_host``: the same tree); None (the default) is True on CUDA, where a read is a sync, and
    False elsewhere (scripts/runtime_probe.py: 224 torch calls a round against 91, own work 0.35 of a plain step
    against 0.23)."""

    tensor_rounds: bool | None = None

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
        return self._take_in(ctx.features, ctx.tokens.shape[0] - 1)

    def _take_in(self, features: torch.Tensor | None, end: int) -> bool:
        """Feed positions seen .. end-1 (their features [n, F]) into every layer's context; whether there is any."""
        head = self.head
        new = 0 if features is None else features.shape[0]
        if self._seen + new != end:
            raise RuntimeError(f"DFlash drafter saw features of {self._seen} positions and got {new} more, "
                               f"but the context has {end} before the root")
        if new:
            positions = torch.arange(self._seen, end, device=self._device)[None]  # [1, n]
            for cache, (k, v) in zip(self._caches, head.context_kv(head.context(features[None]), positions)):
                cache.crop(self._seen)
                cache.append(k, v)
            self._seen = end
        return self._seen > 0

    @torch.no_grad()
    def probe(self, ctx: DraftContext, rows: int) -> Probe | None:
        """``Proposer.probe``: take in all but the root's feature (context positions .. L-3), then run a whole block
        rooted at each of the last m verified tokens x[j] (j = L-1-m .. L-2, seeing the context before j only), all
        m blocks in one pass; each block's slot 1 is its first guess, for x[j+1]. What a round at j would draft
        first, at m blocks' cost in one pass (no target pass, no tree)."""
        length = ctx.tokens.shape[0]
        n = 0 if ctx.features is None else ctx.features.shape[0] - 1
        if n < 1 or rows < 1 or self._seen + n + 1 != length - 1:
            return None
        self._take_in(ctx.features[:-1], length - 2)
        m = min(rows, length - 2)  # anchors from 1: a block needs some context
        head, block, seen, device = self.head, self.block, self._seen, self._device
        anchors = torch.arange(length - 1 - m, length - 1, device=device)  # [m]
        ids = torch.full((m, block), head.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = ctx.tokens[length - 1 - m:length - 1]
        positions = anchors[:, None] + torch.arange(block, device=device)  # [m, B]
        owner = torch.arange(m, device=device).repeat_interleave(block)  # [m*B]: each token's block
        sees = torch.cat([torch.arange(seen, device=device)[None] < anchors[owner][:, None],  # [m*B, S]: before j
                          owner[:, None] == owner[None]], 1)  # [m*B, S + m*B]: and its own block, whole
        mask = hidden_where(~sees, next(head.parameters()).dtype)[None, None]  # [1, 1, m*B, S + m*B]
        h = head(ids.view(1, -1), positions.view(1, -1), self._caches, attention_mask=mask)[0]  # [m*B, H]
        for cache in self._caches:
            cache.crop(seen)
        logits = few_rows_linear(*head.projection(h[1::block]))  # [m, V']: each block's slot 1
        return first_guesses(logits, head.to_target_ids, ctx.tokens[length - m:])

    def block_logits(self, ctx: DraftContext, depth: int) -> torch.Tensor:
        """One block at positions L-1 .. L+B-2 -> logits [depth, V'] of slots 1 .. depth (slot k: depth k)."""
        return self._logits(self._block(ctx.tokens[-1:], ctx.tokens.shape[0] - 1), depth)

    def _block(self, root: torch.Tensor, start: int) -> torch.Tensor:
        """The block, the root [1] then B - 1 mask tokens at positions start .. start+B-1, over the context -> h [B, H];
        the caches left holding the context."""
        head = self.head
        ids = torch.full((1, self.block), head.config.mask_token_id, dtype=torch.long, device=self._device)
        ids[0, 0] = root[0]
        positions = torch.arange(start, start + self.block, device=self._device)[None]  # [1, B]
        h = head(ids, positions, self._caches)  # [1, B, H]; the block's k/v were appended to the caches
        for cache in self._caches:
            cache.crop(self._seen)
        return h[0]

    def _logits(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        """The block's h [B, H] -> logits [depth, V'] of slots 1 .. depth."""
        return few_rows_linear(*self.head.projection(h[1:depth + 1])).float()

    def propose(self, ctx: DraftContext) -> Draft:
        return run_alone(self.propose_steps(ctx))

    def propose_steps(self, ctx: DraftContext) -> Generator[DraftRequest, object, Draft]:
        """The catch-up, then the block (a ``BlockPass``: a batch's rows run theirs as one pass) and its projection
        (``Project``, one product for a batch's rows), then the tree over its rows: EAGLE-2's dynamic tree
        (``_dynamic``) or a static one, whose depth-d level reads slot d's row."""
        tree = ctx.tree if ctx.tree is not None else self.default_tree()
        dynamic = isinstance(tree, DynamicTree)
        tree = tree if dynamic else tree.truncate(ctx.max_depth)
        depth = min(tree.depth, ctx.max_depth)
        if not self._catch_up(ctx) or depth < 1:
            return root_only(ctx)
        head = self.head
        h = yield BlockPass(self, ctx.tokens[-1:], ctx.tokens.shape[0] - 1)  # [B, H]
        logits = (yield Project(head, h[1:depth + 1])).float()  # [depth, V']: a batch's rows' in one product
        if dynamic:
            return self._dynamic(ctx, tree, logits)
        if ctx.sampling is None:  # greedy: a depth's candidates are its slot's top-k, a whole tree one top-k and a gather
            return ranked_draft(tree, ctx.tokens[-1:], logits, head.to_target_ids, ctx.scored)

        def feed(exp, nodes):  # a static level's frontier (one depth): its slot's logits, a row each
            return logits[exp.depths[nodes[0]]].expand(len(nodes), -1)

        return expand_static(tree, ctx.root_token, logits[0], feed, ctx.sampling, ctx.generator, head.to_target_ids,
                             head.widen, ctx.scored)

    def _dynamic(self, ctx: DraftContext, tree: DynamicTree, logits: torch.Tensor) -> Draft:
        """An EAGLE-2 dynamic tree over the block's rows (logits [depth, V']): a level's every row is its depth's slot
        (the slots never read the drafted tokens, so a node's children do not depend on which node it is)."""
        tensor_rounds = self.tensor_rounds if self.tensor_rounds is not None else logits.device.type == "cuda"
        grow = grow_shared_levels if tensor_rounds else grow_shared_levels_host
        return grow(tree, ctx.root_token, logits, self.head.to_target_ids)


class BlockPass(DraftRequest):
    """A row's block (``DFlashProposer._block``): root [1] at ``start``, then the mask tokens -> h [B, H]. A batch's
    rows run theirs as one pass over their context caches stacked per layer (``DraftCache.stacked``), each row seeing
    its own context's slots and its whole block."""

    def __init__(self, proposer: DFlashProposer, root: torch.Tensor, start: int):
        self.key, self.proposer, self.root, self.start = proposer.head, proposer, root, start

    def run(self) -> torch.Tensor:
        return self.proposer._block(self.root, self.start)

    @classmethod
    def run_together(cls, requests: list["BlockPass"], state: dict) -> list[torch.Tensor]:
        if len(requests) == 1:
            return [requests[0].run()]
        head, rows = requests[0].key, [r.proposer for r in requests]
        block, device = rows[0].block, rows[0]._device
        stacked = [DraftCache.stacked([p._caches[i] for p in rows], room=block) for i in range(len(head.layers))]
        valid = stacked[0][1]  # [R, S] each row's context slots (the same in every layer)
        ids = torch.full((len(rows), block), head.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = torch.cat([r.root for r in requests])
        positions = torch.tensor([r.start for r in requests], device=device)[:, None] + \
            torch.arange(block, device=device)  # [R, B]
        mask = step_mask(valid, block, next(head.parameters()).dtype)  # [R, 1, 1, S + B]: the context, the whole block
        return list(head(ids, positions, [cache for cache, _ in stacked], attention_mask=mask))  # [B, H] a row
