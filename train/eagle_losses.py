"""EAGLE losses with per-step counts (exact sums across micro-batches and processes, like Medusa's).

- EAGLE-1 (Li et al., 2024, arXiv:2401.15077): ``SmoothL1(f_hat[t+1], f[t+1]) + 0.1 * CE(p, q)``
  where p = softmax(lm_head f[t+1]) is the target's distribution, q the draft's; the input
  features get uniform noise U(-noise, noise).
- EAGLE-3 (Li et al., 2025, arXiv:2503.01840): training-time test. Step 0 reads the fused target
  features; step i > 0 reads the drafter's own step i-1 output at the same position, the tokens
  shifted by i and RoPE positions ``t + i``; the attention sees step 0's keys causally and the
  diagonal of every later step (``EagleHead.forward(..., ttt=...)``). Loss:
  ``sum_i decay**i * CE(p_i, q_i)`` with p the target's softmax restricted to the draft vocabulary
  (renormalised), rows whose target argmax lies outside the draft vocabulary masked; no
  feature-regression term.

Row t of a step predicts token x[t+2+i] (the same alignment as Medusa head i); it counts when that
token is an assistant token (loss_mask 1). Accuracy is top-1/top-5 of the draft logits against the
target's own argmax there (as EAGLE reports it: what greedy acceptance needs); an argmax outside
the draft vocabulary counts as a miss.

Both soft cross-entropies run through the fused, row-chunked linear cross-entropy
(``headway.train.chunked``): neither the draft's nor the target's [n, V'] logits are kept per step;
``chunk_size=0`` materialises them (the plain path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headway.heads.eagle import TTTKeys
from headway.train.chunked import DEFAULT_CHUNK_SIZE, linear_cross_entropy
from headway.train.divergences import DEFAULT_LK_DECAY


def _shift(x: torch.Tensor, i: int, fill) -> torch.Tensor:
    """x[:, i:] padded back to x's length with ``fill``: row t holds x[:, t + i].  [B, N, ...]"""
    i = min(i, x.shape[1])  # a step deeper than the sequence: all padding, same length
    if i == 0:
        return x
    pad = x.new_full((x.shape[0], i, *x.shape[2:]), fill)
    return torch.cat([x[:, i:], pad], dim=1)


def _counts(prefix: str, ce_sum: torch.Tensor, top1: torch.Tensor, top5: torch.Tensor, n: torch.Tensor,
            extra: dict | None = None) -> dict[str, torch.Tensor]:
    out = {f"{prefix}/loss_sum": ce_sum.detach(), f"{prefix}/top1": top1, f"{prefix}/top5": top5,
           f"{prefix}/count": n}
    for k, v in (extra or {}).items():
        out[f"{prefix}/{k}"] = v.detach()
    return out


def _nothing(prefix: str, n: torch.Tensor, extra: dict | None = None) -> dict[str, torch.Tensor]:
    """The counts of a step without rows (n = 0)."""
    return _counts(prefix, n.float() * 0, n * 0, n * 0, n, extra)


def eagle1_loss(head, features: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                target_rows: torch.Tensor, draft_index: torch.Tensor | None, *, noise: float = 0.1,
                ce_weight: float = 0.1, reg_weight: float = 1.0,
                generator: torch.Generator | None = None, argmax: torch.Tensor | None = None,
                chunk_size: int = DEFAULT_CHUNK_SIZE, kind: str = "ce",
                lk_decay: float = DEFAULT_LK_DECAY) -> tuple[torch.Tensor, dict]:
    """features: [B, T, H] the target's final-norm hidden states; input_ids, loss_mask: [B, T];
    target_rows: [V', H] the target lm_head rows of the draft vocabulary (EAGLE-1 drafts through
    them too); draft_index: [V] target id -> draft index (-1 outside) or None; chunk_size: rows per chunk
    of the fused cross-entropy (0: unchunked); kind: the distribution term's divergence
    (``headway.train.divergences``; ``ce``: EAGLE's soft cross-entropy)."""
    b, t, _ = features.shape
    f = features.float()
    if t < 3:
        zero = sum(p.sum() for p in head.parameters() if p.requires_grad) * 0.0  # every parameter in the graph (DDP)
        n = loss_mask.new_zeros(())
        return zero, _nothing("step0", n)
    inp = f[:, :-2]  # f[t], t = 0 .. T-3
    if noise > 0:
        u = torch.rand(inp.shape, generator=generator, device=inp.device) if generator is not None \
            else torch.rand_like(inp)
        inp = inp + (u * 2 - 1) * noise
    positions = torch.arange(t - 2, device=f.device)[None].expand(b, -1)
    h = head(input_ids[:, 1:-1], head.input_hidden(inp), positions)  # [B, T-2, H]: predicts f[t+1]
    mask = loss_mask[:, 2:].bool()  # token x[t+2] is an assistant token
    h, want = h[mask].float(), f[:, 1:-1][mask]  # [n, H]
    n = mask.sum()
    if h.shape[0] == 0:
        zero = sum(p.sum() for p in head.parameters() if p.requires_grad) * 0.0
        return zero, _nothing("step0", n)
    reg = F.smooth_l1_loss(h, want, reduction="none").mean(-1)  # [n]
    labels = None  # the counts' labels: the target's choice among the draft vocabulary ...
    if draft_index is not None and argmax is not None:  # ... or its own full-vocabulary choice: outside, a miss
        labels = draft_index[argmax[:, 1:-1][mask].clamp_min(0)]
    # q = softmax(lm_head h) against p = softmax(lm_head f[t+1]), both through the target's rows
    ce_sum, top1, top5 = linear_cross_entropy(h, target_rows.to(h.dtype), labels, target=(want, target_rows),
                                              project=head.logits, chunk_size=chunk_size, kind=kind, lk_decay=lk_decay)
    loss = reg_weight * reg.mean() + ce_weight * ce_sum / h.shape[0]
    return loss, _counts("step0", ce_sum, top1, top5, n, {"reg_sum": reg.sum()})


