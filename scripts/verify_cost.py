"""The verification cost curve: time of one target pass over k draft tokens, t(k)/t(1).

Speculative decoding pays when tau (tokens per pass) beats t(k)/t(1) for the k tokens verified.
This times the target over a chain of k tokens (plain causal attention) and over static trees
(4D tree mask) after a prompt of ``--prefix`` tokens, on the chosen device, and prints each ratio.

    python scripts/verify_cost.py [--model smollm2-135m] [--device cuda] [--prefix 512] [--ks 1,2,4,8,16,32,64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from headway.heads.target import load_target
from headway.inference.benchmark import sync_device
from headway.inference.kv_cache import crop_to, new_cache
from headway.inference.tree import chain, load_tree
from headway.inference.tree_attention import prefill, tree_forward


@torch.no_grad()
def seconds_per_pass(target, tree, prefix_ids: torch.Tensor, reps: int) -> float:
    """Mean wall time of one tree_forward over ``tree`` after ``prefix_ids`` [1, T] (cache cropped back each time)."""
    device = prefix_ids.device
    cache = new_cache(target)
    prefill(target, cache, prefix_ids)
    t = prefix_ids.shape[1]
    tokens = prefix_ids[0, : len(tree.parents)]
    for _ in range(max(2, reps // 10)):  # warm-up: kernel selection, allocator growth
        tree_forward(target, cache, tree, tokens, t)
        crop_to(cache, t)
    sync_device(device)
    start = time.perf_counter()
    for _ in range(reps):
        tree_forward(target, cache, tree, tokens, t)
        crop_to(cache, t)
    sync_device(device)
    return (time.perf_counter() - start) / reps


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prefix", type=int, default=512, help="prompt tokens already in the cache")
    p.add_argument("--ks", default="1,2,4,8,16,32,64", help="chain lengths (k tokens verified, the root included)")
    p.add_argument("--trees", default="tree-7,tree-15", help="static trees to time too")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _ = load_target(args.model, device=args.device)
    ks = [int(k) for k in args.ks.split(",") if k]
    if 1 not in ks:
        ks = [1] + ks
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, target.config.vocab_size - 100, (1, args.prefix), generator=g).to(args.device)
    t1 = seconds_per_pass(target, chain(0), ids, args.reps)
    out = {"device": args.device, "dtype": str(target.dtype), "prefix": args.prefix, "t1_ms": 1000 * t1, "chain": {},
           "tree": {}}
    print(f"{args.model} on {args.device} ({target.dtype}), prefix {args.prefix}: t(1) = {1000 * t1:.2f} ms")
    for k in ks:
        if k > 1:
            r = seconds_per_pass(target, chain(k - 1), ids, args.reps) / t1
            out["chain"][k] = r
            print(f"chain t({k})/t(1) = {r:.2f}")
    for name in [t for t in args.trees.split(",") if t]:
        tree = load_tree(name)
        r = seconds_per_pass(target, tree, ids, args.reps) / t1
        out["tree"][name] = r
        print(f"{name} ({len(tree.parents)} nodes, tree mask) t/t(1) = {r:.2f}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
