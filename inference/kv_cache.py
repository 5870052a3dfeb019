"""The target's KV cache across speculative rounds: creation, checks and compaction.

After verification the cache holds the prefix plus every tree node (and padding). Only the
accepted root-to-node path may stay: its entries are gathered into place behind the prefix and
the rest is cropped, so rejected keys/values never reach a later step (the "roll back the KV
cache" step of speculative decoding; Medusa and EAGLE do the same gather-then-truncate). The layers
are ``BufferLayer``s: allocated once and written in place, so neither a forward nor a crop copies the
cache. The layers' buffers are slices of one ``KVArena`` tensor (where they fit it: see there), so a
compaction, a batch's row selection or repack is one gather and one write for the whole cache, not two per
buffer per layer. A batch's rows keep paths of different lengths (``compact_rows``) and masked-out holes that
``repack_rows`` squeezes out.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from headway.heads.eagle_layer import write_slots


CACHE_SLACK = 64  # slots allocated beyond prompt + max_new_tokens: one verification pass's tree (wider ones grow it)


class KVArena:
    """Every layer's keys and values of one cache in one tensor ``data`` [2L, B, Hkv, C, D] (layer i's keys at 2i,
    its values at 2i + 1), so moving slots (a compaction) is one gather and one write for all layers: 2 tensor calls
    a round instead of 4L (120 on the 30-layer default target; each a kernel launch on a GPU). Made at the first
    write of any member, for that write's batch, heads, width, dtype and device, and sized for every member;
    grown (doubled, every layer's slots copied once, the old and the new tensor alive together for that copy) when
    a layer would overflow it. A layer whose keys and values differ in shape or dtype (multi-head latent attention:
    DeepSeek-V2/V3 cache values narrower than keys), do not fit the arena, need gradients, or are given tensors of
    another batch (transformers' ``batch_select_indices``; headway's ``select_rows`` keeps the arena) keeps
    buffers of its own, and compaction then goes layer by layer; once no member is left the arena's tensor is
    freed."""

    def __init__(self, capacity: int):
        self.layers: list["BufferLayer"] = []  # the members, in the cache's order (all join before any write)
        self.capacity = capacity
        self.data: torch.Tensor | None = None  # [2L, B, Hkv, C, D]

    def join(self, layer: "BufferLayer") -> None:
        layer.arena, layer.arena_index = self, len(self.layers)
        self.layers.append(layer)

    def place(self, layer: "BufferLayer", keys: torch.Tensor, values: torch.Tensor, need: int) -> bool:
        """Point ``layer``'s buffers at its slots of the arena (made for ``keys`` [B, Hkv, n, D] at the first call,
        grown to ``need`` slots when shorter); False: they do not fit it, the layer keeps buffers of its own."""
        if keys.shape != values.shape or keys.dtype != values.dtype or keys.requires_grad or values.requires_grad:
            return False
        data = self.data
        if data is None:
            b, h, _, d = keys.shape
            self.data = keys.new_empty(2 * len(self.layers), b, h, max(self.capacity, need), d)
        elif data.shape[1:3] != keys.shape[:2] or data.shape[4] != keys.shape[3] or data.dtype != keys.dtype \
                or data.device != keys.device:
            return False
        elif data.shape[3] < need:
            self._grow(need)
        self._point(layer)
        return True

    def leave(self, layer: "BufferLayer") -> None:
        """``layer`` holds buffers of its own from now on; the last member to leave frees the arena."""
        layer.in_arena = False
        if self.data is not None and not any(member.in_arena for member in self.layers):
            self.data = None

    def _point(self, layer: "BufferLayer") -> None:
        i = layer.arena_index
        layer._buf["keys"], layer._buf["values"] = self.data[2 * i], self.data[2 * i + 1]
        layer.in_arena = True

    def select(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` [B'] long, in that order, every member in one gather: a new tensor of B' rows
        (the same capacity; the slots any layer holds copied), the old one freed."""
        data = self.data
        used = max(max(layer._length.values()) for layer in self.layers)
        self.data = data.new_empty(data.shape[0], index.shape[0], *data.shape[2:])  # [2L, B', Hkv, C, D]
        self.data[:, :, :, :used] = data[:, :, :, :used].index_select(1, index.to(data.device))
        for layer in self.layers:
            self._point(layer)

    def _grow(self, need: int) -> None:
        old = self.data
        self.data = old.new_empty(*old.shape[:3], max(need, 2 * old.shape[3]), old.shape[4])
        self.data[:, :, :, :old.shape[3]] = old
        for layer in self.layers:
            if layer.in_arena:
                self._point(layer)

    def __getstate__(self):
        raise TypeError("a KV arena is not pickled: its layers are (each with buffers of its own)")


