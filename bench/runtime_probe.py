"""How much of a speculative round is the runtime's own work, and how often it reads the device.

A small random target (Llama, 8 layers, hidden 256: a plain step of a few ms on a CPU) and a random
drafter of every kind (``METHODS``: EAGLE-3, Medusa, P-EAGLE, DFlash, LayerSkip, a draft model, and the
retrieval drafters) generate greedily from random prompts. The time spent inside the target's and the
drafter's module forwards (and the drafter's vocabulary projection) is measured with hooks; everything
else in ``generate`` is the runtime's own work: tree building, masks, verification, cache compaction,
bookkeeping, Python. It is reported per round (target verification pass) and relative to a plain step
(the target's one-token forward, timed the same way inside plain greedy ``generate``). The drafter's own
time (its modules and vocabulary projections) and its top-level forwards per round are reported beside it.

A second, separate pass counts host reads per round (past the prompt's) outside the module forwards: ``.item()``, ``.tolist()``,
``int()``, ``float()``, ``bool()``, ``__index__``, ``.nonzero()``, ``.cpu()`` and ``.numpy()`` on a
tensor, each of which is a device sync on a GPU. (On a CPU every tensor is on the host, so this
counts the call sites a GPU would pay for.) Reads inside the target's own forward (transformers'
mask code) are counted apart, and prompt lookup's n-gram search is host work on the generator's
host copy of the context (``DraftContext.host_context``), not counted. The same pass counts the torch calls per
round outside the module forwards (``counted_calls``: operators and tensor methods, each a launch on a GPU;
attribute reads are not counted, host work is): a figure that does not move with the machine's load.

    python scripts/runtime_probe.py                       # every method, 6 prompts x 64 tokens
    python scripts/runtime_probe.py --methods eagle3-chain,medusa --json out.json

``Meter``, ``metered`` and ``counted_reads`` are the tests' tools too (the one-read-per-round tests).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from headway.heads import EagleHead, MedusaHeads
from headway.inference import PromptLookup, SpeculativeGenerator

DYNAMIC = {"depth": 3, "top_k": 4, "total_tokens": 7}
METHODS = {  # name -> (drafter kind, tree)
    "eagle3-chain": ("eagle3", "chain-3"),
    "eagle3-tree": ("eagle3", "tree-7"),
    "eagle3-dynamic": ("eagle3", DYNAMIC),  # the device's default: tensor ops on CUDA, the host version elsewhere
    "eagle3-dynamic-tensor": ("eagle3", DYNAMIC),  # tensor ops forced (EagleProposer.tensor_rounds)
    "medusa": ("medusa", "tree-15"),
    "lookup": ("lookup", None),
    # the other drafter kinds, each under its default tree
    "peagle": ("peagle", None),  # K = 4 from one drafter pass
    "dflash": ("dflash", "chain-7"),  # a block of 8: a chain of 7
    "dflash-dynamic": ("dflash", None),  # its default: EAGLE-2's dynamic tree over its block (as EAGLE's: the host on a CPU)
    "dflash-dynamic-tensor": ("dflash", None),  # tensor ops forced (DFlashProposer.tensor_rounds), read with verification
    "layerskip": ("layerskip", None),  # the target's first layers (counted as the target's time) + the exit head
    "layerskip-nostop": ("layerskip", None),  # without the CPU's early stop (a read per token): the CUDA default
    "draft-model": ("draft-model", "chain-3"),  # a random 2-layer Llama
    "lookahead": ("lookahead", None),
    "suffix": ("suffix", None),
    "hybrid": ("eagle3+suffix", "tree-7"),  # EAGLE-3's tree with suffix decoding's (the default retrieval part) stacked
}
READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "cpu", "numpy")
HOST_WORK = (("headway.inference.prompt_lookup", "find_matches"),)  # searches a host tensor: no device involved


def build_target(layers: int, hidden: int, vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), vocab_size=vocab,
                      max_position_embeddings=4096, tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def build_drafter(kind: str, target, seed: int):
    """A random drafter of ``kind`` sized from ``target`` (a list for a hybrid)."""
    from headway.heads.dflash import DFlashHead
    from headway.heads.layerskip import LayerSkipHead
    from headway.heads.peagle import PEagleHead
    from headway.inference import Lookahead, SuffixDecoding

    torch.manual_seed(seed)
    if "+" in kind:
        return [build_drafter(part, target, seed) for part in kind.split("+")]
    if kind == "draft-model":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = target.config
        small = LlamaConfig(hidden_size=cfg.hidden_size // 2, intermediate_size=cfg.hidden_size * 3 // 2,
                            num_hidden_layers=2, num_attention_heads=max(1, cfg.hidden_size // 128),
                            num_key_value_heads=max(1, cfg.hidden_size // 256), vocab_size=cfg.vocab_size,
                            max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
                            attn_implementation="sdpa")
        return LlamaForCausalLM(small).eval()
    heads = {"eagle3": lambda: EagleHead.from_target(target, version=3),
             "medusa": lambda: MedusaHeads.from_target(target), "peagle": lambda: PEagleHead.from_target(target),
             "dflash": lambda: DFlashHead.from_target(target), "layerskip": lambda: LayerSkipHead.from_target(target)}
    if kind in heads:
        return heads[kind]().eval()
    return {"lookup": PromptLookup, "lookahead": Lookahead, "suffix": SuffixDecoding}[kind]()


def drafter_modules(drafter) -> list:
    """The drafter's modules (each part's, for a hybrid)."""
    parts = drafter if isinstance(drafter, list) else [drafter]
    return [d for d in parts if isinstance(d, torch.nn.Module)]


class Meter:
    """Seconds inside the outermost timed call (module forwards and wrapped functions), and host reads
    made outside them (``inside`` counts those made within)."""

    def __init__(self):
        self.depth, self.t0, self.seconds, self.calls = 0, 0.0, 0.0, []
        self.reads, self.inside, self.host = 0, 0, 0  # host: inside host work (HOST_WORK), reads not counted
        self.torch_calls = 0  # outside the timed calls (``counted_calls``)
        self.reading = 0  # inside a counted read
        self.passes = 0  # the drafter's top-level module forwards (``drafter_passes``)

    def enter(self, *_):
        if self.depth == 0:
            self.t0 = time.perf_counter()
        self.depth += 1

    def leave(self, *_):
        self.depth -= 1
        if self.depth == 0:
            dt = time.perf_counter() - self.t0
            self.seconds += dt
            self.calls.append(dt)

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()
        return timed


@contextlib.contextmanager
def metered(meter: Meter, modules, functions=()):
    """Hook every module of ``modules`` and wrap each (owner, attribute) of ``functions``."""
    handles = []
    for m in modules:
        for sub in m.modules():
            handles.append(sub.register_forward_pre_hook(meter.enter))
            handles.append(sub.register_forward_hook(meter.leave))
    saved = [(owner, name, getattr(owner, name)) for owner, name in functions]
    for owner, name, fn in saved:
        setattr(owner, name, meter.wrap(fn))
    try:
        yield meter
    finally:
        for h in handles:
            h.remove()
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@contextlib.contextmanager
def counted_reads(meter: Meter):
    """Count tensor reads (``READS``) into ``meter``: ``reads`` outside its timed calls, ``inside`` within."""
    import importlib

    saved = {name: getattr(torch.Tensor, name) for name in READS}
    hosts = [(importlib.import_module(mod), name) for mod, name in HOST_WORK]
    hosted = [(owner, name, getattr(owner, name)) for owner, name in hosts]

    def counting(fn):
        def read(self, *args, **kwargs):
            if meter.reading:  # the same read again (a torch function mode dispatches to the patched method)
                return fn(self, *args, **kwargs)
            if meter.depth:
                meter.inside += 1
            elif not meter.host:
                meter.reads += 1
            meter.reading += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                meter.reading -= 1
        return read

    def host_work(fn):
        @functools.wraps(fn)
        def work(*args, **kwargs):
            meter.host += 1
            try:
                return fn(*args, **kwargs)
            finally:
                meter.host -= 1
        return work

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counting(fn))
    for owner, name, fn in hosted:
        setattr(owner, name, host_work(fn))
    try:
        yield meter
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        for owner, name, fn in hosted:
            setattr(owner, name, fn)


@contextlib.contextmanager
def counted_calls(meter: Meter):
    """Count into ``meter.torch_calls`` the torch functions and tensor methods called outside its timed calls (each
    an operator launch on a GPU; attribute reads such as ``.shape`` are not counted; host work is)."""
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not meter.depth and getattr(func, "__name__", "") != "__get__":
                meter.torch_calls += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        yield meter


def drafter_functions(drafter) -> list:
    """The drafter's compute that is not a module forward: its vocabulary projections (each module that calls
    ``few_rows_linear`` binds its own name)."""
    import headway.inference.dflash as dflash_runtime
    import headway.inference.eagle as eagle_runtime
    import headway.inference.layerskip as layerskip_runtime
    import headway.inference.medusa as medusa_runtime

    runtimes = (eagle_runtime, dflash_runtime, medusa_runtime, layerskip_runtime)
    out = [(m, "few_rows_linear") for m in runtimes]  # (P-EAGLE projects through eagle's)
    out += [(d, "head_logits") for d in drafter_modules(drafter) if isinstance(d, MedusaHeads)]
    return out


@contextlib.contextmanager
def drafter_passes(meter: Meter, drafter):
    """Count into ``meter.passes`` the drafter's top-level module forwards (its layers run inside them)."""
    def count(*_):
        meter.passes += 1

    handles = [m.register_forward_pre_hook(count) for m in drafter_modules(drafter)]
    try:
        yield meter
    finally:
        for h in handles:
            h.remove()


