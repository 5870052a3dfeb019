"""P-EAGLE (arXiv:2602.01469): train an EAGLE-3 drafter to propose K tokens in one pass, on a frozen target.

    accelerate launch -m headway.train.peagle --config configs/peagle/smollm2-135m.yaml [key=value ...]
    headway train peagle --config peagle/tiny
    python -m headway.train.peagle --config ...   (one process)

Each sequence is laid out once for all depths: its N real positions (token x[t+1] with the target's
feature f[t], as EAGLE-3's step 0) followed, for each depth d = 1 .. K-1, by N slots (the mask token with
``mask_hidden``) at positions t + d, one chain per anchor t. A real position sees the real ones up to it;
slot (t, d) sees the real positions up to t and its own chain's slots up to depth d (speculators' and
SpecForge's mask). Depth d's output at anchor t is trained against the target's distribution for token
x[t+2+d]. Every position is an anchor unless ``loss.cod_ratio`` < 1 (COD sampling, as the paper's trainers
down-sample deeper depths to save memory on long sequences; at this scale all fit), each depth weighted
``loss.decay ** d`` (1.0: the trainers' uniform weights). Features come online from hooks, or from a cache
made by ``scripts/cache_features.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F

from headway.heads.peagle import PEagleConfig, PEagleHead
from headway.heads.target.features import num_layers
from headway.train.chunked import DEFAULT_CHUNK_SIZE, SoftLossConfig, linear_cross_entropy
from headway.train.common import describe, draft_vocabulary, parse_run_args, report_accuracy, run_main, setup_run
from headway.train.config import to_dict
from headway.train.data import DataConfig
from headway.train.divergences import DEFAULT_LK_DECAY
from headway.train.eagle import EagleMethod, EagleTrainingModule, needed_layers
from headway.train.eagle_losses import _counts, _nothing, _shift
from headway.train.loop import TrainConfig, run_training


@dataclasses.dataclass
class PEagleLossConfig(SoftLossConfig):
    decay: float = 1.0  # depth d is weighted decay**d (1.0: uniform, as speculators and SpecForge)
    # COD sampling (the paper's, and speculators'): in training, depth d >= 1 keeps max(cod_ratio**d, cod_floor) of
    # the anchors, drawn among depth d-1's (a kept slot's whole chain is kept). 1.0: every anchor at every depth
    # (all fit at this scale); the trainers use 0.7 and 0.2 for long sequences. Evaluation always takes all.
    cod_ratio: float = 1.0
    cod_floor: float = 0.2

    def __post_init__(self):
        super().__post_init__()
        if not self.decay > 0:
            raise ValueError(f"loss.decay must be > 0, got {self.decay}")
        if not 0 < self.cod_ratio <= 1 or not 0 <= self.cod_floor <= 1:
            raise ValueError(f"loss.cod_ratio must be in (0, 1] and loss.cod_floor in [0, 1], got {self.cod_ratio} "
                             f"and {self.cod_floor}")


@dataclasses.dataclass
class PEagleRunConfig:
    model: str = "smollm2-135m"  # target: the offline default alias, a local folder or a Hub id
    features: str = "online"  # "online" (hooks on the frozen target per batch) or a feature-cache folder
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    peagle: PEagleConfig = dataclasses.field(default_factory=PEagleConfig)  # sizes come from the target
    loss: PEagleLossConfig = dataclasses.field(default_factory=PEagleLossConfig)
    train: TrainConfig = dataclasses.field(default_factory=lambda: TrainConfig(output_dir="outputs/peagle"))

    def __post_init__(self):
        self.data.check_fits("peagle.parallel_depths", self.peagle.parallel_depths)


def parallel_mask(n: int, depths: int, device) -> torch.Tensor:
    """[K*N, K*N] bool, True where a row may look: rows are N real positions then N slots per depth 1..K-1
    (row d*N + t: anchor t, depth d). Real t sees real <= t; slot (t, d) sees real <= t and slots (t, d'),
    1 <= d' <= d."""
    idx = torch.arange(depths * n, device=device)
    return chain_mask(idx % n, idx // n)


def chain_mask(anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """``parallel_mask`` for any rows: anchor [S], depth [S] (0: a real position) -> [S, S] bool."""
    q_d, q_a, k_d, k_a = depth[:, None], anchor[:, None], depth[None], anchor[None]
    return ((k_d == 0) & (k_a <= q_a)) | ((k_d > 0) & (k_a == q_a) & (k_d <= q_d))


def cod_anchors(n: int, depths: int, ratio: float = 1.0, floor: float = 0.0) -> list[torch.Tensor]:
    """COD sampling (P-EAGLE, arXiv:2602.01469): the anchors [n_d] each depth trains, ascending. Depth 0 keeps all
    n; depth d keeps int(n * max(ratio**d, floor)) drawn at random among depth d-1's, so every kept slot's chain is
    kept too (a slot reads its chain). ratio 1: every anchor at every depth, no random draw."""
    kept = [torch.arange(n)]
    for d in range(1, depths):
        size = min(kept[-1].numel(), int(n * max(ratio ** d, floor)))
        if size < kept[-1].numel():
            kept.append(kept[-1][torch.randperm(kept[-1].numel())[:size]].sort().values)
        else:
            kept.append(kept[-1])
    return kept


def peagle_loss(head: PEagleHead, features: torch.Tensor, last: torch.Tensor, input_ids: torch.Tensor,
                loss_mask: torch.Tensor, target_rows: torch.Tensor, draft_index: torch.Tensor | None,
                argmax: torch.Tensor | None, *, decay: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                kind: str = "ce", lk_decay: float = DEFAULT_LK_DECAY,
                anchors: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, dict]:
    """features: [B, T, F] the fused target layers; last: [B, T, H] the target's final-norm states; the rest
    as ``eagle3_loss``; ``anchors``: the anchors each depth trains (``cod_anchors``; None: all). Returns (the loss,
    counts per depth ``step{d}``)."""
    b, t, _ = features.shape
    n, k = t - 1, head.config.parallel_depths
    metrics: dict[str, torch.Tensor] = {}
    total = features.new_zeros((), dtype=torch.float32)
    if n < 2:
        return total + sum(p.sum() for p in head.parameters() if p.requires_grad) * 0.0, metrics
    device = features.device
    with torch.no_grad():
        counted = torch.zeros((b, n), dtype=torch.bool, device=device)
        counted[:, :n - 1] = loss_mask[:, 2:].bool()  # x[t+2] exists and counts
        chosen = argmax[:, 1:] if argmax is not None else torch.cat([input_ids[:, 2:], input_ids[:, -1:]], 1)
        valid = counted.clone()
        if draft_index is not None:
            valid &= draft_index[chosen.clamp_min(0)] >= 0
        labels_all = draft_index[chosen.clamp_min(0)] if draft_index is not None else chosen
        t_logp = F.linear(last[:, 1:].float(), target_rows.float()).log_softmax(-1)  # [B, N, V'] row t: for x[t+2]
    kept = [a.to(device) for a in (anchors or [torch.arange(n)] * k)]  # depth d's anchors [n_d]
    h = parallel_forward(head, features, input_ids, kept)  # [B, S, H]
    offset = 0
    for d, at in enumerate(kept):
        rows = h[:, offset:offset + at.shape[0]]  # [B, n_d, H]: anchor at[i]'s depth-d output, for x[at[i]+2+d]
        offset += at.shape[0]
        seen = _shift(counted, d, False)[:, at]  # [B, n_d]
        count = seen.sum()
        if int(count):
            rb, ri = seen.nonzero(as_tuple=True)
            rt = at[ri]
            learn = valid[rb, rt + d]
            x, weight = head.projection(rows[rb, ri])
            ce_sum, top1, top5 = linear_cross_entropy(
                x, weight, labels_all[rb, rt + d], learn=learn, target=t_logp[rb, rt + d], project=head.lm_head,
                chunk_size=chunk_size, kind=kind, lk_decay=lk_decay)
            total = total + decay ** d * ce_sum / learn.sum().clamp_min(1)
            metrics.update(_counts(f"step{d}", ce_sum, top1, top5, count))
        else:  # keep the graph whole (DDP)
            total = total + head.logits(rows[:, :1]).sum() * 0.0
            metrics.update(_nothing(f"step{d}", count))
    return total, metrics


def parallel_forward(head: PEagleHead, features: torch.Tensor, input_ids: torch.Tensor,
                     kept: list[torch.Tensor]) -> torch.Tensor:
    """The drafter over one layout of every depth: the N real positions (x[t+1] with f[t]), then depth d's slots
    at anchors ``kept[d]`` (kept[0]: all N) at positions t + d. features [B, T, F], input_ids [B, T] -> the rows'
    outputs [B, S, H], S = sum of the kept anchors, in that order."""
    b, device = features.shape[0], features.device
    with torch.no_grad():
        anchor = torch.cat(kept)  # [S]
        depth = torch.cat([torch.full_like(a, d) for d, a in enumerate(kept)])  # [S]
        mask = torch.zeros(anchor.shape * 2, dtype=features.dtype, device=device).masked_fill_(
            ~chain_mask(anchor, depth), torch.finfo(features.dtype).min)[None, None]  # [1, 1, S, S]
    slots = anchor.shape[0] - kept[0].shape[0]
    real = head.input_hidden(features[:, :-1])  # [B, N, H]
    hidden = torch.cat([real, head.slot_hidden().to(real.dtype).expand(b, slots, -1)], 1)  # [B, S, H]
    mask_ids = torch.full((b, slots), head.config.mask_token_id, dtype=input_ids.dtype, device=device)
    tokens = torch.cat([input_ids[:, 1:], mask_ids], 1)
    return head(tokens, hidden, (anchor + depth)[None].expand(b, -1), attention_mask=mask)


class PEagleTrainingModule(EagleTrainingModule):
    """EAGLE's training module (features, the target's rows) with P-EAGLE's objective."""

    def objective(self, feats, final, batch, argmax):
        fused = feats[..., :self.head.config.feature_width]
        anchors = None
        if self.training and self.loss.cod_ratio < 1:  # COD sampling in training; evaluation takes every anchor
            anchors = cod_anchors(fused.shape[1] - 1, self.head.config.parallel_depths, self.loss.cod_ratio,
                                  self.loss.cod_floor)
        return peagle_loss(self.head, fused, final, batch["input_ids"], batch["loss_mask"], self.target_rows,
                           self.draft_index, argmax, decay=self.loss.decay, chunk_size=self.loss.chunk_size,
                           kind=self.loss.kind, lk_decay=self.loss.lk_decay, anchors=anchors)


class PEagleMethod(EagleMethod):
    def __init__(self, head: PEagleHead, target, loss: PEagleLossConfig):
        self.model = PEagleTrainingModule(head, target, loss)


def parse_args(argv: list[str] | None = None) -> PEagleRunConfig:
    return parse_run_args(PEagleRunConfig, "Train a P-EAGLE drafter (K tokens per pass) on a frozen target.",
                          "configs/peagle/smollm2-135m.yaml", argv)


RunConfig = PEagleRunConfig  # the training entry's protocol (headway.heads.registry.TrainingMethod)


def feature_layers(cfg: PEagleRunConfig, depth: int) -> list[int]:
    """What a feature cache must hold: the drafter's feature layers plus the final-norm layer L."""
    probe = PEagleConfig(**{**dataclasses.asdict(cfg.peagle), "num_target_layers": depth})
    return needed_layers(probe, depth)


def train(cfg: PEagleRunConfig) -> dict:
    """Train and export a P-EAGLE drafter; returns the final held-out metrics per depth."""
    run = setup_run(cfg.model, cfg.features, cfg.data, cfg.train,
                    layers=lambda target: feature_layers(cfg, num_layers(target)))
    head = PEagleHead.from_target(run.target, config=cfg.peagle,
                                  draft_tokens=draft_vocabulary(run, cfg.peagle.draft_vocab_size),
                                  base_model_name_or_path=cfg.model)
    head.to(run.acc.device)
    describe(run, cfg.features)
    metrics = run_training(run.acc, cfg.train, PEagleMethod(head, run.target, cfg.loss), run.train_data,
                           run.eval_data, run_config=to_dict(cfg))
    report_accuracy(run, metrics, "step", head.config.parallel_depths, "depth", cfg.train.output_dir)
    return metrics


def main(argv: list[str] | None = None, exit_process: bool = False) -> dict:
    """Command line: bad input ends with a one-line ``error: ...`` and exit status 2."""
    return run_main(train, parse_args, argv, exit_process)


if __name__ == "__main__":
    main(exit_process=True)
