"""Training throughput and peak memory on the default: online target features vs cached features.

    python scripts/bench_training.py --data PATH.jsonl --features CACHE_DIR [--steps 20] [--rounds 2]

Each measurement runs in its own child process (so peak RSS is that mode's own), alternating
online and cached runs for ``--rounds`` rounds; tokens/s comes from the training loop's own
metrics (start-up excluded). Prints a table with the cached/online ratio.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "medusa" / "smollm2-135m.yaml"


def child(mode: str, data: str, features: str, steps: int, out: str) -> None:
    from headway.train.config import load_config
    from headway.train.medusa import MedusaRunConfig, train

    overrides = [f"data.source={data}", f"train.max_steps={steps}", f"train.output_dir={out}",
                 "train.trackers=[]", "train.log_every=1", "train.save_every=0"]
    if mode == "cached":
        overrides.append(f"features={features}")
    train(load_config(MedusaRunConfig, CONFIG, overrides))
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # first step warms up
    print(json.dumps({"mode": mode, "tokens_per_s": sum(rates) / len(rates),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="the self-distilled JSONL the features were cached from")
    p.add_argument("--features", required=True, help="feature cache made by scripts/cache_features.py")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", choices=["online", "cached"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.data, args.features, args.steps, args.out)
    results: dict[str, list[dict]] = {"online": [], "cached": []}
    for r in range(args.rounds):
        for mode in ("online", "cached"):
            with tempfile.TemporaryDirectory() as tmp:
                res = subprocess.run([sys.executable, __file__, "--child", mode, "--data", args.data, "--features",
                                      args.features, "--steps", str(args.steps), "--out", tmp],
                                     capture_output=True, text=True, check=True)
            results[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {mode}: {results[mode][-1]}", flush=True)
    mean = {m: {k: sum(x[k] for x in v) / len(v) for k in ("tokens_per_s", "peak_rss_mb")} for m, v in results.items()}
    print(f"\n{'mode':<8} {'tokens/s':>10} {'peak RSS MB':>12}")
    for m, v in mean.items():
        print(f"{m:<8} {v['tokens_per_s']:>10.1f} {v['peak_rss_mb']:>12.0f}")
    print(f"cached / online throughput: {mean['cached']['tokens_per_s'] / mean['online']['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
