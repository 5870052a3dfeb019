"""Side-by-side speed of speculative decoding on the default target (SmolLM2-135M-Instruct).

    headway bench | python scripts/benchmark.py | python -m headway.bench.benchmark
        [--heads outputs/demo/quick/heads] [--eagle outputs/demo/quick/eagle3 ...]
        [--methods hf-lookup,lookup,medusa,eagle,draft-model] [--groups chat,multi-turn,code,...]
        [--per-group 3] [--prompts 6] [--copy-prompts 4] [--prompts-file question.jsonl]
        [--max-new-tokens 64] [--threads 1] [--out outputs/benchmark]

Baselines and candidates run in one process, interleaved per prompt (the order reversed on every other
prompt): plain greedy ``generate``,
transformers' own prompt lookup (``prompt_lookup_num_tokens``), and headway with every available
drafter and tree (prompt lookup chain/tree, suffix decoding, trained Medusa heads if ``--heads`` exists, trained
EAGLE-1/EAGLE-3 drafters given with ``--eagle`` over static trees and EAGLE-2 dynamic trees of the
same widths, and an early-exit draft model made of the target's first layers); ``--methods`` picks
families. Prompts come in task groups (``headway.bench.task_prompts``): held-out chat prompts
from the packaged text (never used for training), multi-turn ShareGPT conversations from its
held-out window, HumanEval code, summarization and retrieval-augmented answering over Python's own
documentation (500-1,500 tokens), translation, math word problems, and copy-heavy prompts (edit or
rename in a stdlib function, correct the spelling in an email, repeat a paragraph), where prompt
lookup shines; ``--groups`` picks them, ``--prompts-file`` reads MT-bench or ShareGPT records
instead. A prompt that does not fit the target's context with the new tokens is left out (named).
Relative paths (``--heads``, ``--out``) are read from the current directory.

Prints per group, then overall (the mean of the groups' speedups, each group counting once): tau (new tokens per verification pass), tokens/s and speedup vs plain (whole
calls, prefill included), the decode-only speedup (each prompt's prefill forward, timed on its
own, subtracted from plain; the runtime's own prefill time subtracted from it) next to the bound
tau * t(1) / (t(k) + t_draft) from the same run (t(1): plain decode time per token; t(k),
t_draft: the runtime's verify and draft time per pass), the bookkeeping share of round time, and
whether every output is identical to plain greedy. Writes results.json and acceptance.png.

A float32 CPU target's linear weights are prepacked for multi-row passes (``--no-pack-linears``:
MKL's GEMM as loaded); plain decoding's one-row steps run the same kernel either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from headway.heads import load_drafter
from headway.bench.drafters import DEMO_HEADS, ONE_PASS_KINDS, drafter_folders
from headway.heads.target import DEFAULT_MODEL, load_target
from headway.bench.prompts import chat_prompts
from headway.inference.cost_curve import sync as sync_device
from headway.inference.inputs import context_length
from headway.bench.task_prompts import GROUPS, selected_groups
from headway.inference.cpu_gemm import pack_linears
from headway.inference.draft_model import DraftModelProposer
from headway.inference.generator import SpeculativeGenerator
from headway.inference.hybrid import DEFAULT_RETRIEVAL, RETRIEVAL_PARTS, retrieval_parts
from headway.inference.prompt_lookup import PromptLookup
from headway.inference.retrieval_choice import RetrievalChoice
from headway.inference.suffix_decoding import SuffixDecoding
from headway.inference.lookahead import Lookahead

FAMILIES = ("hf-lookup", "lookup", "lookahead", "medusa", "eagle", "peagle", "dflash", "layerskip", "draft-model")  # plain greedy always runs: the reference


def early_exit_model(target, layers: int):
    """A draft model sharing the target's tokenizer: its first ``layers`` decoder layers, final norm
    and lm_head (weights shared, not copied; untrained as an early exit)."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(config)
    base, dbase = target.get_decoder(), draft.get_decoder()
    dbase.embed_tokens, dbase.norm, dbase.rotary_emb = base.embed_tokens, base.norm, base.rotary_emb
    dbase.layers = torch.nn.ModuleList(base.layers[:layers])
    draft.lm_head = target.lm_head
    return draft.eval()


