"""The decoder layer both EAGLE drafters run, and what it needs: attention with the drafter's own
key/value cache, and the training-time test's unrolled keys (EAGLE-3).

``EagleLayer`` is EAGLE-1's layer; ``Eagle3Layer`` differs only in what its attention reads
(``attention_input``). Both take the drafter's ``EagleConfig`` (``headway.heads.eagle``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def write_slots(buffer: torch.Tensor | None, start: int, new: torch.Tensor, capacity: int = 0) -> torch.Tensor:
    """Write ``new`` [B, H, n, D] into slots start .. start + n - 1 of ``buffer`` [B, H, C, D] (None: none yet) and
    return the buffer: the same one, or, when it is too small or of another batch, a new one (doubled, at least
    ``capacity`` slots) holding its first ``start`` slots. A KV cache that grows this way copies itself only when
    it doubles, never on every append as ``torch.cat`` does."""
    n = new.shape[2]
    if buffer is None or buffer.shape[2] < start + n or buffer.shape[:2] != new.shape[:2]:
        size = max(capacity, start + n, 2 * (buffer.shape[2] if buffer is not None else 0))
        grown = new.new_empty(new.shape[0], new.shape[1], size, new.shape[3])
        if buffer is not None and start:
            grown[:, :, :start] = buffer[:, :, :start]
        buffer = grown
    buffer[:, :, start:start + n] = new
    return buffer


class DraftCache:
    """The drafter's own key/value cache: ``[B, Hkv, S, D]`` views of buffers that double when full (an append
    writes its new slots only, never copies the cache), cropped on roll-back. It is its first layer's; a drafter of
    several layers keeps each later one's in ``layer(i)``, which crops, reserves, advances and stacks with it.

    ``slots`` (a [T] long tensor, normally None) makes ``append`` write its T entries at those slots and return
    the buffers' first ``span`` slots: a step with fixed shapes whatever the length (a CUDA graph's,
    ``inference.graphs``), which masks the slots it must not see and moves the length itself (``advance``)."""

    FIRST = 128  # slots of the first buffer

    def __init__(self):
        self._keys: torch.Tensor | None = None  # [B, Hkv, capacity, D]
        self._values: torch.Tensor | None = None
        self._length = 0
        self.slots: torch.Tensor | None = None
        self.span: int | None = None  # with ``slots``: the buffer's first ``span`` slots are returned
        self._deeper: list[DraftCache] = []  # layers 1, 2, ..: their own caches, created when first asked for

    def layer(self, i: int) -> "DraftCache":
        """Layer ``i``'s cache (0: this one); a layer's first use creates it, writing where this one writes."""
        if i == 0:
            return self
        while len(self._deeper) < i:
            self._deeper.append(DraftCache())
            self._deeper[-1].slots, self._deeper[-1].span = self.slots, self.span
        return self._deeper[i - 1]

    def _all(self) -> list["DraftCache"]:
        return [self, *self._deeper]

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every layer's key and value buffers (what a captured step writes into)."""
        return tuple(t for cache in self._all() for t in (cache._keys, cache._values))

    def write_at(self, slots: torch.Tensor | None, span: int | None) -> None:
        """Every layer's appends go to ``slots`` and return the buffers' first ``span`` slots (None, None: back to
        appending after the cached entries)."""
        for cache in self._all():
            cache.slots, cache.span = slots, span

    @classmethod
    def reusing(cls, other: "DraftCache") -> "DraftCache":
        """An empty cache on ``other``'s buffers (a captured step keeps writing where it was captured)."""
        out = cls()
        out._keys, out._values = other._keys, other._values
        out._deeper = [cls.reusing(d) for d in other._deeper]
        return out

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[2]

    def reserve(self, size: int) -> None:
        """Make room for ``size`` slots (doubling, the first ``len`` kept); needs a first append."""
        for deeper in self._deeper:
            deeper.reserve(size)
        if self._keys is not None and self.capacity < size:
            size = max(size, 2 * self.capacity)
            for name in ("_keys", "_values"):
                old = getattr(self, name)  # [B, Hkv, C, D]
                grown = old.new_empty(old.shape[0], old.shape[1], size, old.shape[3])
                grown[:, :, :self._length] = old[:, :, :self._length]
                setattr(self, name, grown)

    def advance(self, n: int) -> None:
        """Count ``n`` entries written through ``slots`` right after the cached ones."""
        for cache in self._all():
            cache._length += n

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :, :self._length]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :, :self._length]

    def __len__(self) -> int:
        return self._length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slots is not None:  # k, v: [B, Hkv, T, D] at slots [T]; the buffers' first span slots returned
            self._keys.index_copy_(2, self.slots, k)
            self._values.index_copy_(2, self.slots, v)
            return self._keys[:, :, :self.span], self._values[:, :, :self.span]
        self._keys = write_slots(self._keys, self._length, k, self.FIRST)
        self._values = write_slots(self._values, self._length, v, self.FIRST)
        self._length += k.shape[2]
        return self.keys, self.values

    def crop(self, length: int) -> None:
        for cache in self._all():
            cache._length = min(cache._length, length)

    def append_row(self, source: "DraftCache", row: int, start: int, count: int) -> None:
        """Append ``source``'s row ``row``, slots start .. start + count - 1, in every layer (a batch's stacked
        pass handing each row's new entries back to its own cache)."""
        for i, theirs in enumerate(source._all()):
            self.layer(i).append(theirs._keys[row:row + 1, :, start:start + count],
                                 theirs._values[row:row + 1, :, start:start + count])

    @classmethod
    def stacked(cls, caches: list["DraftCache"], room: int = 0) -> tuple["DraftCache", torch.Tensor]:
        """One cache of B = len(caches) rows holding each one-row cache's entries in its row's first slots
        (room for ``room`` more per row), and valid [B, S] bool: the slots a row's entries fill (S the
        longest; the rest of a shorter row must be masked out). Every cache holds at least one entry."""
        out, valid = cls._stacked_layer(caches, room)
        out._deeper = [cls._stacked_layer([c.layer(i) for c in caches], room)[0]
                       for i in range(1, 1 + max(len(c._deeper) for c in caches))]
        return out, valid

    @classmethod
    def _stacked_layer(cls, caches: list["DraftCache"], room: int) -> tuple["DraftCache", torch.Tensor]:
        lengths = [len(c) for c in caches]
        s, like = max(lengths), caches[lengths.index(max(lengths))]._keys  # [1, Hkv, C, D]
        out = cls()
        for name in ("_keys", "_values"):
            buf = like.new_zeros(len(caches), like.shape[1], s + room, like.shape[3])
            for row, (cache, n) in enumerate(zip(caches, lengths)):
                buf[row, :, :n] = getattr(cache, name)[0, :, :n]
            setattr(out, name, buf)
        out._length = s
        valid = torch.arange(s, device=like.device)[None] < torch.tensor(lengths, device=like.device)[:, None]
        return out, valid


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, Hkv, S, D] -> [B, Hkv * groups, S, D]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class EagleAttention(nn.Module):
    """Llama self-attention whose q/k/v read ``in_width`` features (2H for EAGLE-3)."""

    def __init__(self, cfg, in_width: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def _keys_values(self, x):
        # x: [B, T, in_width] -> k, v [B, Hkv, T, D] (k not yet rotated)
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def write_kv(self, x, cos, sin, cache: DraftCache) -> None:
        """Only the keys and values of ``x`` [B, T, in_width] (rotated, as ``forward`` computes them),
        appended to ``cache``: context positions whose outputs nobody reads."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        k, v = self._keys_values(x)
        _, k = apply_rotary_pos_emb(k[:, :0], k, cos, sin)  # keys only: an empty query
        cache.append(k, v)

    def forward(self, x, cos, sin, mask=None, cache: DraftCache | None = None, ttt: TTTKeys | None = None):
        # x: [B, T, in_width]; cos/sin: [B, T, D]; mask: additive [B or 1, 1, T, S] or None (causal)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k, v = self._keys_values(x)  # [B, Hkv, T, D]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = self.heads // self.kv_heads
        if ttt:  # an unrolled step i > 0: step-0 keys causally + the key each step wrote at this position
            out = _ttt_attention(q, k, v, ttt, groups)
            ttt.append((k, v))
        else:
            if ttt is not None:
                ttt.append((k, v))
            if cache is not None:
                k, v = cache.append(k, v)
            s = k.shape[2]
            if mask is None and t > 1 and s > t:  # causal after a cached prefix
                mask = torch.full((t, s), float("-inf"), dtype=q.dtype, device=q.device).triu_(s - t + 1)[None, None]
            out = F.scaled_dot_product_attention(q, _expand_kv(k, groups), _expand_kv(v, groups),
                                                 attn_mask=None if mask is None else mask.to(q.dtype),
                                                 is_causal=mask is None and t > 1)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class TTTKeys:
    """The keys and values each unrolled training-time-test step wrote: [(k_j, v_j)] for steps 0..i-1.

    Deliberately not a list: module hooks that re-wrap tensor arguments (DeepSpeed ZeRO-3's) rebuild
    list and tuple arguments, so a plain list passed down would lose the steps appended inside."""

    def __init__(self):
        self.steps: list = []
        self._deeper: list[TTTKeys] = []  # a drafter of several layers: layer i's steps in layer(i)

    def layer(self, i: int) -> "TTTKeys":
        """Layer ``i``'s steps (0: these)."""
        if i == 0:
            return self
        while len(self._deeper) < i:
            self._deeper.append(TTTKeys())
        return self._deeper[i - 1]

    def append(self, kv) -> None:
        self.steps.append(kv)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i):
        return self.steps[i]


def _ttt_attention(q, k, v, steps: list, groups: int) -> torch.Tensor:
    """Attention of unrolled step i = len(steps) (EAGLE-3 training-time test).

    q, k, v: [B, H or Hkv, T, D] of this step; steps: [(k_j, v_j)] of steps 0..i-1. Position t sees
    step 0's keys at positions <= t (causal) and, of every later step including this one, only the
    key at t itself (the diagonal): exactly what a depth-i tree node sees at inference.
    """
    scale = q.shape[-1] ** -0.5
    k0, v0 = _expand_kv(steps[0][0], groups), _expand_kv(steps[0][1], groups)
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril_()
    s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, H, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag_k = [_expand_kv(kj, groups) for kj, _ in steps[1:]] + [_expand_kv(k, groups)]
    diag_v = [_expand_kv(vj, groups) for _, vj in steps[1:]] + [_expand_kv(v, groups)]
    sd = torch.stack([(q * kj).sum(-1) * scale for kj in diag_k], dim=-1)  # [B, H, T, i]
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in at least fp32 (bf16 training)
    weights = torch.cat([s0, sd], dim=-1).to(acc).softmax(-1).to(q.dtype)  # [B, H, T, T + i]
    out = weights[..., :t] @ v0  # [B, H, T, D]
    for j, vj in enumerate(diag_v):
        out = out + weights[..., t + j, None] * vj
    return out


class EagleLayer(nn.Module):
    """The drafter's decoder layer, as EAGLE-1 has it: no input norm; q/k/v and the residual read the
    layer input x (the head's ``fc([emb; f])``); then the post-attention norm and the MLP."""

    def __init__(self, cfg, attention_width: int | None = None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        h = cfg.hidden_size
        self.self_attn = EagleAttention(cfg, attention_width or h)
        self.mlp = LlamaMLP(cfg.llama_config())
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)

    def attention_input(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        # x: [B, T, H] -> what q/k/v read
        return x

    def write_context(self, x, emb, cos, sin, cache: DraftCache) -> None:
        """Positions whose outputs are never read: only their keys/values go into ``cache``."""
        self.self_attn.write_kv(self.attention_input(x, emb), cos, sin, cache)

    def forward(self, x, emb, cos, sin, mask=None, cache=None, ttt=None):
        # x: [B, T, H] the layer input; emb: [B, T, H] the tokens' embeddings
        x = x + self.self_attn(self.attention_input(x, emb), cos, sin, mask, cache, ttt)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Layer(EagleLayer):
    """EAGLE-3's decoder layer: q/k/v read ``[input_layernorm(emb); hidden_norm(h)]`` (2H wide), the
    residual runs on h (norm_before_residual false)."""

    def __init__(self, cfg):
        super().__init__(cfg, attention_width=2 * cfg.hidden_size)
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def attention_input(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        # x, emb: [B, T, H] -> [B, T, 2H]
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], dim=-1)


class PlainLayer(EagleLayer):
    """A later decoder layer of an EAGLE-3 drafter of several (layers 1 .. N-1; speculators' ``num_hidden_layers``,
    P-EAGLE's published drafters have 4): a standard Llama pre-norm layer, q/k/v reading ``input_layernorm(x)``
    (H wide), the residual on x; the token embedding enters at the first layer only."""

    def __init__(self, cfg):
        super().__init__(cfg)
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def attention_input(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(x)  # [B, T, H]
