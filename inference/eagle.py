"""EAGLE drafter (EAGLE-1/3 heads; EAGLE-2 dynamic trees, Li et al. 2024, arXiv:2406.16858).

The head drafts autoregressively with its own KV cache. Its entry at position j pairs the
target's feature f[j] with the next token x[j+1]; after a round the cache holds exactly the
context entries (positions 0 .. L-2 for L tokens), so rejected draft entries are rolled back by a
crop, and the next round feeds the target's features of the newly accepted positions (handed
over by the generator, captured with forward hooks) before growing the tree from the root:

    root:   h'[L-2] = head(x[L-1], f[L-2])         -> candidates for depth 1 (logits(h'))
    node n: h'_n    = head(token_n, h'_parent(n))   at position L-2 + depth(n), tree-masked

Trees: a static tree (name, YAML file, list of paths; top-k or sampled children with q) or
EAGLE-2 dynamic settings ``{"depth", "top_k", "total_tokens"}`` (the default).
"""

from __future__ import annotations

import torch

from headway.heads.eagle import DraftCache, EagleHead
from headway.inference.cpu_gemm import few_rows_linear
from headway.inference.proposer import Draft, DraftContext, Proposer, root_only
from headway.inference.expand import (DynamicTree, Expansion, additive_mask, expand_dynamic, expand_dynamic_tensors,
                                      expand_static, feed_mask)
from headway.inference.tree import Tree

# EAGLE-2's settings scaled to a CPU, where a verification of 8 tokens costs ~1.8-2 plain steps (~1.75 on
# prepacked weights) and of 16 ~2.3 (PERFORMANCE.md), and each dynamic draft level ~0.15 of one: 3 levels of top-4, 7
# nodes (measured against depth 4 / 8 nodes in BENCHMARKS.md: same tau, 0.92x vs 0.85x). On GPUs
# the paper's depth 6 / top_k 10 / total 60 are the usual choice.
CPU_DYNAMIC = DynamicTree(depth=3, top_k=4, total_tokens=7)
GPU_DYNAMIC = DynamicTree(depth=6, top_k=10, total_tokens=60)