def probe(target, name: str, drafter, tree, prompts, max_new_tokens: int) -> dict:
    gen = SpeculativeGenerator(target, drafter, tree=tree)
    if name.endswith("-tensor"):
        gen.drafter.tensor_rounds = True
    if name.endswith("-nostop"):
        gen.drafter.early_stop = False
    modules = [target] + drafter_modules(drafter)
    gen.generate(prompts[0], max_new_tokens=8)  # warm-up
    wall, inside, drafting, draft_passes, passes, tokens, outputs = 0.0, 0.0, 0.0, 0, 0, 0, []
    for p in prompts:
        meter, draft = Meter(), Meter()  # draft: the drafter's modules and projections alone
        with metered(meter, modules, drafter_functions(drafter)), \
                metered(draft, drafter_modules(drafter), drafter_functions(drafter)), drafter_passes(draft, drafter):
            t0 = time.perf_counter()
            out = gen.generate(p, max_new_tokens=max_new_tokens)
            wall += time.perf_counter() - t0
        inside += meter.seconds
        drafting += draft.seconds
        draft_passes += draft.passes
        passes += out.stats.target_forward_passes
        tokens += out.stats.new_tokens
        outputs.append(out.sequences[0].tolist())
    # reads per round past the first: a whole generate less one of a single round (the prompt's pass), whose
    # setup (input checks, generation-config handling, the prompt's host copy) reads a fixed number of times
    reads = inside_reads = read_passes = calls = 0
    for p in prompts:
        for sign, budget in ((1, max_new_tokens), (-1, 1)):
            meter = Meter()
            with metered(meter, modules, drafter_functions(drafter)), counted_reads(meter), counted_calls(meter):
                out = gen.generate(p, max_new_tokens=budget)
            reads += sign * meter.reads
            inside_reads += sign * meter.inside
            calls += sign * meter.torch_calls
            read_passes += sign * out.stats.target_forward_passes
    return dict(method=name, rounds=passes, new_tokens=tokens, tau=tokens / passes,
                own_ms_per_round=1e3 * (wall - inside) / passes, own_share=(wall - inside) / wall,
                draft_ms_per_round=1e3 * drafting / passes, draft_passes_per_round=draft_passes / passes,
                reads_per_round=reads / read_passes, model_reads_per_round=inside_reads / read_passes,
                torch_calls_per_round=calls / read_passes, outputs=outputs)


