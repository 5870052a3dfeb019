"""The one training loop every method shares (Medusa-1, Medusa-2, EAGLE-1 and EAGLE-3 plug in the same way).

A method supplies the trainable drafter, a loss over a padded batch (returning per-head counts),
and an export. The loop owns everything else: accelerate (DDP on CPU/gloo or GPUs, mixed
precision), deterministic data order, gradient accumulation, warmup + cosine schedule, clipping,
atomic checkpoints with automatic resume, held-out evaluation, TensorBoard + JSONL metrics, tqdm.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from tqdm.auto import tqdm

from headway.heads.files import atomic_write_text
from headway.train import checkpoint as ckpt
from headway.train.accelerator import check_trackers, gathered, zero_stage
from headway.train import fsdp as fsdp_mod
from headway.train import run_dir
from headway.train.batches import pad_batch
from headway.train.best import BestKeeper, check_choice
from headway.train.losses import summarize

METRICS_NAME = "metrics.jsonl"


@dataclasses.dataclass
class TrainConfig:
    output_dir: str = "outputs/medusa"  # exported drafter, checkpoints, metrics and logs go here
    overwrite: bool = False  # replace an output_dir that holds a different run
    resume: bool = True  # continue from the newest checkpoint in output_dir, if any
    seed: int = 0  # data order and initialisation
    batch_size: int = 4  # sequences per process per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    epochs: int = 1  # passes over the training data (ignored when max_steps is set)
    max_steps: int | None = None  # optimizer steps; None = epochs * steps_per_epoch
    lr: float = 1e-3  # peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    warmup_ratio: float = 0.05  # share of steps with linear warmup before the cosine decay
    min_lr_ratio: float = 0.0  # cosine floor as a share of lr
    max_grad_norm: float = 1.0  # gradient clipping (0 = off)
    mixed_precision: str = "auto"  # auto (bf16 on GPUs that have it, else fp32) | no | bf16 | fp16
    save_every: int = 100  # optimizer steps between checkpoints (0 = only the final export)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk (0: every one)
    eval_every: int = 0  # optimizer steps between held-out evaluations (0 = at the end only)
    eval_batch_size: int = 8  # sequences per process per evaluation batch
    log_every: int = 10  # optimizer steps between metric logs
    trackers: list[str] = dataclasses.field(default_factory=lambda: ["tensorboard"])  # accelerate trackers
    num_threads: int | None = None  # torch CPU threads per process (None = torch default)
    # Batches of similar lengths (less padding): each epoch's shuffled order is cut into groups of this
    # many global batches, each group sorted by length, cut into batches and those shuffled (as
    # transformers' group_by_length does). 0 = plain shuffled batches.
    group_by_length: int = 0
    fsdp: bool = False  # shard the drafter's weights, gradients and optimizer state (FSDP2); also set by an accelerate FSDP config
    # the drafter exported: "last" (the final weights) or "simulated_tau" (the evaluation with the highest
    # held-out simulated tau, as SpecForge keeps its best simulated acceptance length; set eval_every)
    select_best: str = "last"

    def __post_init__(self):
        # every message starts with the field's name: a run config shows it as train.<name>
        if not str(self.output_dir).strip():
            raise ValueError("output_dir is empty: name the folder the drafter, checkpoints and metrics go to")
        for name in ("batch_size", "grad_accum", "epochs", "log_every", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or null, got {self.max_steps}")
        if not self.lr > 0 or not math.isfinite(self.lr):  # AdamW refuses a negative one only once the model is loaded
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("max_grad_norm", "save_every", "eval_every", "group_by_length"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if self.keep_checkpoints < 0:
            raise ValueError(f"keep_checkpoints must be >= 0 (0: keep every one), got {self.keep_checkpoints}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or null (torch's default), got {self.num_threads}")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be auto, no, bf16 or fp16, got {self.mixed_precision!r}")
        check_trackers(self.trackers)
        check_choice(self.select_best)
        if self.select_best != "last" and not self.eval_every:
            raise ValueError(f"select_best={self.select_best} chooses among held-out evaluations: set eval_every "
                             "(optimizer steps between them), or select_best=last")


def epoch_order(lengths: list[int], epoch: int, seed: int, batch: int, group: int = 0) -> torch.Tensor:
    """The order of the training sequences in one epoch: [n] indices, the same on every process.

    lengths: [n] tokens per sequence; batch: sequences per global batch (every process's share of one
    micro-step); group: 0 for a plain shuffle, else that many global batches are sorted by length
    together and cut into batches, whose order within the group is shuffled again."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=g)
    if not group:
        return order
    size = group * batch
    out = []
    for s in range(0, len(order), size):
        chunk = order[s:s + size]
        chunk = chunk[torch.tensor([lengths[i] for i in chunk.tolist()]).argsort(descending=True, stable=True)]
        batches = list(chunk.split(batch))
        out += [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
    return torch.cat(out)


class Method:
    """What a training method plugs into the loop (subclass it).

    ``model`` is an ``nn.Module`` whose forward takes a padded batch dict and returns
    ``(loss, counts)``; it holds the trainable drafter (the loop wraps it for DDP, so gradients
    synchronise) and computes the features it needs. ``export`` writes the trained drafter;
    ``param_groups`` and ``set_step`` have defaults a method overrides when it needs to.
    """

    model: torch.nn.Module

    def param_groups(self, lr: float) -> list[dict]:
        """The optimizer's parameter groups (default: every trainable parameter, at the run's lr)."""
        return [{"params": [p for p in self.model.parameters() if p.requires_grad]}]

    def set_step(self, step: int) -> None:
        """Called before each optimizer step with its index (e.g. a loss weight warmed up over steps)."""

    def export(self, model: torch.nn.Module, output_dir: Path, metrics: dict) -> None:
        raise NotImplementedError


def lr_lambda(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, prefix + k + "."))
        else:
            out[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


@torch.no_grad()
def evaluate(acc: Accelerator, method: Method, model, examples: list[dict], batch_size: int,
             lockstep: bool = False) -> dict[str, float]:
    """Held-out loss and accuracy per head, counted over every process's share. ``lockstep``: the
    forward gathers sharded weights collectively (FSDP), so every rank runs as many batches."""
    model.eval()  # the unwrapped module: no DDP collectives, so ranks with fewer examples cannot hang
    mine = examples[acc.process_index::acc.num_processes]
    totals: dict[str, torch.Tensor] = {}
    # ZeRO-3 and FSDP gather parameters collectively in every forward: every rank runs as many
    # batches (a rank out of examples runs a filler batch and discards its counts)
    per_rank = -(-len(examples) // acc.num_processes)
    batches = -(-(per_rank if lockstep or zero_stage(acc) == 3 else len(mine)) // batch_size)
    for b in range(batches):
        chunk = mine[b * batch_size:(b + 1) * batch_size]
        batch = {k: v.to(acc.device) for k, v in pad_batch(chunk or (mine or examples)[-1:]).items()}
        with acc.autocast():
            _, counts = model(batch)
        for k, v in counts.items() if chunk else ():
            totals[k] = totals.get(k, 0) + v.detach().double()
    keys = sorted(_all_keys(acc, totals))
    vec = torch.stack([torch.as_tensor(totals.get(k, 0.0), dtype=torch.float64, device=acc.device)
                       for k in keys]) if keys else None
    if vec is not None and acc.num_processes > 1:
        vec = acc.reduce(vec, reduction="sum")
    model.train()
    return summarize({k: float(v) for k, v in zip(keys, vec.tolist())}) if keys else {}


def _all_keys(acc: Accelerator, totals: dict) -> list[str]:
    from accelerate.utils import gather_object

    keys = set(totals)
    if acc.num_processes > 1:
        keys = set().union(*gather_object([sorted(keys)]))
    return list(keys)


def parameter_fingerprint(model: torch.nn.Module) -> list[float]:
    """Per-tensor sums in float64: identical on every rank iff training stayed in sync."""
    return [float(p.detach().double().sum()) for p in model.parameters() if p.requires_grad]


def run_training(acc: Accelerator, cfg: TrainConfig, method: Method, train_data: list[dict],
                 eval_data: list[dict], run_config: dict) -> dict:
    """Train ``method.model`` on ``train_data``; returns the final held-out metrics."""
    if not train_data:
        raise ValueError("the training set is empty; check the data source and its filters")
    global_batch = cfg.batch_size * acc.num_processes * cfg.grad_accum
    if len(train_data) < global_batch:  # refused before the output folder is touched
        raise ValueError(f"{len(train_data)} training sequences are fewer than one optimizer step needs "
                         f"({global_batch} = train.batch_size x processes x train.grad_accum); lower "
                         "train.batch_size or add data")
    # the world size decides data order and schedule, so a resume must keep it
    run_config = {**run_config, "num_processes": acc.num_processes, "train_sequences": len(train_data),
                  "heldout_sequences": len(eval_data)}
    with run_dir.claimed(Path(cfg.output_dir), run_config, overwrite=cfg.overwrite, resume=cfg.resume,
                         is_main=acc.is_main_process) as out:
        acc.wait_for_everyone()
        return _train(acc, cfg, method, train_data, eval_data, run_config, out)


def _train(acc: Accelerator, cfg: TrainConfig, method: Method, train_data, eval_data, run_config: dict,
           out: Path) -> dict:
    done = out / "eval_metrics.json"
    if cfg.resume and done.is_file() and (out / "model.safetensors").is_file():
        try:
            finished = json.loads(done.read_text())
        except json.JSONDecodeError:  # written atomically since; an older run's cut file: export from the checkpoint
            finished = None
        if finished is not None:
            acc.print(f"{out} already holds this finished run; nothing to do (train.overwrite=true retrains)")
            return finished
    set_seed(cfg.seed)
    global_batch = cfg.batch_size * acc.num_processes * cfg.grad_accum
    steps_per_epoch = len(train_data) // global_batch
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    lengths = ((train_data.lengths() if hasattr(train_data, "lengths") else [len(e["input_ids"]) for e in train_data])
               if cfg.group_by_length else [0] * len(train_data))  # cached features: read without their rows
    warmup = max(1, int(cfg.warmup_ratio * total_steps)) if cfg.warmup_ratio > 0 else 0

    model = method.model
    fsdp = cfg.fsdp
    if fsdp:
        fsdp_mod.shard(model)  # before the optimizer: sharded parameters are new tensors
    groups = method.param_groups(cfg.lr)
    params = [p for g in groups for p in g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, total_steps, warmup, cfg.min_lr_ratio))
    if fsdp:
        optimizer = acc.prepare(optimizer)  # the module is sharded already (no DDP wrapper)
        unwrapped = model
    else:
        model, optimizer = acc.prepare(model, optimizer)
        unwrapped = acc.unwrap_model(model)
    if zero_stage(acc) == 3:
        # losses may read a drafter's weights directly (e.g. lm_head.weight in a chunked
        # cross-entropy), outside the submodule whose hook ZeRO-3 gathers them in: gather the
        # (small) trainable weights for the whole forward of the training module
        from deepspeed.runtime.zero import register_external_parameter

        for p in params:
            register_external_parameter(unwrapped, p)
    sharded = acc.distributed_type == DistributedType.DEEPSPEED  # the only sharded engine make_accelerator allows

    step = 0
    running: dict[str, torch.Tensor] = {}  # the log window's counts (restored with a checkpoint taken inside one)
    last = ckpt.checkpoint_dirs(out / "checkpoints")
    if cfg.resume and last:
        step, running = _resume(acc, last[-1], unwrapped, optimizer, scheduler, sharded, fsdp)
        acc.print(f"resumed from {last[-1]} at step {step}/{total_steps}")
    _truncate_metrics(out / METRICS_NAME, step, acc.is_main_process)
    best = BestKeeper(out, cfg.select_best, acc.is_main_process)
    best.restore(step)

    if cfg.trackers:
        acc.init_trackers("headway", config=_flat(run_config))
    if step == 0 and eval_data:  # the baseline the trained heads are judged against
        _log(acc, out, {"step": 0, **{f"eval/{k}": v for k, v in
                                      evaluate(acc, method, unwrapped, eval_data, cfg.eval_batch_size, fsdp).items()}}, cfg)
    bar = tqdm(total=total_steps, initial=step, disable=not acc.is_local_main_process, desc="training", unit="step")
    model.train()
    tokens, t0 = 0, time.perf_counter()
    train_tokens, train_start = 0, time.perf_counter()  # this process's tokens since the (re)start
    order, order_epoch = None, -1
    while step < total_steps:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        if epoch != order_epoch:  # once per epoch, not per step: grouping walks every sequence's length
            order, order_epoch = epoch_order(lengths, epoch, cfg.seed, cfg.batch_size * acc.num_processes,
                                             cfg.group_by_length), epoch
        method.set_step(step)  # e.g. a loss weight warmed up over optimizer steps
        loss_value = 0.0
        for micro in range(cfg.grad_accum):
            first = ((in_epoch * cfg.grad_accum + micro) * acc.num_processes + acc.process_index) * cfg.batch_size
            batch = pad_batch([train_data[i] for i in order[first:first + cfg.batch_size].tolist()])
            batch = {k: v.to(acc.device) for k, v in batch.items()}
            n_tokens = int(batch["attention_mask"].sum())
            tokens += n_tokens
            train_tokens += n_tokens
            # accelerate syncs (DDP) / steps (DeepSpeed's engine) on the last micro-step only and
            # scales the loss by 1 / grad_accum itself
            with acc.accumulate(model):
                with acc.autocast():
                    loss, counts = model(batch)
                acc.backward(loss)
                if acc.sync_gradients and cfg.max_grad_norm > 0:
                    acc.clip_grad_norm_(params, cfg.max_grad_norm)  # DeepSpeed clips in its engine
                optimizer.step()  # a no-op until the accumulation boundary
                optimizer.zero_grad(set_to_none=True)
            loss_value += float(loss.detach()) / cfg.grad_accum
            for k, v in counts.items():
                running[k] = running.get(k, 0) + v.detach().double()
        if not acc.sync_gradients:
            raise RuntimeError("accelerate did not reach a gradient-accumulation boundary after grad_accum micro-steps")
        scheduler.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}")

        if step % cfg.log_every == 0 or step == total_steps:
            elapsed = time.perf_counter() - t0
            record = {"step": step, "loss": loss_value, "lr": scheduler.get_last_lr()[0],
                      "tokens_per_s": tokens * acc.num_processes / max(elapsed, 1e-9), "seconds": elapsed,
                      **{f"train/{k}": v for k, v in summarize({k: float(v) for k, v in running.items()}).items()}}
            running, tokens, t0 = {}, 0, time.perf_counter()
            _log(acc, out, record, cfg)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps and eval_data:
            metrics = evaluate(acc, method, unwrapped, eval_data, cfg.eval_batch_size, fsdp)
            _log(acc, out, {"step": step, **{f"eval/{k}": v for k, v in metrics.items()}}, cfg)
            best.consider(acc, step, metrics, unwrapped, fsdp)
        if cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
            _save(acc, out / "checkpoints", step, unwrapped, optimizer, scheduler, sharded, cfg.keep_checkpoints, fsdp,
                  running)
    bar.close()

    final = evaluate(acc, method, unwrapped, eval_data, cfg.eval_batch_size, fsdp) if eval_data else {}
    _log(acc, out, {"step": step, **{f"eval/{k}": v for k, v in final.items()}}, cfg)
    best.consider(acc, step, final, unwrapped, fsdp)
    exported = best.chosen(step, final)  # the final metrics, or the best evaluation's
    if exported.get("selected_step", step) != step:
        acc.print(f"train.select_best={cfg.select_best}: exporting the drafter of step {exported['selected_step']} "
                  f"({cfg.select_best} {best.score:.4f}; the last, step {step}: {final.get(cfg.select_best, float('nan')):.4f})")
    if fsdp:
        fsdp_mod.unshard_for_export(unwrapped)  # whole trainable weights on every rank
    with gathered(acc, unwrapped):  # ZeRO-3: whole trainable weights for the check and the export
        _write_sync_check(acc, out, unwrapped, time.perf_counter() - train_start, train_tokens, fsdp)
        if acc.is_main_process:
            best.load_into(unwrapped, step)  # the fingerprints above are the trained weights'; the export is the best's
            method.export(unwrapped, out, exported)
            atomic_write_text(out / "eval_metrics.json", json.dumps(exported, indent=2))  # the finished run's mark
    acc.wait_for_everyone()
    if cfg.trackers:
        acc.end_training()
    return exported


def _save(acc: Accelerator, root: Path, step: int, model, optimizer, scheduler, sharded: bool, keep: int,
          fsdp: bool = False, running: dict | None = None) -> None:
    """An atomic checkpoint. DDP: safetensors (rank 0 holds the whole state). Sharded state is
    written by every rank, which needs a filesystem every node shares: FSDP through
    torch.distributed.checkpoint (reshardable), DeepSpeed through ``accelerate.save_state`` (the
    engine's own format). The loop's state goes with it: the scheduler, the fp16 loss scaler's (a resumed
    run scales as the uninterrupted one would) and the current log window's counts (its first log line
    averages the same steps)."""
    loop_state = {"step": step, "scheduler": scheduler.state_dict(), "world_size": acc.num_processes,
                  "distributed_type": _mode(acc, fsdp), "sharded": sharded, "fsdp": fsdp,
                  "running": {k: float(v) for k, v in (running or {}).items()}}
    scaler = getattr(acc, "scaler", None)
    if scaler is not None and not sharded:  # DeepSpeed's engine keeps its own loss scale in its state
        loop_state["scaler"] = scaler.state_dict()
    if fsdp:
        ckpt.save_checkpoint(root, step, model_state=None, optimizer=None, loop_state=loop_state,
                             rank=acc.process_index, is_main=acc.is_main_process, keep=keep,
                             barrier=acc.wait_for_everyone,
                             write_state=lambda tmp: fsdp_mod.save_state(model, _torch_optimizer(optimizer), tmp / "fsdp"))
        return
    if not sharded:
        ckpt.save_checkpoint(root, step, model_state=_trainable_state(model),
                             optimizer=_torch_optimizer(optimizer),
                             loop_state=loop_state, rank=acc.process_index, is_main=acc.is_main_process,
                             keep=keep, barrier=acc.wait_for_everyone)
        return
    ckpt.save_checkpoint(root, step, model_state=None, optimizer=None, loop_state=loop_state, rank=acc.process_index,
                         is_main=acc.is_main_process, keep=keep, barrier=acc.wait_for_everyone,
                         write_state=lambda tmp: acc.save_state(str(tmp / "engine"), safe_serialization=True,
                                                                exclude_frozen_parameters=True))


def _resume(acc: Accelerator, path: Path, model, optimizer, scheduler, sharded: bool,
            fsdp: bool = False) -> tuple[int, dict[str, torch.Tensor]]:
    """Restore a checkpoint written by ``_save``; returns its step and its log window's counts. A DeepSpeed
    checkpoint needs the same world size and engine; a DDP one (the whole state) or an FSDP one (reshardable
    shards) resumes with any world size."""
    state = ckpt.load_state_json(path)
    world, kind = state.get("world_size"), state.get("distributed_type")
    if state.get("fsdp", False) != fsdp:
        raise ValueError(f"{path} was written {'with' if state.get('fsdp') else 'without'} FSDP and this launch runs "
                         f"{'with' if fsdp else 'without'} it: a checkpoint resumes only in the mode that wrote it; "
                         "relaunch in that mode, or pass train.overwrite=true to start over")
    if state.get("sharded", False) != sharded or (sharded and kind != str(acc.distributed_type)):
        raise ValueError(f"{path} was written under {kind} and this launch runs {acc.distributed_type}: a checkpoint "
                         "resumes only under the engine that wrote it; relaunch in that mode, or pass "
                         "train.overwrite=true to start over")
    if sharded and world != acc.num_processes:
        raise ValueError(f"{path} was written by {world} process(es) and this launch has {acc.num_processes}: a "
                         f"sharded optimizer state cannot be resharded here; relaunch with --num_processes {world}, "
                         "or pass train.overwrite=true to start over")
    if sharded:
        acc.load_state(str(path / "engine"), load_module_strict=False)  # frozen weights are not in it
    elif fsdp:
        fsdp_mod.load_state(model, _torch_optimizer(optimizer), path / "fsdp")
    else:
        saved = ckpt.load_checkpoint(path)
        model.load_state_dict({**model.state_dict(), **saved["model"]})
        ckpt.optimizer_from_flat(_torch_optimizer(optimizer), saved["optimizer"], saved["optimizer_meta"])
    if not sharded and (rng := ckpt.load_rng(path, acc.process_index)) is not None:
        torch.set_rng_state(rng)  # DeepSpeed's own state restores its RNG
    scheduler.load_state_dict(state["scheduler"])
    scaler = getattr(acc, "scaler", None)
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    step = state["step"]
    if world is not None and world != acc.num_processes:
        # keep the examples already seen: the global batch scales with the world size
        step = step * world // acc.num_processes
        scheduler.last_epoch = step
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(step)
        acc.print(f"note: {path} was written by {world} process(es) at step {state['step']}; resuming with "
                  f"{acc.num_processes} at step {step} (the same examples seen; "
                  f"{'its FSDP shards are resharded' if fsdp else 'a DDP checkpoint holds the whole state'})")
    running = {k: torch.tensor(v, dtype=torch.float64, device=acc.device)
               for k, v in state.get("running", {}).items()}
    return step, running


def _mode(acc: Accelerator, fsdp: bool) -> str:
    """The distributed mode as recorded in checkpoints and distributed.json (FSDP is headway's own, on a DDP-type group)."""
    return "FSDP" if fsdp else str(acc.distributed_type)


def _torch_optimizer(optimizer):
    """The torch optimizer inside accelerate's wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def _trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k in names}


def peak_memory_mb() -> dict[str, float]:
    """This process's peak resident memory (and peak CUDA allocation on a GPU), in MiB."""
    import resource

    peak = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux reports KiB
    if torch.cuda.is_available():
        peak["cuda"] = torch.cuda.max_memory_allocated() / 2**20
    return peak


def _write_sync_check(acc: Accelerator, out: Path, model: torch.nn.Module, train_seconds: float, tokens: int,
                      fsdp: bool = False) -> None:
    """Record how many processes trained, each rank's parameter fingerprint and peak memory, and
    the run's training throughput (tokens per second over all processes)."""
    from accelerate.utils import gather_object

    mine = [{"fingerprint": parameter_fingerprint(model), "peak_memory_mb": peak_memory_mb()}]
    ranks = gather_object(mine) if acc.num_processes > 1 else mine
    if acc.is_main_process:
        atomic_write_text(out / "distributed.json", json.dumps({
            "num_processes": acc.num_processes, "distributed_type": _mode(acc, fsdp),
            "zero_stage": zero_stage(acc), "fingerprints": [r["fingerprint"] for r in ranks],
            "peak_memory_mb": [r["peak_memory_mb"] for r in ranks],
            "train_tokens_per_s": tokens * acc.num_processes / max(train_seconds, 1e-9)}))


def _log(acc: Accelerator, out: Path, record: dict, cfg: TrainConfig) -> None:
    if cfg.trackers:
        acc.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
    if acc.is_main_process:
        with open(out / METRICS_NAME, "a") as f:
            f.write(json.dumps(record) + "\n")


def _truncate_metrics(path: Path, step: int, is_main: bool) -> None:
    """On resume, drop metric lines logged after the checkpoint (they will be logged again)."""
    if not is_main or not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    atomic_write_text(path, "".join(line + "\n" for line in keep) if step else "")
