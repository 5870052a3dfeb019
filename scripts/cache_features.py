"""Cache the frozen target's features once, so drafter heads can train for many epochs.

    python scripts/cache_features.py --config configs/medusa/smollm2-135m.yaml --out CACHE_DIR [key=value ...]

Tokenizes the run config's data exactly as training would (same split), runs the target once
over every sequence and writes safetensors shards to CACHE_DIR/train and CACHE_DIR/heldout.
Interrupted runs resume per shard. Then train with ``features=CACHE_DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from headway.heads.target import load_target
from headway.train.config import ConfigError, load_config
from headway.train.data import build_datasets
from headway.train.features import cache_features
from headway.train.medusa import MedusaRunConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="the training run config whose model and data to cache")
    parser.add_argument("--out", required=True, help="output folder (train/ and heldout/ are created)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=256, help="sequences per shard")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="storage dtype of the features")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run config")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.shard_size < 1:
        sys.exit("error: --batch-size and --shard-size must be >= 1")
    torch.set_num_threads(args.threads)
    try:
        cfg = load_config(MedusaRunConfig, args.config, args.overrides)
        target, tokenizer = load_target(cfg.model)
        train, heldout = build_datasets(cfg.data, tokenizer, cfg.model)
        meta = {"model": cfg.model, "data": dataclasses.asdict(cfg.data), "dtype": args.dtype,
                "shard_size": args.shard_size}
        start = time.perf_counter()
        for name, examples in (("train", train), ("heldout", heldout)):
            cache_features(target, examples, f"{args.out}/{name}", meta={**meta, "split": name},
                           batch_size=args.batch_size, shard_size=args.shard_size, dtype=_DTYPES[args.dtype])
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        sys.exit(f"error: {exc}")
    tokens = sum(len(e["input_ids"]) for e in train + heldout)
    print(f"cached {len(train)} + {len(heldout)} sequences ({tokens} tokens) in {time.perf_counter() - start:.1f} s "
          f"to {args.out}")


if __name__ == "__main__":
    main()
