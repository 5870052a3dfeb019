"""The Accelerator a training run uses, and what the loop asks of it: gloo DDP or DeepSpeed ZeRO on
CPU, NCCL on GPUs, FSDP by torch's ``fully_shard`` (``headway.train.fsdp``); DeepSpeed's config filled
from the run config; ZeRO-3's gathered parameters; trackers checked up front."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs

if TYPE_CHECKING:
    from headway.train.loop import TrainConfig


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    """An Accelerator that really synchronises: gloo DDP or DeepSpeed ZeRO on CPU, NCCL on GPUs.

    Gradient accumulation goes through accelerate (``accumulate``), so DeepSpeed's engine steps
    once per optimizer step. FSDP (``train.fsdp=true``, or an accelerate config with
    ``distributed_type: FSDP``) is applied by the loop with torch's ``fully_shard`` (headway.train.fsdp)
    on top of the DDP-type process group, because accelerate's own FSDP runs only on GPUs.
    """
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    on_cpu = not torch.cuda.is_available()
    deepspeed = _env_flag("ACCELERATE_USE_DEEPSPEED")
    if fsdp_requested(cfg):  # an accelerate FSDP config: headway shards with torch's fully_shard itself
        os.environ.pop("ACCELERATE_USE_FSDP", None)
        cfg.fsdp = True
    if cfg.fsdp and deepspeed:
        raise ValueError("FSDP and DeepSpeed were both asked for; choose one (train.fsdp=false, or drop --use_deepspeed)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    handlers = [InitProcessGroupKwargs(backend="gloo")] if on_cpu and world > 1 else []
    acc = Accelerator(cpu=on_cpu and not deepspeed, mixed_precision=mp, log_with=cfg.trackers or None,
                      project_dir=cfg.output_dir, gradient_accumulation_steps=cfg.grad_accum, kwargs_handlers=handlers)
    if world != acc.num_processes:
        # e.g. `accelerate launch --cpu --num_processes 2`: processes that would train independently
        raise RuntimeError(
            f"{world} processes were launched but accelerate sees {acc.num_processes}: they would not "
            "synchronise. On CPU launch with `accelerate launch --multi_gpu --num_processes N` (headway "
            "builds a CPU accelerator itself) or with torchrun."
        )
    if acc.distributed_type not in SUPPORTED:
        raise ValueError(f"accelerate's distributed type {acc.distributed_type.value} is not supported by headway's "
                         f"loop; use one of {', '.join(t.value for t in SUPPORTED)}")
    if acc.distributed_type == DistributedType.DEEPSPEED:
        fill_deepspeed_config(acc.state.deepspeed_plugin.deepspeed_config, cfg, acc.num_processes, mp)
    if cfg.fsdp and acc.num_processes == 1:
        acc.print("note: train.fsdp with one process has nothing to shard; training unsharded")
        cfg.fsdp = False
    return acc


SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.DEEPSPEED)


def fill_deepspeed_config(ds: dict, cfg: TrainConfig, processes: int, mixed_precision: str) -> None:
    """Fill DeepSpeed's batch, accumulation and clipping entries from the run config (the loop has no
    DataLoader for accelerate to read them from); an explicit value that contradicts the run config,
    or a precision the run does not use, is a one-line ValueError."""
    wanted = {"train_micro_batch_size_per_gpu": (cfg.batch_size, "train.batch_size"),
              "gradient_accumulation_steps": (cfg.grad_accum, "train.grad_accum"),
              "train_batch_size": (cfg.batch_size * cfg.grad_accum * processes,
                                   "train.batch_size x train.grad_accum x processes"),
              "gradient_clipping": (cfg.max_grad_norm if cfg.max_grad_norm > 0 else 0.0, "train.max_grad_norm")}
    for key, (value, name) in wanted.items():
        given = ds.get(key, "auto")
        if given != "auto" and float(given) != float(value):
            raise ValueError(f"the DeepSpeed config sets {key}={given} but the run config gives {value} "
                             f"({name}); set it to \"auto\" in the DeepSpeed config or change the run config")
        ds[key] = value
    for kind, mode in (("bf16", "bf16"), ("fp16", "fp16")):
        enabled = ds.get(kind, {}).get("enabled", "auto")
        if enabled is True and mixed_precision != mode:
            raise ValueError(f"the DeepSpeed config enables {kind} but the run's mixed precision is {mixed_precision!r}; "
                             f"set {kind}.enabled to \"auto\" or pass train.mixed_precision={mode}")
    ds.setdefault("zero_allow_untested_optimizer", True)


def fsdp_requested(cfg: TrainConfig) -> bool:
    """Whether this run asks for FSDP (train.fsdp, or an accelerate launch with an FSDP config)."""
    return cfg.fsdp or _env_flag("ACCELERATE_USE_FSDP")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def zero_stage(acc: Accelerator) -> int:
    """DeepSpeed's ZeRO stage (0 when not running DeepSpeed)."""
    if acc.distributed_type != DistributedType.DEEPSPEED:
        return 0
    return int(acc.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))


def gathered(acc: Accelerator, model: torch.nn.Module):
    """A context in which ZeRO-3's partitioned trainable parameters are whole on every rank."""
    if zero_stage(acc) < 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([p for p in model.parameters() if p.requires_grad], modifier_rank=None)


def check_trackers(names: list[str]) -> None:
    """accelerate's tracker names, each installed (accelerate itself would drop a missing one silently)."""
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    known, installed = {t.value for t in LoggerType}, {str(getattr(t, "value", t)) for t in get_available_trackers()}
    for name in names:
        if name not in known:
            raise ValueError(f"trackers: unknown tracker {name!r}; choose from {sorted(known)}, or [] for none")
        if name != "all" and name not in installed:
            raise ValueError(f"trackers: {name} is not installed: pip install {name.replace('_', '-')} "
                             "(or train.trackers=[] for metrics.jsonl only)")