MEDUSA_TREES = ("chain-1", "chain-2", "chain-3", "tree-7", "tree-15", "auto")  # auto: tree="auto" over the default tree
# EAGLE: chains, static trees, and EAGLE-2 dynamic trees of the same widths as tree-7 / tree-15
EAGLE_TREES = {"chain-3": "chain-3", "chain-4": "chain-4", "chain-5": "chain-5", "tree-7": "tree-7",
               "tree-15": "tree-15", "dynamic-7": {"depth": 5, "top_k": 3, "total_tokens": 7},
               "dynamic-15": {"depth": 6, "top_k": 4, "total_tokens": 15},
               "dynamic": None,  # the drafter's default: EAGLE-2 settings sized for the device
               "auto": "auto",  # the default dynamic tree, cut each round to what pays (headway.inference.auto)
               # the same trees feeding every frontier node, as EAGLE-2's code does (not run by default)
               "dynamic-7-unpruned": {"depth": 5, "top_k": 3, "total_tokens": 7, "prune": False},
               "dynamic-15-unpruned": {"depth": 6, "top_k": 4, "total_tokens": 15, "prune": False}}
DEFAULT_EAGLE_TREES = [name for name in EAGLE_TREES if not name.endswith("-unpruned")]


def retrieval_choice() -> RetrievalChoice:
    """Suffix decoding or prompt lookup, whichever would have been accepted more so far in the request."""
    return retrieval_parts("choice")[0]


def with_lookup(drafter, lookup) -> list:
    """The drafter alone, and with each retrieval drafter ``lookup`` names (True: prompt lookup) merged into its
    tree (a hybrid): "... + lookup", "... + suffix"."""
    kinds = ("lookup",) if lookup is True else () if not lookup else tuple(lookup)  # True: prompt lookup alone
    return [("", drafter)] + [(f" + {kind}", [drafter, *retrieval_parts(kind)]) for kind in kinds]


def eagle_methods(target, folder: str, trees, taken=(), lookup=False, graphs_off=False) -> dict:
    """One method per tree (``graphs_off``: each also without CUDA graphs, "... no graphs", side by side). A drafter whose label is already ``taken`` (another drafter of the same
    version) is labelled with its folder's name too, or with the whole path where that is taken as well
    or the folder's name is the label itself (two runs' ``eagle3`` folders)."""
    head = load_drafter(folder)
    version = f"eagle{head.config.version}"
    base = Path(folder).name
    # a folder named like the label itself ("outputs/x/eagle3") tells nothing: its whole path then
    candidates = (version, *([f"{version} ({base})"] if base != version else []), f"{version} ({folder})")
    label = next((c for c in candidates if not any(name.startswith(c + " ") for name in taken)), candidates[-1])
    out = {f"{label} {name}{suffix}": ("headway", SpeculativeGenerator(target, drafter, tree=EAGLE_TREES[name]))
           for name in trees for suffix, drafter in with_lookup(head, lookup)}
    if graphs_off:
        out.update({f"{label} {name} no graphs": ("headway", SpeculativeGenerator(
            target, head, tree=EAGLE_TREES[name], cuda_graphs=False)) for name in trees})
    return out


