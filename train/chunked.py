"""Fused linear cross-entropy: the loss of ``logits = x @ W.T`` without keeping [n, V] logits.

The plain way (``F.linear`` then ``F.cross_entropy``) keeps each projection's [n, V] log-softmax
alive until backward, so a loss over several heads or unrolled steps holds heads x [n, V] floats
at its peak. Here a custom autograd function walks the rows in chunks, and since the loss is a sum
of row losses it turns each chunk's softmax straight into that chunk's share of ``d_x`` and ``d_W``
during forward (as Liger Kernel's fused linear cross-entropy does); backward only scales them by
the incoming gradient. Peak memory is one chunk's [chunk, V] logits and their softmax whatever the
number of heads, plus the saved ``d_x`` [n, H] and ``d_W`` [V, H]; no product is recomputed.
Related: Cut Cross-Entropy (Wijmans et al., 2024, arXiv:2411.09009).

Two kinds of target, one row per token:
- hard: ``labels`` [n] target indices; row loss ``logsumexp(l) - l[label]``;
- soft: the distribution ``p = softmax(target_x @ target_W.T)`` (EAGLE's target distribution,
  itself chunked and never differentiated), or ``p`` given as log-probabilities; row loss
  ``-sum_v p_v log_softmax(l)_v``.
Only rows marked ``learn`` carry loss; top-1 / top-k counts cover every row (a label outside
``[0, V)`` is a miss), so they add up across micro-batches like the losses' other counts.

With soft targets the row loss may be another divergence than the cross-entropy (``kind``:
``headway.train.divergences``, e.g. reverse KL or the LK acceptance loss); ``ce`` and ``kl`` use the
closed-form ``q - p`` gradient, the others autograd within each chunk.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

from headway.train.divergences import CLOSED_FORM, DEFAULT_LK_DECAY, check_kind, row_losses

DEFAULT_CHUNK_SIZE = 512  # rows per chunk: [512, V] fp32 logits (~100 MB at V = 49152); 0 = unchunked


@dataclasses.dataclass
class SoftLossConfig:
    """What every soft loss through ``linear_cross_entropy`` is set by (a method's ``loss`` block extends it)."""

    # the row loss against the target's distribution (headway.train.divergences): ce (soft cross-entropy),
    # kl, rkl, jsd, tv, lk_alpha (-log acceptance), lk_lambda
    kind: str = "ce"
    lk_decay: float = DEFAULT_LK_DECAY  # lk_lambda: KL weight exp(-lk_decay * alpha)
    chunk_size: int = DEFAULT_CHUNK_SIZE  # rows per block of the fused cross-entropy (0: unchunked)
    positions: str = "assistant"  # "assistant" answers, or "all" real tokens (the labels are the target's own)

    def __post_init__(self):
        check_kind(self.kind, "loss.kind")
        if not self.lk_decay >= 0:
            raise ValueError(f"loss.lk_decay must be >= 0, got {self.lk_decay}")
        if self.chunk_size < 0:
            raise ValueError(f"loss.chunk_size must be >= 0 (0: unchunked), got {self.chunk_size}")
        if self.positions not in ("assistant", "all"):
            raise ValueError(f"loss.positions must be 'assistant' or 'all', got {self.positions!r}")


def topk_counts(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    # logits: [N, V], labels: [N], mask: [N] bool -> (top-1 correct, top-k correct) counts
    top = logits.topk(k, dim=-1).indices  # [N, k]
    hit = top == labels[:, None]
    return (hit[:, 0] & mask).sum(), (hit.any(-1) & mask).sum()


def logits_cross_entropy(logits: torch.Tensor, labels: torch.Tensor | None, learn: torch.Tensor,
                         target_logits: torch.Tensor | None = None, k: int = 5, kind: str = "ce",
                         lk_decay: float = DEFAULT_LK_DECAY):
    """The plain (unchunked) loss on materialised logits: (loss_sum [], top1 [], topk []).

    logits: [n, V]; labels: [n] (None with soft targets: the target's argmax); learn: [n] bool;
    target_logits: [n, V] soft targets' logits (no gradient) or None for hard labels; kind: the
    soft row loss (``headway.train.divergences``; hard labels take ``ce`` only)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least (as under autocast)
    if target_logits is None:
        ce = F.cross_entropy(logits, labels.masked_fill(~learn, -100), reduction="sum", ignore_index=-100)
    else:
        with torch.no_grad():
            logp = target_logits.to(logits.dtype).log_softmax(-1)  # [n, V]
            labels = logp.argmax(-1) if labels is None else labels
        ce = row_losses(logits.log_softmax(-1), logp, kind, lk_decay)[learn].sum()
    with torch.no_grad():
        top1, topk = topk_counts(logits, labels, torch.ones_like(learn), k=min(k, logits.shape[-1]))
    return ce, top1, topk


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The matmul dtype autocast would pick for ``F.linear`` here (backward runs outside autocast)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _chunk_logits(x: torch.Tensor, w: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    # x: [c, H], w: [V, H] (both in the compute dtype) -> [c, V] in the accumulation dtype
    return F.linear(x.to(w.dtype), w).to(acc)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """(x [n, H], W [V, H]) -> (loss_sum [], top1 [], topk []).

    The loss is a sum of row losses, so its gradients are known once the forward has seen each
    chunk's softmax: forward turns every chunk straight into its share of ``d_x`` and ``d_W``
    (``d row / d logits`` = q - p, or q - onehot) and saves those, and backward only scales them
    by the incoming gradient. Three [c, V] x H products per chunk (logits, d_x, d_W) instead of
    four (backward recomputing the logits), and with soft targets given as (x, W) their logits
    once instead of twice. Saved for backward: d_x [n, H] and d_W [V, H] only."""

    @staticmethod
    def forward(ctx, x, weight, labels, learn, target_x, target_weight, target_logp, chunk_size: int, k: int,
                need_x: bool, need_w: bool, kind: str = "ce", lk_decay: float = DEFAULT_LK_DECAY):
        dtype = _compute_dtype(x)
        acc = torch.promote_types(dtype, torch.float32)  # softmax statistics in fp32 at least
        n, soft = x.shape[0], target_x is not None or target_logp is not None
        own_labels = labels is None  # soft targets: count against the target's own argmax
        if own_labels:
            labels = torch.empty(n, dtype=torch.long, device=x.device)
        loss = x.new_zeros((), dtype=acc)
        top1 = topk = torch.zeros((), dtype=torch.long, device=x.device)
        dx = torch.empty_like(x) if need_x else None  # [n, H]
        dw = weight.new_zeros(weight.shape, dtype=acc) if need_w else None  # [V, H] summed over chunks
        with torch.autocast(x.device.type, enabled=False):
            w = weight.to(dtype)
            tw = target_weight.to(dtype) if target_x is not None else None
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                xc = x[s:e].to(dtype)
                logits = _chunk_logits(xc, w, acc)  # [c, V]
                lse = logits.logsumexp(-1)  # [c]
                keep = learn[s:e]
                p = d = None  # d: d loss / d logits [c, V] where autograd gives it
                if soft:
                    if target_logp is not None:  # the target's log-probabilities, computed once by the caller
                        t = target_logp[s:e].to(acc)  # [c, V]
                    else:
                        t = _chunk_logits(target_x[s:e], tw, acc)  # [c, V] the target's logits
                        t = t.sub_(t.logsumexp(-1, keepdim=True))
                    if own_labels:
                        labels[s:e] = t.argmax(-1)
                    if kind not in CLOSED_FORM:  # another divergence: its rows (and gradient) by autograd
                        row, d = _autograd_rows(logits, t, keep, kind, lk_decay, need_x or need_w)
                    else:
                        p = t.exp_() if target_logp is None else t.exp()  # [c, V] the target's distribution
                        row = lse - (p * logits).sum(-1)  # [c]: sum(p) = 1
                        if kind == "kl":  # KL(p || q) = cross-entropy - H(p): the same gradient
                            row = row + torch.xlogy(p, p).sum(-1)
                else:
                    row = lse - logits.gather(1, labels[s:e].clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
                loss = loss + row[keep].sum()
                h1, hk = topk_counts(logits, labels[s:e], torch.ones_like(keep), k=min(k, logits.shape[1]))
                top1, topk = top1 + h1, topk + hk
                if not (need_x or need_w):
                    continue
                if d is None:  # the closed forms
                    d = logits.sub_(lse[:, None]).exp_()  # [c, V] softmax q, in place
                    if p is None:  # d row / d logits = q - onehot(label)
                        d.scatter_add_(1, labels[s:e].clamp(0, d.shape[1] - 1)[:, None], d.new_full((e - s, 1), -1.0))
                    else:  # = q - p
                        d.sub_(p)
                    d = d.mul_(keep.to(acc)[:, None])  # rows without loss give nothing
                _accumulate(d.to(dtype), xc, w, dx, dw, s, e, x.dtype, dtype == acc)
        dw = dw.to(weight.dtype) if need_w else None
        ctx.save_for_backward(dx, dw)
        ctx.mark_non_differentiable(top1, topk)
        return loss, top1, topk

    @staticmethod
    def backward(ctx, grad_loss, _g1, _gk):
        dx, dw = ctx.saved_tensors
        dx = dx * grad_loss.to(dx.dtype) if dx is not None else None
        dw = dw * grad_loss.to(dw.dtype) if dw is not None else None
        return dx, dw, None, None, None, None, None, None, None, None, None, None, None


def _autograd_rows(logits: torch.Tensor, logp: torch.Tensor, keep: torch.Tensor, kind: str, lk_decay: float,
                   grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's row losses [c] and, with ``grad``, the gradient [c, V] of their kept sum in ``logits``
    (autograd on this chunk only: the fused forward runs with gradients off); None without."""
    if not grad:  # evaluation: the rows alone
        return row_losses(logits.log_softmax(-1), logp, kind, lk_decay), None
    with torch.enable_grad():
        leaf = logits.detach().requires_grad_(True)
        row = row_losses(leaf.log_softmax(-1), logp, kind, lk_decay)  # [c]
        (d,) = torch.autograd.grad(row[keep].sum(), leaf)
    return row.detach(), d


def _accumulate(d, xc, w, dx, dw, s: int, e: int, x_dtype, in_place: bool) -> None:
    """Add one chunk's share of the gradients: d [c, V] (d loss / d logits, compute dtype), xc [c, H],
    w [V, H]; dx [n, H] rows s:e, dw [V, H] summed (None: not wanted)."""
    if dx is not None:
        dx[s:e] = (d @ w).to(x_dtype)
    if dw is not None and in_place:
        dw.addmm_(d.T, xc)  # in place: no [V, H] temporary
    elif dw is not None:
        dw += (d.T @ xc).to(dw.dtype)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None = None, *,
                         learn: torch.Tensor | None = None,
                         target: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None = None,
                         project: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         chunk_size: int = DEFAULT_CHUNK_SIZE, k: int = 5, kind: str = "ce",
                         lk_decay: float = DEFAULT_LK_DECAY):
    """Summed cross-entropy (or another divergence) of ``x @ weight.T`` and its top-1 / top-k counts,
    chunked over rows.

    x: [n, H]; weight: [V, H] (trainable or frozen); labels: [n] the target index per row, used for
    the hard loss and the counts (-1: not in the vocabulary, a miss); with soft targets labels
    only feed the counts (None: the target's own argmax). learn: [n] bool rows that carry loss
    (default: labels >= 0 for hard targets, every row for soft ones). target: (target_x [n, H_t],
    target_weight [V, H_t]) for soft targets softmax(target_x @ target_weight.T), or those targets'
    log-probabilities [n, V] when the caller has them (a target shared by several calls is then
    projected once); never differentiated. project: the module's own ``x -> logits`` for the unchunked path (default
    ``F.linear(x, weight)``). chunk_size: rows per chunk; 0 keeps the whole [n, V] logits for
    autograd (the plain path, for reference and measurement). kind: the row loss against soft
    targets (``headway.train.divergences.KINDS``; hard labels take ``ce`` only); lk_decay: the
    ``lk_lambda`` mix's decay.
    Returns (loss_sum [] fp32, top1 [] long, topk [] long).
    """
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0: unchunked), got {chunk_size}")
    if target is None and labels is None:
        raise ValueError("linear_cross_entropy needs labels for hard targets (or target=(x, W) for soft ones)")
    check_kind(kind)
    if target is None and kind != "ce":
        raise ValueError(f"loss kind {kind!r} compares two distributions: pass the target's (target=...), "
                         "hard labels take 'ce' only")
    if learn is None:
        learn = labels >= 0 if target is None else torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    # ZeRO-3 gathers a parameter only inside its own module's forward: there use the module itself
    partitioned = hasattr(weight, "ds_id")
    if chunk_size == 0 or partitioned:
        logits = project(x) if project is not None else F.linear(x, weight.to(x.dtype))
        t_logits = None
        if isinstance(target, torch.Tensor):
            t_logits = target.detach()  # log-probabilities: their softmax is the distribution itself
        elif target is not None:
            with torch.no_grad():
                t_logits = F.linear(target[0], target[1].to(target[0].dtype))
        return logits_cross_entropy(logits, labels, learn, t_logits, k, kind, lk_decay)
    tx = tw = t_logp = None
    if isinstance(target, torch.Tensor):
        t_logp = target.detach()
    elif target is not None:
        tx, tw = target[0].detach(), target[1].detach()
    grad = torch.is_grad_enabled()  # forward computes the gradients, so it must know whether any are wanted
    return _FusedLinearCrossEntropy.apply(x, weight, labels, learn, tx, tw, t_logp, chunk_size, k,
                                          grad and x.requires_grad, grad and weight.requires_grad, kind, lk_decay)
