"""What every training method does before its own part: the command line, the accelerator, the
frozen target, the data (tokenized online, or a lazily read feature cache), the reduced draft
vocabulary, and the one-line error exit. ``train/medusa.py`` and ``train/eagle.py`` hold only what
is theirs (their drafter, its features and its loss).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Callable

from accelerate.utils import set_seed

from headway.configs import resolve_config
from headway.heads.target.features import num_layers
from headway.heads.target import check_model_name, freeze, load_target, resolve_model_path
from headway.heads.base import read_config_file, resolve_folder
from headway.train.config import ConfigError, load_config, to_dict
from headway.train.data import DataConfig, build_datasets, frequent_tokens, resolve_source
from headway.train.features import feature_fingerprint
from headway.train.feature_reader import load_cached_features, read_cache_index
from headway.train.run_dir import RESUMABLE_DIFFS, check_output_dir
from headway.train.launch import end_process
from headway.train.loop import TrainConfig
from headway.train.accelerator import make_accelerator


@dataclasses.dataclass
class RunSetup:
    """The pieces a method builds its drafter and loss from."""

    acc: object  # accelerate.Accelerator
    target: object  # the frozen target model, on acc.device
    tokenizer: object
    train_data: object  # list of examples, or a lazily read CachedFeatures
    eval_data: object
    cached: bool  # True: examples carry "features" (the requested layers) read from a cache


def setup_run(model: str, features: str, data: DataConfig, train: TrainConfig,
              layers: Callable[[object], list[int]] | None = None) -> RunSetup:
    """Accelerator, frozen target and data. ``layers(target)``: the target layers a feature cache
    must hold for this method (checked against the cache's fingerprint)."""
    early = target_config(model)  # the context check before the weights load (minutes for a big model)
    if early is not None:
        check_context(data.max_length, early)
    acc = make_accelerator(train)
    with whole_weights(acc):
        target, tokenizer = load_target(model, device=acc.device)
    freeze(target)
    if early is None:  # its config could not be read alone: checked now
        check_context(data.max_length, target.config)
    set_seed(train.seed)  # the drafter built next initialises from train.seed
    if features == "online":
        with acc.main_process_first():
            train_data, eval_data = build_datasets(data, tokenizer, model)
        return RunSetup(acc, target, tokenizer, train_data, eval_data, cached=False)
    wanted = layers(target) if layers else [num_layers(target)]
    meta = {"model": model, "data": dataclasses.asdict(data)}
    fingerprint = feature_fingerprint(target, tokenizer, wanted)
    train_data = load_cached_features(Path(features) / "train", expect_meta=meta, expect_fingerprint=fingerprint)
    eval_data = load_cached_features(Path(features) / "heldout", expect_meta=meta, expect_fingerprint=fingerprint)
    return RunSetup(acc, target, tokenizer, train_data, eval_data, cached=True)


def target_config(model: str):
    """The target's config read alone (no weights), or None where that fails: the load then says why."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(resolve_model_path(model))
    except Exception:  # noqa: BLE001 -- never a new failure: the check then runs after the load
        return None


def check_context(max_length: int, config) -> None:
    """A one-line ValueError for sequences longer than the target's positions."""
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    if context is not None and max_length > context:  # past it a target's positions are untrained or absent
        raise ValueError(f"data.max_length={max_length} exceeds the target's context ({context} positions, "
                         f"max_position_embeddings): set data.max_length <= {context}")


@contextlib.contextmanager
def whole_weights(acc):
    """Load models with whole weights on every rank even under DeepSpeed ZeRO-3 (the drafter
    initialises from the target's); ZeRO-3 partitions the frozen target when the loop prepares the
    training module. transformers partitions at load whenever a DeepSpeed config is registered."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def draft_vocabulary(setup: RunSetup, size: int | None) -> list[int] | None:
    """The ``size`` most frequent assistant tokens of the training data (None: full vocabulary)."""
    if not size:
        return None
    return frequent_tokens(setup.train_data, size, setup.target.config.get_text_config().vocab_size)


def target_rows(drafter, target):
    """The frozen target's lm_head rows of ``drafter``'s draft vocabulary, [V', H] fp32: the projection of
    the target's distribution that soft losses train against."""
    return drafter.draft_rows(target.get_output_embeddings().weight.detach()).float().contiguous()


def describe(setup: RunSetup, features: str) -> None:
    acc = setup.acc
    acc.print(f"{len(setup.train_data)} training / {len(setup.eval_data)} held-out sequences, "
              f"{acc.num_processes} process(es) on {acc.device}, features: {features}")


def report_accuracy(setup: RunSetup, metrics: dict, prefix: str, count: int, what: str, output_dir: str) -> None:
    """Print held-out top-1 / top-5 of ``{prefix}{k}`` (Medusa head k, EAGLE step k: token t+k+2)."""
    if not setup.acc.is_main_process:
        return
    for k in range(count):
        if f"{prefix}{k}/top1" in metrics:
            print(f"{what} {k} (token t+{k + 2}): held-out top-1 {metrics[f'{prefix}{k}/top1']:.3f}  "
                  f"top-5 {metrics[f'{prefix}{k}/top5']:.3f}")
    if "simulated_acc_len" in metrics:
        print(f"simulated chain of {count}: {metrics['simulated_acc_len']:.2f} draft tokens accepted per round, "
              f"tau {metrics['simulated_tau']:.2f} (sum_k prod_(i<=k) top-1_i, plus the bonus token)")
    print(f"exported to {output_dir}")


def parse_run_args(config_class, description: str, example: str, argv: list[str] | None = None):
    """``--config YAML [--model M] [--data D] [key=value ...]`` -> the run config dataclass."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help=f"YAML run config, or a shipped config's name (e.g. {example})")
    parser.add_argument("--model", help="target: Hub id, local folder or smollm2-135m (same as model=...)")
    parser.add_argument("--data", help="data: default, packaged, a local json/jsonl/parquet file or a Hub dataset "
                                       "(same as data.source=...)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.lr=3e-4")
    args = parser.parse_intermixed_args(argv)  # key=value overrides wherever they stand
    shortcuts = [f"model={args.model}"] * bool(args.model) + [f"data.source={args.data}"] * bool(args.data)
    config = resolve_config(args.config, Path(example).parent.name) if args.config else None
    return load_config(config_class, config, [*shortcuts, *args.overrides])


# a drafter config's fields that every trainer takes from the target's config (``from_target``), never the run's
FROM_TARGET = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
               "max_position_embeddings", "num_target_layers", "base_model_name_or_path")


def check_sizes_unset(cfg) -> None:
    """A one-line ValueError for a drafter size set in the run config (``eagle.hidden_size=48``): the trainer
    takes it from the target, so the setting would be silently dropped."""
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(value):
            continue
        if not any(field.name in FROM_TARGET for field in dataclasses.fields(value)):
            continue
        default = type(value)()  # (as the run config builds it: fields derived from others included)
        for field in dataclasses.fields(value):
            if field.name in FROM_TARGET and getattr(value, field.name) != getattr(default, field.name):
                raise ValueError(f"{section.name}.{field.name} is not a run setting: the trainer builds the drafter's "
                                 "architecture from the target model; remove it (pick another target with model=)")


def check_run(cfg) -> None:
    """What a run checks before it loads a model or writes a file: its output folder (a file, another
    run, a non-empty folder holding none), its data source or feature cache, and a drafter folder the
    config names (``heads_init``). Raises the one-line error the command prints."""
    check_sizes_unset(cfg)
    train = cfg.train
    # the accelerator may still turn train.fsdp on (an accelerate FSDP config): the loop compares that field
    check_output_dir(train.output_dir, to_dict(cfg), overwrite=train.overwrite, resume=train.resume,
                     ignore=RESUMABLE_DIFFS | {"fsdp"})
    check_model_name(cfg.model)
    if cfg.features == "online":
        resolve_source(cfg.data, cfg.model)
    elif not Path(cfg.features).is_dir():
        raise FileNotFoundError(f"features={cfg.features}: no such folder; pass features=online or a folder written "
                                "by scripts/cache_features.py")
    else:
        meta = {"model": cfg.model, "data": dataclasses.asdict(cfg.data)}
        for split in ("train", "heldout"):
            read_cache_index(Path(cfg.features) / split, expect_meta=meta)
    if getattr(cfg, "heads_init", None):
        kind = read_config_file(resolve_folder(cfg.heads_init)).get("drafter_type")
        if kind != "medusa":
            raise ValueError(f"heads_init={cfg.heads_init} holds a {kind!r} drafter, not Medusa heads; "
                             "pass the output folder of a Medusa-1 run")


def run_main(train: Callable, parse: Callable, argv: list[str] | None = None, exit_process: bool = False):
    """Command line: bad input ends with a one-line ``error: ...`` and exit status 2. The run is
    checked (``check_run``) before anything loads or is written.

    ``exit_process`` (a process's own entry point: the script, ``python -m``, ``headway train``):
    one rank of a finished several-process run ends here (``launch.end_process``) and never returns."""
    cfg = None
    try:
        cfg = parse(argv)
        check_run(cfg)
        result = train(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        close_process_group()
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: say how to go on (a checkpoint, once written, resumes)
        close_process_group()
        print(interrupted_hint(cfg), file=sys.stderr)
        sys.exit(130)
    except BaseException:
        close_process_group()
        raise
    if exit_process:
        end_process()  # one rank of several: never returns
    close_process_group()
    return result


def interrupted_hint(cfg) -> str:
    """What a Ctrl-C'd run says: how to resume it where a checkpoint can exist (never with train.overwrite, which
    would empty the folder)."""
    train = cfg.train if cfg is not None else None
    if train is None or not train.save_every or not train.resume:
        return "interrupted"
    again = "the same command without train.overwrite=true" if train.overwrite else "the same command"
    return (f"interrupted: run {again} to resume {train.output_dir} from its newest checkpoint, if one was written "
            f"(every train.save_every={train.save_every} steps)")


def close_process_group() -> None:
    """Tear the process group down (one process, or a run that failed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