class EagleProposer(Proposer):
    """Wraps an ``EagleHead``; default tree: EAGLE-2 dynamic (CPU- or GPU-sized).

    ``tensor_rounds``: True grows a dynamic tree with tensor ops and one read for the kept tree
    (``expand_dynamic_tensors``); False takes the host version, which reads once per level and
    skips pruned rows (the same tree); None (the default) is True on CUDA, where a read is a sync,
    and False elsewhere: on a CPU a read costs nothing and the host version's own work measured
    less (scripts/runtime_probe.py, BENCHMARKS.md)."""

    tensor_rounds: bool | None = None

    def __init__(self, head: EagleHead):
        self.head = head.eval()
        self.feature_layers = list(head.config.feature_layers)
        self._cache = DraftCache()
        self._seen = 0  # context entries in the draft cache (positions 0 .. seen-1)
        self._device = torch.device("cpu")
        self._widen_ids = None

    def bind(self, target_model) -> None:
        self.head.bind_target(target_model)  # ValueError naming both values on a mismatch
        p = next(target_model.parameters())
        self._device = p.device
        if next(self.head.parameters()).device != p.device or next(self.head.parameters()).dtype != p.dtype:
            # once, here: never a per-step weight copy. RoPE frequencies stay fp32 (as trained): in bf16
            # they would shift relative angles by radians at long distances
            rope = {n: b.float() for n, b in self.head.rotary_emb.named_buffers(recurse=False)}
            self.head.to(p.device, p.dtype)
            for name, buf in rope.items():
                self.head.rotary_emb._buffers[name] = buf.to(p.device)  # the bound target tensors need no re-bind
        self._widen_ids = self.head.draft_token_ids
        self._vocab = self.head.config.vocab_size

    def default_tree(self):
        return GPU_DYNAMIC if self._device.type == "cuda" else CPU_DYNAMIC

    def resolve_tree(self, spec):
        if isinstance(spec, dict):
            return DynamicTree.from_spec(spec)
        if isinstance(spec, DynamicTree):
            return spec
        return super().resolve_tree(spec)

    def check_tree(self, tree: Tree) -> None:
        tree.validate(top_k=self.head.config.output_size)

    def reset(self) -> None:
        self._cache = DraftCache()
        self._seen = 0

    def _widen(self, q: torch.Tensor) -> torch.Tensor:
        # [V'] draft-vocabulary distribution -> [V] over target ids
        if self._widen_ids is None:
            return q
        full = q.new_zeros(self._vocab)
        full[self._widen_ids] = q
        return full

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        head, length = self.head, ctx.tokens.shape[0]
        new = 0 if ctx.features is None else ctx.features.shape[0]
        if self._seen + new != length - 1:
            raise RuntimeError(f"EAGLE drafter saw features of {self._seen} positions and got {new} more, "
                               f"but the context has {length - 1} before the root")
        if new == 0:
            return root_only(ctx)  # a one-token prompt: no feature yet
        self._cache.crop(self._seen)  # drop the previous round's tree entries
        device = self._device
        ids = ctx.tokens[self._seen + 1:length][None]  # [1, n]: x[j+1] paired with f[j]
        positions = torch.arange(self._seen, length - 1, device=device)[None]
        # only the last position's output is read: the others just write their keys/values (a long prompt's
        # catch-up costs a quarter of the full layer over it)
        h = head.extend(ids, head.input_hidden(ctx.features)[None], positions, self._cache)  # [1, 1, H]
        self._seen = length - 1
        root_h = h[0, -1]  # predicted feature after the root
        root_logits = few_rows_linear(*head.projection(root_h))  # [V'] (the same product as head.logits)
        tree = self.default_tree() if ctx.tree is None else ctx.tree
        hidden = {0: root_h}  # node -> its output h' (what its children read)

        def feed(exp: Expansion, nodes: list[int]) -> torch.Tensor:
            mask = feed_mask(exp, nodes, self._seen, root_h.dtype, device)  # [1, 1, R, seen + F + R]
            tok = exp.token_ids(nodes, device)[None]
            pos = exp.node_depths(nodes, device)[None] + (length - 2)
            hid = torch.stack([hidden[exp.parents[n]] for n in nodes])[None]  # [1, R, H]
            out = head(tok, hid, pos, attention_mask=mask, cache=self._cache)[0]  # [R, H]
            for r, n in enumerate(nodes):
                hidden[n] = out[r]
            return few_rows_linear(*head.projection(out))  # [R, V']

        last = [root_h[None]]  # the previous feed's outputs [R, H] (the root's first), for rows_feed

        def rows_feed(tokens: torch.Tensor, parent_rows: torch.Tensor, depth: int, allowed: torch.Tensor):
            r = tokens.shape[0]
            mask = additive_mask(~allowed, self._seen, root_h.dtype)  # [1, 1, R, seen + F + R]
            hid = last[0][parent_rows.clamp(min=0)]  # [R, H] (-1: the root, row 0 of the first "feed")
            pos = torch.full((1, r), length - 2 + depth, dtype=torch.long, device=device)
            last[0] = head(tokens[None], hid[None], pos, attention_mask=mask, cache=self._cache)[0]  # [R, H]
            return few_rows_linear(*head.projection(last[0]))  # [R, V']

        to_target = head.to_target_ids
        tensor_rounds = self.tensor_rounds if self.tensor_rounds is not None else device.type == "cuda"
        if isinstance(tree, DynamicTree) and tensor_rounds:
            draft = expand_dynamic_tensors(tree, ctx.max_depth, ctx.root_token, root_logits, rows_feed, to_target)
        elif isinstance(tree, DynamicTree):
            draft = expand_dynamic(tree, ctx.max_depth, ctx.root_token, root_logits, feed, to_target)
        else:
            tree = tree.truncate(ctx.max_depth)
            if tree.size == 1:
                return root_only(ctx)
            draft = expand_static(tree, ctx.root_token, root_logits, feed, ctx.sampling, ctx.generator,
                                  to_target, self._widen)
        self._cache.crop(self._seen)
        return draft
