"""The target's verification pass captured per width (CUDA graphs, issue 22 item 4).

A verification pass of a small target on a GPU is hundreds of small kernels (a few per decoder layer) whose
launches cost more than their arithmetic. Captured once per width W (a tree padded up to a power of two) and
replayed, a pass is one launch. As for the drafter (``inference.graphs``), whatever varies is a tensor of
fixed shape: the tokens [1, W], their positions [1, W], the additive mask [1, 1, W, C] over the cache's whole
buffer of C slots (the prefix visible, the tree's ancestors, the never-written or stale slots hidden), and the
slots [W] the pass writes its keys/values at (``BufferLayer.slots``). The cache's buffers persist across
requests (``cache``) so the captured passes keep writing where they were captured; a request that outgrows them
grows them and the passes are captured again.

The pass runs the target's own modules in order (embed_tokens, rotary_emb, each decoder layer with the mask and
position embeddings, the final norm, the output embeddings), as LayerSkip's resumed pass does, and returns the
layers the drafter reads as outputs: forward hooks run Python, which a replay does not. Llama-style decoders
only (Llama, Qwen2, Qwen3, Mistral; SmolLM2); others verify eagerly (``why_not``).
"""

from __future__ import annotations

import torch

from headway.heads.target.features import decoder_layers, num_layers
from headway.inference.graphs import (GraphBackend, StepGraphs, graph_width, kv_span, rope_why_not, same_mode,
                                      uncapturable_now)
from headway.inference.kv_cache import BufferLayer, new_cache
from headway.inference.target_forward import _cache_arg, padded_tree_tensors
from headway.inference.tree import Tree

CAPTURED_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # decoders whose forward is exactly these modules in order


def why_not(model) -> str | None:
    """None when ``model``'s verification pass can be captured, else why not (one line)."""
    kind = getattr(model.config, "model_type", None)
    if kind not in CAPTURED_TYPES:
        return (f"the target's verification pass ({type(model).__name__}, model_type {kind!r}) is captured for "
                f"{', '.join(CAPTURED_TYPES)} decoders only")
    base = model.get_decoder()
    missing = [name for name in ("embed_tokens", "rotary_emb", "norm") if not hasattr(base, name)]
    if missing:
        return f"the target's verification pass cannot be captured: its decoder has no {', '.join(missing)}"
    if getattr(model, "hf_device_map", None) and len(set(map(str, model.hf_device_map.values()))) > 1:
        return "the target's verification pass cannot be captured: the model is spread over several devices"
    return rope_why_not(model.config, "the target's verification pass")


class VerifyGraphs(StepGraphs):
    """The target's verification pass captured per width and span over a cache whose buffers persist across
    requests.

    ``layers``: the feature layers the drafter reads (transformers hidden_states ids; the number of layers = after
    the final norm), returned with the logits. ``strict``: as ``StepGraphs``."""

    MIN_CAPACITY = 256
    WHAT = "the target's verification pass"
    INSTEAD = "verifying without graphs"

    def __init__(self, model, backend: GraphBackend, layers, strict: bool = False):
        super().__init__(backend, strict)
        self.model = model
        self.layers = list(layers or [])
        self._cache = None

    def cache(self, capacity: int):
        """An empty target cache for a request of up to ``capacity`` tokens: the last one's buffers when they hold
        it (the captured passes stay valid), else a new one (a power of two, at least ``MIN_CAPACITY``). The captured
        passes are forgotten when the model's weights moved since (a ``.to()``, a reload) and the cache when it was
        made in or out of ``torch.inference_mode`` and this request is not."""
        self.forget_if_moved([*self.model.parameters(), *self.model.buffers()])
        kept = self._cache is not None and all(same_mode(layer._buf["keys"]) for layer in self._cache.layers)
        if kept and self._slots() >= capacity:
            for layer in self._cache.layers:
                layer.crop(-layer.get_seq_length())
            return self._cache
        self._cache = new_cache(self.model, capacity=max(self.MIN_CAPACITY, graph_width(capacity)))
        return self._cache

    def _slots(self) -> int:
        """The slots the kept cache holds (its buffers once allocated, else what they will be)."""
        layer = self._cache.layers[0] if self._cache.layers else None
        if layer is None:
            return 0
        buf = layer._buf["keys"]
        return buf.shape[2] if buf is not None else layer.capacity

    def verify(self, cache, tree: Tree, tokens: torch.Tensor, prefix_len: int):
        """The pass over ``tree``'s nodes (tokens [N], node 0 first) after ``prefix_len`` cached entries ->
        (logits [N, V], the width W it ran at, the feature rows [W, F] or None), or None: run it eagerly (a capture
        that failed, a cache that is not this one's or too small for the pass)."""
        if self.failed is not None or cache is not self._cache or uncapturable_now(tokens.device):
            return None
        n = tokens.shape[0]
        width = graph_width(n)
        layers = cache.layers
        if not all(isinstance(layer, BufferLayer) and layer._buf["keys"] is not None for layer in layers):
            return None
        if prefix_len + width > layers[0]._buf["keys"].shape[2] or cache.get_seq_length() != prefix_len:
            return None
        buffers = tuple(layer._buf[name] for layer in layers for name in ("keys", "values"))
        self.adopt(buffers, prefix_len)
        device, dtype = tokens.device, self.model.dtype
        span = kv_span(prefix_len + width, buffers[0].shape[2], least=self.MIN_CAPACITY)
        mask, depths = padded_tree_tensors(tree, width, device, dtype)  # [W, W], [W]
        full = torch.full((1, 1, width, span), torch.finfo(dtype).min, dtype=dtype, device=device)
        full[0, 0, :, :prefix_len] = 0.0
        full[0, 0, :, prefix_len:prefix_len + width] = mask  # [1, 1, W, span]
        if width > n:
            tokens = torch.cat([tokens, tokens[:1].expand(width - n)])
        inputs = (tokens[None], (depths + prefix_len)[None], full,
                  torch.arange(prefix_len, prefix_len + width, device=device))
        call = self._call(cache, inputs, span)
        if call is None:
            return None
        outputs = call(*inputs)
        for layer in layers:
            layer.advance(width)
        logits = outputs[0][:n].clone()  # the next replay (or another width's) overwrites the static outputs
        return logits, width, outputs[1].clone() if self.layers else None

    def _step(self, cache, span: int):
        model, layers = self.model, self.layers
        base, blocks, depth = model.get_decoder(), decoder_layers(model), num_layers(model)
        name = _cache_arg(blocks[0])

        def step(ids, positions, mask, slots):
            for layer in cache.layers:
                layer.slots, layer.span = slots, span
            try:
                hidden = base.embed_tokens(ids)  # [1, W, H]
                embeddings = base.rotary_emb(hidden, positions)
                kept = {}
                for i, block in enumerate(blocks):
                    if i in layers:
                        kept[i] = hidden
                    out = block(hidden, attention_mask=mask, position_ids=positions, use_cache=True,
                                position_embeddings=embeddings, **{name: cache})
                    hidden = out[0] if isinstance(out, tuple) else out
                hidden = base.norm(hidden)
                kept[depth] = hidden
                logits = model.get_output_embeddings()(hidden)[0]  # [W, V]
            finally:
                for layer in cache.layers:
                    layer.slots = layer.span = None
            if not layers:
                return (logits,)
            return logits, torch.cat([kept[i] for i in layers], dim=-1)[0]  # [W, F]

        return step
