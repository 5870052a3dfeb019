"""DFlash (arXiv:2602.06036): train a block drafter on a frozen target's features.

    accelerate launch -m headway.train.dflash --config configs/dflash/smollm2-135m.yaml [key=value ...]
    headway train dflash --config dflash/tiny
    python -m headway.train.dflash --config ...   (one process)

As the paper and the trainers (SpecForge, speculators) do: each sequence gets up to ``loss.anchors``
random anchors a among the positions whose next token counts; each anchor's block holds the token
x[a] at position a and B - 1 mask tokens at a+1 .. a+B-1. Every block reads the context (the fused
target features, through each layer's k/v) at positions before a, and its own block bidirectionally;
blocks never see each other. Slot k is trained against the target's distribution for x[a+k] (its
final-norm state at a+k-1), weighted exp(-(k-1)/gamma), each slot's rows averaged. The context and the
target's distribution come from one frozen target pass (online hooks) or a feature cache
(``scripts/cache_features.py``, the same layers as EAGLE-3's).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from headway.heads.dflash import DFlashConfig, DFlashHead
from headway.heads.target.features import num_layers
from headway.train.chunked import DEFAULT_CHUNK_SIZE, SoftLossConfig, linear_cross_entropy
from headway.train.common import describe, draft_vocabulary, parse_run_args, report_accuracy, run_main, setup_run
from headway.train.config import to_dict
from headway.train.data import DataConfig
from headway.train.divergences import DEFAULT_LK_DECAY
from headway.train.eagle import EagleMethod, EagleTrainingModule, needed_layers
from headway.train.eagle_losses import _counts, _nothing
from headway.train.loop import TrainConfig, run_training

DEFAULT_GAMMA = 4.0  # slot k's weight exp(-(k-1)/gamma): speculators' default for blocks of 8 (z-lab: 7 for 16)
DEFAULT_ANCHORS = 32  # blocks per sequence (the demo's 96-token sequences hold ~60 answer positions)
EVAL_SEED = 0  # held-out evaluations draw their anchors from this seed: comparable across evaluations


@dataclasses.dataclass
class DFlashLossConfig(SoftLossConfig):
    gamma: float = DEFAULT_GAMMA  # slot k (1 .. B-1) weighted exp(-(k-1)/gamma)
    anchors: int = DEFAULT_ANCHORS  # at most this many blocks per sequence, anchored at random counted positions

    def __post_init__(self):
        super().__post_init__()
        if not self.gamma > 0 or self.anchors < 1:
            raise ValueError(f"loss.gamma must be > 0 and loss.anchors >= 1, got {self.gamma}, {self.anchors}")


@dataclasses.dataclass
class DFlashRunConfig:
    model: str = "smollm2-135m"  # target: the offline default alias, a local folder or a Hub id
    features: str = "online"  # "online" (hooks on the frozen target per batch) or a feature-cache folder
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    dflash: DFlashConfig = dataclasses.field(default_factory=DFlashConfig)  # sizes come from the target
    loss: DFlashLossConfig = dataclasses.field(default_factory=DFlashLossConfig)
    train: TrainConfig = dataclasses.field(default_factory=lambda: TrainConfig(output_dir="outputs/dflash"))

    def __post_init__(self):
        self.data.check_fits("dflash.block_size", self.dflash.block_size)


def pick_anchors(loss_mask: torch.Tensor, count: int, generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` distinct anchors per row, at random among positions a whose next token counts
    (loss_mask[a + 1]), sorted. loss_mask: [B, T] -> (anchors [B, A] long, valid [B, A] bool), A = min(count, T-1);
    a row with fewer candidates pads with invalid anchors at 0."""
    b, t = loss_mask.shape
    candidates = loss_mask[:, 1:].bool()  # [B, T-1]: anchor a = column a
    a = min(count, t - 1)
    noise = torch.rand(candidates.shape, generator=generator, device=loss_mask.device)
    picked = noise.masked_fill(~candidates, -1.0).topk(a, dim=1)  # [B, A]
    valid = picked.values >= 0
    anchors = torch.where(valid, picked.indices, 0)
    order = torch.where(valid, anchors, t).argsort(dim=1)  # valid anchors first, ascending
    return anchors.gather(1, order), valid.gather(1, order)


