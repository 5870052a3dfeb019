"""Tokens/s and peak memory per process of every distributed mode, side by side (2 processes, CPU/gloo).

    python scripts/bench_distributed.py [--runs tiny,default] [--modes ddp,zero2,zero3,fsdp] [--steps 12]
                                        [--data ~/.cache/headway/data/smollm2-135m-selfdistill-400x96.jsonl]

Each (run, mode) is one real `accelerate launch` of train/medusa.py with 2 processes; the loop
records every rank's peak RSS and the run's training tokens/s in distributed.json, which this
script reads and prints. "tiny" is configs/medusa/tiny.yaml; "default" is the SmolLM2-135M config
with online features on the given self-distilled data. FSDP is accelerate's FSDP config, which
headway runs with torch's FSDP2 on CPUs too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "ddp": ["--multi_gpu"],
    "zero2": ["--use_deepspeed", "--deepspeed_config_file", str(ROOT / "configs" / "deepspeed" / "zero2.json")],
    "zero3": ["--use_deepspeed", "--deepspeed_config_file", str(ROOT / "configs" / "deepspeed" / "zero3.json")],
    "fsdp": ["--config_file", str(ROOT / "configs" / "accelerate" / "cpu-fsdp-2.yaml")],
}


def run_args(run: str, data: str | None) -> list[str]:
    if run == "tiny":
        return ["--config", str(ROOT / "configs" / "medusa" / "tiny.yaml")]
    return ["--config", str(ROOT / "configs" / "medusa" / "smollm2-135m.yaml"), "features=online",
            "train.batch_size=4", "train.num_threads=1"] + ([f"data.source={data}"] if data else [])


def launch(run: str, mode: str, steps: int, out: Path, data: str | None, port: int) -> dict:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *MODES[mode], "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
           str(ROOT / "train" / "medusa.py"), *run_args(run, data), f"train.output_dir={out}",
           f"train.max_steps={steps}", "train.trackers=[]", "train.save_every=0", "train.overwrite=true"]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode != 0:
        raise SystemExit(f"{run}/{mode} failed:\n{res.stdout[-2000:]}{res.stderr[-3000:]}")
    return json.loads((out / "distributed.json").read_text())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="tiny,default")
    p.add_argument("--modes", default="ddp,zero2,zero3,fsdp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--data", help="self-distilled JSONL for the default run (default: data.source=default)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="headway-dist-") as tmp:
        for i, run in enumerate(args.runs.split(",")):
            for j, mode in enumerate(args.modes.split(",")):
                info = launch(run, mode, args.steps, Path(tmp) / f"{run}-{mode}", args.data, 29800 + 10 * i + j)
                assert info["num_processes"] == 2 and info["fingerprints"][0] == info["fingerprints"][1]
                rss = [m["rss"] for m in info["peak_memory_mb"]]
                rows.append((run, mode, info["train_tokens_per_s"], rss))
                print(f"{run}/{mode} done", file=sys.stderr, flush=True)
    print(f"\n{'run':<8} {'mode':<6} {'tokens/s':>9} {'peak RSS rank0 (MiB)':>21} {'rank1':>7}")
    for run, mode, tps, rss in rows:
        print(f"{run:<8} {mode:<6} {tps:>9.0f} {rss[0]:>21.0f} {rss[1]:>7.0f}")


if __name__ == "__main__":
    main()
