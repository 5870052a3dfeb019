"""torch's argmax and top-k over the vocabulary against headway's chunked ones, side by side on one device.

The runtime takes an argmax over the vocabulary at every verified node with children (greedy
verification) and a top-k or argmax at every drafted level; on a CPU torch walks those rows one
element at a time (``headway.inference.vocab_reduce``). This times both ways for each vocabulary
size and row count, alternating, and checks they agree.

``--cold`` times each call where the runtime makes it: right after a vocabulary projection (``F.linear`` of
[rows, hidden] by a [vocab, hidden] weight, not timed) has streamed its weight through the caches. A CPU's
figures are then several times the loop's, and rank the ways differently (the module's thresholds come
from them).

    python scripts/vocab_reduce_bench.py [--vocabs 16384,49152] [--rows 1,3,8] [--k 2] [--reps 2000] [--cold]
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


def cold_seconds(reduce, project, reps: int, sync=lambda: None) -> float:
    """Median seconds of ``reduce(x)``, each on fresh logits ``x = project()`` (the projection not timed)."""
    times = []
    for _ in range(max(5, reps // 10)):
        x = project()
        sync()
        t0 = time.perf_counter()
        reduce(x)
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def chunks(reduce, *args):
    """``reduce`` (``vocab_reduce.argmax`` or ``topk``) through the chunks whatever the input's size."""
    saved = vocab_reduce.ARGMAX_MIN, vocab_reduce.TOPK_MIN
    vocab_reduce.ARGMAX_MIN = vocab_reduce.TOPK_MIN = 0
    try:
        return reduce(*args)
    finally:
        vocab_reduce.ARGMAX_MIN, vocab_reduce.TOPK_MIN = saved


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocabs", default="16384,49152", help="vocabulary sizes (logits per row)")
    p.add_argument("--rows", default="1,3,8", help="rows reduced at once (a tree level's frontier, verified nodes)")
    p.add_argument("--k", type=int, default=2, help="top-k's k")
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--cold", action="store_true", help="each call right after a vocabulary projection (as in a round)")
    p.add_argument("--hidden", type=int, default=576, help="the projection's input width (--cold)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows_out = []
    print(f"{'vocab':>7} {'rows':>4} {'argmax us':>11} {'max us':>8} {'chunks us':>11} {'headway':>8} "
          f"{'topk us':>9} {'chunks us':>11} {'headway':>8}")
    for v in (int(x) for x in args.vocabs.split(",") if x):
        for r in (int(x) for x in args.rows.split(",") if x):
            x = torch.randn(r, v, generator=g).to(args.device)
            if not torch.equal(chunks(vocab_reduce.argmax, x), x.argmax(-1)) or \
                    not torch.equal(chunks(vocab_reduce.topk, x, args.k).values, x.topk(args.k, dim=-1).values):
                raise SystemExit(f"vocab {v}, rows {r}: the chunked reduction differs from torch's")
            if args.cold:
                weight = torch.randn(v, args.hidden, generator=g).to(args.device)
                h = torch.randn(r, args.hidden, generator=g).to(args.device)

                def timed(reduce):
                    return cold_seconds(reduce, lambda: torch.nn.functional.linear(h, weight), args.reps, sync)
            else:
                def timed(reduce):
                    return seconds(lambda: reduce(x), args.reps, sync)
            row = dict(vocab=v, rows=r, argmax_chunked=vocab_reduce._chunked(x), topk_chunked=vocab_reduce._chunked(x, args.k),
                       argmax_torch_us=1e6 * timed(lambda y: y.argmax(-1)),
                       argmax_max_us=1e6 * timed(lambda y: y.max(-1).indices),
                       argmax_chunks_us=1e6 * timed(lambda y: chunks(vocab_reduce.argmax, y)),
                       topk_torch_us=1e6 * timed(lambda y: y.topk(args.k, dim=-1)),
                       topk_chunks_us=1e6 * timed(lambda y: chunks(vocab_reduce.topk, y, args.k)))
            rows_out.append(row)
            print(f"{v:>7} {r:>4} {row['argmax_torch_us']:>11.1f} {row['argmax_max_us']:>8.1f} "
                  f"{row['argmax_chunks_us']:>11.1f} {'chunks' if row['argmax_chunked'] else 'max':>8} "
                  f"{row['topk_torch_us']:>9.1f} {row['topk_chunks_us']:>11.1f} "
                  f"{'chunks' if row['topk_chunked'] else 'topk':>8}")
    out = dict(device=args.device, k=args.k, threads=args.threads, rows=rows_out)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