def block_mask(anchors: torch.Tensor, valid: torch.Tensor, length: int, block: int, dtype) -> torch.Tensor:
    """Additive [B, 1, A*Bk, T + A*Bk] mask: slot (j, k) sees context positions < anchors[j] (none for an invalid
    anchor) and every slot of its own block (bidirectional), nothing of another block."""
    b, a = anchors.shape
    limit = torch.where(valid, anchors, 0).repeat_interleave(block, dim=1)  # [B, A*Bk]
    context = torch.arange(length, device=anchors.device)[None, None] < limit[..., None]  # [B, A*Bk, T]
    owner = torch.arange(a, device=anchors.device).repeat_interleave(block)  # [A*Bk]
    own = (owner[:, None] == owner[None])[None].expand(b, -1, -1)  # [B, A*Bk, A*Bk]
    allowed = torch.cat([context, own], dim=2)
    return torch.zeros(allowed.shape, dtype=dtype, device=anchors.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min)[:, None]


def block_outputs(head: DFlashHead, features: torch.Tensor, input_ids: torch.Tensor, starts: torch.Tensor,
                  valid: torch.Tensor) -> torch.Tensor:
    """Every anchor's block in one pass. features: [B, T, F]; input_ids: [B, T]; starts, valid: [B, A] (``pick_anchors``)
    -> the layers' outputs [B, A, Bk, H] (slot k of block j: the drafter's state for x[starts[j] + k])."""
    b, t, _ = features.shape
    a, block = starts.shape[1], head.config.block_size
    with torch.no_grad():
        positions = (starts[..., None] + torch.arange(block, device=starts.device)).reshape(b, a * block)  # [B, A*Bk]
        ids = torch.full((b, a, block), head.config.mask_token_id, dtype=torch.long, device=starts.device)
        ids[..., 0] = input_ids.gather(1, starts)
        mask = block_mask(starts, valid, t, block, head.fc.weight.dtype)
    kv = head.context_kv(head.context(features), torch.arange(t, device=starts.device)[None].expand(b, -1))
    return head(ids.reshape(b, a * block), positions, kv, attention_mask=mask).view(b, a, block, -1)


