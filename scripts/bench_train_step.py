"""Training speed of one drafter config under named variants, side by side.

    python scripts/bench_train_step.py --config configs/eagle/eagle3-smollm2-135m.yaml \
        --data PATH.jsonl --features CACHE_DIR --steps 30 --rounds 2 \
        --variant plain="train.group_by_length=0" --variant grouped="train.group_by_length=16"

Each variant (a name and space-separated ``key=value`` overrides on top of the config) trains
``--steps`` optimizer steps in its own child process; the variants alternate for ``--rounds``
rounds, so a slow spell of the machine hits all of them. Reported per variant: seconds per
optimizer step and real (unpadded) tokens per second, both from the training loop's own per-step
log with the first step (warm-up) left out, and its speed relative to the first variant in real
tokens per second (an epoch holds the same tokens whatever the batching, so this is the ratio of
epoch times; seconds per step also move with how many tokens the measured steps happened to hold).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

METHODS = {"medusa": "headway.train.medusa:MedusaRunConfig", "eagle": "headway.train.eagle:EagleRunConfig"}


def child(method: str, config: str, overrides: list[str], steps: int, out: str) -> dict:
    import importlib

    from headway.train.config import load_config

    module, cls = METHODS[method].split(":")
    mod = importlib.import_module(module)
    cfg = load_config(getattr(mod, cls), config, [*overrides, f"train.max_steps={steps}", f"train.output_dir={out}",
                                                  "train.trackers=[]", "train.log_every=1", "train.save_every=0"])
    mod.train(cfg)
    logs = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r for r in logs if "seconds" in r][1:]  # the first step warms up
    seconds = sum(r["seconds"] for r in steps_logged)
    tokens = sum(r["tokens_per_s"] * r["seconds"] for r in steps_logged)
    return {"s_per_step": seconds / len(steps_logged), "tokens_per_s": tokens / seconds}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a training config (configs/eagle/... or configs/medusa/...)")
    p.add_argument("--method", choices=sorted(METHODS), default=None, help="default: from the config's folder name")
    p.add_argument("--data", default=None, help="the self-distilled JSONL (default: the config's data.source)")
    p.add_argument("--features", default=None, help="a feature cache made by scripts/cache_features.py, or online "
                   "(default: the config's)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES",
                   help="a name, '=', then space-separated key=value overrides (repeat; the first is the baseline)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    method = args.method or next((m for m in METHODS if m in Path(args.config).parent.name), None)
    variants: dict[str, list[str]] = {}
    for v in args.variant or ["config="]:
        name, sep, rest = v.partition("=")
        if not sep or not name or "." in name or " " in name:
            p.error(f"--variant {v!r}: write NAME=OVERRIDES, e.g. grouped=\"train.group_by_length=16\"")
        variants[name] = rest.split()
    if method is None:
        p.error(f"--method: cannot tell medusa from eagle by the folder of {args.config}; pass --method")
    if args.steps < 2 or args.rounds < 1:
        p.error("--steps must be at least 2 (the first is left out) and --rounds at least 1")
    common = ([f"features={args.features}"] if args.features else []) + ([f"data.source={args.data}"] if args.data else [])
    if args.child:
        print(json.dumps(child(method, args.config, common + variants[args.child], args.steps, args.out)))
        return {}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in variants:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, __file__, "--config", args.config, "--method", method,
                       *(["--features", args.features] if args.features else []), *(["--data", args.data] if args.data else []), "--steps", str(args.steps), "--child", name, "--out", tmp,
                       *[f"--variant={n}={' '.join(o)}" for n, o in variants.items()]]
                res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"variant {name} failed:\n{res.stderr[-2000:]}")
            runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    mean = {n: {k: sum(x[k] for x in v) / len(v) for k in ("s_per_step", "tokens_per_s")} for n, v in runs.items()}
    base = mean[next(iter(variants))]
    print(f"\n{'variant':<16} {'s/step':>8} {'tokens/s':>9} {'speed':>7}  overrides")
    for n, m in mean.items():
        print(f"{n:<16} {m['s_per_step']:>8.2f} {m['tokens_per_s']:>9.0f} {m['tokens_per_s'] / base['tokens_per_s']:>6.2f}x  "
              f"{' '.join(variants[n]) or '(the config as it is)'}")
    return mean


if __name__ == "__main__":
    main()
