"""Medusa drafter (Cai et al., 2024, arXiv:2401.10774): candidates from each head's top-k along a tree.

Head k reads the target's final-norm hidden state at the position that predicted the root and
proposes the token k+1 places after the root, so a node at depth d takes the rank-r token of head
d-1 (mapped back to target ids when the heads score a reduced draft vocabulary). Candidates are
deterministic (top-k of the raw head logits, which temperature, top-k and top-p filtering do not
reorder), so verification treats each as a one-hot draft: lossless.
"""

from __future__ import annotations

from typing import Generator

import torch

from headway.heads.target.features import num_layers
from headway.heads.medusa import MedusaHeads
from headway.inference.cpu_gemm import few_rows_linear
from headway.inference.proposer import (Draft, DraftContext, DraftRequest, Probe, Proposer, first_guesses, root_only,
                                        run_alone)
from headway.inference.ranked import ranked_draft
from headway.inference.tree import Tree, load_tree

DEFAULT_TREE = "tree-15"


class MedusaProposer(Proposer):
    """Wraps ``MedusaHeads``; default tree ``tree-15`` cut to the number of heads."""

    def __init__(self, heads: MedusaHeads):
        self.heads = heads.eval()
        self._default: Tree | None = None
        self.feature_layers = None  # [L] (the target's final-norm output), set by bind
        self._dtype = next(heads.parameters()).dtype  # the target's once bound

    @property
    def num_heads(self) -> int:
        return self.heads.config.num_heads

    def bind(self, target_model) -> None:
        """Check sizes, then move the heads to the target's device and dtype once (a shared lm_head
        is then used as it is, never copied per call)."""
        self.heads.check_target(target_model)  # ValueError naming both sizes on a hidden/vocab mismatch
        self._dtype = target_model.dtype  # the heads' from here on (a round reads it here, not from a parameter walk)
        self.heads.to(device=next(target_model.parameters()).device, dtype=self._dtype)
        self.heads.bind_target(target_model)
        self.feature_layers = [num_layers(target_model)]

    def default_tree(self) -> Tree:
        if self._default is None:
            self._default = load_tree(DEFAULT_TREE).truncate(self.num_heads)
        return self._default

    def check_tree(self, tree: Tree) -> None:
        tree.validate(top_k=self.heads.config.output_size, max_depth=self.num_heads)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        return run_alone(self.propose_steps(ctx))

    def propose_steps(self, ctx: DraftContext) -> Generator[DraftRequest, object, Draft]:
        """The heads' logits are one request (``HeadLogits``): a batch's rows' in one pass."""
        tree = (self.default_tree() if ctx.tree is None else ctx.tree).truncate(ctx.max_depth)
        if ctx.features is None or ctx.features.shape[0] == 0 or tree.size == 1:
            return root_only(ctx)
        hidden = ctx.features[-1].to(self._dtype)  # [H]: the final-norm state that predicted the root
        logits = yield HeadLogits(self.heads, hidden, tree.depth)  # [D, V']
        return ranked_draft(tree, ctx.tokens[-1:], logits, self.heads.to_target_ids, ctx.scored)


    @torch.no_grad()
    def probe(self, ctx: DraftContext, rows: int) -> Probe | None:
        """The first head after each of the last ``rows`` positions but the root's: its guess for x[j+2]
        (``Proposer.probe``; the heads keep no state, so nothing is taken in)."""
        n = 0 if ctx.features is None else ctx.features.shape[0] - 1
        m = min(rows, n)
        if m < 1:
            return None
        hidden = ctx.features[-m - 1:-1].to(self._dtype)  # [m, H]: positions L-2-m .. L-3
        return first_guesses(head_rows(self.heads, hidden, 0), self.heads.to_target_ids, ctx.tokens[-m:])


class HeadLogits(DraftRequest):
    """The first ``depth`` heads' logits [D, V'] after the final-norm state ``hidden`` [H]; a batch's rows'
    through each head at once (``depth_logits``)."""

    def __init__(self, heads: MedusaHeads, hidden: torch.Tensor, depth: int):
        self.key, self.hidden, self.depth = heads, hidden, depth

    def run(self) -> torch.Tensor:
        return depth_logits(self.key, self.hidden[None], self.depth)[0]

    @classmethod
    def run_together(cls, requests: list["HeadLogits"], state: dict) -> list[torch.Tensor]:
        hidden = torch.stack([r.hidden for r in requests])  # [B, H]
        logits = depth_logits(requests[0].key, hidden, max(r.depth for r in requests))  # [B, D, V']
        return [row[:r.depth] for row, r in zip(logits, requests)]


def depth_logits(heads: MedusaHeads, hidden: torch.Tensor, depth: int) -> torch.Tensor:
    """Heads 0 .. depth-1 after each row of ``hidden`` [B, H] -> [B, D, V']. Heads that share the target's lm_head
    project all their rows in one product (``few_rows_linear``: B * D rows over the one weight, where D one-row
    products each read the whole vocabulary weight); heads with their own lm_heads, each its B rows."""
    if heads.lm_heads is not None:
        return torch.stack([head_rows(heads, hidden, d) for d in range(depth)], 1)
    features = torch.stack([heads.head_features(hidden, d) for d in range(depth)], 1)  # [B, D, H]
    weight = heads.projection_weight(0).to(features.dtype)
    return few_rows_linear(features.flatten(0, 1), weight).unflatten(0, features.shape[:2])  # [B, D, V']


def head_rows(heads: MedusaHeads, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """Head k's logits for several rows, ``hidden`` [R, H] -> [R, V'] (``head_logits``, its product through
    ``few_rows_linear``)."""
    features = heads.head_features(hidden, k)  # [R, H]
    return few_rows_linear(features, heads.projection_weight(k).to(features.dtype))