def methods(target, heads_dir: str | None, draft_layers: int, eagle_dirs=(), eagle_trees=tuple(DEFAULT_EAGLE_TREES),
            medusa_trees=MEDUSA_TREES, families=FAMILIES, lookup=False, one_pass=None, graphs_off=False) -> dict:
    """name -> ("hf", generate kwargs) or ("headway", SpeculativeGenerator), for the chosen families;
    ``lookup``: each trained drafter also as a hybrid with prompt lookup ("... + lookup"; True) or with each
    retrieval drafter named (("lookup", "suffix"): "... + suffix" merges suffix decoding); ``one_pass``: {kind: folders}
    of ``ONE_PASS_KINDS`` (P-EAGLE, DFlash, LayerSkip), each run as its own chain and with tree="auto" (DFlash also
    with an EAGLE-2 dynamic tree over its block: "... dynamic")."""
    out = {"plain": ("hf", {})}
    if "hf-lookup" in families:
        out["hf prompt lookup (10)"] = ("hf", {"prompt_lookup_num_tokens": 10})
    if "lookup" in families:
        out["prompt lookup chain-10"] = ("headway", SpeculativeGenerator(target, PromptLookup(num_pred_tokens=10),
                                                                         tree=None))
        out["prompt lookup auto"] = ("headway", SpeculativeGenerator(target, PromptLookup(num_pred_tokens=10)))
        out["prompt lookup tree (4 matches)"] = ("headway", SpeculativeGenerator(
            target, PromptLookup(num_pred_tokens=10, max_matches=4, max_nodes=24), tree=None))
        # suffix decoding within each request; the cross-request cache would draft from the other prompts'
        # outputs (and from the same prompt's under --repeats), which this benchmark does not model
        out["suffix decoding"] = ("headway", SpeculativeGenerator(target, SuffixDecoding(cross_request=False),
                                                                  tree=None))
        out["suffix decoding auto"] = ("headway", SpeculativeGenerator(target, SuffixDecoding(cross_request=False),
                                                                       tree="auto"))
        out["retrieval choice auto"] = ("headway", SpeculativeGenerator(target, retrieval_choice(), tree="auto"))
    if "lookahead" in families:  # the target drafts for itself: Jacobi window + n-gram pool (W/N/G)
        for w, n, g in ((5, 4, 3), (3, 3, 2)):  # the default (15 nodes a pass), and a narrower one (7)
            out[f"lookahead {w}/{n}/{g}"] = ("headway", SpeculativeGenerator(
                target, Lookahead(window=w, ngram=n, guesses=g), tree=None))
    if "medusa" in families and heads_dir:
        heads = load_drafter(heads_dir)
        for tree in medusa_trees:
            for suffix, drafter in with_lookup(heads, lookup):
                out[f"medusa {tree}{suffix}"] = ("headway", SpeculativeGenerator(target, drafter, tree=tree))
    for folder in eagle_dirs if "eagle" in families else ():
        out.update(eagle_methods(target, folder, eagle_trees, out, lookup, graphs_off))
    for kind, folders in (one_pass or {}).items():  # their own chain, and cut per round
        for folder in folders if kind in families else ():
            head = load_drafter(folder)
            c = head.config
            what = {"layerskip": "E={}", "peagle": "K={}", "dflash": "B={}"}[kind].format(
                getattr(c, {"layerskip": "exit_layer", "peagle": "parallel_depths", "dflash": "block_size"}[kind]))
            label = f"{kind} {what}" + (f" ({Path(folder).name})" if len(folders) > 1 else "")
            own = f"chain-{c.block_size - 1}" if kind == "dflash" else None  # (DFlash's default is a dynamic tree)
            for suffix, drafter in with_lookup(head, lookup if kind != "layerskip" else False):
                out[f"{label} chain{suffix}"] = ("headway", SpeculativeGenerator(target, drafter, tree=own))
                out[f"{label} auto{suffix}"] = ("headway", SpeculativeGenerator(target, drafter, tree="auto"))
                if kind == "dflash":  # EAGLE-2's dynamic tree over the block's rows (as EAGLE's CPU default: 7 nodes)
                    out[f"{label} dynamic{suffix}"] = ("headway", SpeculativeGenerator(target, drafter, tree={
                        "depth": c.block_size - 1, "top_k": 4, "total_tokens": 7}))
    if draft_layers and "draft-model" in families:
        out[f"draft model: first {draft_layers} layers, chain-3"] = (
            "headway", SpeculativeGenerator(target, DraftModelProposer(early_exit_model(target, draft_layers), gamma=3),
                                            tree=None))
    return out


@torch.no_grad()
def prefill_seconds(target, ids) -> float:
    """One forward over the prompt: what plain generate spends before its first new token."""
    sync_device(ids.device)
    start = time.perf_counter()
    target(ids, use_cache=True, logits_to_keep=1)  # as generate's prefill: last position's logits only
    sync_device(ids.device)
    return time.perf_counter() - start


def run_one(kind, method, target, ids, max_new_tokens: int, eos: int):
    sync_device(ids.device)
    start = time.perf_counter()
    if kind == "hf":
        seq = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                              eos_token_id=eos, pad_token_id=eos, **method)
        return seq[0, ids.shape[1]:].tolist(), time.perf_counter() - start, None  # tolist waits for the device
    # profile: the draft / verify / bookkeeping split it prints is timed exactly (on a GPU, waits around each part)
    out = method.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos, profile=True)
    return out.sequences[0, ids.shape[1]:].tolist(), time.perf_counter() - start, out.stats


