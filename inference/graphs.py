"""CUDA graphs for the drafter's step at fixed widths (issue 22).

On a GPU an EAGLE draft level is a few dozen small kernels whose launches, not their arithmetic, set its
cost (0.29-0.70 of a plain step each on the H200 check, BENCHMARKS.md). A CUDA graph records one level's
kernels once per width and replays them with one launch. A replay runs no Python: every tensor it reads
or writes must sit at the address it had at capture, and every Python value is frozen at its capture-time
value. So a graphed step takes all that varies as tensors of fixed shapes: its inputs are copied into
static buffers, the drafter's KV cache is written at slots given as a tensor (``DraftCache.slots``), and
attention reads the cache's whole buffer under a mask that hides what the step must not see.

Backends: ``CudaGraphs`` (``torch.cuda.CUDAGraph``: warm-up on a side stream, capture into one shared
memory pool, replay), and ``TracedGraphs``, the CPU stand-in the tests use: ``make_fx`` traces the step
once with the same freezing (Python values become constants, tensors are the captured ones) and a replay
runs the traced graph into fixed output buffers, so a step that would go wrong under a CUDA graph goes
wrong under it too.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

from headway.heads.values import first_line

Run = Callable[[], Sequence[torch.Tensor]]


class GraphBackend(Protocol):
    def capture(self, run: Run) -> tuple[Callable[[], None], tuple[torch.Tensor, ...]]:
        """Capture ``run`` (a step over fixed buffers) -> (replay, the outputs every replay overwrites)."""


class CudaGraphs:
    """``torch.cuda.CUDAGraph`` capture: two warm-up runs on a side stream (lazy initialisations, cuBLAS
    workspaces), then the capture into a memory pool shared by every graph of this backend (safe: no two replay
    at once and every caller copies a replay's outputs before the next replay). A capture that fails (a host
    sync inside, say) leaves the stream it found current and the next capture a fresh pool; captures are
    thread-local (another thread's work does not break one)."""

    def __init__(self):
        self.pool = None
        self.captures = 0

    def capture(self, run: Run):
        current = torch.cuda.current_stream()
        stream = torch.cuda.Stream()
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        current.wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                outputs = tuple(run())
        except Exception:
            torch.cuda.set_stream(current)  # a failed capture's exit leaves its capture stream current
            try:  # and may leave the pool recording: stop it, and give the next capture a fresh pool
                torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), self.pool)
            except Exception:  # noqa: BLE001 - already stopped, or not in this build
                pass
            self.pool = None
            raise
        self.captures += 1
        return graph.replay, outputs


class TracedGraphs:
    """A CUDA graph's semantics on any device, for tests: the step traced once (``make_fx``: Python values
    frozen, the captured tensors read and written in place at every replay) and replayed into fixed
    output buffers that the next replay overwrites."""

    def __init__(self):
        self.captures = 0

    def capture(self, run: Run):
        from torch.fx.experimental.proxy_tensor import make_fx

        traced = make_fx(lambda: tuple(run()))()
        outputs = tuple(t.clone() for t in traced())
        self.captures += 1

        def replay() -> None:
            for out, new in zip(outputs, traced()):
                out.copy_(new)

        return replay, outputs


class GraphedCall:
    """``fn(*inputs)`` captured for inputs of these shapes: a call copies its inputs into the static ones
    and replays. ``fn`` must be idempotent for equal inputs (the capture may run it)."""

    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
                 backend: GraphBackend):
        self.inputs = tuple(t.clone() for t in inputs)
        self.replay, self.outputs = backend.capture(lambda: fn(*self.inputs))

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for static, value in zip(self.inputs, inputs):
            static.copy_(value)
        self.replay()
        return self.outputs


class CaptureError(ValueError):
    """A step that cannot be captured, asked for explicitly (``cuda_graphs=True``)."""


def graph_width(n: int) -> int:
    """The captured width n rows are padded to: the next power of two (a few captures cover all)."""
    return 1 << max(0, n - 1).bit_length()


