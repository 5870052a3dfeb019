"""EAGLE-1 and EAGLE-3 (training-time test): train a feature drafter on a frozen target.

    accelerate launch train/eagle.py --config configs/eagle/eagle3-smollm2-135m.yaml [key=value ...]
    accelerate launch -m headway.train.eagle --config ...   (same thing)
    python -m headway.train.eagle --config ...               (one process)

Features come from forward hooks on the target's layers (online, per batch) or from a cache made
by ``scripts/cache_features.py`` (``features=<folder>``; it must hold the drafter's feature
layers and the final-norm layer L, which gives the target's distribution). The trained drafter
is exported to ``train.output_dir`` (config.json, model.safetensors, model card, metrics).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from headway.heads.eagle import EagleConfig, EagleHead
from headway.heads.target.features import capture_features, num_layers
from headway.train.common import (describe, draft_vocabulary, parse_run_args, report_accuracy, run_main, setup_run,
                                  target_rows)
from headway.train.config import to_dict
from headway.train.data import DataConfig
from headway.train.chunked import SoftLossConfig
from headway.train.eagle_losses import eagle1_loss, eagle3_loss
from headway.train.loop import Method, TrainConfig, run_training


@dataclasses.dataclass
class EagleLossConfig(SoftLossConfig):
    """``kind`` (ce: EAGLE's soft cross-entropy), ``positions`` ("assistant": the answers only, as EAGLE and
    SpecForge do; "all": every real token, prompts and chat template too, valid self-distillation as the labels
    are the target's own distribution; held-out accuracy is always over answers), ``chunk_size``, ``lk_decay``:
    ``SoftLossConfig``'s; the rest EAGLE's own."""

    ttt_steps: int = 7  # EAGLE-3: unrolled training-time-test steps (7 in the paper and SpecForge)
    decay: float = 0.8  # EAGLE-3: step i is weighted decay**i
    noise: float = 0.1  # EAGLE-1: uniform noise U(-noise, noise) on the input features
    ce_weight: float = 0.1  # EAGLE-1: weight of the soft cross-entropy against the target's distribution
    reg_weight: float = 1.0  # EAGLE-1: weight of the SmoothL1 feature regression

    def __post_init__(self):
        super().__post_init__()
        if self.ttt_steps < 1:
            raise ValueError(f"loss.ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.noise < 0 or self.ce_weight < 0 or self.reg_weight < 0:
            raise ValueError("loss.noise, loss.ce_weight and loss.reg_weight must be >= 0")
        if not self.decay > 0:
            raise ValueError(f"loss.decay must be > 0, got {self.decay}")


@dataclasses.dataclass
class EagleRunConfig:
    model: str = "smollm2-135m"  # target: the offline default alias, a local folder or a Hub id
    features: str = "online"  # "online" (hooks on the frozen target per batch) or a feature-cache folder
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    eagle: EagleConfig = dataclasses.field(default_factory=EagleConfig)  # sizes come from the target
    loss: EagleLossConfig = dataclasses.field(default_factory=EagleLossConfig)
    train: TrainConfig = dataclasses.field(default_factory=lambda: TrainConfig(output_dir="outputs/eagle"))


def needed_layers(head_config: EagleConfig, depth: int) -> list[int]:
    """The drafter's feature layers, plus the final-norm layer L (the target's distribution)."""
    layers = list(head_config.feature_layers)
    return layers if depth in layers else layers + [depth]


class EagleTrainingModule(torch.nn.Module):
    """The drafter plus its loss; the frozen target (online features) is held outside the module."""

    def __init__(self, head: EagleHead, target, loss: EagleLossConfig):
        super().__init__()
        self.head = head
        self._target = (target,)  # not a submodule: never wrapped, saved or trained
        self.loss = loss
        self.depth = num_layers(target)
        self.layers = needed_layers(head.config, self.depth)
        self.register_buffer("target_rows", target_rows(head, target), persistent=False)  # [V', H]
        self.register_buffer("draft_index", head.draft_index(), persistent=False)  # [V] or None

    def forward(self, batch: dict[str, torch.Tensor]):
        feats, argmax = batch.get("features"), batch.get("argmax")
        cfg, hsz = self.head.config, self.head.config.hidden_size
        if feats is None:  # online: hooks on the frozen target
            target = self._target[0]
            if cfg.version == 3 or self.draft_index is not None:
                feats, logits = capture_features(target, batch["input_ids"], self.layers, batch["attention_mask"],
                                                 with_logits=True)
                argmax = logits.argmax(-1)
            else:
                feats = capture_features(target, batch["input_ids"], self.layers, batch["attention_mask"])
        if self.training and self.loss.positions == "all":
            batch = {**batch, "loss_mask": batch["attention_mask"]}
        feats = feats.float()  # cached features are stored in bf16
        last = self.layers.index(self.depth)
        final = feats[..., last * hsz:(last + 1) * hsz]  # [B, T, H] the target's final-norm states
        if argmax is not None:
            argmax = torch.where(argmax >= 0, argmax, batch["input_ids"])  # padding (-1): masked by loss_mask anyway
        return self.objective(feats, final, batch, argmax)

    def objective(self, feats: torch.Tensor, final: torch.Tensor, batch: dict, argmax: torch.Tensor | None):
        """The loss and counts from the features [B, T, F] (the feature layers first, in their order), the
        target's final-norm states [B, T, H] and its argmax [B, T] (or None)."""
        cfg = self.head.config
        if cfg.version == 1:
            return eagle1_loss(self.head, final, batch["input_ids"], batch["loss_mask"], self.target_rows, self.draft_index,
                               noise=self.loss.noise if self.training else 0.0, ce_weight=self.loss.ce_weight,
                               reg_weight=self.loss.reg_weight, argmax=argmax, chunk_size=self.loss.chunk_size,
                               kind=self.loss.kind, lk_decay=self.loss.lk_decay)
        fused = feats[..., :cfg.feature_width]  # the feature layers come first, in their order
        return eagle3_loss(self.head, fused, final, batch["input_ids"], batch["loss_mask"], self.target_rows,
                           self.draft_index, argmax, steps=self.loss.ttt_steps, decay=self.loss.decay,
                           chunk_size=self.loss.chunk_size, kind=self.loss.kind, lk_decay=self.loss.lk_decay)


