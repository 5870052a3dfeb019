"""Cache the frozen target's features once, so drafter heads can train for many epochs.

    python scripts/cache_features.py --config configs/medusa/smollm2-135m.yaml --out CACHE_DIR [key=value ...]
    python scripts/cache_features.py --config EAGLE_CONFIG.yaml --out CACHE_DIR --layers 2,15,27,30

Tokenizes the run config's data exactly as training would (same split), runs the target once
over every sequence and writes safetensors shards to CACHE_DIR/train and CACHE_DIR/heldout: the
hidden states of ``--layers`` side by side (bf16 by default) and the target's argmax per token.
Without ``--layers`` the run config decides, through the training method whose run config it fits
(``feature_layers`` of that method's entry): a config with an ``eagle:`` section caches its
feature layers (the EAGLE version's default unless ``eagle.feature_layers`` names them) plus the
final layer L; a Medusa-1 config caches ``[L]``. A cache with more layers serves
a run that needs fewer. Interrupted runs resume per shard. Then train with ``features=CACHE_DIR``.

    accelerate launch --multi_gpu --num_processes N scripts/cache_features.py --config ... --out CACHE_DIR
    torchrun --nproc_per_node N scripts/cache_features.py --config ... --out CACHE_DIR

Several processes split the shards (rank r computes shards r, r+N, ...) and rank 0 writes each
index: the folder, fingerprint included, is bit-identical to what one process writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from headway.heads.target.features import check_feature_layers, num_layers
from headway.heads.target import load_target
from headway.heads.registry import resolve, training_methods
from headway.train.config import ConfigError, apply_overrides, from_dict, read_yaml
from headway.train.data import build_datasets
from headway.train.features import cache_features, feature_fingerprint
from headway.train.launch import end_process, launch_state, main_process_first, my_units, rank_and_world

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_run_config(path: str | None, overrides: list[str]):
    """(model, data config, training entry, run config) of a run config: the first registered
    training method (``headway.heads.registry.training_methods``) whose run config has every
    top-level section the file names (an ``eagle:`` section is EAGLE's, a ``lora:`` one Medusa-2's,
    neither: Medusa-1's), the file then checked whole against it."""
    raw = apply_overrides(read_yaml(path) if path else {}, list(overrides))
    methods = training_methods()
    for method in methods.values():
        entry = resolve(method.entry)  # imported one at a time: Medusa-1's config needs no peft (Medusa-2's module)
        if set(raw) <= {f.name for f in dataclasses.fields(entry.RunConfig)}:
            cfg = from_dict(entry.RunConfig, raw)
            return cfg.model, cfg.data, entry, cfg
    raise ConfigError(f"{path or 'the overrides'} has sections {sorted(raw)} that fit no training method's run config "
                      f"({', '.join(methods)}); check the top-level keys")


def default_layers(entry, cfg, depth: int) -> list[int]:
    """The layers the run needs (its method's ``feature_layers``), checked against the target's depth."""
    return check_feature_layers(entry.feature_layers(cfg, depth), depth, "the run config's feature layers")


def parse_layers(text: str, depth: int) -> list[int]:
    try:
        layers = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--layers {text!r} is not a comma-separated list of layer ids (e.g. 2,15,27,30)") from None
    return check_feature_layers(layers, depth, "--layers")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="the training run config whose model and data to cache")
    parser.add_argument("--out", required=True, help="output folder (train/ and heldout/ are created)")
    parser.add_argument("--layers", help="comma-separated target layer ids (0 = embeddings, L = after the final "
                                         "norm); default: what the run config needs")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=256, help="sequences per shard")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="storage dtype of the features")
    parser.add_argument("--no-argmax", action="store_true",
                        help="do not store the target's argmax per token (EAGLE-3 training needs it)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run config")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.shard_size < 1:
        sys.exit("error: --batch-size and --shard-size must be >= 1")
    torch.set_num_threads(args.threads)
    try:
        model, data, entry, cfg = read_run_config(args.config, args.overrides)
        state = launch_state()
        # rank 0 first: it builds the model folder and the tokenized-data cache once, the others reuse them
        with main_process_first(state):
            target, tokenizer = load_target(model, device=state.device if state is not None else None)
            train, heldout = build_datasets(data, tokenizer, model)
        depth = num_layers(target)
        layers = parse_layers(args.layers, depth) if args.layers else default_layers(entry, cfg, depth)
        fingerprint = feature_fingerprint(target, tokenizer, layers)
        meta = {"model": model, "data": dataclasses.asdict(data)}
        start = time.perf_counter()
        for name, examples in (("train", train), ("heldout", heldout)):
            cache_features(target, examples, f"{args.out}/{name}", layers=layers, meta={**meta, "split": name},
                           batch_size=args.batch_size, shard_size=args.shard_size, dtype=_DTYPES[args.dtype],
                           with_argmax=not args.no_argmax, fingerprint=fingerprint, state=state)
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as exc:
        sys.exit(f"error: {exc}")
    rank, world = rank_and_world(state)
    mine = [list(my_units(-(-len(split) // args.shard_size), state)) for split in (train, heldout)]
    print(f"rank {rank} of {world}: wrote train shards {mine[0]} and heldout shards {mine[1]} (or kept them)")
    if rank != 0:
        return
    tokens = sum(len(e["input_ids"]) for e in train + heldout)
    per_token = len(layers) * fingerprint["hidden_size"] * torch.empty((), dtype=_DTYPES[args.dtype]).element_size()
    print(f"cached {len(train)} + {len(heldout)} sequences ({tokens} tokens), layers {layers}, {args.dtype}, "
          f"in {time.perf_counter() - start:.1f} s to {args.out}")
    print(f"{per_token} feature bytes per token ({per_token * tokens / 2**20:.1f} MiB of features"
          f"{', plus 4 bytes per token of argmax' if not args.no_argmax else ''})")


if __name__ == "__main__":
    main()
    end_process()  # one rank of several: ends here, without the exit-time teardown
