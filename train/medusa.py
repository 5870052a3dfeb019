"""Medusa-1: train heads on a frozen target.

    accelerate launch train/medusa.py --config configs/medusa/smollm2-135m.yaml [key=value ...]
    accelerate launch -m headway.train.medusa --config ...   (same thing)
    python -m headway.train.medusa --config ...               (one process)

Features are the target's last hidden state, computed online per batch or read from a cache
made by ``scripts/cache_features.py`` (``features=<folder>``). At the end the heads are exported
to ``train.output_dir`` (config.json, model.safetensors, README.md model card, metrics).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from headway.heads import MedusaConfig, MedusaHeads
from headway.train.common import (describe, draft_vocabulary, parse_run_args, report_accuracy, run_main, setup_run,
                                  target_rows)
from headway.train.config import to_dict
from headway.train.data import DataConfig
from headway.train.batches import last_hidden_state
from headway.train.loop import Method, TrainConfig, run_training
from headway.train.divergences import DEFAULT_LK_DECAY, check_kind
from headway.train.losses import DEFAULT_CHUNK_SIZE, head_weights, medusa_loss


@dataclasses.dataclass
class LossConfig:
    decay: float = 0.8  # head k is weighted decay**k (Medusa's 0.8)
    weights: list[float] | None = None  # explicit per-head weights instead of decay**k
    chunk_size: int = DEFAULT_CHUNK_SIZE  # rows per block of the fused cross-entropy (0: unchunked, [n, V'] logits kept)
    # ce: the data's next tokens (Medusa's loss); kl, rkl, jsd, tv, lk_alpha, lk_lambda: the target's own
    # distribution for each head's token (headway.train.divergences)
    kind: str = "ce"
    lk_decay: float = DEFAULT_LK_DECAY  # lk_lambda: KL weight exp(-lk_decay * alpha)

    def __post_init__(self):
        check_kind(self.kind, "kind")
        if not self.lk_decay >= 0:
            raise ValueError(f"lk_decay must be >= 0, got {self.lk_decay}")
        if not self.decay > 0:
            raise ValueError(f"decay must be > 0 (head k is weighted decay**k), got {self.decay}")
        if self.weights is not None and (not self.weights or not all(w >= 0 for w in self.weights)):
            raise ValueError(f"weights must be one number >= 0 per head (or null for decay**k), got {self.weights}")
        if self.chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0 (0: unchunked), got {self.chunk_size}")


@dataclasses.dataclass
class MedusaRunConfig:
    model: str = "smollm2-135m"  # target: the offline default alias, a local folder or a Hub id
    features: str = "online"  # "online" (run the frozen target per batch) or a feature-cache folder
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    heads: MedusaConfig = dataclasses.field(default_factory=MedusaConfig)  # hidden/vocab sizes come from the target
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    train: TrainConfig = dataclasses.field(default_factory=lambda: TrainConfig(output_dir="outputs/medusa"))

    def __post_init__(self):
        if self.loss.weights and len(self.loss.weights) != self.heads.num_heads:
            raise ValueError(f"loss.weights has {len(self.loss.weights)} entries for heads.num_heads="
                             f"{self.heads.num_heads}; give one per head")


class MedusaTrainingModule(torch.nn.Module):
    """Heads plus their loss; the frozen target (online features) is held outside the module.

    ``chunk_size``: rows per chunk of the fused loss (peak memory: one [chunk, V] block of logits
    whatever the number of heads); 0 keeps every head's [n, V] logits for backward."""

    def __init__(self, heads: MedusaHeads, target, weights: list[float], *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 loss: LossConfig | None = None):
        super().__init__()
        self.heads = heads
        self._target = (target,)  # not a submodule: never wrapped, saved or trained
        self.weights = weights
        self.chunk_size = chunk_size
        self.loss = loss or LossConfig()
        self.register_buffer("draft_index", heads.draft_index(), persistent=False)  # None for a full vocabulary
        rows = target_rows(heads, target) if self.loss.kind != "ce" else None
        self.register_buffer("target_rows", rows, persistent=False)  # [V', H] or None

    def forward(self, batch: dict[str, torch.Tensor]):
        hidden = batch.get("features")  # cached: the final-norm layer only
        if hidden is None:
            hidden = last_hidden_state(self._target[0], batch["input_ids"], batch["attention_mask"])
        hidden = hidden.float()  # cached features may be stored in half precision
        return medusa_loss(self.heads, hidden, batch["input_ids"], batch["loss_mask"], self.weights, self.draft_index,
                           chunk_size=self.chunk_size, kind=self.loss.kind, target_rows=self.target_rows,
                           lk_decay=self.loss.lk_decay)



class MedusaMethod(Method):
    """The Medusa-1 plug-in for the shared loop."""

    def __init__(self, heads: MedusaHeads, target, weights: list[float], *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 loss: LossConfig | None = None):
        self.model = MedusaTrainingModule(heads, target, weights, chunk_size=chunk_size, loss=loss)

    def export(self, model: MedusaTrainingModule, output_dir: Path, metrics: dict) -> None:
        model.heads.save_pretrained(output_dir, metrics=metrics)


def parse_args(argv: list[str] | None = None) -> MedusaRunConfig:
    return parse_run_args(MedusaRunConfig, "Train Medusa-1 heads on a frozen target.",
                          "configs/medusa/smollm2-135m.yaml", argv)


RunConfig = MedusaRunConfig  # the training entry's protocol (headway.heads.registry.TrainingMethod)


def feature_layers(cfg: MedusaRunConfig, depth: int) -> list[int]:
    """What a feature cache must hold for this run: the final-norm layer L."""
    return [depth]


def train(cfg: MedusaRunConfig) -> dict:
    """Train and export Medusa-1 heads; returns the final held-out metrics per head."""
    run = setup_run(cfg.model, cfg.features, cfg.data, cfg.train)  # cached features: the final-norm layer
    heads = MedusaHeads.from_target(run.target, cfg.heads, draft_tokens=draft_vocabulary(run, cfg.heads.draft_vocab_size),
                                    base_model_name_or_path=cfg.model)
    heads.to(run.acc.device)
    describe(run, cfg.features)
    method = MedusaMethod(heads, run.target, head_weights(cfg.heads.num_heads, cfg.loss.decay, cfg.loss.weights),
                          chunk_size=cfg.loss.chunk_size, loss=cfg.loss)
    metrics = run_training(run.acc, cfg.train, method, run.train_data, run.eval_data, run_config=to_dict(cfg))
    report_accuracy(run, metrics, "head", cfg.heads.num_heads, "head", cfg.train.output_dir)
    return metrics


def main(argv: list[str] | None = None, exit_process: bool = False) -> dict:
    """Command line: bad input ends with a one-line ``error: ...`` and exit status 2 (``exit_process``:
    see ``run_main``)."""
    return run_main(train, parse_args, argv, exit_process)


if __name__ == "__main__":
    main(exit_process=True)