class EagleMethod(Method):
    """The EAGLE plug-in for the shared loop."""

    def __init__(self, head: EagleHead, target, loss: EagleLossConfig):
        self.model = EagleTrainingModule(head, target, loss)

    def export(self, model: EagleTrainingModule, output_dir: Path, metrics: dict) -> None:
        model.head.save_pretrained(output_dir, metrics=metrics)


def parse_args(argv: list[str] | None = None) -> EagleRunConfig:
    return parse_run_args(EagleRunConfig, "Train an EAGLE-1 or EAGLE-3 drafter on a frozen target.",
                          "configs/eagle/eagle3-smollm2-135m.yaml", argv)


RunConfig = EagleRunConfig  # the training entry's protocol (headway.heads.registry.TrainingMethod)


def feature_layers(cfg: EagleRunConfig, depth: int) -> list[int]:
    """What a feature cache must hold for this run on a target of ``depth`` layers: the drafter's
    feature layers (``eagle.feature_layers`` or the version's default) plus the final-norm layer L."""
    probe = EagleConfig(**{**dataclasses.asdict(cfg.eagle), "num_target_layers": depth})
    return needed_layers(probe, depth)


def train(cfg: EagleRunConfig) -> dict:
    """Train and export an EAGLE drafter; returns the final held-out metrics per unrolled step."""
    run = setup_run(cfg.model, cfg.features, cfg.data, cfg.train,
                    layers=lambda target: feature_layers(cfg, num_layers(target)))
    head = EagleHead.from_target(run.target, config=cfg.eagle,
                                 draft_tokens=draft_vocabulary(run, cfg.eagle.draft_vocab_size),
                                 base_model_name_or_path=cfg.model)
    head.to(run.acc.device)
    describe(run, cfg.features)
    metrics = run_training(run.acc, cfg.train, EagleMethod(head, run.target, cfg.loss), run.train_data,
                           run.eval_data, run_config=to_dict(cfg))
    steps = cfg.loss.ttt_steps if head.config.version == 3 else 1
    report_accuracy(run, metrics, "step", steps, "step", cfg.train.output_dir)
    return metrics


def main(argv: list[str] | None = None, exit_process: bool = False) -> dict:
    """Command line: bad input ends with a one-line ``error: ...`` and exit status 2 (``exit_process``:
    see ``run_main``)."""
    return run_main(train, parse_args, argv, exit_process)


if __name__ == "__main__":
    main(exit_process=True)
