"""Argmax and top-k over the vocabulary on a CPU, through the maxima of the vocabulary's chunks.

torch's CPU ``argmax`` and ``topk`` walk a row of logits one element at a time, while ``amax`` and
``max(dim)`` are vectorized. What a call costs where the runtime makes it, right after a vocabulary
projection has streamed its weight through the caches (``scripts/vocab_reduce_bench.py --cold``, torch 2.13,
one thread), is several times its cost in a loop over the same tensor: every op and every fresh output then
misses the caches. Measured that way, ``max(-1)`` beats ``argmax`` everywhere (1 x 16,384: 44 us
against 52; 4 x 16,384: 77 against 128; 1 x 49,152: 91 against 142), and a row of V = n * CHUNK logits
reduced in two steps (each chunk's maximum with ``amax`` over [R, n, CHUNK], then the argmax or top-k among
the best chunks only) pays from about 250,000 logits for an argmax (8 x 49,152: 500 us against ``max``'s
639) and about 100,000 for a top-k (1 x 128,256: 321 us against 537; 4 x 49,152: 449 against 509), under
which its extra ops cost more than they save (1 x 16,384: 121 us against ``max``'s 46).

The results are torch's own: ``argmax`` gives the first maximal index (``max(-1)`` returns the same one; the
chunked form takes the first chunk holding the maximum, then its first maximal element; a NaN counts as the
maximum in each, as in torch), and ``topk`` the same values (the k largest values can all be found in the k
chunks with the largest maxima); only which of exactly tied values' indices come back, and in which order,
may differ, which torch leaves unspecified. Smaller inputs, rows read with a stride, vocabularies that are not
a multiple of CHUNK and a k above the number of chunks take torch's call (``max(-1)`` for an argmax on a CPU);
other devices (one kernel on a GPU) take torch's call as it is.
"""

from __future__ import annotations

import torch

CHUNK = 128  # logits per chunk (a multiple of the SIMD width; divides 16,384, 32,000, 49,152, 128,256, 151,936)
# below this many logits in all, torch's own call is faster where the runtime makes it (after a projection)
ARGMAX_MIN = 250_000  # 4 x 49,152: max(-1) 331-334 us, chunks 343-373; 8 x 49,152: 639 against 500
TOPK_MIN = 98_304  # 6 x 16,384: chunks 171 us, topk 213; 4 x 16,384: topk 135-154, chunks 157-224


def _chunked(x: torch.Tensor, k: int = 1) -> bool:
    if not x.is_cpu or x.numel() < (ARGMAX_MIN if k == 1 else TOPK_MIN) or x.dim() == 0:
        return False
    # a row read with a stride (a transposed product's) defeats amax's vectorization:
    # measured 3x slower chunked than torch's call on it, and a copy to contiguous costs what the chunks save
    v = x.shape[-1]
    return x.stride(-1) == 1 and v % CHUNK == 0 and v // CHUNK >= k


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: x [..., V] -> [...] long, the first maximal index."""
    if not _chunked(x):
        return x.max(-1).indices if x.is_cpu and x.dim() else x.argmax(-1)  # the same index
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