def arena_of(cache) -> torch.Tensor | None:
    """The ``KVArena`` data [2L, B, Hkv, C, D] holding every layer of ``cache``, or None (some layer holds its own)."""
    layers = cache.layers
    arena = getattr(layers[0], "arena", None) if layers else None
    if arena is None or arena.data is None or len(arena.layers) != len(layers):
        return None
    return arena.data if all(layer.in_arena and layer.arena is arena for layer in layers) else None


class BufferLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values live in buffers allocated once, not grown by
    ``torch.cat`` on every forward (which copies the whole cache: at 1,000 tokens of the default target
    about 11 ms of a ~70 ms round, 20 ms at 1,500). ``keys``/``values`` are views of the buffers' first
    ``length`` slots, so transformers' code, ``crop`` and headway's in-place compaction work unchanged;
    a forward writes only its new slots. The buffers double when a forward would overflow them, and a
    tensor assigned that is not such a view (``batch_select_indices``, a repack) is copied in.
    """

    def __init__(self, capacity: int = 0):
        self.slots: torch.Tensor | None = None  # [n] long: ``update`` writes there, returns the first ``span`` slots
        self.span: int | None = None
        self._buf: dict[str, torch.Tensor | None] = {"keys": None, "values": None}  # [B, Hkv, capacity, D]
        self._raw: dict[str, torch.Tensor | None] = {"keys": None, "values": None}  # before any 4D tensor: as assigned
        self._length = {"keys": 0, "values": 0}  # apart: transformers assigns keys, then values (crop)
        self.capacity = capacity
        self.arena: KVArena | None = None  # the cache's shared buffer (``KVArena.join``), if any
        self.arena_index = 0
        self.in_arena = False  # the buffers are the arena's slices
        super().__init__()

    def _view(self, name: str):
        buf = self._buf[name]
        return self._raw[name] if buf is None else buf[:, :, :self._length[name]]

    def _assign(self, name: str, value) -> None:
        buf = self._buf[name]
        if value is None or value.dim() != 4:  # reset, or transformers' empty placeholder before the first update
            self._buf[name], self._raw[name] = None, value
            self._length[name] = 0
            self._leave()
            return
        if buf is not None and value.data_ptr() == buf.data_ptr() and value.stride() == buf.stride() \
                and value.shape[:2] == buf.shape[:2] and value.shape[3] == buf.shape[3]:
            self._length[name] = value.shape[2]  # a view of the buffer's first slots (crop)
            return
        # a new tensor (another batch, a repack): copied into the buffer, or a new one of its batch
        self._buf[name] = write_slots(buf, 0, value, self.capacity)
        if self._buf[name] is not buf:
            self._leave()
        self._length[name] = value.shape[2]

    def _leave(self) -> None:
        if self.in_arena:
            self.arena.leave(self)

    def __getstate__(self):
        """Pickled (``pickle``; ``copy.deepcopy`` too) without the arena: the copy's buffers are its own (cloned
        out of it, or pickle would write the whole arena's storage for each layer's view of it)."""
        state = self.__dict__.copy()
        if self.in_arena:
            state["_buf"] = {name: buf.clone() for name, buf in self._buf.items()}
        state["arena"], state["in_arena"] = None, False
        return state

    keys = property(lambda self: self._view("keys"), lambda self, v: self._assign("keys", v))
    values = property(lambda self: self._view("values"), lambda self, v: self._assign("values", v))

    def get_seq_length(self) -> int:
        """The cached length, read without the two views of the buffer transformers' own makes (``keys.numel()``,
        ``keys.shape``: a model's forward asks once per pass and mask, LayerSkip's trim once per early layer)."""
        if self._buf["keys"] is None:
            return super().get_seq_length()
        return self._length["keys"] if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' ``crop`` (a negative count of slots to drop) as two lengths moved: no views made."""
        if tokens_to_remove < 0 and self._buf["keys"] is not None and self._buf["values"] is not None:
            for name in ("keys", "values"):
                self._length[name] = max(0, self._length[name] + tokens_to_remove)
            return
        super().crop(tokens_to_remove)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the forward's new keys/values ([B, Hkv, n, D]) after the cached ones; returns the views. With
        ``slots`` set (a captured verification pass, headway.inference.target_graphs): writes them at those slots
        and returns the buffers' first ``span`` slots, the length left to the caller (``advance``)."""
        if self.slots is not None:
            for name, new in (("keys", key_states), ("values", value_states)):
                self._buf[name].index_copy_(2, self.slots, new)
            return self._buf["keys"][:, :, :self.span], self._buf["values"][:, :, :self.span]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self._length["keys"]
        need, buf = start + key_states.shape[2], self._buf["keys"]
        if self.arena is not None and (self.in_arena or buf is None) and (buf is None or buf.shape[2] < need):
            self.arena.place(self, key_states, value_states, need)  # the arena's slices (made or grown), or below
        for name, new in (("keys", key_states), ("values", value_states)):
            buf = self._buf[name]
            self._buf[name] = write_slots(buf, start, new, self.capacity)
            if self._buf[name] is not buf:  # not the arena's (it refused them) or no longer (another batch)
                self._leave()
            self._length[name] = start + new.shape[2]
        return self.keys, self.values

    def advance(self, n: int) -> None:
        """Count ``n`` entries written through ``slots`` right after the cached ones."""
        for name in ("keys", "values"):
            self._length[name] += n