def prompt_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """[1, T] ids of a chat prompt (the chat template with a generation prompt)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def fitting_groups(groups: dict, tokenizer, context: int | None, max_new_tokens: int) -> dict:
    """The prompt groups with the prompts that leave room for max_new_tokens in the target's context
    (a note names each one left out); a group left empty is dropped."""
    out = {}
    for group, prompts in groups.items():
        kept = []
        for i, messages in enumerate(prompts):
            n = prompt_ids(tokenizer, messages).shape[1]
            if context is not None and n + max_new_tokens > context:
                print(f"({group} prompt {i + 1}: {n} tokens + {max_new_tokens} new exceed the model's context of "
                      f"{context}: left out)")
            else:
                kept.append(messages)
        if kept:
            out[group] = kept
    return out


def run_prompts(table: dict, target, tokenizer, groups: dict, max_new_tokens: int, eos: int, device, label: str = ""):
    """Every method on every prompt (a list of chat messages), interleaved per prompt, in the table's order
    on one prompt and the reverse order on the next (a method's place in the order moves its timing by
    several percent: measured, two identical generators 8% apart); returns ({group: {method: rows}},
    {group: prefill s})."""
    raw: dict = {g: {name: [] for name in table} for g in groups}
    prefill = {g: 0.0 for g in groups}
    turn = 0
    for group, prompts in groups.items():
        for i, messages in enumerate(prompts):
            ids = prompt_ids(tokenizer, messages).to(device)
            prefill[group] += prefill_seconds(target, ids)
            order = list(table.items()) if turn % 2 == 0 else list(table.items())[::-1]
            turn += 1
            rows = {}
            for name, (kind, method) in order:  # interleaved: every method on this prompt in turn
                tokens, secs, stats = run_one(kind, method, target, ids, max_new_tokens, eos)
                rows[name] = {"new_tokens": len(tokens), "seconds": secs, "tokens": tokens,
                              "stats": stats.as_dict() if stats else None}
            reference = rows["plain"]["tokens"]
            for name in table:
                row = rows[name]
                tokens = row.pop("tokens")
                raw[group][name].append({**row, "identical": tokens == reference})
            print(f"{label}{group} prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    return raw, prefill


def summarize(rows: list[dict], plain: list[dict], prefill: float) -> dict:
    tokens = sum(r["new_tokens"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    plain_secs, plain_tokens = sum(r["seconds"] for r in plain), sum(r["new_tokens"] for r in plain)
    t1 = (plain_secs - prefill) / plain_tokens  # plain decode time per token
    s = {"new_tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
         "speedup": (plain_secs / plain_tokens) / (secs / tokens), "identical": all(r["identical"] for r in rows)}
    stats = [r["stats"] for r in rows if r["stats"]]
    if stats:
        passes = sum(st["target_forward_passes"] for st in stats)
        # the prompt's pass (it verified the first tree too) is timed as the prefill: t(k) is the other passes'
        rounds_timed = max(1, passes - sum(st.get("prefill_passes", 0) for st in stats))
        t_verify = sum(st["time_verify"] for st in stats) / rounds_timed
        t_draft = sum(st["time_draft"] for st in stats) / passes
        rounds = sum(st["time_draft"] + st["time_verify"] + st["time_bookkeeping"] for st in stats)
        tau = sum(st["new_tokens"] for st in stats) / passes
        decode = secs - sum(st["time_prefill"] for st in stats)
        s.update(tau=tau, decode_speedup=t1 / (decode / tokens), bound=tau * t1 / (t_verify + t_draft),
                 t_verify_rel=t_verify / t1, t_draft_rel=t_draft / t1,
                 bookkeeping_share=sum(st["time_bookkeeping"] for st in stats) / rounds,
                 control_share=sum(st.get("time_control", 0.0) for st in stats) / rounds,
                 plain_share=sum(st.get("plain_steps", 0) for st in stats) / passes,
                 mean_width=sum(sum(st["verify_width_per_step"]) for st in stats) / passes,
                 # one draft step = one drafter forward per tree level (a pass drafts depth levels)
                 t_draft_step_rel=t_draft / t1 / max(1.0, sum(sum(st["draft_depth_per_step"]) for st in stats) / passes),
                 depth_acceptance=depth_acceptance(stats))
    return s


def overall(results: dict) -> dict:
    """Per method: the mean of its speedups over the task groups (each group counts once, whatever its
    size), and its speedup and tau in each group."""
    out = {}
    for name in next(iter(results.values()), {}):  # every group runs every method
        per = {g: results[g][name] for g in results}
        out[name] = {"speedup": sum(s["speedup"] for s in per.values()) / len(per),
                     "group_speedup": {g: s["speedup"] for g, s in per.items()},
                     "group_tau": {g: s["tau"] for g, s in per.items() if "tau" in s},
                     "identical": all(s["identical"] for s in per.values())}
    return out


def depth_acceptance(stats: list[dict]) -> list[float]:
    accepted = [a - 1 for st in stats for a in st["accepted_per_step"]]
    depths = [d for st in stats for d in st["draft_depth_per_step"]]
    rates = []
    for d in range(1, max(depths, default=0) + 1):
        reached = [a for a, t in zip(accepted, depths) if t >= d]
        rates.append(sum(a >= d for a in reached) / len(reached))
    return rates


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(results)
    cols = min(4, len(groups))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, group in zip(axes.flat, groups):
        for name, s in results[group].items():
            if s.get("depth_acceptance"):
                ax.plot(range(1, len(s["depth_acceptance"]) + 1), s["depth_acceptance"], marker="o", label=name)
        ax.set(title=f"{group}: acceptance per depth", xlabel="draft depth d",
               ylabel="P(accepted >= d | tree reached d)", ylim=(0, 1))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser(parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The command line (``headway bench`` embeds it, with its one-line-error parser class); defaults are
    relative to the current directory."""
    p = parser_class(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--heads", help=f"trained Medusa heads, a folder or Hub id (default: {DEMO_HEADS} when make demo "
                                   "has written it)")
    p.add_argument("--eagle", action="append", default=[], help="a trained EAGLE drafter, a folder or Hub id (repeatable)")
    p.add_argument("--peagle", action="append", default=[],
                   help="a trained P-EAGLE drafter, a folder or Hub id (repeatable): its chain and tree=auto")
    p.add_argument("--dflash", action="append", default=[],
                   help="a trained DFlash drafter, a folder or Hub id (repeatable): its block's chain and tree=auto")
    p.add_argument("--layerskip", action="append", default=[],
                   help="a trained LayerSkip exit head, a folder or Hub id (repeatable): its chain and tree=auto")
    p.add_argument("--eagle-trees", default=",".join(DEFAULT_EAGLE_TREES),
                   help=f"EAGLE trees, of {list(EAGLE_TREES)} (default: all but the unpruned ones)")
    p.add_argument("--medusa-trees", default=",".join(MEDUSA_TREES), help="Medusa trees")
    p.add_argument("--methods", default=",".join(FAMILIES),
                   help=f"method families to run next to plain greedy, of {list(FAMILIES)}")
    p.add_argument("--groups", default=",".join(GROUPS),
                   help=f"task groups to run, of {list(GROUPS)} (headway.bench.task_prompts); the overall figure is "
                        "the mean of their speedups")
    p.add_argument("--per-group", type=int, default=3, help="prompts per task group other than chat and copy")
    p.add_argument("--prompts", type=int, default=6, help="held-out chat prompts (the chat group)")
    p.add_argument("--copy-prompts", type=int, default=4, help="copy-heavy prompts (edit, rename, spelling, repeat in turn)")
    p.add_argument("--prompts-file", metavar="FILE",
                   help="prompts from a file instead of the task groups, grouped by category: MT-bench's question.jsonl "
                        "(question_id, category, turns) or ShareGPT/OpenAI records; --per-group caps each category")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-layers", type=int, help="early-exit draft model depth: 1..(the target's layers - 1), or "
                                                   "0: skip (default: 6, at most the target's layers - 1)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="the target's dtype (auto: bf16 on GPUs that support it, else fp32); greedy output is "
                        "identical to plain greedy in fp32, while in bf16/fp16 the wider verification pass rounds "
                        "differently and can flip a near-tie")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole prompt set this many times; the table pools them and adds each run's speedup")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest and steadiest on small CPUs)")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                   help="also run each Medusa/EAGLE tree as a hybrid with retrieval merged into it ('+ suffix' rows by "
                        "default: --hybrid-retrieval)")
    p.add_argument("--hybrid-retrieval", default=DEFAULT_RETRIEVAL,
                   help=f"the retrieval drafters each hybrid row merges, one row each, of {list(RETRIEVAL_PARTS)} "
                        "(the default suffix: suffix decoding within the request; lookup: prompt lookup; "
                        "lookup+suffix: both merged; choice: one of the two each round, the one that would have been "
                        "accepted more so far)")
    p.add_argument("--pack-linears", action=argparse.BooleanOptionalAction, default=True,
                   help="float32 CPU target: prepack its linear weights for multi-row passes (verification, prefill; "
                        "one-row plain decoding keeps its kernel), see headway.inference.cpu_gemm; no-op elsewhere")
    p.add_argument("--graphs-off", action="store_true",
                   help="also run each EAGLE tree without CUDA graphs (cuda_graphs=False; on a GPU they are on by "
                        "default), side by side: '... no graphs' rows")
    p.add_argument("--out", default=str(Path("outputs", "benchmark")))
    return p


