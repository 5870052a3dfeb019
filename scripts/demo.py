"""The main job on the embedded default, end to end and offline.

    python scripts/demo.py            (make demo)       about 15-20 minutes on a 2-core CPU
    python scripts/demo.py --long     (make demo-long)  more data and epochs: better heads

1. converts the packaged SmolLM2-135M-Instruct (GGUF) to safetensors, once;
2. self-distils a data set: the target answers real prompts from the packaged text;
3. caches the frozen target's features to safetensors shards;
4. trains Medusa-1 heads on them (configs/medusa/smollm2-135m.yaml) and exports them;
5. prints held-out top-1 / top-5 accuracy per head;
6. generates with the heads on held-out prompts, side by side with plain greedy decoding and
   prompt lookup (scripts/benchmark.py), and prints tau and the speedup.
Every step is cached: a rerun skips what is done and resumes what was interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import benchmark  # noqa: E402
import cache_features  # noqa: E402
import generate_data  # noqa: E402

from headway.heads.target import DEFAULT_MODEL, default_model_dir, headway_cache_dir  # noqa: E402
from headway.train.config import load_config  # noqa: E402
from headway.train.medusa import MedusaRunConfig, train  # noqa: E402

CONFIG = ROOT / "configs" / "medusa" / "smollm2-135m.yaml"
SIZES = {  # prompts, new tokens per answer, training epochs
    "quick": dict(prompts=240, max_new_tokens=96, epochs=8),
    "long": dict(prompts=960, max_new_tokens=128, epochs=10),
}


def step(title: str) -> float:
    print(f"\n== {title}", flush=True)
    return time.perf_counter()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="headway demo: Medusa heads for SmolLM2-135M, offline")
    parser.add_argument("--long", action="store_true", help="more data and epochs (about an hour on 2 cores)")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "demo"), help="where the heads and caches go")
    args = parser.parse_args(argv)
    size = SIZES["long" if args.long else "quick"]
    torch.set_num_threads(1)
    out = Path(args.out) / ("long" if args.long else "quick")
    data = headway_cache_dir() / "data" / f"{DEFAULT_MODEL}-selfdistill-{size['prompts']}x{size['max_new_tokens']}.jsonl"
    overrides = [f"data.source={data}", f"train.epochs={size['epochs']}", f"train.output_dir={out / 'heads'}"]
    t_all = time.perf_counter()

    t = step("1/6 target model: SmolLM2-135M-Instruct from the packaged GGUF")
    print(f"   {default_model_dir()} ({time.perf_counter() - t:.0f} s)")

    t = step(f"2/6 self-distillation: the target answers {size['prompts']} packaged prompts")
    code = generate_data.main(["--model", DEFAULT_MODEL, "--out", str(data), "--num-prompts", str(size["prompts"]),
                               "--max-new-tokens", str(size["max_new_tokens"])])
    if code:
        sys.exit(code)
    print(f"   {data} ({time.perf_counter() - t:.0f} s)")

    t = step("3/6 caching the frozen target's features (safetensors shards)")
    feats = out / "features"
    cache_features.main(["--config", str(CONFIG), "--out", str(feats), *overrides])
    print(f"   ({time.perf_counter() - t:.0f} s)")

    t = step("4/6 training Medusa heads on the cached features")
    cfg = load_config(MedusaRunConfig, CONFIG, [*overrides, f"features={feats}"])
    metrics = train(cfg)
    print(f"   ({time.perf_counter() - t:.0f} s)")

    step("5/6 held-out accuracy per head (head k predicts the token k+2 ahead)")
    print(f"   {'head':>6} {'top-1':>7} {'top-5':>7}")
    for k in range(cfg.heads.num_heads):
        print(f"   {k:>6} {metrics[f'head{k}/top1']:>7.3f} {metrics[f'head{k}/top5']:>7.3f}")
    print(f"\nheads: {cfg.train.output_dir}  (load with headway.heads.load_drafter)")

    t = step("6/6 speculative generation with the heads vs plain greedy (output must be identical)")
    results = benchmark.main(["--heads", cfg.train.output_dir, "--prompts", "4", "--copy-prompts", "2",
                              "--max-new-tokens", "64", "--draft-layers", "0", "--out", str(out / "benchmark")])
    best = max((n for n in results["chat"] if n.startswith("medusa")), key=lambda n: results["chat"][n]["speedup"])
    s = results["chat"][best]
    print(f"\nMedusa heads on held-out chat prompts, best tree {best.split()[-1]}: tau {s['tau']:.2f} new tokens per "
          f"target pass, {s['speedup']:.2f}x plain greedy ({'identical output' if s['identical'] else 'OUTPUT DIFFERS'})"
          f"  ({time.perf_counter() - t:.0f} s)")
    print(f"total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
