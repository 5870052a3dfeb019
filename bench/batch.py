"""Batched speculative decoding against plain batched ``generate``, on the default target.

    python scripts/batch_bench.py                                # prompt lookup, batch 1, 2, 4, 8
    python scripts/batch_bench.py --batches 1,4 --prompts 8 --max-new-tokens 64 [--heads DIR] [--eagle DIR] \
        [--layerskip DIR] [--drafter DIR ...]

(--eagle adds EAGLE alone and EAGLE with suffix decoding merged, the hybrid ``headway generate`` runs.)

Task-diverse prompts (``headway.bench.task_prompts``: one group after another, cycling) are cut into
batches of B and left-padded as a tokenizer pads them for ``generate``; for each batch plain greedy
``target.generate`` and each speculative method run in turn, the order reversed on every other batch.
Prints per batch size: tokens/s of each method (all rows' new tokens over the whole calls' seconds),
the ratio to plain batched generate, tau (new tokens per row per verification pass), the mean
verification width per row and the share of plain steps (what ``tree="auto"`` chose at that batch
size), and whether every row equals plain generate's row (both stop at EOS). Writes results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from headway.bench.task_prompts import GROUPS, task_prompts
from headway.heads.target import DEFAULT_MODEL, load_target
from headway.inference import PromptLookup, SpeculativeGenerator
from headway.inference.cost_curve import sync as sync_device
from headway.inference.cpu_gemm import pack_linears
from headway.inference.hybrid import DEFAULT_RETRIEVAL, retrieval_parts
from headway.inference.inputs import context_length

DEFAULT_GROUPS = ("chat", "code", "translate", "math", "copy", "multi-turn")  # short prompts: many fit a batch


def mixed_prompts(tokenizer, groups, n: int, room: int) -> list[list[int]]:
    """``n`` chat-templated prompts, one group after another (cycling), each leaving ``room`` positions."""
    per = {g: task_prompts(g, n) for g in groups}
    out, i = [], 0
    while len(out) < n and any(per.values()):
        g = groups[i % len(groups)]
        i += 1
        if per[g]:
            ids = tokenizer.apply_chat_template(per[g].pop(0), add_generation_prompt=True, return_dict=True)["input_ids"]
            if room is None or len(ids) <= room:
                out.append(list(ids))
    return out


def left_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] ids and attention mask, left-padded."""
    t = max(map(len, rows))
    ids = torch.full((len(rows), t), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, t - len(row):] = torch.tensor(row)
        mask[r, t - len(row):] = 1
    return ids.to(device), mask.to(device)


