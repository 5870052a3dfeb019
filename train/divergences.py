"""Row losses between the target's distribution p and the drafter's q = softmax(logits): ``loss.kind``.

Every kind is a sum of row losses, so each runs through the chunked linear cross-entropy
(``headway.train.chunked``) with memory flat in the vocabulary. Per row (p and q over the draft
vocabulary, p renormalised there):

- ``ce``: soft cross-entropy ``-sum p log q`` (EAGLE's and today's default); with hard labels, the
  label's ``-log q``;
- ``kl``: forward ``KL(p || q)`` (the same gradient as ``ce``; the value drops p's entropy);
- ``rkl``: reverse ``KL(q || p)`` (mode seeking);
- ``jsd``: Jensen-Shannon ``(KL(p || m) + KL(q || m)) / 2`` with ``m = (p + q) / 2``;
- ``tv``: total variation ``sum |p - q| / 2`` (= 1 - alpha);
- ``lk_alpha``: ``-log alpha`` with ``alpha = sum min(p, q)``, the probability that speculative
  sampling accepts a token drawn from q (LK losses, arXiv:2602.23881);
- ``lk_lambda``: the LK hybrid ``w KL(p || q) + (1 - w) TV`` with ``w = exp(-decay * alpha)`` held
  constant (no gradient through the weight) and decay 3 (the paper's best): KL leads while
  acceptance is low, total variation (1 - alpha) once it is high. The weight is per row, as
  vllm-project/speculators computes it (SpecForge uses one weight per batch and step, from the
  batch's mean alpha): a per-row weight keeps the loss a sum of rows, so it chunks.

``ce`` and ``kl`` have the closed-form gradient ``q - p`` the fused path uses directly; the other
kinds get their chunk's gradient from autograd on ``row_losses`` (one chunk's [c, V] at a time).
"""

from __future__ import annotations

import math

import torch

KINDS = ("ce", "kl", "rkl", "jsd", "tv", "lk_alpha", "lk_lambda")
CLOSED_FORM = ("ce", "kl")  # d row / d logits = q - p
DEFAULT_LK_DECAY = 3.0  # lk_lambda: w = exp(-decay * alpha)


def check_kind(kind: str, where: str = "loss.kind") -> str:
    """The kind, or a one-line error naming the valid ones."""
    if kind not in KINDS:
        raise ValueError(f"{where}: unknown loss kind {kind!r}; choose one of {', '.join(KINDS)}")
    return kind


def row_losses(logq: torch.Tensor, logp: torch.Tensor, kind: str, lk_decay: float = DEFAULT_LK_DECAY) -> torch.Tensor:
    """Each row's loss, differentiable in ``logq``.

    logq: [n, V] the drafter's log-probabilities (a log_softmax); logp: [n, V] the target's
    (finite: a log_softmax of finite logits, never -inf). Returns [n]."""
    q, p = logq.exp(), logp.exp()
    if kind == "ce":
        return -(p * logq).sum(-1)
    if kind == "kl":
        return (p * (logp - logq)).sum(-1)
    if kind == "rkl":
        return (q * (logq - logp)).sum(-1)
    if kind == "jsd":
        logm = torch.logaddexp(logp, logq) - math.log(2.0)  # [n, V] log of the mixture, stable
        return 0.5 * ((p * (logp - logm)).sum(-1) + (q * (logq - logm)).sum(-1))
    if kind == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    alpha = torch.minimum(p, q).sum(-1).clamp_min(torch.finfo(logq.dtype).tiny)  # [n] acceptance probability
    if kind == "lk_alpha":
        return -alpha.log()
    if kind == "lk_lambda":
        w = torch.exp(-lk_decay * alpha.detach())  # [n] the mix's weight, held constant
        return w * (p * (logp - logq)).sum(-1) + (1 - w) * (1 - alpha)
    raise ValueError(f"unknown loss kind {kind!r}; choose one of {', '.join(KINDS)}")