def eagle3_loss(head, features: torch.Tensor, last: torch.Tensor, input_ids: torch.Tensor,
                loss_mask: torch.Tensor, target_rows: torch.Tensor, draft_index: torch.Tensor | None,
                argmax: torch.Tensor | None = None, *, steps: int = 7,
                decay: float = 0.8, chunk_size: int = DEFAULT_CHUNK_SIZE, kind: str = "ce",
                lk_decay: float = DEFAULT_LK_DECAY) -> tuple[torch.Tensor, dict]:
    """features: [B, T, F] the fused target layers; last: [B, T, H] the target's final-norm hidden
    states (its distribution); argmax: [B, T] the target's full-vocabulary argmax (None: use the
    data's next token); target_rows: [V', H] the target lm_head rows of the draft vocabulary;
    chunk_size: rows per chunk of the fused cross-entropy (0: unchunked); kind: each step's divergence
    from the target's distribution (``headway.train.divergences``; ``ce``: EAGLE-3's soft cross-entropy)."""
    b, t, _ = features.shape
    n = t - 1  # rows t = 0 .. T-2: step 0 pairs f[t] with x[t+1]
    metrics: dict[str, torch.Tensor] = {}
    total = features.new_zeros((), dtype=torch.float32)
    if n < 2:
        return total + sum(p.sum() for p in head.parameters() if p.requires_grad) * 0.0, metrics
    with torch.no_grad():
        counted = torch.zeros((b, n), dtype=torch.bool, device=features.device)
        counted[:, :n - 1] = loss_mask[:, 2:].bool()  # x[t+2] exists and is an assistant token
        chosen = argmax[:, 1:] if argmax is not None else torch.cat([input_ids[:, 2:], input_ids[:, -1:]], 1)
        valid = counted.clone()
        if draft_index is not None:
            valid &= draft_index[chosen.clamp_min(0)] >= 0  # the loss learns where the target's choice is in the draft vocabulary
        # accuracy labels: the target's argmax at position t+1 (draft index; -1 outside the draft vocabulary: a miss)
        labels_all = draft_index[chosen.clamp_min(0)] if draft_index is not None else chosen
        # the target's log-probabilities over the draft vocabulary at positions 1 .. T-1, projected once
        # for every unrolled step (step i reads row t+i): [B, N, V'], B*N*V' floats while the loss runs
        t_logp = F.linear(last[:, 1:].float(), target_rows.float()).log_softmax(-1)
    hidden = head.input_hidden(features[:, :-1])  # [B, N, H]
    positions = torch.arange(n, device=features.device)[None].expand(b, -1)
    ttt = TTTKeys()  # not a list: see TTTKeys
    for i in range(steps):
        tokens = _shift(input_ids[:, 1:], i, 0)  # x[t+1+i]
        h = head(tokens, hidden, positions + i, ttt=ttt)  # [B, N, H]
        seen = _shift(counted, i, False)  # [B, N] rows whose target x[t+2+i] counts for accuracy
        count = seen.sum()
        if int(count):
            rb, rt = seen.nonzero(as_tuple=True)  # [n_i]
            learn = valid[rb, rt + i]  # of those, the rows the loss learns from (target's choice in the draft vocabulary)
            # the draft's logits lm_head(norm h) against the target's distribution at position t+1+i
            x, weight = head.projection(h[rb, rt])  # norm(h) (EAGLE-3.1: h, normed by the step) and lm_head
            ce_sum, top1, top5 = linear_cross_entropy(
                x, weight, labels_all[rb, rt + i], learn=learn,
                target=t_logp[rb, rt + i], project=head.lm_head, chunk_size=chunk_size, kind=kind, lk_decay=lk_decay)
            total = total + decay ** i * ce_sum / learn.sum().clamp_min(1)
            metrics.update(_counts(f"step{i}", ce_sum, top1, top5, count))
        else:  # nothing to learn at this depth in this batch: keep the graph whole (DDP)
            total = total + head.logits(h[:, :1]).sum() * 0.0
            metrics.update(_nothing(f"step{i}", count))
        hidden = h  # the next step reads this step's own output
    return total, metrics
