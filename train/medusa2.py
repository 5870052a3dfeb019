"""Medusa-2: heads trained jointly with a LoRA adapter on the target (Cai et al., 2024, arXiv:2401.10774, 2.3.2).

    accelerate launch train/medusa2.py --config configs/medusa2/smollm2-135m.yaml [key=value ...]
    python -m headway.train.medusa2 --config medusa2/tiny ...   (one process)

Loss per batch: ``KL(original || tuned) + lambda * sum_k w_k CE(head_k, x_{t+k+2})`` over assistant
tokens. The tuned model is the target with LoRA adapters (peft); the original is the same model
with its adapters disabled, so no second copy is held. ``lambda`` warms up linearly to
``loss.lambda_max``; the heads train at ``lr * loss.heads_lr_mult``; for the first
``loss.stage1_steps`` only the heads train (Medusa-1 style, the adapters get no gradient).
Features are online only: a feature cache cannot follow a target that changes.

Export (``train.output_dir``): the heads (config.json, model.safetensors, model card),
``adapter/`` (peft's adapter_config.json + adapter_model.safetensors) and, with ``merge: true``,
``merged/`` (the tuned target with the adapter merged, plus its tokenizer). At run time:

    target, tok = load_target(base, adapter=output_dir / "adapter")
    SpeculativeGenerator(target, load_drafter(output_dir))
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F

from headway.heads import MedusaHeads
from headway.train.common import (describe, draft_vocabulary, parse_run_args, report_accuracy, run_main, setup_run,
                                  target_rows)
from headway.train.config import to_dict
from headway.train.loop import Method, TrainConfig, run_training
from headway.train.accelerator import fsdp_requested, zero_stage
from headway.train.losses import DEFAULT_CHUNK_SIZE, head_weights, medusa_loss
from headway.train.medusa import LossConfig, MedusaRunConfig

ADAPTER_DIR = "adapter"  # peft's own layout: adapter_config.json + adapter_model.safetensors
MERGED_DIR = "merged"  # the tuned target with the adapter merged in (merge: true)


@dataclasses.dataclass
class LoraSettings:
    r: int = 16  # LoRA rank
    alpha: float = 32.0  # LoRA scaling numerator (scale = alpha / r)
    dropout: float = 0.05  # dropout on the LoRA input
    target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])  # module names, or all-linear
    train_lm_head: bool = False  # also train a full copy of lm_head (peft modules_to_save)

    def __post_init__(self):
        if self.r < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"lora needs r >= 1, alpha > 0 and 0 <= dropout < 1, "
                             f"got {self.r}, {self.alpha}, {self.dropout}")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the target's modules to adapt, or [all-linear]")


@dataclasses.dataclass
class Medusa2LossConfig(LossConfig):
    lambda_max: float = 0.2  # weight of the heads' loss next to the self-distillation KL, after warmup
    lambda_warmup_steps: int = 0  # joint steps over which lambda rises linearly to lambda_max (0: at once)
    heads_lr_mult: float = 4.0  # the heads train at lr * heads_lr_mult, the adapter at lr
    stage1_steps: int = 0  # first optimizer steps that train the heads only (adapter frozen, no KL)

    def __post_init__(self):
        super().__post_init__()
        if self.lambda_max < 0 or self.lambda_warmup_steps < 0 or self.stage1_steps < 0 or self.heads_lr_mult <= 0:
            raise ValueError("loss needs lambda_max >= 0, lambda_warmup_steps >= 0, stage1_steps >= 0 and "
                             f"heads_lr_mult > 0, got {self.lambda_max}, {self.lambda_warmup_steps}, "
                             f"{self.stage1_steps}, {self.heads_lr_mult}")

    def weight(self, step: int) -> float:
        """lambda at optimizer step ``step`` (0-based); 0 during the heads-only stage."""
        joint = step - self.stage1_steps
        if joint < 0:
            return 0.0
        if not self.lambda_warmup_steps:
            return self.lambda_max
        return self.lambda_max * min(1.0, (joint + 1) / self.lambda_warmup_steps)


@dataclasses.dataclass
class Medusa2RunConfig(MedusaRunConfig):
    loss: Medusa2LossConfig = dataclasses.field(default_factory=Medusa2LossConfig)
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)
    gradient_checkpointing: bool = True  # recompute the target's layers in backward (non-reentrant)
    merge: bool = False  # also export merged/: the tuned target with the adapter merged in
    heads_init: str | None = None  # start from exported Medusa-1 heads (a folder) instead of fresh heads
    train: TrainConfig = dataclasses.field(default_factory=lambda: TrainConfig(output_dir="outputs/medusa2"))

    def __post_init__(self):
        super().__post_init__()
        if self.features != "online":
            raise ValueError(f"features={self.features!r}: Medusa-2 tunes the target, so cached features would go "
                             "stale; use features=online")
        if self.lora.train_lm_head and self.heads.share_lm_head:
            raise ValueError("lora.train_lm_head=true with heads.share_lm_head=true: the heads would train against "
                             "the original lm_head but run against the tuned one; set one of them false")
        if self.lora.train_lm_head and self.loss.kind != "ce":
            raise ValueError(f"loss.kind={self.loss.kind} with lora.train_lm_head=true: the heads' soft targets come "
                             "through the frozen lm_head; set lora.train_lm_head=false or loss.kind=ce")


def adaptable_module_names(model) -> list[str]:
    """Distinct names of the target's linear layers (what ``lora.target_modules`` may name)."""
    from transformers.pytorch_utils import Conv1D

    out = model.get_output_embeddings()
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
             if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not out}
    return sorted(names)


