"""What the EAGLE layouts share: the drafter's Llama config (written and read; one layer, or an EAGLE-3 drafter's
several: ``num_hidden_layers``), its tensor names and shapes, and the target layer ids in each engine's numbering
(see ``headway.heads.formats.eagle`` for the sources)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from headway.heads.eagle import EagleConfig
from headway.heads.formats.folder import dtype_name

LAYER_KEYS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "post_attention_layernorm.weight"]
PLAIN_LAYER_KEYS = LAYER_KEYS + ["input_layernorm.weight"]  # an EAGLE-3 drafter's layers after the first
EAGLE3_LAYER_KEYS = PLAIN_LAYER_KEYS + ["hidden_norm.weight"]


def deeper_layer_tensors(state: dict, num_layers: int) -> dict:
    """An EAGLE-3 head's layers after the first (``layers.{i}.*``, i = 1 .. N-1: the names speculators, vLLM and
    headway share), from its state dict."""
    return {f"layers.{i}.{k}": state[f"layers.{i}.{k}"] for i in range(1, num_layers) for k in PLAIN_LAYER_KEYS}


def deeper_layer_shapes(fields: dict, num_layers: int) -> dict[str, tuple]:
    """The shapes of those tensors (H-wide attention, no ``hidden_norm``) for the fields ``parse_llama_config``
    gives."""
    shapes = {k: s for k, s in layer_shapes(fields, fields["hidden_size"]).items() if k in PLAIN_LAYER_KEYS}
    return {f"layers.{i}.{k}": s for i in range(1, num_layers) for k, s in shapes.items()}


def to_engine_layer_ids(feature_layers, engine: str) -> list[int]:
    """headway feature layer ids -> the ids ``engine`` ("vllm", also the speculators format, or "sglang")
    reads from ``eagle_aux_hidden_state_layer_ids`` (see the module docstring for the sources)."""
    shift = _engine_shift(engine)
    return [int(i) - shift for i in feature_layers]


def from_engine_layer_ids(ids, engine: str) -> list[int]:
    """The inverse of :func:`to_engine_layer_ids`."""
    shift = _engine_shift(engine)
    return [int(i) + shift for i in ids]


def _engine_shift(engine: str) -> int:
    if engine not in ("vllm", "sglang"):
        raise ValueError(f"unknown engine {engine!r} for layer ids; use 'vllm' (also speculators) or 'sglang'")
    return 1 if engine == "sglang" else 0


def warn_inexact_layers(layers: list[int], depth: int, fmt: str) -> None:
    odd = [i for i in layers if i in (0, depth)]
    if odd:
        warnings.warn(f"feature layer(s) {odd} of this drafter have no exact counterpart in the engines that "
                      f"read the {fmt!r} layout (0: their residual stream is empty before layer 0; {depth}: "
                      f"headway's is after the final norm, theirs before it); serving may fail or draft worse",
                      UserWarning, stacklevel=3)


def warn_official_config(cfg: EagleConfig, fmt: str) -> None:
    """One line when the official EAGLE runtime (which reads the 'eagle' and 'sglang' layouts) cannot
    represent the head's attention: its config accepts ``rope_scaling`` only as {type: linear|dynamic,
    factor}, and it takes the head size as hidden / heads."""
    if fmt not in ("eagle", "sglang"):
        return
    rope = dict(cfg.rope_scaling or {})
    if rope and not (set(rope) == {"type", "factor"} and rope["type"] in ("linear", "dynamic")):
        warnings.warn(f"the official EAGLE runtime refuses this head's rope_scaling {rope} (its config takes only "
                      f"{{'type': 'linear' or 'dynamic', 'factor': f}}); SGLang and vLLM read this {fmt!r} export",
                      UserWarning, stacklevel=3)
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        warnings.warn(f"the official EAGLE runtime computes the head size as hidden_size / num_attention_heads = "
                      f"{cfg.hidden_size // cfg.num_attention_heads}, not this head's head_dim {cfg.head_dim}; SGLang "
                      f"and vLLM read this {fmt!r} export", UserWarning, stacklevel=3)


def llama_fields(cfg: EagleConfig, dtype: torch.dtype) -> dict:
    """The drafter's layers as a Llama config dict (legacy rope keys: every engine reads them)."""
    return {
        "model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype_name(dtype),
    }


def sorted_features(layers: list[int], fc: torch.Tensor, hidden: int) -> tuple[list[int], torch.Tensor]:
    """Sort the feature layers ascending (engines concatenate in layer order); permute fc's input blocks."""
    order = sorted(range(len(layers)), key=lambda j: layers[j])
    if order == list(range(len(layers))):
        return list(layers), fc
    return [layers[j] for j in order], torch.cat([fc[:, j * hidden:(j + 1) * hidden] for j in order], dim=1)


def parse_llama_config(path: Path, data: dict, what: str, many_layers: bool = False) -> dict:
    """Check the Llama config of a drafter and return EagleConfig's layer fields; ``many_layers``: it may have
    several layers (an EAGLE-3 drafter's), given as ``num_layers``, else exactly one."""
    if data.get("model_type") != "llama":
        raise ValueError(f"{path}: {what} has model_type {data.get('model_type')!r}; headway imports Llama-layer "
                         "EAGLE drafters (model_type 'llama') only")
    need = ["hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "rms_norm_eps"]
    missing = [k for k in need if data.get(k) is None]
    if missing:
        raise ValueError(f"{path}: {what} lacks {missing}")
    depth = data.get("num_hidden_layers", 1)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise ValueError(f"{path}: {what} has num_hidden_layers {depth!r}; a drafter has an integer >= 1 of layers")
    if depth != 1 and not many_layers:
        raise ValueError(f"{path}: {what} has num_hidden_layers {depth}; this drafter kind has exactly one layer "
                         "(EAGLE-3 drafters may have several)")
    biased = [k for k in ("attention_bias", "mlp_bias") if data.get(k)]
    if biased:
        raise ValueError(f"{path}: {what} sets {biased}; headway's EAGLE layer has no attention or MLP biases")
    hidden, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
    rope = dict(data.get("rope_parameters") or {})
    theta = data.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = data.get("rope_scaling")
    if scaling is None and rope:
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling:
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"}:
            scaling = None
    return dict(
        **({"num_layers": depth} if many_layers else {}), hidden_size=hidden, vocab_size=int(data["vocab_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or hidden // heads), intermediate_size=int(data["intermediate_size"]),
        hidden_act=data.get("hidden_act", "silu"), rms_norm_eps=float(data["rms_norm_eps"]),
        rope_theta=float(theta), rope_scaling=scaling or None,
        max_position_embeddings=int(data.get("max_position_embeddings") or 8192))


def layer_shapes(f: dict, in_width: int) -> dict[str, tuple]:
    h, q, kv = f["hidden_size"], f["num_attention_heads"] * f["head_dim"], f["num_key_value_heads"] * f["head_dim"]
    i = f["intermediate_size"]
    return {"self_attn.q_proj.weight": (q, in_width), "self_attn.k_proj.weight": (kv, in_width),
            "self_attn.v_proj.weight": (kv, in_width), "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
            "post_attention_layernorm.weight": (h,), "input_layernorm.weight": (h,), "hidden_norm.weight": (h,)}
