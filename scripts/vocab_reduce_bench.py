"""torch's argmax and top-k over the vocabulary against headway's chunked ones, side by side on one device.

The runtime takes an argmax over the vocabulary at every verified node with children (greedy
verification) and a top-k or argmax at every drafted level; on a CPU torch walks those rows one
element at a time (``headway.inference.vocab_reduce``). This times both ways for each vocabulary
size and row count, alternating, and checks they agree.

    python scripts/vocab_reduce_bench.py [--vocabs 16384,49152] [--rows 1,3,8] [--k 2] [--reps 2000]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from headway.inference import vocab_reduce


def seconds(fn, reps: int, sync=lambda: None) -> float:
    """Median of 5 blocks of ``reps // 5`` calls, per call (``sync``: wait for the device before reading the clock)."""
    for _ in range(max(1, reps // 10)):
        fn()
    blocks = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(max(1, reps // 5)):
            fn()
        sync()
        blocks.append((time.perf_counter() - t0) / max(1, reps // 5))
    return sorted(blocks)[2]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocabs", default="16384,49152", help="vocabulary sizes (logits per row)")
    p.add_argument("--rows", default="1,3,8", help="rows reduced at once (a tree level's frontier, verified nodes)")
    p.add_argument("--k", type=int, default=2, help="top-k's k")
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows_out = []
    print(f"{'vocab':>7} {'rows':>4} {'argmax torch us':>15} {'chunked us':>10} "
          f"{'topk torch us':>13} {'chunked us':>10}")
    for v in (int(x) for x in args.vocabs.split(",") if x):
        for r in (int(x) for x in args.rows.split(",") if x):
            x = torch.randn(r, v, generator=g).to(args.device)
            if not torch.equal(vocab_reduce.argmax(x), x.argmax(-1)) or \
                    not torch.equal(vocab_reduce.topk(x, args.k).values, x.topk(args.k, dim=-1).values):
                raise SystemExit(f"vocab {v}, rows {r}: the chunked reduction differs from torch's")
            row = dict(vocab=v, rows=r, chunked=vocab_reduce._chunked(x, args.k),
                       argmax_torch_us=1e6 * seconds(lambda: x.argmax(-1), args.reps, sync),
                       argmax_chunked_us=1e6 * seconds(lambda: vocab_reduce.argmax(x), args.reps, sync),
                       topk_torch_us=1e6 * seconds(lambda: x.topk(args.k, dim=-1), args.reps, sync),
                       topk_chunked_us=1e6 * seconds(lambda: vocab_reduce.topk(x, args.k), args.reps, sync))
            rows_out.append(row)
            print(f"{v:>7} {r:>4} {row['argmax_torch_us']:>15.1f} {row['argmax_chunked_us']:>10.1f} "
                  f"{row['topk_torch_us']:>13.1f} {row['topk_chunked_us']:>10.1f}"
                  + ("" if row["chunked"] else "   (both torch's own call)"))
    out = dict(device=args.device, k=args.k, threads=args.threads, rows=rows_out)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
