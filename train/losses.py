"""Losses and accuracy counts for the drafters.

Medusa-1 (Cai et al., 2024): ``sum_k w_k * CE(head_k(h_t), x_{t+k+2})`` over assistant tokens,
with ``w_k = 0.8**k`` by default. Metrics are returned as counts (correct, total) so they add up
exactly across micro-batches and processes. Each head's loss is a fused, row-chunked linear
cross-entropy (``headway.train.chunked``): peak memory holds one [chunk, V] block of logits, not
one [n, V] per head.
"""

from __future__ import annotations

import re

import torch

from headway.train.chunked import DEFAULT_CHUNK_SIZE, linear_cross_entropy, topk_counts
from headway.train.divergences import DEFAULT_LK_DECAY

__all__ = ["DEFAULT_CHUNK_SIZE", "head_weights", "medusa_loss", "summarize",
           "topk_counts"]  # topk_counts now lives in headway.train.chunked; re-exported for old imports


def head_weights(num_heads: int, decay: float = 0.8, weights: list[float] | None = None) -> list[float]:
    """Per-head loss weights: explicit ``weights`` or ``decay**k``."""
    if weights:
        if len(weights) != num_heads:
            raise ValueError(f"loss weights has {len(weights)} entries for {num_heads} heads; give one per head")
        return list(weights)
    return [decay**k for k in range(num_heads)]


def medusa_loss(heads, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                weights: list[float], draft_index: torch.Tensor | None = None,
                chunk_size: int = DEFAULT_CHUNK_SIZE, *, kind: str = "ce", target_rows: torch.Tensor | None = None,
                lk_decay: float = DEFAULT_LK_DECAY) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted Medusa loss and per-head counts.

    hidden: [B, T, H] target features; input_ids, loss_mask: [B, T]. Head k at position t is
    trained on token t+k+2 where that token is an assistant token (loss_mask 1). With a reduced
    draft vocabulary, ``draft_index`` [V] maps target ids to draft indices (-1 outside): such labels carry
    no loss but count as misses in the accuracy, which stays comparable with a full vocabulary.
    ``chunk_size``: rows per chunk of the fused loss; 0 materialises every head's [n, V] logits
    (the plain path: same values, memory growing with heads x vocabulary).
    ``kind``: ``ce`` trains on the data's tokens (Medusa's loss); any other kind
    (``headway.train.divergences``) trains head k on the target's own distribution for that token,
    ``softmax(target_rows @ hidden[t+k+1])`` over the draft vocabulary (``target_rows`` [V', H]:
    the frozen target's lm_head rows), so ``kl`` is self-distillation and ``lk_alpha`` trains
    acceptance itself. The accuracy counts stay against the data's tokens either way.
    """
    num_heads = len(weights)
    soft = kind != "ce"
    if soft and target_rows is None:
        raise ValueError(f"loss.kind={kind} needs the target's distribution: pass target_rows (its lm_head rows)")
    total = hidden.new_zeros((), dtype=torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    for k in range(num_heads):
        shift = k + 2
        mask = loss_mask[:, shift:].reshape(-1).bool()  # [N] (empty when T <= shift)
        feats = hidden[:, :-shift].reshape(-1, hidden.shape[-1])[mask]  # [n, H]: only rows that count
        labels = input_ids[:, shift:].reshape(-1)[mask]  # [n]
        if draft_index is not None:
            labels = draft_index[labels]  # -1: not in the draft vocabulary
        n = mask.sum()
        if feats.shape[0] == 0:
            # keep every head's parameters in the graph (zero gradient): DDP needs each one reduced
            total = total + 0.0 * heads.head_logits(hidden[:1, :1], k).sum()
            metrics.update({f"head{k}/loss_sum": n.float() * 0, f"head{k}/top1": n * 0, f"head{k}/top5": n * 0,
                            f"head{k}/count": n})
            continue
        target = None
        if soft:  # the target's distribution for token t+k+2: its own next-token output at position t+k+1
            want = hidden[:, k + 1:-1].reshape(-1, hidden.shape[-1])[mask].detach()  # [n, H]
            target = (want, target_rows)
        ce, top1, top5 = linear_cross_entropy(heads.head_features(feats, k), heads.projection_weight(k), labels,
                                              learn=labels >= 0, target=target,
                                              project=lambda x, k=k: heads.project(x, k), chunk_size=chunk_size,
                                              kind=kind, lk_decay=lk_decay)
        total = total + weights[k] * ce / n
        metrics.update({f"head{k}/loss_sum": ce.detach(), f"head{k}/top1": top1, f"head{k}/top5": top5,
                        f"head{k}/count": n})
    return total, metrics


def summarize(counts: dict[str, float]) -> dict[str, float]:
    """Turn summed counts into per-head (Medusa ``head{k}``) or per-step (EAGLE ``step{i}``) loss,
    top-1 / top-5 accuracy, and any other ``*_sum`` averaged the same way; any other group ``g``
    with a ``g/count`` has each ``g/*_sum`` averaged by it (Medusa-2's ``joint/kl``)."""
    out: dict[str, float] = {}
    groups = sorted({key.split("/")[0] for key in counts if re.fullmatch(r"(head|step)\d+", key.split("/")[0])},
                    key=lambda g: (g.rstrip("0123456789"), int(g.lstrip("headstp"))))
    for g in groups:
        n = max(float(counts.get(f"{g}/count", 0)), 1.0)
        out[f"{g}/loss"] = float(counts[f"{g}/loss_sum"]) / n
        out[f"{g}/top1"] = float(counts[f"{g}/top1"]) / n
        out[f"{g}/top5"] = float(counts[f"{g}/top5"]) / n
        for key in counts:
            if key.startswith(f"{g}/") and key.endswith("_sum") and key != f"{g}/loss_sum":
                out[key[:-4]] = float(counts[key]) / n
    for g in sorted({key.split("/")[0] for key in counts if "/" in key} - set(groups)):  # e.g. Medusa-2's "joint"
        if f"{g}/count" in counts:
            n = max(float(counts[f"{g}/count"]), 1.0)
            out.update({key[:-4]: float(counts[key]) / n for key in counts if key.startswith(f"{g}/") and key.endswith("_sum")})
    top1 = [out[f"{g}/top1"] for g in groups]
    if top1 and len({g.rstrip("0123456789") for g in groups}) == 1:
        out["simulated_acc_len"] = simulated_acc_len(top1)
        out["simulated_tau"] = 1.0 + out["simulated_acc_len"]
    return out


def simulated_acc_len(top1: list[float]) -> float:
    """Expected accepted draft tokens of a chain whose step k is accepted with probability top1[k]
    given steps < k were (SpecForge's simulated_acc_len): sum_k prod_{i<=k} top1[i]. A chain round's
    tau is this plus the bonus token (``simulated_tau``), the figure to set beside a measured tau."""
    total, running = 0.0, 1.0
    for acc in top1:
        running *= acc
        total += running
    return total
