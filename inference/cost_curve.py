"""The verification cost curve t(k)/t(1) of a target: what one pass over k tokens costs relative to a
one-token decoding step, for chains (causal attention) and trees (a 4D mask), per prefix-length band.

Speculation pays when the expected new tokens of a round beat (t(k) + t_draft) / t(1); ``tree="auto"``
reads this curve every round. It is measured once per target, device, dtype, thread count and
packing (``fingerprint``), cached as JSON under the headway cache, and measured again on request, when
a cached file's fingerprint differs (never used then), or when it was measured on a busier machine than
today's: load slows a one-token step more than a wide pass, so such a curve makes wide passes look cheap
(measured: t(2)/t(1) 1.03 under load against 1.26 on the quiet machine). Each load times a few one-token
steps to tell (``STALE_RATIO``); a curve measured on a quieter machine than today's is kept.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import math
import time
import warnings
from pathlib import Path

import torch

from headway.inference.cpu_gemm import is_packed
from headway.inference.kv_cache import crop_to, new_cache
from headway.inference.tree import Tree, chain
from headway.inference.target_forward import prefill, tree_forward

logger = logging.getLogger(__name__)

KS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # verification widths timed (wider ones: extrapolated)
PREFIXES = (128, 512, 1536)  # one band each: a prompt of up to ~300, ~1,000, or more tokens
FORMAT = 2  # 2: medians of interleaved passes, t(1) a one-token step (1: t(1) was a two-token chain)
REPS = 7  # timed passes per width and shape; the median is kept
RECHECK_REPS = 5  # one-token steps a load times to compare with the cached curve's t(1)
STALE_RATIO = 1.25  # a cached t(1) this many times today's: measured on a busier machine, so measured again
_CHECKED: set[str] = set()  # cache files checked (or measured) by this process: checked once a process


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock times cover it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def seconds_per_pass(targets, tree: Tree, prefix_ids: torch.Tensor, reps: int, rounds: int = 1) -> list[float]:
    """Mean wall time of one tree_forward over ``tree`` after ``prefix_ids`` [1, T] (cache cropped back
    each time), for each of ``targets``; with several, ``rounds`` alternating blocks of reps/rounds
    passes each, so drift in the machine's speed falls on all of them alike."""
    device = prefix_ids.device
    t = prefix_ids.shape[1]
    tokens = prefix_ids[0, : len(tree.parents)]
    caches = []
    for target in targets:
        cache = new_cache(target)
        prefill(target, cache, prefix_ids)
        for _ in range(max(2, reps // 10)):  # warm-up: kernel selection, allocator growth
            tree_forward(target, cache, tree, tokens, t)
            crop_to(cache, t)
        caches.append(cache)
    total = [0.0] * len(targets)
    block = max(1, reps // rounds)
    for _ in range(rounds):
        for i, (target, cache) in enumerate(zip(targets, caches)):
            sync(device)
            start = time.perf_counter()
            for _ in range(block):
                tree_forward(target, cache, tree, tokens, t)
                crop_to(cache, t)
            sync(device)
            total[i] += time.perf_counter() - start
    return [x / (block * rounds) for x in total]


def binary_tree(k: int) -> Tree:
    """A k-node tree of the shape drafters verify (node i below node (i - 1) // 2): the 4D-mask path."""
    return Tree([-1] + [(i - 1) // 2 for i in range(1, k)], name=f"binary-{k}")


def fingerprint(target) -> dict:
    """What the curve depends on: the model, its dtype and device, torch, threads, packed linears."""
    cfg = target.config.get_text_config()
    device = next(target.parameters()).device
    return {"format": FORMAT, "model": str(getattr(target.config, "_name_or_path", "")),
            "architecture": type(target).__name__, "hidden_size": cfg.hidden_size,
            "layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size, "dtype": str(target.dtype),
            "device": device.type if device.type != "cuda" else f"cuda:{torch.cuda.get_device_name(device)}",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "packed": bool(is_packed(target))}


@dataclasses.dataclass
class CostCurve:
    """t(k)/t(1) per prefix band: ``chain[b][i]`` and ``tree[b][i]`` at width ``ks[i]`` after ``prefixes[b]``
    tokens; ``t1[b]`` the seconds of one one-token step there."""

    ks: list[int]
    prefixes: list[int]
    t1: list[float]
    chain: list[list[float]]
    tree: list[list[float]]
    fingerprint: dict

    def rel(self, k: int, prefix_len: int, is_chain: bool = False) -> float:
        """t(k)/t(1) after ``prefix_len`` tokens (the nearest band; linear between measured widths,
        extrapolated past the last one)."""
        band = min(range(len(self.prefixes)), key=lambda b: abs(self.prefixes[b] - prefix_len))
        ys = (self.chain if is_chain or k <= 1 else self.tree)[band]
        if k <= self.ks[0]:
            return ys[0]
        i = min(bisect.bisect_left(self.ks, k), len(self.ks) - 1)
        k0, k1, y0, y1 = self.ks[i - 1], self.ks[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (k - k0) / (k1 - k0)

    def seconds(self, prefix_len: int) -> float:
        band = min(range(len(self.prefixes)), key=lambda b: abs(self.prefixes[b] - prefix_len))
        return self.t1[band]


class OnlineCost:
    """The curve corrected by the verification passes actually timed during generation.

    A pass of width w after p tokens is predicted to take ``curve.seconds(p) * curve.rel(w, p)``; the
    ratio of its measured time to that prediction is averaged (in logs, the recent past weighing
    most) per band of widths (1; 2-4; 5-8; 9-16; 17-32; more), starting from the curve itself. So a
    curve measured on a busier or quieter machine, or a width whose kernels behave differently inside
    generation, is corrected within a few rounds, and ``rel`` stays t(k)/t(1) as generation sees it.
    """

    EDGES = (1, 4, 8, 16, 32)  # upper widths of the bands
    PRIOR = 2.0  # weight of the measured curve, in passes
    DECAY = 0.95

    def __init__(self, curve: CostCurve):
        self.curve = curve
        self.log_ratio = [0.0] * (len(self.EDGES) + 1)  # decayed sums of log(measured / predicted)
        self.weight = [0.0] * (len(self.EDGES) + 1)

    def _band(self, width: int) -> int:
        return bisect.bisect_left(self.EDGES, width)

    def factor(self, width: int) -> float:
        b = self._band(width)
        return math.exp(self.log_ratio[b] / (self.weight[b] + self.PRIOR))

    def measured(self, width: int, prefix_len: int, is_chain: bool = False) -> float:
        """Seconds of one pass over ``width`` tokens after ``prefix_len``, as the curve was measured."""
        return self.curve.seconds(prefix_len) * self.curve.rel(width, prefix_len, is_chain)

    def seconds(self, width: int, prefix_len: int, is_chain: bool = False) -> float:
        """Predicted seconds of one pass over ``width`` tokens after ``prefix_len``, corrected."""
        return self.measured(width, prefix_len, is_chain) * self.factor(width)

    def rel(self, width: int, prefix_len: int, is_chain: bool = False) -> float:
        return self.seconds(width, prefix_len, is_chain) / self.seconds(1, prefix_len)

    def plain_passes(self) -> float:
        """How many one-token passes (decayed) the correction of t(1) rests on."""
        return self.weight[0]

    def observe(self, width: int, prefix_len: int, is_chain: bool, seconds: float) -> None:
        predicted = self.measured(width, prefix_len, is_chain)
        if not (seconds > 0 and predicted > 0):
            return
        b = self._band(width)
        self.log_ratio[b] = self.DECAY * self.log_ratio[b] + math.log(seconds / predicted)
        self.weight[b] = self.DECAY * self.weight[b] + 1.0


@torch.no_grad()
def measure(target, ks=KS, prefixes=PREFIXES, reps: int = REPS) -> CostCurve:
    """Time the target's passes over chains and trees of each width after each prefix length (the
    prefixes the target's context allows).

    Every width and shape is timed once per repetition, in turn, after a warm-up pass of each, and
    the median is kept: a one-off stall, or the machine warming up, then moves no ratio (timing
    each width in a block of its own, the first one timed read 25-40% slow here)."""
    device = next(target.parameters()).device
    context = getattr(target.config.get_text_config(), "max_position_embeddings", None) or 1 << 20
    vocab = target.config.get_text_config().vocab_size
    ks = [k for k in ks if k < context // 2] or [1]
    prefixes = sorted({min(p, context - max(ks) - 1) for p in prefixes if min(p, context - max(ks) - 1) > 0}) or [1]
    g = torch.Generator().manual_seed(0)
    shapes = [(k, chain(k - 1)) for k in ks] + [(k, binary_tree(k)) for k in ks if k > 1]
    t1s, chains, trees = [], [], []
    for p in prefixes:
        ids = torch.randint(0, vocab, (1, p + max(ks)), generator=g).to(device)
        cache = new_cache(target)
        prefill(target, cache, ids[:, :p])
        times: dict[str, list[float]] = {tree.name: [] for _, tree in shapes}
        for rep in range(reps + 1):  # the first round warms up every shape
            for k, tree in shapes:
                sync(device)
                start = time.perf_counter()
                tree_forward(target, cache, tree, ids[0, p:p + k], p)
                sync(device)
                if rep:
                    times[tree.name].append(time.perf_counter() - start)
                crop_to(cache, p)
        median = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
        t1 = median[chain(0).name]  # a one-token step (chain(d) holds d + 1 tokens)
        chains.append([median[chain(k - 1).name] / t1 for k in ks])
        trees.append([1.0 if k == 1 else median[binary_tree(k).name] / t1 for k in ks])
        t1s.append(t1)
    return CostCurve(list(ks), list(prefixes), t1s, chains, trees, fingerprint(target))


def cache_path(target, folder: Path | None = None) -> Path:
    from headway.heads.target import headway_cache_dir

    key = hashlib.sha256(json.dumps(fingerprint(target), sort_keys=True).encode()).hexdigest()[:20]
    return (folder or headway_cache_dir() / "cost_curves") / f"{key}.json"


def load_cost_curve(target, refresh: bool = False, path: Path | None = None, recheck: bool = True) -> CostCurve:
    """The target's cost curve from the headway cache (or ``path``), measured and saved when absent,
    when ``refresh``, when the saved one was measured for another target, device, dtype, thread
    count or packing (a warning says so; such a curve is never used), or, with ``recheck``, when its
    one-token step took ``STALE_RATIO`` times today's or more (``quiet_machine_check``, once a process per file)."""
    from headway.heads.files import atomic_write_text

    path = Path(path) if path is not None else cache_path(target)
    want = fingerprint(target)
    if path.is_file() and not refresh:
        try:
            data = json.loads(path.read_text())
            if data.get("fingerprint") == want:
                curve = CostCurve(**data)
                stale = quiet_machine_check(target, curve) if recheck and str(path) not in _CHECKED else None
                if stale is None:
                    if recheck:
                        _CHECKED.add(str(path))
                    return curve
                warnings.warn(f"the cost curve in {path} was measured on a busier machine ({stale}); measuring it "
                              "again", stacklevel=2)
            else:
                warnings.warn(f"the cost curve in {path} was measured for another setup "
                              f"({_differs(data.get('fingerprint') or {}, want)}); measuring this one", stacklevel=2)
        except (json.JSONDecodeError, TypeError):
            warnings.warn(f"the cost curve in {path} is unreadable; measuring it again", stacklevel=2)
    logger.info("measuring the verification cost curve of %s (once; cached in %s)", want["model"], path)
    curve = measure(target)
    atomic_write_text(path, json.dumps(dataclasses.asdict(curve), indent=1))
    _CHECKED.add(str(path))
    return curve


@torch.no_grad()
def quiet_machine_check(target, curve: CostCurve, reps: int = RECHECK_REPS) -> str | None:
    """Time ``reps`` one-token steps after the curve's first prefix band; None when the curve's own t(1) there is
    below ``STALE_RATIO`` times today's (the curve stands: a busier machine today is the online correction's
    business), else what was found, in words."""
    device = next(target.parameters()).device
    p = curve.prefixes[0]
    ids = torch.randint(0, target.config.get_text_config().vocab_size, (1, p),
                        generator=torch.Generator().manual_seed(0)).to(device)
    now = seconds_per_pass([target], chain(0), ids, reps)[0]
    if not now > 0 or curve.t1[0] < STALE_RATIO * now:
        return None
    return (f"a one-token step after {p} tokens took {curve.t1[0] * 1e3:.1f} ms then, {now * 1e3:.1f} ms now: "
            "load inflates t(1) more than wide passes, so that curve makes wide passes look cheap")


def _differs(old: dict, new: dict) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return ", ".join(f"{k} {old.get(k)!r} vs {new.get(k)!r}" for k in keys[:3])
