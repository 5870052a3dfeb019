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