def plain_step(target, prompts, max_new_tokens: int) -> tuple[float, list]:
    """Median one-token target forward inside plain greedy generate, and its outputs."""
    steps, outputs = [], []
    for p in prompts:
        meter = Meter()
        with metered(meter, [target]):
            out = target.generate(p[None], attention_mask=torch.ones_like(p[None]), do_sample=False,
                                  max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
        steps += meter.calls[1:]  # the first call is the prefill
        outputs.append(out[0].tolist())
    return statistics.median(steps), outputs


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {list(METHODS)}")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    torch.set_num_threads(args.threads)
    target = build_target(args.layers, args.hidden, args.vocab, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(4, args.vocab, (args.prompt_len,), generator=g) for _ in range(args.prompts)]
    with torch.no_grad():
        step, reference = plain_step(target, prompts, args.max_new_tokens)
    print(f"target: Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; plain step "
          f"(one-token forward) {1e3 * step:.2f} ms; {args.prompts} prompts of {args.prompt_len} tokens, "
          f"{args.max_new_tokens} new, greedy, {args.threads} thread(s)")
    print(f"{'method':<21} {'tau':>5} {'own ms/round':>12} {'/plain step':>11} {'own share':>9} "
          f"{'reads/round':>11} {'model reads':>11} {'calls/round':>11} {'draft ms/round':>14} {'draft passes':>12} "
          f"{'same':>5}")
    rows = []
    for name in methods:
        kind, tree = METHODS[name]
        drafter = build_drafter(kind, target, args.seed)
        r = probe(target, name, drafter, tree, prompts, args.max_new_tokens)
        r["identical"] = r.pop("outputs") == reference
        r["own_per_plain_step"] = r["own_ms_per_round"] / (1e3 * step)
        rows.append(r)
        print(f"{name:<21} {r['tau']:>5.2f} {r['own_ms_per_round']:>12.2f} {r['own_per_plain_step']:>11.2f} "
              f"{100 * r['own_share']:>8.0f}% {r['reads_per_round']:>11.2f} {r['model_reads_per_round']:>11.2f} "
              f"{r['torch_calls_per_round']:>11.1f} {r['draft_ms_per_round']:>14.2f} "
              f"{r['draft_passes_per_round']:>12.2f} {'yes' if r['identical'] else 'NO':>5}")
    results = dict(plain_step_ms=1e3 * step, settings=vars(args), methods=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
