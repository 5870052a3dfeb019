"""The target's forwards: the prefill, one pass over a flattened tree, a causal chain, through the
model's public arguments only.

Per TRANSFORMERS.md (measured on Llama, Qwen2 and GPT-2 in transformers 5.24): a 4D float additive
mask [1, 1, N, P + N] of 0 / finfo.min and 2D ``position_ids = P + depth`` give each tree node
exactly the result of a causal run over its own root-to-node path. A bool or 2D mask, or missing
position_ids, is silently wrong, so both are always built here.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
import torch.nn.functional as F

from headway.heads.target.features import decoder_layers
from headway.inference.tree import Tree

SUPPORTED_ATTENTION = ("sdpa", "eager")


def check_attention(model) -> None:
    """Refuse attention kernels that ignore a custom 4D mask (flash-attention would silently be wrong)."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(f"tree verification needs a 4D attention mask, which attn_implementation={impl!r} does not "
                         "honour; load the model with attn_implementation='sdpa' or 'eager' "
                         "(or call model.set_attn_implementation('sdpa'))")


def padded_tree_tensors(tree: Tree, width: int, device: torch.device, dtype: torch.dtype):
    """(additive mask [W, W], depths [W]) for ``tree`` padded to ``width`` >= tree.size nodes.

    Padding nodes see only the prefix and themselves (depth 0); no real node sees them, and the
    cache compaction drops them. Memoised on the tree.
    """
    def build():
        mask, depths = tree.device_tensors(device, dtype)  # [N, N], [N]
        n = tree.size
        if width > n:
            full = torch.full((width, width), torch.finfo(dtype).min, dtype=dtype, device=device)
            full[:n, :n] = mask
            full.diagonal()[n:] = 0.0
            mask = full
            depths = torch.cat([depths, depths.new_zeros(width - n)])
        return mask, depths

    return tree.cached(("padded", width, device, dtype), build)


def verify_width(n: int, pad_to: int) -> int:
    """Widths 2..pad_to-1 are padded to ``pad_to``: on CPU the 2-3 row output projection hits a
    slow path that costs more than 4 rows (PERFORMANCE.md)."""
    return pad_to if 1 < n < pad_to else n


def tree_forward(model, cache, tree: Tree, tokens: torch.Tensor, prefix_len: int, *, pad_to: int = 1,
                 max_positions: int | None = None, pending: torch.Tensor | None = None, width: int | None = None,
                 dtype: torch.dtype | None = None):
    """Run ``model`` over the tree's nodes appended to a prefix of ``prefix_len`` tokens.

    tokens: [N] long (node 0 first) on the model's device. The cache holds the prefix, or, for a
    chain, all of it but its last ``pending`` [M] tokens, which this pass runs first (the prefill and
    the first round in one causal forward; a tree would need a 4D mask over the whole prompt, which
    costs more than a prefill of its own). The cache grows by M + the padded width W (``width`` when given,
    >= N: tree="auto"'s cheapest, headway.inference.auto; else ``verify_width(N, pad_to)``); the
    caller compacts the tree's part. ``max_positions``: the model's context (absolute position
    embeddings): a chain is not padded past it. ``dtype``: the model's (None: read from its parameters, a walk
    a caller running many passes makes once). Returns (logits [N, V], W). (Drafters' features come
    from the generator's forward hooks, at the layers each drafter asks for.)
    """
    n, m = tokens.shape[0], 0 if pending is None else pending.shape[0]
    if m and not tree.is_chain:
        raise ValueError("pending prompt tokens run before a chain only: prefill them first for a tree")
    width = verify_width(n, pad_to) if width is None else max(width, n)
    if tree.is_chain and max_positions is not None and prefix_len + width > max_positions:
        width = n  # a chain's padding sits after its last node: keep every position inside the context
    device = tokens.device
    if width > n:
        tokens = torch.cat([tokens, tokens[:1].expand(width - n)])
    if m:
        tokens = torch.cat([pending, tokens])  # [M + W]
    start = prefix_len - m  # the first position this pass runs
    if tree.is_chain:
        # A chain (padding after it included) is plain causal attention: let the model build its own
        # mask, which keeps its fastest attention path (no 4D mask; SDPA's native GQA).
        positions = torch.arange(start, prefix_len + width, device=device)
        full = None
    else:
        dtype = model.dtype if dtype is None else dtype  # (a walk over the parameters: only where a mask is built)
        mask, depths = padded_tree_tensors(tree, width, device, dtype)  # [W, W], [W]
        positions = depths + prefix_len
        full = F.pad(mask.expand(1, 1, width, width), (prefix_len, 0))  # [1, 1, W, P + W]: the prefix visible to all
    out = model(input_ids=tokens[None], position_ids=positions[None], attention_mask=full,
                cache=cache, use_cache=True, logits_to_keep=width)
    return out.logits[0, :n], width