def kv_span(needed: int, capacity: int, least: int = 128) -> int:
    """The cache slots a captured step attends over: the power of two that holds ``needed`` (at least ``least``),
    at most the buffer's ``capacity``. A step is captured per span, so attention (and transformers' copy of the keys
    and values per query head) grows with the context, not with the buffer."""
    return min(capacity, max(least, graph_width(needed)))


def same_mode(buffer: torch.Tensor | None) -> bool:
    """Whether a kept buffer can be written now: one made under ``torch.inference_mode`` cannot be outside it."""
    return buffer is None or buffer.is_inference() == torch.is_inference_mode_enabled()


def uncapturable_now(device: torch.device) -> bool:
    """Whether a capture or a replay now would be wrong: under autocast (its casts of the weights are cached while
    it lasts and freed after: a replay would read freed memory)."""
    return torch.is_autocast_enabled(device.type)


def signature(tensors) -> tuple:
    """The addresses, dtypes and shapes of ``tensors``: a captured step reads its weights at the addresses it saw
    (a ``.to()``, a re-bind, a ``load_state_dict(assign=True)`` moves them)."""
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors if t is not None)


def rope_why_not(config, what: str) -> str | None:
    """Why a model with this config's RoPE cannot be captured (a dynamic RoPE recomputes its frequencies on the host
    as positions grow), or None."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if "dynamic" in str(kind):
        return f"{what} cannot be captured in a graph: its RoPE is {kind!r} (frequencies updated on the host)"
    return None


class StepGraphs:
    """A step captured once per (width, span) over cache buffers it writes in place, replayed after: what the
    drafter's levels (``EagleStepGraphs``) and the target's pass (``target_graphs.VerifyGraphs``) share.

    ``strict``: a failed capture raises ``CaptureError`` (graphs asked for); otherwise it is logged once and
    every later step runs eagerly (``failed`` says why). Subclasses name the step (``WHAT``), say what runs
    instead (``INSTEAD``) and build it (``_step``)."""

    WHAT = "the step"
    INSTEAD = "running it eagerly"

    def __init__(self, backend: GraphBackend, strict: bool = False, failed: str | None = None):
        self.backend, self.strict, self.failed = backend, strict, failed
        self._calls: dict[tuple[int, int], GraphedCall] = {}  # (width, span) -> the captured step
        self._buffers: tuple = ()  # the cache buffers the captured steps write into (kept alive with them)
        self._weights: tuple = ()  # the weights' signature when they were captured

    def forget_if_moved(self, weights) -> None:
        """A new request: forget the captured steps if ``weights`` moved since (re-bound, cast, loaded)."""
        now = signature(weights)
        if now != self._weights:
            self._calls.clear()
            self._weights = now

    def adopt(self, buffers: tuple, start: int) -> None:
        """The cache buffers the next steps write. New ones (a first request, a grown buffer): the captures of the
        old ones write elsewhere and are forgotten, and the slots from ``start`` on start as zeros: attention reads
        every slot of its span, masked or not, and never-written memory may hold NaN or inf, which a mask cannot
        hide (NaN + min is NaN)."""
        if len(buffers) != len(self._buffers) or any(a is not b for a, b in zip(buffers, self._buffers)):
            self._calls.clear()
            self._buffers = buffers
            for buf in buffers:
                buf[:, :, start:].zero_()

    def _call(self, cache, inputs, span: int) -> GraphedCall | None:
        """The step for ``inputs`` (its width: ``inputs[0]``'s second dimension) and ``span``: captured before, or
        now; None when it cannot be captured (not strict)."""
        key = (inputs[0].shape[1], span)
        call = self._calls.get(key)
        if call is not None:
            return call
        try:
            call = GraphedCall(self._step(cache, span), inputs, self.backend)
        except Exception as e:  # noqa: BLE001 - any failure to capture falls back (or, asked for, says why)
            why = f"{self.WHAT} cannot be captured in a graph ({type(e).__name__}: {first_line(e)})"
            if self.strict:
                raise CaptureError(f"cuda_graphs=True: {why}; pass cuda_graphs=None to fall back to eager") from e
            self.failed = why
            logging.getLogger(type(self).__module__).warning("%s; %s", why, self.INSTEAD)
            return None
        self._calls[key] = call
        return call

    def _step(self, cache, span: int) -> Callable[..., Sequence[torch.Tensor]]:
        raise NotImplementedError


class EagleStepGraphs(StepGraphs):
    """An EAGLE head's tree level (R nodes through the layer and the vocabulary projection) captured once per
    width R, span and cache buffer, replayed for every later level of that width."""

    WHAT = "the EAGLE drafter's step"
    INSTEAD = "drafting without graphs"

    def __init__(self, head, backend: GraphBackend, strict: bool = False):
        super().__init__(backend, strict, rope_why_not(head.config.llama_config(), self.WHAT))
        self.head = head

    def check(self) -> None:
        """A new request: forget the captured levels if the head's weights moved since (re-bound, cast, loaded)."""
        self.forget_if_moved([*self.head.parameters(), *self.head.buffers(), *self.head._bound])

    def level(self, cache, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              blocked: torch.Tensor, prefix: int):
        """tokens [R], hidden [R, H] (each node's parent's output), positions [R]; blocked [R, F + R] bool
        (True: hidden) over the F tree nodes fed since the ``prefix`` context entries, then these; the
        nodes are written at slots prefix + F .. -> (h' [R, H], logits [R, V']) or None (run it eagerly)."""
        if self.failed is not None or uncapturable_now(hidden.device):
            return None
        r, cols = blocked.shape
        start = len(cache)
        if start != prefix + cols - r:
            raise RuntimeError(f"a graphed level of {r} nodes after {start} cache entries masks {cols} columns "
                               f"after {prefix}")
        cache.reserve(start + r)
        self.adopt(cache.buffers(), start)  # every decoder layer's
        room = min(cache.layer(i).capacity for i in range(len(self.head.decoder_layers)))
        span, dtype, device = kv_span(start + r, room), hidden.dtype, hidden.device
        mask = torch.full((1, 1, r, span), torch.finfo(dtype).min, dtype=dtype, device=device)
        mask[0, 0, :, :prefix] = 0.0
        mask[0, 0, :, prefix:prefix + cols].masked_fill_(~blocked, 0.0)  # [1, 1, R, C]
        slots = torch.arange(start, start + r, device=device)
        inputs = (tokens[None], hidden[None], positions[None], mask, slots)
        call = self._call(cache, inputs, span)
        if call is None:
            return None
        out, logits = call(*inputs)
        cache.advance(r)
        return out.clone(), logits.clone()  # the next replay overwrites the static outputs

    def _step(self, cache, span: int):
        head = self.head

        def step(tokens, hidden, positions, mask, slots):
            cache.write_at(slots, span)
            try:
                out = head(tokens, hidden, positions, attention_mask=mask, cache=cache)[0]  # [R, H]
            finally:
                cache.write_at(None, None)
            return out, F.linear(*head.projection(out))

        return step


def resolve_backend(flag, device: torch.device) -> tuple[GraphBackend | None, bool]:
    """``cuda_graphs`` -> (the backend or None, strict): None (the default) is CUDA graphs on a CUDA device,
    failures falling back; True asks for them (an error where they cannot be captured; a no-op off CUDA);
    False never; a ``GraphBackend`` instance captures with it on any device, strictly (tests)."""
    if flag is None or flag is True:
        return (CudaGraphs() if device.type == "cuda" else None), flag is True
    if flag is False:
        return None, False
    if not callable(getattr(flag, "capture", None)):
        raise ValueError(f"cuda_graphs must be None, True, False or a graph backend, got {flag!r}")
    return flag, True