def check_args(args, p) -> tuple:
    """The checks before the model loads (one-line usage errors: ``p.error``); returns (prompt groups, Medusa heads
    folder, EAGLE folders)."""
    named = (("--methods", args.families, FAMILIES), ("--eagle-trees", args.eagle_trees.split(","), EAGLE_TREES),
             ("--hybrid-retrieval", args.hybrid_retrieval.split(","), RETRIEVAL_PARTS))
    for flag, given, known in named:
        if unknown := sorted(set(given) - {""} - set(known)):
            p.error(f"unknown {flag} {unknown}; choose from {list(known)}")
    for name, least in dict(threads=1, max_new_tokens=1, repeats=1, prompts=0, copy_prompts=0, per_group=0,
                            draft_layers=0).items():  # (--draft-layers unset: None, resolved once the target loads)
        if (getattr(args, name) or 0) < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    # a family --methods names needs its drafter (the default, every family, skips those it lacks)
    has = {"medusa": args.heads or Path(DEMO_HEADS, "config.json").is_file(), "draft-model": args.draft_layers != 0,
           **{kind: getattr(args, kind) for kind in ("eagle", *ONE_PASS_KINDS)}}
    needs = {"medusa": "--heads FOLDER", "draft-model": "--draft-layers N (N >= 1)"}
    for f in [f for f in args.families if not has.get(f, True)] if args.methods != p.get_default("methods") else []:
        p.error(f"--methods {f} needs {needs.get(f, f'--{f} FOLDER')}")
    try:  # before the model loads: too many held-out prompts fails at once
        chat_prompts(args.prompts)
    except ValueError as exc:
        p.error(f"--prompts {args.prompts}: {exc}")
    try:  # an unknown group, a prompts file that does not exist, a drafter folder of another kind
        groups = selected_groups(args.groups, args.prompts_file, args.prompts, args.copy_prompts, args.per_group)
        if not groups:
            p.error(f"no prompts to run: --prompts-file {args.prompts_file} holds none" if args.prompts_file else
                    f"no prompts to run: --groups {args.groups} selects none with --prompts {args.prompts} (chat), "
                    f"--copy-prompts {args.copy_prompts} (copy) and --per-group {args.per_group} (the others); "
                    "raise a count")
        return (groups, *drafter_folders(args))
    except (ValueError, FileNotFoundError) as exc:
        p.error(str(exc))