def check_target_modules(model, wanted: list[str]) -> None:
    """Refuse names that match no module, listing what the target has (peft would only say 'not found')."""
    if wanted == ["all-linear"]:
        return
    names = [n for n, _ in model.named_modules()]
    for w in wanted:
        if not any(n == w or n.endswith("." + w) for n in names):
            raise ValueError(f"lora.target_modules: {w!r} matches no module of the target; its linear layers are "
                             f"{', '.join(adaptable_module_names(model))} (or use all-linear)")


def wrap_with_lora(target, lora: LoraSettings):
    """``target`` (frozen) -> a peft model with fresh LoRA adapters; the base weights stay frozen."""
    from peft import LoraConfig, get_peft_model

    check_target_modules(target, lora.target_modules)
    if lora.train_lm_head and getattr(target.config.get_text_config(), "tie_word_embeddings", False):
        raise ValueError("lora.train_lm_head: this target ties lm_head to its input embeddings, so a tuned copy "
                         "would not survive a save; set lora.train_lm_head=false")
    modules = "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    out_name = [n for n, m in target.named_modules() if m is target.get_output_embeddings()][0]
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=modules,
                        modules_to_save=[out_name] if lora.train_lm_head else None, task_type="CAUSAL_LM")
    return get_peft_model(target, config)


def enable_checkpointing(model) -> None:
    """Recompute the target's layers in backward (non-reentrant: the frozen inputs need no grad)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x spelling
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module):
    """Temporarily eval mode (no dropout), restoring each submodule's own flag afterwards."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def final_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    # [B, T] -> [B, T, H] after the final norm (lm_head(h) == logits); gradients flow when enabled
    base = getattr(model, model.base_model_prefix, model)
    return base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def self_distill_kl(tuned_logits: torch.Tensor, original_logits: torch.Tensor) -> torch.Tensor:
    # [n, V] each -> sum over rows of KL(original || tuned) = sum_v p_o (log p_o - log p_t)
    return F.kl_div(F.log_softmax(tuned_logits.float(), -1), F.log_softmax(original_logits.float(), -1),
                    log_target=True, reduction="sum")


