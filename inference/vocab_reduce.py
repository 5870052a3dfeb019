"""Argmax and top-k over the vocabulary on a CPU, through the maxima of the vocabulary's chunks.

torch's CPU ``argmax``, ``max(dim)`` and ``topk`` walk a row of logits one element at a time (measured
with torch 2.13, one thread: about 1 us per 1,000 logits, 124 us for 3 rows of SmolLM2's 49,152),
while ``amax`` is vectorized (about 0.15 us per 1,000). So a row of V = n * CHUNK logits is reduced
in two steps: each chunk's maximum (``amax`` over [R, n, CHUNK]), then the argmax or top-k among
the logits of the best chunks only (32 us for the same 3 rows; ``scripts/vocab_reduce_bench.py``).

The results are torch's own: ``argmax`` gives the first maximal index (the first chunk holding the
maximum, then its first maximal element; a NaN counts as the maximum in both, as in torch), and
``topk`` the same values (the k largest values can all be found in the k chunks with the largest
maxima); only which of exactly tied values' indices come back, and in which order, may differ,
which torch leaves unspecified. Small inputs (under ``MIN_ELEMENTS``, where the extra calls cost more
than they save), rows read with a stride, vocabularies that are not a multiple of CHUNK, a k above the
number of chunks, and other devices (one kernel on a GPU) take torch's call.
"""

from __future__ import annotations

import torch

CHUNK = 128  # logits per chunk (a multiple of the SIMD width; divides 16,384, 32,000, 49,152, 128,256, 151,936)
MIN_ELEMENTS = 32_768  # below this many logits in all, torch's own call is faster (measured: 1 x 16,384 is)


def _chunked(x: torch.Tensor, k: int = 1) -> bool:
    if x.dim() == 0 or x.device.type != "cpu" or x.numel() < MIN_ELEMENTS:
        return False
    # a row read with a stride (a transposed product's) defeats amax's vectorization:
    # measured 3x slower chunked than torch's call on it, and a copy to contiguous costs what the chunks save
    v = x.shape[-1]
    return x.stride(-1) == 1 and v % CHUNK == 0 and v // CHUNK >= k


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: x [..., V] -> [...] long, the first maximal index."""
    if not _chunked(x):
        return x.argmax(-1)
    blocks = x.unflatten(-1, (x.shape[-1] // CHUNK, CHUNK))  # [..., n, C]
    best = blocks.amax(-1).argmax(-1, keepdim=True)  # [..., 1]: the first chunk holding the maximum
    inner = blocks.gather(-2, best.unsqueeze(-1).expand(*best.shape, CHUNK)).argmax(-1)  # [..., 1]
    return (best * CHUNK + inner).squeeze(-1)


def topk(x: torch.Tensor, k: int):
    """``x.topk(k, dim=-1)``: x [..., V] -> its (values [..., k], indices [..., k] long), largest first."""
    if not _chunked(x, k):
        return x.topk(k, dim=-1)
    blocks = x.unflatten(-1, (x.shape[-1] // CHUNK, CHUNK))  # [..., n, C]
    chunks = blocks.amax(-1).topk(k, dim=-1).indices  # [..., k]: the chunks holding the k largest
    found = blocks.gather(-2, chunks.unsqueeze(-1).expand(*chunks.shape, CHUNK)).flatten(-2)  # [..., k * C]
    values, at = found.topk(k, dim=-1)  # [..., k]
    return torch.return_types.topk((values, chunks.gather(-1, at // CHUNK) * CHUNK + at % CHUNK))
