"""LayerSkip self-speculation: train an exit head (norm + lm_head) on a frozen target's early layers.

    accelerate launch -m headway.train.layerskip --config configs/layerskip/smollm2-135m.yaml [key=value ...]
    headway train layerskip --config layerskip/tiny
    python -m headway.train.layerskip --config ...   (one process)

The head reads the state entering the target's layer ``E`` (feature layer E) and learns the target's
own next-token distribution there (the final-norm state through the target's lm_head): LayerSkip's
early-exit loss applied to a frozen model, as self-distillation (arXiv:2404.16710 trains the whole
model with layer dropout and an early-exit loss; headway keeps the target frozen, so outputs stay the
target's and only the exit is learnt). Features come from forward hooks (online) or a cache made by
``scripts/cache_features.py`` holding layers E and L.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from headway.heads.layerskip import LayerSkipConfig, LayerSkipHead, default_exit_layer
from headway.heads.target.features import capture_features, num_layers
from headway.train.chunked import DEFAULT_CHUNK_SIZE, SoftLossConfig, linear_cross_entropy
from headway.train.common import (describe, draft_vocabulary, parse_run_args, report_accuracy, run_main, setup_run,
                                  target_rows)
from headway.train.config import to_dict
from headway.train.data import DataConfig
from headway.train.divergences import DEFAULT_LK_DECAY
from headway.train.loop import Method, TrainConfig, run_training


@dataclasses.dataclass
class LayerSkipLossConfig(SoftLossConfig):
    positions: str = "all"  # "all" real tokens (the labels are the target's own) or "assistant" answers only


@dataclasses.dataclass
class LayerSkipRunConfig:
    model: str = "smollm2-135m"  # target: the offline default alias, a local folder or a Hub id
    features: str = "online"  # "online" (hooks on the frozen target per batch) or a feature-cache folder
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    layerskip: LayerSkipConfig = dataclasses.field(default_factory=LayerSkipConfig)  # sizes come from the target
    loss: LayerSkipLossConfig = dataclasses.field(default_factory=LayerSkipLossConfig)
    train: TrainConfig = dataclasses.field(default_factory=lambda: TrainConfig(output_dir="outputs/layerskip"))


def exit_loss(head: LayerSkipHead, early: torch.Tensor, final: torch.Tensor, loss_mask: torch.Tensor,
              rows: torch.Tensor, draft_index: torch.Tensor | None, argmax: torch.Tensor | None = None, *,
              chunk_size: int = DEFAULT_CHUNK_SIZE, kind: str = "ce", lk_decay: float = DEFAULT_LK_DECAY):
    """The exit head's loss and counts.

    early: [B, T, H] the states entering layer E; final: [B, T, H] the target's final-norm states;
    loss_mask: [B, T] (token t counts); rows: [V', H] the target's lm_head rows of the draft vocabulary;
    draft_index: [V] target id -> draft index (-1 outside) or None; argmax: [B, T] the target's own
    next token at each position (the counts' label; None: the argmax of its draft-vocabulary distribution).
    Position t predicts token t+1, so it counts where token t+1 does. Returns (mean loss, counts of
    "step0")."""
    mask = loss_mask[:, 1:].bool()  # [B, T-1]
    x = early[:, :-1][mask].float()  # [n, H]
    want = final[:, :-1][mask].float()  # [n, H]
    n = mask.sum()
    if x.shape[0] == 0:
        zero = sum(p.sum() for p in head.parameters() if p.requires_grad) * 0.0  # every parameter in the graph (DDP)
        return zero, {"step0/loss_sum": n.float() * 0, "step0/top1": n * 0, "step0/top5": n * 0, "step0/count": n}
    labels = None
    if argmax is not None:
        labels = argmax[:, :-1][mask]
        if draft_index is not None:
            labels = draft_index[labels.clamp_min(0)]  # outside the draft vocabulary: a miss
    normed, weight = head.projection(x)
    loss_sum, top1, top5 = linear_cross_entropy(normed, weight, labels, target=(want, rows),
                                                project=lambda v: v @ weight.T, chunk_size=chunk_size, kind=kind,
                                                lk_decay=lk_decay)
    return loss_sum / x.shape[0], {"step0/loss_sum": loss_sum.detach(), "step0/top1": top1, "step0/top5": top5,
                                   "step0/count": n}


class LayerSkipTrainingModule(torch.nn.Module):
    """The exit head plus its loss; the frozen target (online features) is held outside the module."""

    def __init__(self, head: LayerSkipHead, target, loss: LayerSkipLossConfig):
        super().__init__()
        self.head = head
        self._target = (target,)  # not a submodule: never wrapped, saved or trained
        self.loss = loss
        self.layers = [head.config.exit_layer, num_layers(target)]
        self.register_buffer("target_rows", target_rows(head, target), persistent=False)  # [V', H]
        self.register_buffer("draft_index", head.draft_index(), persistent=False)  # [V] or None

    def forward(self, batch: dict[str, torch.Tensor]):
        feats, argmax = batch.get("features"), batch.get("argmax")
        if feats is None:  # online: hooks on the frozen target
            feats, logits = capture_features(self._target[0], batch["input_ids"], self.layers, batch["attention_mask"],
                                             with_logits=True)
            argmax = logits.argmax(-1)
        if argmax is not None:
            argmax = torch.where(argmax >= 0, argmax, batch["input_ids"])  # padding (-1): masked by loss_mask anyway
        mask = batch["attention_mask"] if self.training and self.loss.positions == "all" else batch["loss_mask"]
        h = self.head.config.hidden_size
        feats = feats.float()  # cached features are stored in bf16
        return exit_loss(self.head, feats[..., :h], feats[..., h:2 * h], mask, self.target_rows, self.draft_index,
                         argmax, chunk_size=self.loss.chunk_size, kind=self.loss.kind, lk_decay=self.loss.lk_decay)


class LayerSkipMethod(Method):
    """The LayerSkip plug-in for the shared loop."""

    def __init__(self, head: LayerSkipHead, target, loss: LayerSkipLossConfig):
        self.model = LayerSkipTrainingModule(head, target, loss)

    def export(self, model: LayerSkipTrainingModule, output_dir: Path, metrics: dict) -> None:
        model.head.save_pretrained(output_dir, metrics=metrics)


def parse_args(argv: list[str] | None = None) -> LayerSkipRunConfig:
    return parse_run_args(LayerSkipRunConfig, "Train a LayerSkip exit head on a frozen target's early layers.",
                          "configs/layerskip/smollm2-135m.yaml", argv)


RunConfig = LayerSkipRunConfig  # the training entry's protocol (headway.heads.registry.TrainingMethod)


def feature_layers(cfg: LayerSkipRunConfig, depth: int) -> list[int]:
    """What a feature cache must hold for this run: the exit layer E and the final-norm layer L."""
    exit_layer = cfg.layerskip.exit_layer if cfg.layerskip.exit_layer is not None else default_exit_layer(depth)
    if not 1 <= exit_layer < depth:
        raise ValueError(f"layerskip.exit_layer must be in 1..{depth - 1} (the target has {depth} layers), "
                         f"got {exit_layer}")
    return [exit_layer, depth]


def train(cfg: LayerSkipRunConfig) -> dict:
    """Train and export a LayerSkip exit head; returns the final held-out metrics."""
    run = setup_run(cfg.model, cfg.features, cfg.data, cfg.train,
                    layers=lambda target: feature_layers(cfg, num_layers(target)))
    exit_layer = feature_layers(cfg, num_layers(run.target))[0]
    head = LayerSkipHead.from_target(run.target, config=cfg.layerskip, exit_layer=exit_layer,
                                     draft_tokens=draft_vocabulary(run, cfg.layerskip.draft_vocab_size),
                                     base_model_name_or_path=cfg.model)
    head.to(run.acc.device)
    describe(run, cfg.features)
    metrics = run_training(run.acc, cfg.train, LayerSkipMethod(head, run.target, cfg.loss), run.train_data,
                           run.eval_data, run_config=to_dict(cfg))
    if run.acc.is_main_process and "step0/top1" in metrics:
        print(f"exit at layer {exit_layer}: held-out top-1 {metrics['step0/top1']:.3f}  top-5 "
              f"{metrics['step0/top5']:.3f} (the target's own next token)")
    report_accuracy(run, {}, "step", 0, "step", cfg.train.output_dir)
    return metrics


def main(argv: list[str] | None = None, exit_process: bool = False) -> dict:
    """Command line: bad input ends with a one-line ``error: ...`` and exit status 2 (``exit_process``:
    see ``run_main``)."""
    return run_main(train, parse_args, argv, exit_process)


if __name__ == "__main__":
    main(exit_process=True)