class Medusa2TrainingModule(torch.nn.Module):
    """Heads plus the LoRA-wrapped target and the joint loss.

    The joint run's own metrics form the ``joint`` group (the loop's ``summarize`` averages each
    ``joint/*_sum`` by ``joint/count``, head 0's token count): ``joint/kl`` (mean KL per assistant
    token), ``joint/lambda`` and ``joint/heads_only`` (1 during the first stage).
    """

    def __init__(self, heads: MedusaHeads, tuned, weights: list[float], *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 loss: LossConfig | None = None):
        super().__init__()
        self.heads = heads
        self.tuned = tuned  # peft model: only its LoRA weights (and a lm_head copy) require grad
        self.weights = weights
        self.chunk_size = chunk_size  # rows per chunk of the heads' fused loss (loss.chunk_size)
        self.lam = 0.0  # set per optimizer step by Medusa2Method.set_step
        self.heads_only = False
        self.register_buffer("draft_index", heads.draft_index(), persistent=False)
        self.loss = loss or LossConfig()
        # soft targets (loss.kind != ce): the tuned model's own distribution, through its frozen lm_head
        rows = target_rows(heads, tuned.get_base_model()) if self.loss.kind != "ce" else None
        self.register_buffer("target_rows", rows, persistent=False)  # [V', H] or None

    def forward(self, batch: dict[str, torch.Tensor]):
        ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        model = self.tuned.get_base_model()  # the target with LoRA layers injected
        heads_only = self.heads_only and self.training
        with torch.no_grad() if heads_only else contextlib.nullcontext():
            hidden = final_hidden(model, ids, attn)  # [B, T, H], adapters on
        head_loss, counts = medusa_loss(self.heads, hidden.float(), ids, mask, self.weights, self.draft_index,
                                        chunk_size=self.chunk_size, kind=self.loss.kind, target_rows=self.target_rows,
                                        lk_decay=self.loss.lk_decay)
        n0 = counts["head0/count"].float()
        if heads_only:  # adapters untouched: tuned == original here, the KL would be 0
            counts.update({"joint/kl_sum": n0 * 0, "joint/lambda_sum": n0 * 0, "joint/heads_only_sum": n0,
                           "joint/count": counts["head0/count"]})
            return head_loss, counts
        rows = mask[:, 1:].reshape(-1).bool()  # [B*(T-1)]: position t predicts assistant token t+1
        lm_head = model.get_output_embeddings()
        tuned = lm_head(hidden[:, :-1].reshape(-1, hidden.shape[-1])[rows])  # [n, V]
        with torch.no_grad(), self.tuned.disable_adapter(), eval_mode(model):
            orig_hidden = final_hidden(model, ids, attn)
            original = lm_head(orig_hidden[:, :-1].reshape(-1, hidden.shape[-1])[rows])  # [n, V]
        n = rows.sum().clamp(min=1)
        kl = self_distill_kl(tuned, original) / n
        lam = self.lam if self.training else 0.0
        counts.update({"joint/kl_sum": kl.detach() * n0, "joint/lambda_sum": n0 * lam, "joint/heads_only_sum": n0 * 0,
                       "joint/count": counts["head0/count"]})
        return kl + lam * head_loss, counts


class Medusa2Method(Method):
    """The Medusa-2 plug-in for the shared loop: param groups (heads' lr multiplier), the stage and
    lambda schedule per step, and the export of heads + adapter (+ merged target)."""

    def __init__(self, heads: MedusaHeads, tuned, weights: list[float], loss: Medusa2LossConfig,
                 tokenizer=None, merge: bool = False, base_model: str | None = None):
        self.model = Medusa2TrainingModule(heads, tuned, weights, chunk_size=loss.chunk_size, loss=loss)
        self.loss, self.tokenizer, self.merge = loss, tokenizer, merge
        if base_model:  # as the run names it (a Hub id, folder or alias), not a resolved cache path
            for config in tuned.peft_config.values():
                config.base_model_name_or_path = base_model

    def param_groups(self, lr: float) -> list[dict]:
        lora = [p for p in self.model.tuned.parameters() if p.requires_grad]
        heads = [p for p in self.model.heads.parameters() if p.requires_grad]
        return [{"params": lora, "lr": lr}, {"params": heads, "lr": lr * self.loss.heads_lr_mult}]

    def set_step(self, step: int) -> None:
        self.model.heads_only = step < self.loss.stage1_steps
        self.model.lam = self.loss.weight(step)

    def export(self, model: Medusa2TrainingModule, output_dir: Path, metrics: dict) -> None:
        model.heads.save_pretrained(output_dir, metrics=metrics)
        model.tuned.save_pretrained(output_dir / ADAPTER_DIR)
        if self.merge:
            merged = copy.deepcopy(model.tuned).merge_and_unload()  # the live model keeps its adapters
            merged.save_pretrained(output_dir / MERGED_DIR)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(output_dir / MERGED_DIR)