def row_tokens(seq: torch.Tensor, t: int, eos: int) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS."""
    out = []
    for row in seq[:, t:].tolist():
        out.append(row[:row.index(eos) + 1] if eos in row else row)
    return out


def run(name, method, target, ids, mask, max_new: int, eos: int, pad: int):
    sync_device(ids.device)
    start = time.perf_counter()
    if name == "plain":
        seq = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, eos_token_id=eos,
                              pad_token_id=pad)
        stats = None
    else:
        out = method.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos)
        seq, stats = out.sequences, out.stats
    tokens = row_tokens(seq, ids.shape[1], eos)  # a read: waits for the device
    return tokens, time.perf_counter() - start, stats


def build_parser(parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser_class(description="Batched speculative decoding vs plain batched generate (see the module docstring).")
    p.add_argument("--model", default=DEFAULT_MODEL, help="target: the offline default, a folder or a Hub id")
    p.add_argument("--batches", default="1,2,4,8", help="batch sizes, comma-separated")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch size (cut into batches of B)")
    p.add_argument("--groups", default=",".join(DEFAULT_GROUPS), help=f"task groups, from {list(GROUPS)}")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tree", default="auto", help="the generator's tree (auto: chosen per row and batch size)")
    p.add_argument("--heads", default=None, help="Medusa heads folder (adds a medusa row)")
    p.add_argument("--eagle", default=None, help="EAGLE drafter folder (adds an eagle row)")
    p.add_argument("--layerskip", default=None, help="LayerSkip exit head folder (adds a layerskip row)")
    p.add_argument("--drafter", action="append", default=[], metavar="DIR",
                   help="any saved drafter folder (P-EAGLE, DFlash, ...): adds a row named by its kind; repeatable")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-pack-linears", dest="pack_linears", action="store_false")
    p.add_argument("--out", default=str(Path("outputs", "batch_bench")))
    return p


def main(argv=None, parser_class=argparse.ArgumentParser) -> dict:
    p = build_parser(parser_class)
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        p.error(f"--batches must be integers, got {args.batches!r}")
    groups = [g for g in args.groups.split(",") if g]
    if not batches or min(batches) < 1 or set(groups) - set(GROUPS):
        p.error(f"--batches must be >= 1 and --groups from {list(GROUPS)}")
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.model)
    if args.pack_linears:
        pack_linears(target)
    device = next(target.parameters()).device
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    context = context_length(target.config)
    prompts = mixed_prompts(tokenizer, groups, args.prompts, None if context is None else context - args.max_new_tokens)
    if not prompts:
        p.error("no prompt of those groups fits the target's context")
    from headway.heads import load_drafter
    from headway.heads.registry import saved_kind

    methods = {"lookup": SpeculativeGenerator(target, PromptLookup(), tree=args.tree)}
    if args.heads:
        methods["medusa"] = SpeculativeGenerator(target, load_drafter(args.heads), tree=args.tree)
    if args.eagle:
        methods["eagle"] = SpeculativeGenerator(target, load_drafter(args.eagle), tree=args.tree)
        # the hybrid headway generate runs: the default retrieval part (suffix decoding) beside EAGLE
        methods[f"eagle+{DEFAULT_RETRIEVAL}"] = SpeculativeGenerator(
            target, [load_drafter(args.eagle), *retrieval_parts()], tree=args.tree)
    if args.layerskip:
        methods["layerskip"] = SpeculativeGenerator(target, load_drafter(args.layerskip), tree=args.tree)
    for folder in args.drafter:
        kind = saved_kind(folder)
        name = kind.name if kind is not None else Path(folder).name
        name = name if name not in methods else f"{name} ({folder})"
        methods[name] = SpeculativeGenerator(target, load_drafter(folder), tree=args.tree)
    for gen in methods.values():
        gen.prepare()  # tree="auto": the cost curve is measured (once, cached) before any timing
    names = ["plain", *methods]
    results = {}
    for b in batches:
        rows = {name: {"tokens": 0, "seconds": 0.0, "same": True, "passes": 0, "widths": [], "plain": 0}
                for name in names}
        for turn, start in enumerate(range(0, len(prompts) - b + 1, b)):
            ids, mask = left_pad(prompts[start:start + b], pad, device)
            outputs = {}
            for name in names if turn % 2 == 0 else names[::-1]:
                outputs[name], secs, stats = run(name, methods.get(name), target, ids, mask, args.max_new_tokens,
                                                 eos, pad)
                row = rows[name]
                row["tokens"] += sum(map(len, outputs[name]))
                row["seconds"] += secs
                if stats is not None:
                    row["passes"] += stats.target_forward_passes
                    row["widths"] += stats.verify_width_per_step
                    row["plain"] += stats.plain_steps
            for name in methods:  # every row equal to plain batched generate's row, each up to its EOS
                rows[name]["same"] &= outputs[name] == outputs["plain"]
            print(f"batch {b}: rows {start + 1}-{start + b} done", file=sys.stderr, flush=True)
        plain_rate = rows["plain"]["tokens"] / rows["plain"]["seconds"]
        summary = {}
        for name, row in rows.items():
            rate = row["tokens"] / row["seconds"]
            summary[name] = {"tokens_per_s": rate, "ratio": rate / plain_rate, "identical": row["same"],
                             "tau": row["tokens"] / row["passes"] if row["passes"] else None,
                             "mean_width": sum(row["widths"]) / len(row["widths"]) if row["widths"] else None,
                             "plain_share": row["plain"] / row["passes"] if row["passes"] else None}
        results[b] = summary
    print(f"\n{len(prompts)} prompts ({', '.join(groups)}), {args.max_new_tokens} new tokens, {device.type}, "
          f"{str(target.dtype).removeprefix('torch.')}, {args.threads} thread(s), tree={args.tree}")
    print(f"{'batch':>5} {'method':<14} {'tok/s':>7} {'vs plain':>8} {'tau':>5} {'width':>6} {'plain':>6} {'same':>5}")
    for b, summary in results.items():
        for name, s in summary.items():
            tau = f"{s['tau']:.2f}" if s["tau"] else "-"
            width = f"{s['mean_width']:.2f}" if s["mean_width"] else "-"
            share = f"{100 * s['plain_share']:.0f}%" if s["plain_share"] is not None else "-"
            print(f"{b:>5} {name:<14} {s['tokens_per_s']:>7.1f} {s['ratio']:>7.2f}x {tau:>5} {width:>6} {share:>6} "
                  f"{'yes' if s['identical'] else 'NO':>5}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"\ntok/s: all rows' new tokens over the calls' seconds; tau: new tokens per row per verification pass; "
          f"width: tokens verified per row per pass; plain: row-passes that verified the root alone. Wrote {out}/results.json")
    return results


if __name__ == "__main__":
    main()
