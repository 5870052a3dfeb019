"""The verification cost curve: time of one target pass over k draft tokens, t(k)/t(1).

Speculative decoding pays when tau (tokens per pass) beats t(k)/t(1) for the k tokens verified.
This times the target over a chain of k tokens (plain causal attention) and over static trees
(4D tree mask) after a prompt of ``--prefix`` tokens, on the chosen device, and prints each ratio.

    python scripts/verify_cost.py [--model smollm2-135m] [--device cuda] [--prefix 512] [--ks 1,2,4,8,16,32,64]
                                  [--no-pack-linears | --compare-packing]

A float32 CPU target's linear weights are prepacked for multi-row passes as the runtime's
``headway bench`` and ``headway generate`` do (``headway.inference.cpu_gemm``); t(1) keeps its kernel.
``--compare-packing`` times the target as loaded and a prepacked copy side by side, in alternating
blocks, and prints both ratios against the same t(1).
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from headway.heads.target import load_target
from headway.inference.cpu_gemm import pack_linears, packing_available
from headway.inference.cost_curve import seconds_per_pass
from headway.inference.tree import chain, load_tree


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prefix", type=int, default=512, help="prompt tokens already in the cache")
    p.add_argument("--ks", default="1,2,4,8,16,32,64", help="chain lengths (k tokens verified, the root included)")
    p.add_argument("--trees", default="tree-7,tree-15", help="static trees to time too")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pack-linears", action=argparse.BooleanOptionalAction, default=True,
                   help="prepack a float32 CPU target's linear weights (no-op elsewhere)")
    p.add_argument("--compare-packing", action="store_true",
                   help="time the target as loaded and a prepacked copy side by side, alternating blocks of passes")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _ = load_target(args.model, device=args.device)
    if args.compare_packing:
        packed_copy = copy.deepcopy(target)
        if not pack_linears(packed_copy):
            p.error(f"--compare-packing: nothing to pack ({packing_available(target)})")
        variants = {"as loaded": target, "packed": packed_copy}
    else:
        variants = {"packed" if args.pack_linears and pack_linears(target) else "as loaded": target}
    targets, rounds = list(variants.values()), 5 if len(variants) > 1 else 1
    ks = [int(k) for k in args.ks.split(",") if k]
    if 1 not in ks:
        ks = [1] + ks
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, target.config.vocab_size - 100, (1, args.prefix), generator=g).to(args.device)
    t1 = seconds_per_pass(targets, chain(0), ids, args.reps, rounds)[0]  # one-row passes: the same kernel in both
    out = {"device": args.device, "dtype": str(target.dtype), "prefix": args.prefix, "variants": list(variants),
           "packed_linears": "packed" in variants, "t1_ms": 1000 * t1, "chain": {}, "tree": {}}
    print(f"{args.model} on {args.device} ({target.dtype}, {' vs '.join(variants)}), prefix {args.prefix}: "
          f"t(1) = {1000 * t1:.2f} ms")
    shapes = [(f"chain t({k})/t(1)", "chain", k, chain(k - 1)) for k in ks if k > 1]
    trees = {name: load_tree(name) for name in args.trees.split(",") if name}
    shapes += [(f"{name} ({tree.size} nodes, tree mask) t/t(1)", "tree", name, tree) for name, tree in trees.items()]
    for label, kind, key, tree in shapes:
        ratios = [s / t1 for s in seconds_per_pass(targets, tree, ids, args.reps, rounds)]
        out[kind][key] = ratios[0] if len(ratios) == 1 else dict(zip(variants, ratios))
        print(f"{label} = " + ", ".join(f"{r:.2f}" + (f" {v}" if len(ratios) > 1 else "") for v, r in zip(variants, ratios)))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