def build_heads(cfg: Medusa2RunConfig, run) -> MedusaHeads:
    """Fresh heads from the target, or exported Medusa-1 heads (``heads_init``) bound to it."""
    if not cfg.heads_init:
        tokens = draft_vocabulary(run, cfg.heads.draft_vocab_size)
        return MedusaHeads.from_target(run.target, cfg.heads, draft_tokens=tokens, base_model_name_or_path=cfg.model)
    heads = MedusaHeads.from_pretrained(cfg.heads_init)
    for field in ("num_heads", "num_layers", "share_lm_head", "draft_vocab_size"):
        if getattr(heads.config, field) != getattr(cfg.heads, field):
            raise ValueError(f"heads_init {cfg.heads_init} has {field}={getattr(heads.config, field)} but the run "
                             f"config says heads.{field}={getattr(cfg.heads, field)}; make them agree")
    return heads.bind_target(run.target)


def parse_args(argv: list[str] | None = None) -> Medusa2RunConfig:
    return parse_run_args(Medusa2RunConfig, "Train Medusa-2: heads jointly with a LoRA adapter on the target.",
                          "configs/medusa2/smollm2-135m.yaml", argv)


RunConfig = Medusa2RunConfig  # the training entry's protocol (headway.heads.registry.TrainingMethod)


def feature_layers(cfg: Medusa2RunConfig, depth: int) -> list[int]:
    raise ValueError("Medusa-2 tunes the target with its heads, so its features change as it trains and cannot be "
                     "cached; it trains on online features")


def train(cfg: Medusa2RunConfig) -> dict:
    """Jointly tune heads and a LoRA adapter; export both; returns the final held-out metrics."""
    if fsdp_requested(cfg.train):  # the tuned target lives in the training module: FSDP would shard the adapter with it
        raise ValueError("Medusa-2 under FSDP is not supported (the merged export needs the whole tuned target); use "
                         "DDP or DeepSpeed ZeRO-2 (configs/deepspeed/zero2.json)")
    run = setup_run(cfg.model, cfg.features, cfg.data, cfg.train)
    if zero_stage(run.acc) == 3:  # the tuned target lives in the training module: ZeRO-3 would partition it
        raise ValueError("Medusa-2 under DeepSpeed ZeRO-3 is not supported (the merged export needs the whole tuned "
                         "target); use DDP or ZeRO-2 (configs/deepspeed/zero2.json)")
    heads = build_heads(cfg, run).to(run.acc.device)
    tuned = wrap_with_lora(run.target, cfg.lora)
    if cfg.gradient_checkpointing:
        enable_checkpointing(tuned.get_base_model())
    if cfg.loss.stage1_steps and run.acc.num_processes > 1:
        from accelerate.utils import DistributedDataParallelKwargs

        # the adapters get no gradient in the heads-only stage: DDP must not wait for them
        run.acc.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    describe(run, cfg.features)
    method = Medusa2Method(heads, tuned, head_weights(cfg.heads.num_heads, cfg.loss.decay, cfg.loss.weights),
                           cfg.loss, tokenizer=run.tokenizer, merge=cfg.merge, base_model=cfg.model)
    metrics = run_training(run.acc, cfg.train, method, run.train_data, run.eval_data, run_config=to_dict(cfg))
    report_accuracy(run, metrics, "head", cfg.heads.num_heads, "head", cfg.train.output_dir)
    if run.acc.is_main_process and "joint/kl" in metrics:
        print(f"tuned target vs original: held-out KL {metrics['joint/kl']:.4f} per assistant token")
    return metrics


def main(argv: list[str] | None = None, exit_process: bool = False) -> dict:
    """Command line: bad input ends with a one-line ``error: ...`` and exit status 2 (``exit_process``:
    see ``run_main``)."""
    return run_main(train, parse_args, argv, exit_process)


if __name__ == "__main__":
    main(exit_process=True)