def main(argv=None, parser_class=argparse.ArgumentParser) -> dict:
    """Run the benchmark with command-line arguments ``argv`` (None: sys.argv); returns the per-group summaries."""
    p = build_parser(parser_class)
    args = p.parse_args(argv)
    args.families = families = [f for f in args.methods.split(",") if f]
    groups, heads_dir, eagle_dirs = check_args(args, p)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.model, dtype=None if args.dtype == "auto" else getattr(torch, args.dtype))
    eos = tokenizer.eos_token_id
    if (args.draft_layers or 0) >= (layers := target.config.num_hidden_layers):  # 0 (skip) or 1..layers - 1
        p.error(f"--draft-layers {args.draft_layers} must be 0 (skip) or 1..{layers - 1}: {args.model} has {layers} "
                "layers")
    args.draft_layers = min(6, layers - 1) if args.draft_layers is None else args.draft_layers  # unset: 6, at most that
    packed = pack_linears(target) if args.pack_linears else 0
    table = methods(target, heads_dir, args.draft_layers, eagle_dirs, [t for t in args.eagle_trees.split(",") if t],
                    [t for t in args.medusa_trees.split(",") if t], families,
                    args.lookup and [k for k in args.hybrid_retrieval.split(",") if k],
                    {kind: getattr(args, kind) for kind in ONE_PASS_KINDS if kind in families}, args.graphs_off)
    device = next(target.parameters()).device
    for kind, method in table.values():  # tree="auto": the cost curve is measured (once, cached) before any timing
        if kind == "headway":
            method.prepare()
    groups = fitting_groups(groups, tokenizer, context_length(target.config), args.max_new_tokens)
    if not groups:  # before anything is written
        p.error(f"no prompts to run: none fits the target's context with --max-new-tokens {args.max_new_tokens}")
    if device.type != "cpu":  # first calls on a GPU pay for kernel selection and allocator growth: not timed
        warm = tokenizer("Hello there, how are you today?", return_tensors="pt")["input_ids"].to(device)
        for kind, method in table.values():
            run_one(kind, method, target, warm, 8, eos)
    runs = []  # one (raw rows, prefill seconds) per repeat of the whole prompt set
    for r in range(args.repeats):
        runs.append(run_prompts(table, target, tokenizer, groups, args.max_new_tokens, eos, device,
                                f"run {r + 1}/{args.repeats}, " if args.repeats > 1 else ""))
    raw = {g: {name: [row for run, _ in runs for row in run[g][name]] for name in table} for g in groups}
    prefill = {g: sum(pre[g] for _, pre in runs) for g in groups}
    results = {g: {name: summarize(rows, raw[g]["plain"], prefill[g]) for name, rows in per.items()}
               for g, per in raw.items()}
    if args.repeats > 1:  # each repeat's own speedup: the spread a single run would hide
        for g, per in results.items():
            for name, s in per.items():
                s["speedup_runs"] = [summarize(run[g][name], run[g]["plain"], pre[g])["speedup"] for run, pre in runs]
    for group, per in results.items():
        print(f"\n{group} ({len(groups[group])} prompts, {args.max_new_tokens} new tokens max, {device.type}, "
              f"{str(target.dtype).removeprefix('torch.')}, {args.threads} thread(s)"
              f"{f', {packed} linears packed' if packed else ''})")
        print(f"{'method':<36} {'tau':>5} {'tok/s':>6} {'speedup':>8} {'decode':>7} {'bound':>6} {'t(k)':>5} "
              f"{'draft':>6} {'/step':>6} {'bookk.':>6} {'plain':>5} {'same':>5}" + (f" {'runs':>11}" if args.repeats > 1 else ""))
        for name, s in per.items():
            tau = f"{s['tau']:.2f}" if "tau" in s else "-"
            extra = (f"{s['decode_speedup']:>6.2f}x {s['bound']:>5.2f}x {s['t_verify_rel']:>5.2f} {s['t_draft_rel']:>6.2f} "
                     f"{s['t_draft_step_rel']:>6.3f} {100 * s['bookkeeping_share']:>5.1f}% "
                     f"{100 * s['plain_share']:>4.0f}%") if "tau" in s else \
                f"{'-':>7} {'-':>6} {'-':>5} {'-':>6} {'-':>6} {'-':>6} {'-':>5}"
            spread = f" {min(s['speedup_runs']):>5.2f}-{max(s['speedup_runs']):.2f}x" if "speedup_runs" in s else ""
            print(f"{name:<36} {tau:>5} {s['tokens_per_s']:>6.1f} {s['speedup']:>7.2f}x {extra} "
                  f"{'yes' if s['identical'] else 'NO':>5}{spread}")
    mean = overall(results)
    if len(results) > 1:
        print(f"\noverall: the mean of the speedups over {len(results)} groups ({', '.join(results)}); tau per group")
        for name, o in mean.items():
            taus = " ".join(f"{g} {t:.2f}" for g, t in o["group_tau"].items())
            print(f"{name:<36} {o['speedup']:>6.2f}x  {'yes' if o['identical'] else 'NO':>3}  {taus}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "packed_linears": packed, "results": results,
                                                  "overall": mean, "raw": raw}, indent=1))
    plot(results, out / "acceptance.png")
    print(f"\nspeedup: whole calls{' (all repeats pooled; runs: each repeat alone, min-max)' if args.repeats > 1 else ''}; decode: prefill excluded on both sides; bound: tau*t(1)/(t(k)+t_draft); t(k), "
          f"draft: per verification pass, relative to plain decode time per token t(1); /step: draft time per drafted level; plain: passes that verified the root alone.\nWrote {out}/results.json "
          f"and {out}/acceptance.png")
    return results


if __name__ == "__main__":
    main()
