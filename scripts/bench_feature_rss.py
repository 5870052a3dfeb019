"""Peak RSS of one training rank reading a feature cache: every shard loaded eagerly vs lazy reads.

    python scripts/bench_feature_rss.py --features outputs/demo/long/features [--world 2]

For each rank r of ``--world``, two fresh processes read the features of that rank's examples
(r, r + world, ...), as the loop does over one epoch: "eager" first loads every train shard into
RAM (what every rank did before the lazy cache), "lazy" goes through ``load_cached_features``
(safetensors memory maps, one example's rows at a time). Prints each process's peak RSS
(VmHWM) above the interpreter with torch imported.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(mode: str, folder: str, rank: int, world: int) -> None:
    import torch  # noqa: F401  (the baseline includes torch)
    from safetensors.torch import load_file

    from headway.train.feature_reader import load_cached_features

    base = vm_hwm_mib()
    train = Path(folder) / "train"
    if mode == "eager":
        # materialised in RAM, as the pre-lazy loader held them (load_file alone only maps the file)
        shards = [{k: v.clone() for k, v in load_file(str(p)).items()} for p in sorted(train.glob("shard-*.safetensors"))]
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    data = load_cached_features(train)
    rows = 0
    for i in range(rank, len(data), world):
        rows += int(data[i]["features"].shape[0])
    print(json.dumps({"mode": mode, "rank": rank, "rows": rows, "peak_mib": vm_hwm_mib() - base,
                      "examples": len(range(rank, len(data), world)),
                      **({"shard_bytes": total} if mode == "eager" else {})}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--features", required=True, help="a feature cache folder (with train/)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        mode, rank, world = args.child
        return child(mode, args.features, int(rank), int(world))
    shards = sum(f.stat().st_size for f in (Path(args.features) / "train").glob("shard-*.safetensors"))
    print(f"train shards on disk: {shards / 2**20:.0f} MiB; {args.world} ranks")
    print(f"{'mode':<6} {'rank':>4} {'examples':>8} {'feature rows':>12} {'peak RSS above start (MiB)':>27}")
    for mode in ("eager", "lazy"):
        for rank in range(args.world):
            out = subprocess.run([sys.executable, __file__, "--features", args.features, "--child", mode, str(rank),
                                  str(args.world)], capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{mode:<6} {rank:>4} {r['examples']:>8} {r['rows']:>12} {r['peak_mib']:>27.0f}")


if __name__ == "__main__":
    main()
