"""LayerSkip's costs on the target, per exit layer: what reusing the early layers saves, and what a round costs.

For each exit layer E and chain of k drafted tokens (k + 1 verified, the root included), after a prompt
of ``--prefix`` tokens, this times in one process, interleaved:
- a full verification pass over the k + 1 tokens (``tree_forward``: what a pass costs without reuse);
- the resumed pass (``resume_forward``: layers E..L-1 over the saved layer-E states, the early layers'
  keys/values already in the cache): the pass LayerSkip runs;
- one drafting step: one token through layers 0..E-1 (``early_forward``) and the exit head's lm_head over
  ``--draft-vocab`` rows;
- a plain decoding step (one token through the whole target), the unit.
It prints each as a multiple of the plain step, the reuse's saving (resumed / full), and the round's
break-even tau: (k + 1 early steps + k head projections + the resumed pass) / plain step, the tokens per
round a chain of k must average to match plain decoding.

    python scripts/layerskip_cost.py [--model smollm2-135m] [--exits 8,15,22,27] [--ks 1,2,3,4] [--prefix 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from headway.heads.target import load_target
from headway.heads.target.features import num_layers
from headway.inference.cpu_gemm import pack_linears
from headway.inference.kv_cache import new_cache
from headway.inference.target_forward import early_forward, prefill, resume_forward, tree_forward, trim_layers
from headway.inference.tree import chain


def timed(fn, reps: int, sync) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--exits", default="8,15,22,27", help="exit layers E to time")
    p.add_argument("--ks", default="1,2,3,4", help="drafted chain lengths k (k + 1 tokens verified)")
    p.add_argument("--prefix", type=int, default=256, help="prompt tokens already in the cache")
    p.add_argument("--draft-vocab", type=int, default=8192, help="rows of the exit head's lm_head")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pack-linears", action=argparse.BooleanOptionalAction, default=True,
                   help="prepack a float32 CPU target's linear weights, as headway bench does (no-op elsewhere)")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _ = load_target(args.model, device=args.device)
    if args.pack_linears:
        pack_linears(target)
    depth = num_layers(target)
    exits = [int(e) for e in args.exits.split(",") if e]
    bad = [e for e in exits if not 1 <= e < depth]
    if bad:
        p.error(f"--exits {bad}: exit layers are 1..{depth - 1} for this target")
    device = next(target.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(100, vocab, (1, args.prefix + 1), generator=g).to(device)
    cache = new_cache(target, capacity=args.prefix + 64)
    prefill(target, cache, prompt[:, :-1])
    p_len = args.prefix
    hidden = target.config.get_text_config().hidden_size
    head = torch.randn(args.draft_vocab, hidden, dtype=target.dtype, device=device) * 0.02
    every = range(depth)

    def restore():
        trim_layers(cache, every, p_len)

    def plain():
        tree_forward(target, cache, chain(0), prompt[0, -1:], p_len)
        restore()

    plain_s = timed(plain, args.reps, sync)
    rows = []
    for e in exits:
        def draft_step():
            state = early_forward(target, cache, prompt[0, -1:], p_len, e)
            state @ head.T
            restore()

        step_s = timed(draft_step, args.reps, sync)
        for k in (int(x) for x in args.ks.split(",") if x):
            tokens = prompt[0, -1:].repeat(k + 1)
            tree = chain(k)

            def full():
                tree_forward(target, cache, tree, tokens, p_len)
                restore()

            states = torch.cat([early_forward(target, cache, tokens[i:i + 1], p_len + i, e) for i in range(k + 1)])
            restore()

            def resumed():
                for i in range(k + 1):  # the early layers' keys/values, as drafting leaves them (not timed here)
                    early_forward(target, cache, tokens[i:i + 1], p_len + i, e)
                sync()
                t0 = time.perf_counter()
                resume_forward(target, cache, tree, states, p_len, e)
                sync()
                restore()
                return time.perf_counter() - t0

            resumed()
            full_s = timed(full, args.reps, sync)
            resume_s = statistics.median(resumed() for _ in range(args.reps))
            round_s = (k + 1) * step_s + resume_s  # k + 1 early steps (k with the head's projection: one more, bound)
            rows.append({"exit": e, "k": k, "full": full_s / plain_s, "resumed": resume_s / plain_s,
                         "saving": 1 - resume_s / full_s, "draft_step": step_s / plain_s,
                         "break_even_tau": round_s / plain_s})
            r = rows[-1]
            print(f"E={e:2d} k={k}: full pass {r['full']:.2f}, resumed {r['resumed']:.2f} (saves {r['saving']:.0%}), "
                  f"draft step {r['draft_step']:.2f}, round {r['break_even_tau']:.2f} plain steps "
                  f"(tau to break even)")
    result = {"model": args.model, "device": str(device), "prefix": args.prefix, "draft_vocab": args.draft_vocab,
              "plain_step_ms": plain_s * 1e3, "rows": rows}
    print(f"plain step {plain_s * 1e3:.1f} ms ({args.model}, {device}, prefix {args.prefix})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
