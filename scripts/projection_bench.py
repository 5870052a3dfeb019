"""A drafter's vocabulary projection over a few rows: ``F.linear`` against ``few_rows_linear``, side by side.

A drafted tree level, P-EAGLE's K slots, a DFlash block and a batch's rows each project several hidden
states onto a wide vocabulary weight at once. On a CPU MKL's GEMM for a few rows costs a multiple of its
one-row time (it is a different kernel from 4 rows on); ``headway.inference.cpu_gemm.few_rows_linear``
multiplies a packed copy of the weight with oneDNN instead. This times, for each weight shape and row
count, alternating: ``F.linear``, the transposed product over 4 rows that ``few_rows_linear`` used before
(``weight @ x.T``, 2-3 rows padded to 4), and ``few_rows_linear``; each as a multiple of one row's
``F.linear``. ``--evict`` (the default) streams a 64 MB buffer before every call, as the target's pass does
to the drafter's weight between two drafted levels.

    python scripts/projection_bench.py [--shapes 16384x256,8192x576,32000x576] [--rows 1,2,3,4,7,16] [--reps 60]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from headway.inference.cpu_gemm import few_rows_linear


def transposed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The earlier kernel: ``weight @ x.T`` over 4 rows (2-3 padded), other row counts ``F.linear``."""
    rows = x.shape[0]
    if not 1 < rows <= 4:
        return F.linear(x, weight)
    if rows < 4:
        x = torch.cat([x, x[:1].expand(4 - rows, -1)])
    return (weight @ x.T).T[:rows]


def seconds(fn, reps: int, evict: torch.Tensor | None) -> float:
    """Median seconds per call over ``reps`` calls (each after streaming ``evict``, not timed)."""
    times = []
    for _ in range(reps):
        if evict is not None:
            evict.add_(1.0)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="16384x256,8192x576,32000x576", help="weights, vocabulary x hidden")
    p.add_argument("--rows", default="1,2,3,4,7,16", help="rows projected at once")
    p.add_argument("--reps", type=int, default=60, help="calls per kernel and shape, in 3 alternating blocks")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-evict", dest="evict", action="store_false", help="keep the weight in cache between calls")
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",") if s]
        rows = [int(r) for r in args.rows.split(",") if r]
    except ValueError:
        p.error(f"--shapes takes VOCABxHIDDEN[,..] and --rows integers, got {args.shapes!r} / {args.rows!r}")
    if not shapes or not rows or min(rows) < 1 or any(len(s) != 2 or min(s) < 1 for s in shapes):
        p.error("--shapes takes VOCABxHIDDEN[,..] (positive) and --rows positive integers")
    torch.set_num_threads(args.threads)
    evict = torch.zeros(64 * 2**20 // 4) if args.evict else None
    g = torch.Generator().manual_seed(0)
    kernels = {"linear": F.linear, "transposed": transposed, "few_rows_linear": few_rows_linear}
    out = []
    print(f"{'weight':>10} {'rows':>4} {'F.linear ms':>11} {'weight@x.T ms':>13} {'few_rows ms':>11}   "
          f"(x one row's F.linear)")
    with torch.no_grad():
        for vocab, hidden in shapes:
            weight = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) / hidden ** 0.5, requires_grad=False)
            for r in rows:
                x = torch.randn(r, hidden, generator=g)
                diff = (few_rows_linear(x, weight) - F.linear(x, weight)).abs().max().item()
                if diff > 1e-3:
                    raise SystemExit(f"{vocab}x{hidden}, {r} rows: few_rows_linear differs from F.linear by {diff}")
                took = {k: [] for k in ["one_row", *kernels]}
                for _ in range(3):  # alternating blocks, one row's F.linear among them (the unit)
                    took["one_row"].append(seconds(lambda: F.linear(x[:1], weight), max(1, args.reps // 3), evict))
                    for name, fn in kernels.items():
                        took[name].append(seconds(lambda: fn(x, weight), max(1, args.reps // 3), evict))
                ms = {k: 1e3 * sorted(v)[1] for k, v in took.items()}
                one = ms["one_row"] / 1e3
                out.append(dict(vocab=vocab, hidden=hidden, rows=r, max_abs_diff=diff,
                                **{f"{k}_ms": v for k, v in ms.items()}))
                print(f"{vocab:>5}x{hidden:<4} {r:>4} {ms['linear']:>11.3f} {ms['transposed']:>13.3f} "
                      f"{ms['few_rows_linear']:>11.3f}   ({ms['linear'] / 1e3 / one:.2f} / "
                      f"{ms['transposed'] / 1e3 / one:.2f} / {ms['few_rows_linear'] / 1e3 / one:.2f})")
    report = dict(threads=args.threads, evict=args.evict, rows=out)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