def prefill(model, cache, input_ids: torch.Tensor) -> torch.Tensor:
    """Causal forward over ``input_ids`` [1, T] into an empty cache; logits of the last position [V]."""
    t = input_ids.shape[1]
    positions = torch.arange(t, device=input_ids.device)[None]
    out = model(input_ids=input_ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def chain_forward(model, cache, tokens: torch.Tensor, prefix_len: int):
    """Causal forward over ``tokens`` [T] appended to a cache of ``prefix_len``; logits of the last token [V]."""
    t = tokens.shape[0]
    positions = torch.arange(prefix_len, prefix_len + t, device=tokens.device)[None]
    out = model(input_ids=tokens[None], position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


# --- the target's layers in two parts (LayerSkip: headway.inference.layerskip) --------------------

@functools.lru_cache(maxsize=None)
def _cache_name(layer_type: type) -> str:
    params = inspect.signature(layer_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_arg(layer) -> str:
    """The decoder layer's name for the cache argument (``cache`` since transformers 5.25, before it
    ``past_key_values``): read from its class's signature once."""
    return _cache_name(type(layer))


_PARTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _layer_parts(model) -> tuple:
    """(the decoder module, its layers as a list, their cache argument's name), looked up once per model: LayerSkip
    runs its layers a few at a time, several times a round, where transformers' ``get_decoder`` and a ModuleList's
    indexing cost more than the layer's own small ops."""
    parts = _PARTS.get(model)
    if parts is None:
        blocks = decoder_layers(model)
        parts = _PARTS[model] = (model.get_decoder(), list(blocks), _cache_arg(blocks[0]))
    return parts


def run_layers(model, cache, hidden: torch.Tensor, positions: torch.Tensor, layers: range,
               mask: torch.Tensor | None) -> torch.Tensor:
    """The target's decoder layers ``layers`` over ``hidden`` [B, n, H] at ``positions`` [B, n], appending
    their keys/values to ``cache``; mask: [B, 1, n, S] additive, or None for one token of one row (it sees
    the whole cache). Returns [B, n, H]."""
    base, blocks, name = _layer_parts(model)
    embeddings = base.rotary_emb(hidden, positions)
    for i in layers:
        out = blocks[i](hidden, attention_mask=mask, position_ids=positions, use_cache=True,
                        position_embeddings=embeddings, **{name: cache})
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def early_forward(model, cache, token: torch.Tensor, position: int, exit_layer: int) -> torch.Tensor:
    """One token [1] at ``position`` through layers 0..exit_layer-1 into ``cache``: its layer-E state [1, H]."""
    hidden = _layer_parts(model)[0].embed_tokens(token[None])  # [1, 1, H]
    positions = torch.full((1, 1), position, dtype=torch.long, device=token.device)
    return run_layers(model, cache, hidden, positions, range(exit_layer), None)[0]


def trim_layers(cache, layers: range, length: int) -> None:
    """Drop the entries past ``length`` in the cache layers ``layers``."""
    for i in layers:
        extra = cache.layers[i].get_seq_length() - length
        if extra > 0:
            cache.layers[i].crop(-extra)


def resume_forward(model, cache, tree: Tree, states: torch.Tensor, prefix_len: int, exit_layer: int,
                   dtype: torch.dtype | None = None):
    """Verify ``tree`` (a chain of N nodes) from its nodes' saved layer-E states [>= N, H]: layers
    E..L-1 over them, appended to a cache whose early layers already hold the nodes (after
    ``prefix_len``) and whose late layers hold the prefix only; then the final norm and lm_head.
    Returns (logits [N, V], N), as ``tree_forward`` does (the pass is not padded; ``dtype`` as there)."""
    n = tree.size
    base, blocks, _ = _layer_parts(model)
    trim_layers(cache, range(exit_layer), prefix_len + n)  # a chain cut by tree="auto": its first n nodes
    device, dtype = states.device, model.dtype if dtype is None else dtype
    mask, depths = padded_tree_tensors(tree, n, device, dtype)  # [N, N], [N]
    full = None
    if n > 1:  # [1, 1, N, P + N]: the prefix visible to all, as tree_forward pads its mask
        full = F.pad(mask.expand(1, 1, n, n), (prefix_len, 0))
    positions = (depths + prefix_len)[None]
    hidden = run_layers(model, cache, states[:n][None].to(dtype), positions, range(exit_layer, len(blocks)), full)
    hidden = base.norm(hidden)
    return model.get_output_embeddings()(hidden)[0], n