def check_compactable(cache) -> None:
    """Only full-attention dynamic layers can be compacted: a sliding-window layer keeps a truncated
    buffer whose slots no longer line up with positions, so it is refused."""
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False) or type(layer) not in (DynamicLayer, BufferLayer):
            raise ValueError(f"cache layer {i} is a {type(layer).__name__}: headway compacts only full-attention "
                             "DynamicLayer caches; sliding-window / hybrid / quantized caches are not supported "
                             "(for Mistral/Qwen2-style models disable the sliding window in the config)")


def new_cache(model, capacity: int = 0) -> DynamicCache:
    """An empty ``DynamicCache`` for ``model`` whose full-attention layers are ``BufferLayer``s sized for
    ``capacity`` tokens (they double past it), checked to be compactable."""
    cache = DynamicCache(config=model.config)
    if cache.layers:
        cache.layers = [BufferLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
        buffered = [layer for layer in cache.layers if isinstance(layer, BufferLayer)]
        spread = len(set(map(str, (getattr(model, "hf_device_map", None) or {}).values()))) > 1
        if not spread:  # one arena on one device; a model split over devices keeps each layer's buffers apart
            arena = KVArena(capacity)
            for layer in buffered:
                arena.join(layer)
    else:
        cache.layer_class_to_replicate = functools.partial(BufferLayer, capacity)
    check_compactable(cache)
    return cache


def layer_buffers(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors a cache layer's keys and values live in, to write in place: a ``BufferLayer``'s buffers (no
    view made), else its keys and values."""
    if isinstance(layer, BufferLayer) and layer._buf["keys"] is not None and layer._buf["values"] is not None:
        return layer._buf["keys"], layer._buf["values"]
    return layer.keys, layer.values


def compact_cache(cache, start: int, keep: Sequence[int], written: int) -> None:
    """Keep, right after the first ``start`` entries, only the entries at offsets ``keep``.

    The cache holds start + written entries; keep: ascending offsets in [0, written) with
    keep[i] >= i (a root-to-node path of a tree flattened parents-first). Afterwards the cache
    holds start + len(keep) entries, in the order of ``keep``.
    """
    kept = len(keep)
    moved = next((i for i, k in enumerate(keep) if k != i), kept)  # the entries before it are in place already
    if moved < kept:  # not a contiguous prefix (a chain's): gather the rest of the path down
        src = torch.tensor([k + start for k in keep[moved:]], dtype=torch.long,
                           device=cache.layers[0].keys.device)  # [kept - moved]
        data = arena_of(cache)
        if data is not None:  # [2L, B, Hkv, C, D]: every layer at once
            data[:, :, :, start + moved:start + kept] = data.index_select(3, src)
        else:
            for layer in cache.layers:
                for buf in layer_buffers(layer):  # [B, Hkv, T or capacity, D]
                    # index_select copies first, so overlapping ranges are safe
                    buf[:, :, start + moved:start + kept] = buf.index_select(2, src)
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
        data = arena_of(cache)
        if data is not None:  # [2L, B, Hkv, C, D]: every layer at once
            index = src[None, :, None, :, None].expand(data.shape[0], -1, data.shape[2], -1, data.shape[4])
            data[:, :, :, start:start + longest] = data.gather(3, index)
        else:
            for layer in cache.layers:
                b, h, _, d = layer.keys.shape  # keys/values: [B, Hkv, T, D]
                index = src[:, None, :, None].expand(b, h, longest, d)
                # gather copies first, so overlapping ranges are safe
                layer.keys[:, :, start:start + longest] = layer.keys.gather(2, index)
                layer.values[:, :, start:start + longest] = layer.values.gather(2, index)
    if written > longest:
        cache.crop(-(written - longest))
    return longest


def select_rows(cache, index: torch.Tensor) -> None:
    """Keep the batch rows ``index`` [B'] long, in that order (transformers' ``batch_select_indices``): through the
    arena one gather for every layer, the layers staying in it (a new arena tensor of B' rows, the old one freed),
    so the batch's later compactions stay one call; else layer by layer."""
    if arena_of(cache) is None:
        cache.batch_select_indices(index)
    else:
        cache.layers[0].arena.select(index)


def hidden_where(blocked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (True: hidden) -> the additive mask of 0 / finfo(dtype).min of the same shape."""
    return torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill_(blocked, torch.finfo(dtype).min)


def step_mask(valid: torch.Tensor, chain: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [B, 1, 1, S + chain] of one token a row stepped over a batch cache of S slots a row
    (valid [B, S] bool: each row's own) and then ``chain`` slots, the row's chain so far and the token's own."""
    return hidden_where(torch.cat([~valid, valid.new_zeros(valid.shape[0], chain)], 1), dtype)[:, None, None]


def lay_rows(cache, rows: list, slots: int) -> None:
    """Lay one-row caches ``rows`` (each's entries made alone) into the empty B-row ``cache`` as ``slots`` slots a
    row, each row's entries in its last slots (as left padding puts them); the slots before them are zeros, which
    the batch's validity mask keeps out of sight."""
    for i, layer in enumerate(cache.layers):
        parts = [rc.layers[i] for rc in rows]
        like = next(p.keys for p in parts if p.is_initialized)  # [1, Hkv, n, D]
        keys = like.new_zeros(len(rows), like.shape[1], slots, like.shape[3])
        values = keys.clone()
        for r, part in enumerate(parts):
            n = part.get_seq_length()
            if n:
                keys[r, :, slots - n:], values[r, :, slots - n:] = part.keys[0], part.values[0]
        layer.update(keys, values)


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
    data = arena_of(cache)
    if data is not None:  # [2L, B, Hkv, C, D]: every layer in one gather (which copies first: overlaps are safe)
        index = order[None, :, None, :, None].expand(data.shape[0], -1, data.shape[2], -1, data.shape[4])
        data[:, :, :, :length] = data[:, :, :, :valid.shape[1]].gather(3, index)
        cache.crop(-(valid.shape[1] - length))
        return valid.gather(1, order)
    for layer in cache.layers:
        b, h, _, d = layer.keys.shape
        index = order[:, None, :, None].expand(b, h, length, d)
        layer.keys = layer.keys.gather(2, index)
        layer.values = layer.values.gather(2, index)
    return valid.gather(1, order)
