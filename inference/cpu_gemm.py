"""Prepacked oneDNN GEMM for a CPU target's multi-row inference passes.

On a CPU a verification pass over k tree tokens multiplies every weight by a k-row input. With
MKL's GEMM (torch's default) a pass of 2-8 rows of the default target cost 1.7-2.1 plain steps
here (PERFORMANCE.md); oneDNN's linear on weights reordered once into its blocked layout cost
1.2-1.95 in the same runs (BENCHMARKS.md, "Prepacked CPU GEMM"). Pure torch ops
(``torch.ops.mkldnn``, what torch's own CPU freezing pass uses); no new math: the same products
summed in another order, so logits move only by rounding (~1e-4), as between any two GEMM kernels.

``pack_linears(model)`` turns every ``nn.Linear`` of a float32 CPU model into a ``PackedLinear``
(the same module, parameters and state dict, plus a packed copy of its weight) whose calls with
more than one input row, made without autograd, use the packed copy. One-row calls (plain
decoding) keep the original kernel, bit for bit, and so does anything that needs gradients or runs
off float32 CPU (a module moved or cast later). A weight changed in place or replaced after packing is
repacked at its next call, and a copy (``copy.deepcopy``) repacks its own. The packed copies
double the memory of the linear weights; ``unpack_linears(model)`` drops them.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn


def packing_available(model: nn.Module) -> str | None:
    """None when ``model`` can be packed, else why not (one line)."""
    p = next(model.parameters(), None)
    if p is None:
        return "the model has no parameters"
    if p.device.type != "cpu":
        return f"the model is on {p.device.type}, packing is for CPU inference"
    if p.dtype != torch.float32:
        return f"the model is {str(p.dtype).removeprefix('torch.')}, packing is for float32"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear"
    return None


class _Packed:
    """A weight's packed copy and what identifies the data it was packed from: a weak reference to the storage (a
    replaced one is told apart even when the next is allocated at its address, and is not kept alive), the view
    and the version (an in-place change: a load, an optimizer step). ``_Packed()`` holds nothing and is never
    current. A copy (deepcopy, pickle: ``torch.save`` of a module keeps a parameter's attributes too) carries no
    packed tensor (oneDNN's opaque layout has no storage to copy): it repacks at its first call."""

    def __init__(self, weight: torch.Tensor | None = None):
        self.tensor = None if weight is None else torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
        self.key = None if weight is None else _data_key(weight)
        self.storage = None if weight is None else weakref.ref(weight.untyped_storage())

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether this is the packed copy of ``weight``'s data as it is now."""
        return (self.storage is not None and self.storage() is weight.untyped_storage()
                and self.key == _data_key(weight))

    def __deepcopy__(self, memo):
        return type(self)()

    def __reduce__(self):
        return type(self), ()


def _data_key(weight: torch.Tensor) -> tuple:
    return weight.storage_offset(), weight._version, tuple(weight.shape), weight.stride()


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # x [rows, in], packed weight -> [rows, out]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose multi-row, autograd-free calls use its prepacked weight (``pack_linears``
    turns a module into one in place; ``unpack_linears`` turns it back)."""

    _packed: _Packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        w = self.weight
        if (rows <= 1 or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
                or w.device.type != "cpu" or w.dtype != torch.float32 or x.dtype != w.dtype):
            return F.linear(x, w, self.bias)
        if not self._packed.holds(w):  # changed in place (a load, an optimizer step), replaced, or a copy
            self._packed = _Packed(w)
        y = _packed_linear(x.reshape(rows, x.shape[-1]), self._packed.tensor, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])  # [..., out]


def pack_linears(model: nn.Module) -> int:
    """Pack every ``nn.Linear`` of ``model`` (idempotent). Returns how many are packed; 0 when the
    model is not a float32 CPU model (see ``packing_available``), which is then left untouched."""
    if packing_available(model) is not None:
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:  # subclasses (LoRA, quantized) keep their own forward
            module._packed = _Packed(module.weight)
            module.__class__ = PackedLinear
        count += type(module) is PackedLinear
    return count


def unpack_linears(model: nn.Module) -> int:
    """Drop the packed copies and make the modules plain ``nn.Linear`` again; returns how many were packed."""
    count = 0
    for module in model.modules():
        if type(module) is PackedLinear:
            del module._packed
            module.__class__ = nn.Linear
            count += 1
    return count


def is_packed(model: nn.Module) -> bool:
    return any(type(m) is PackedLinear for m in model.modules())


PACKED_ROWS = 4  # rows from which a projection takes the packed copy (``few_rows_linear``)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [R, in] @ weight [out, in].T -> [R, out] for a drafter's vocabulary projection.

    From PACKED_ROWS rows on, float32 CPU input takes oneDNN's linear on a packed copy of the weight kept on the
    weight tensor (a drafter's lm_head, or the target's rows a head keeps bound), made at the second such call
    with that tensor (a copy made per call, a cast, is never packed) and remade when the weight changes in place
    or is replaced: against a wide weight MKL's ``F.linear`` costs 1.5-2.9x its one-row time from 4 rows on, the
    packed product 1.2-1.5x up to 7 rows, while at 2-3 rows ``F.linear`` costs 1.0-1.2x and the packed product a
    little more (``scripts/projection_bench.py``; BENCHMARKS.md, "Drafter projections on packed weights"). The
    packed copy doubles that one weight's memory. Fewer rows, and other inputs, take ``F.linear`` (one row: bit
    for bit what the module computes)."""
    packed = _packed_weight(weight) if x.shape[0] >= PACKED_ROWS and _packable(x, weight) else None
    return F.linear(x, weight) if packed is None else _packed_linear(x, packed, None)


def _packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype == weight.dtype == torch.float32  # oneDNN's linear has no autograd kernel:
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            and not weight.is_inference() and torch.backends.mkldnn.is_available())  # (no version counter)


def _packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy kept on ``weight``, None at its first call (marked as seen); remade when its data was
    changed in place (its version: a detached view of a parameter shares it) or replaced (``module.to``,
    ``param.data = ...`` keep the parameter object)."""
    kept = getattr(weight, "_headway_packed", None)
    if kept is None:
        weight._headway_packed = _Packed()
        return None
    if not kept.holds(weight):
        kept = weight._headway_packed = _Packed(weight)
    return kept.tensor