def dflash_loss(head: DFlashHead, features: torch.Tensor, last: torch.Tensor, input_ids: torch.Tensor,
                loss_mask: torch.Tensor, target_rows: torch.Tensor, argmax: torch.Tensor | None,
                draft_index: torch.Tensor | None = None, *, anchors: int = DEFAULT_ANCHORS, gamma: float = DEFAULT_GAMMA, chunk_size: int = DEFAULT_CHUNK_SIZE,
                kind: str = "ce", lk_decay: float = DEFAULT_LK_DECAY, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """features: [B, T, F] the fused target layers; last: [B, T, H] the target's final-norm states; input_ids,
    loss_mask: [B, T]; target_rows: [V', H] the target's lm_head rows of the draft vocabulary; argmax: [B, T] the
    target's greedy choice after each position (None: the next token); draft_index: [V] the draft index of each
    target id (-1 outside), None for the full vocabulary. Returns (the loss, counts per slot ``step{k-1}``)."""
    b, t, _ = features.shape
    block = head.config.block_size
    metrics: dict[str, torch.Tensor] = {}
    total = features.new_zeros((), dtype=torch.float32)
    starts, valid = pick_anchors(loss_mask, anchors, generator)  # [B, A]
    h = block_outputs(head, features, input_ids, starts, valid)  # [B, A, Bk, H]
    chosen = argmax if argmax is not None else torch.cat([input_ids[:, 1:], input_ids[:, -1:]], 1)  # [B, T]
    if draft_index is not None:  # target ids -> draft indices (-1 outside the draft vocabulary: a miss)
        chosen = draft_index[chosen.clamp_min(0)]
    for k in range(1, block):
        with torch.no_grad():
            pos = starts + k  # [B, A]: slot k predicts x[pos], the target's distribution at pos - 1
            learn = valid & (pos < t) & loss_mask.gather(1, pos.clamp(max=t - 1)).bool()
            rb, rj = learn.nonzero(as_tuple=True)
            before = pos[rb, rj] - 1
        count = learn.sum()
        if int(count):
            x, weight = head.projection(h[rb, rj, k])
            ce_sum, top1, top5 = linear_cross_entropy(
                x, weight, chosen[rb, before], target=(last[rb, before].float(), target_rows), project=head.logits,
                chunk_size=chunk_size, kind=kind, lk_decay=lk_decay)
            total = total + math.exp(-(k - 1) / gamma) * ce_sum / count
            metrics.update(_counts(f"step{k - 1}", ce_sum, top1, top5, count))
        else:  # keep the graph whole (DDP)
            total = total + head.logits(h[:, :1, k]).sum() * 0.0
            metrics.update(_nothing(f"step{k - 1}", count))
    return total, metrics


class DFlashTrainingModule(EagleTrainingModule):
    """EAGLE's training module (features, the target's rows) with DFlash's objective."""

    def objective(self, feats, final, batch, argmax):
        fused = feats[..., :self.head.config.feature_width]
        generator = None
        if not self.training:  # the same anchors at every evaluation
            generator = torch.Generator(device=fused.device).manual_seed(EVAL_SEED)
        loss = self.loss
        return dflash_loss(self.head, fused, final, batch["input_ids"], batch["loss_mask"], self.target_rows, argmax,
                           self.draft_index, anchors=loss.anchors, gamma=loss.gamma, chunk_size=loss.chunk_size, kind=loss.kind,
                           lk_decay=loss.lk_decay, generator=generator)


class DFlashMethod(EagleMethod):
    def __init__(self, head: DFlashHead, target, loss: DFlashLossConfig):
        self.model = DFlashTrainingModule(head, target, loss)


def parse_args(argv: list[str] | None = None) -> DFlashRunConfig:
    return parse_run_args(DFlashRunConfig, "Train a DFlash block drafter (B - 1 tokens per pass) on a frozen target.",
                          "configs/dflash/smollm2-135m.yaml", argv)


RunConfig = DFlashRunConfig  # the training entry's protocol (headway.heads.registry.TrainingMethod)


def feature_layers(cfg: DFlashRunConfig, depth: int) -> list[int]:
    """What a feature cache must hold: the drafter's feature layers plus the final-norm layer L."""
    probe = DFlashConfig(**{**dataclasses.asdict(cfg.dflash), "num_target_layers": depth})
    return needed_layers(probe, depth)


def train(cfg: DFlashRunConfig) -> dict:
    """Train and export a DFlash drafter; returns the final held-out metrics per slot."""
    run = setup_run(cfg.model, cfg.features, cfg.data, cfg.train,
                    layers=lambda target: feature_layers(cfg, num_layers(target)))
    head = DFlashHead.from_target(run.target, config=cfg.dflash,
                                  draft_tokens=draft_vocabulary(run, cfg.dflash.draft_vocab_size),
                                  base_model_name_or_path=cfg.model)
    head.to(run.acc.device)
    describe(run, cfg.features)
    metrics = run_training(run.acc, cfg.train, DFlashMethod(head, run.target, cfg.loss), run.train_data,
                           run.eval_data, run_config=to_dict(cfg))
    report_accuracy(run, metrics, "step", head.config.block_size - 1, "slot", cfg.train.output_dir)
    return metrics


def main(argv: list[str] | None = None, exit_process: bool = False) -> dict:
    """Command line: bad input ends with a one-line ``error: ...`` and exit status 2."""
    return run_main(train, parse_args, argv, exit_process)


if __name__ == "__main__":
    main(exit_process=True)
