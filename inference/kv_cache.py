"""The target's KV cache across speculative rounds: creation, checks and compaction.

After verification the cache holds the prefix plus every tree node (and padding). Only the
accepted root-to-node path may stay: its entries are gathered into place behind the prefix and
the rest is cropped, so rejected keys/values never reach a later step (the "roll back the KV
cache" step of speculative decoding; Medusa and EAGLE do the same gather-then-truncate).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def check_compactable(cache) -> None:
    """Only plain ``DynamicLayer``s can be compacted: a sliding-window layer keeps a truncated
    buffer whose slots no longer line up with positions, so it is refused."""
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False) or type(layer) is not DynamicLayer:
            raise ValueError(f"cache layer {i} is a {type(layer).__name__}: headway compacts only full-attention "
                             "DynamicLayer caches; sliding-window / hybrid / quantized caches are not supported "
                             "(for Mistral/Qwen2-style models disable the sliding window in the config)")


def new_cache(model) -> DynamicCache:
    """An empty ``DynamicCache`` for ``model``, checked to be compactable."""
    cache = DynamicCache(config=model.config)
    check_compactable(cache)
    return cache


def compact_cache(cache, start: int, keep: Sequence[int], written: int) -> None:
    """Keep, right after the first ``start`` entries, only the entries at offsets ``keep``.

    The cache holds start + written entries; keep: ascending offsets in [0, written) with
    keep[i] >= i (a root-to-node path of a tree flattened parents-first). Afterwards the cache
    holds start + len(keep) entries, in the order of ``keep``.
    """
    kept = len(keep)
    if keep[-1] != kept - 1:  # not already a contiguous prefix (a chain): gather the path down
        src = torch.tensor(keep, dtype=torch.long, device=cache.layers[0].keys.device) + start  # [kept]
        for layer in cache.layers:
            # keys/values: [B, Hkv, T, D]; index_select copies first, so overlapping ranges are safe
            layer.keys[:, :, start:start + kept] = layer.keys.index_select(2, src)
            layer.values[:, :, start:start + kept] = layer.values.index_select(2, src)
    if written > kept:
        cache.crop(-(written - kept))


def crop_to(cache, length: int) -> None:
    """Drop every entry after the first ``length`` (a draft model's roll-back)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def compact_rows(cache, start: int, keep: Sequence[Sequence[int]], written: int) -> int:
    """``compact_cache`` for a batch whose rows keep paths of different lengths.

    The cache holds start + written slots per row; row r keeps the slots at offsets ``keep[r]``
    (a root-to-node path, or nothing for a row that is leaving). Each row's kept slots are gathered
    to the front of the written region, which is then cropped to the longest kept path K: a row that
    kept fewer leaves slots it must mask out (the caller's validity mask). Returns K.
    """
    longest = max((len(k) for k in keep), default=0)
    if longest and any(list(k) != list(range(len(k))) for k in keep):
        device = cache.layers[0].keys.device
        # [B, K] source slot of each row's j-th kept entry; rows with fewer entries repeat slot ``start``
        src = torch.tensor([list(k) + [0] * (longest - len(k)) for k in keep], dtype=torch.long, device=device) + start
        for layer in cache.layers:
            b, h, _, d = layer.keys.shape  # keys/values: [B, Hkv, T, D]
            index = src[:, None, :, None].expand(b, h, longest, d)
            # gather copies first, so overlapping ranges are safe
            layer.keys[:, :, start:start + longest] = layer.keys.gather(2, index)
            layer.values[:, :, start:start + longest] = layer.values.gather(2, index)
    if written > longest:
        cache.crop(-(written - longest))
    return longest


def repack_rows(cache, valid: torch.Tensor) -> torch.Tensor:
    """Drop the slots no row needs: each row's valid slots (in order) move to the end of a cache as long
    as the row with the most, the others left-padded (attention does not depend on the slots' order:
    positions were applied when the keys were written). valid: [B, S] bool -> the new [B, S'] mask."""
    counts = valid.sum(1)  # [B]
    length = int(counts.max()) if valid.numel() else 0
    if length == valid.shape[1]:
        return valid
    # a stable sort puts each row's invalid slots first and keeps its valid ones in order
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, valid.shape[1] - length:]  # [B, S']
    for layer in cache.layers:
        b, h, _, d = layer.keys.shape
        index = order[:, None, :, None].expand(b, h, length, d)
        layer.keys = layer.keys.gather(2, index)
        layer.values = layer.values.gather(2, index)
    return valid.gather(1, order)
