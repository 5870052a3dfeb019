"""EAGLE drafters in the layouts serving engines load as they are: export and import.

Three layouts (``fmt``), each one folder with ``config.json`` and ``model.safetensors``:

- ``"eagle"``: EAGLE-1/2 as the official code (SafeAILab/EAGLE) and vLLM's ``EagleLlamaForCausalLM``
  load it: a one-layer Llama config (``"bias"`` = fc bias) and tensors ``fc.*``, ``layers.0.*``,
  optionally ``embed_tokens.weight``. EAGLE-1 heads only.
- ``"sglang"``: EAGLE-3 as the official code, SGLang and vLLM load it (``LlamaForCausalLMEagle3``):
  tensors ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``.
- ``"speculators"``: EAGLE-3 as vLLM's ``speculators`` package (0.9.0) writes it
  (``speculators_model_type: "eagle3"``): tensors ``fc.weight``, ``layers.0.*``, ``norm.weight``,
  ``lm_head.weight`` and ``d2t``/``t2d`` when the vocabulary is reduced.

Target layer ids. headway's ``feature_layers`` use transformers' ``hidden_states`` numbering: id i
(0 <= i < L) is the residual stream ENTERING decoder layer i (0: the embedding output) and id L is
the output of the final norm. The engines number the same streams differently:

- vLLM (``eagle_aux_hidden_state_layer_ids`` at the top level of the draft config, and the
  speculators format, which vLLM and the speculators trainer share): id i = the stream entering
  layer i, i.e. headway's id unchanged. Source: vllm/model_executor/models/llama.py,
  ``LlamaModel.forward`` appends ``hidden_states + residual`` when ``idx in aux_hidden_state_layers``
  BEFORE running layer idx; ``get_eagle3_aux_hidden_state_layers`` defaults to (2, L//2, L-3);
  vllm/v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config`` passes the config's ids
  through unchanged (top-level key first, ``eagle_config`` only as a fallback).
- SGLang (``eagle_config.eagle_aux_hidden_state_layer_ids``): id j = the OUTPUT of layer j, i.e.
  the stream entering layer j + 1, so headway id i is written as i - 1. Source:
  python/sglang/srt/models/llama.py, ``set_eagle3_layers_to_capture`` sets
  ``layers_to_capture = [val + 1 for val in layer_ids]`` ("for the ith layer, it takes the output of
  the (i-1)th layer") and ``LlamaModel.forward`` captures ``hidden_states + residual`` before layer
  i for i in ``layers_to_capture``; python/sglang/srt/model_executor/model_runner.py reads the ids
  only from ``eagle_config``. Without ids both engines capture the inputs of layers 2, L//2, L-3.

So the ``"sglang"`` config carries both keys, each in its reader's numbering (top level = headway
ids for vLLM, ``eagle_config`` = headway ids - 1 for SGLang). Engines capture the streams in layer
order, so the export sorts the feature layers and permutes ``fc``'s input blocks to match. Ids 0
and L have no exact engine counterpart (before layer 0 the engines' residual is still empty, and
headway's L is after the final norm where vLLM's is before it); exporting them warns.

Import reads any of the three back into an :class:`EagleHead` with identical weights. What the
foreign configs lack comes, in this order, from the ``"headway"`` block export writes into
config.json (``num_target_layers``, ``base_model_name_or_path``; engines ignore it), from the
format's own fields (speculators' verifier; a verifier that is a local folder gives the depth),
then from keyword arguments; a keyword that contradicts the folder is a ValueError naming both.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from headway.heads.base import CONFIG_NAME, WEIGHTS_NAME, load_state_strict, read_json, read_weights
from headway.heads.eagle import EagleConfig, EagleHead
from headway.heads.features import check_feature_layers
from headway.heads.files import share, temporary_folder

__all__ = ["FORMATS", "SPECULATORS_VERSION", "detect_eagle_format", "export_eagle", "from_engine_layer_ids",
           "import_eagle", "to_engine_layer_ids"]

FORMATS = ("eagle", "sglang", "speculators")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose eagle3 config and tensor names are matched
_VERSION_OF = {"eagle": 1, "sglang": 3, "speculators": 3}
# EAGLE-1: the official checkpoints carry "LlamaForCausalLM"; vLLM maps it to EagleLlamaForCausalLM in every
# v1 release (early ones prefix "Eagle" unconditionally, so "EagleLlamaForCausalLM" would become
# "EagleEagleLlamaForCausalLM" there); the official EAGLE code ignores the field.
EAGLE1_ARCHITECTURE = "LlamaForCausalLM"
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"
_EAGLE1_ARCHITECTURES = {"LlamaForCausalLM", "EagleLlamaForCausalLM", "LlamaForCausalLMEagle"}
_LAYER_KEYS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "post_attention_layernorm.weight"]
_EAGLE3_LAYER_KEYS = _LAYER_KEYS + ["input_layernorm.weight", "hidden_norm.weight"]


# --- layer ids -------------------------------------------------------------------------------

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


def _warn_inexact_layers(layers: list[int], depth: int, fmt: str) -> None:
    odd = [i for i in layers if i in (0, depth)]
    if odd:
        warnings.warn(f"feature layer(s) {odd} of this drafter have no exact counterpart in the engines that "
                      f"read the {fmt!r} layout (0: their residual stream is empty before layer 0; {depth}: "
                      f"headway's is after the final norm, theirs before it); serving may fail or draft worse",
                      UserWarning, stacklevel=3)


# --- export ----------------------------------------------------------------------------------

def export_eagle(head: EagleHead, out_dir, fmt: str, *, target_name_or_path: str | None = None,
                 speculative_tokens: int = 3, overwrite: bool = False,
                 embeddings: torch.Tensor | None = None) -> Path:
    """Write ``head`` into ``out_dir`` in the layout ``fmt`` ("eagle", "sglang" or "speculators").

    - "eagle" (EAGLE-1 heads): the official EAGLE-1/2 layout. It has no reduced draft vocabulary: the
      official runtime (and vLLM) score the full target vocabulary through the target's lm_head, so
      a head's ``d2t``/``t2d`` are dropped and the exported drafter proposes from the whole
      vocabulary. ``feature_layers`` must be ``[L]`` (the target's final-norm output, which those
      runtimes feed). ``embed_tokens.weight`` is written only for ``store_embeddings`` heads.
      vLLM's ``EagleLlamaForCausalLM`` builds ``fc`` without a bias, so only ``fc_bias=False``
      heads load there; the official runtime reads both (``"bias"`` in config.json).
    - "sglang" / "speculators" (EAGLE-3 heads): exactly three feature layers for "sglang" (SGLang
      and vLLM size ``fc`` as 3 x hidden), written sorted with ``fc`` permuted to match; no fc
      bias (the engines' ``fc`` has none, and a ``"bias"`` key would also turn on attention biases
      there); no ``embed_tokens`` (the engines reuse the target's; a stored copy is dropped).
      "sglang" always writes ``d2t``/``t2d`` (identity for a full vocabulary); "speculators" only for a
      reduced one, as the speculators package does.
    - "sglang" is also what the official EAGLE-3 runtime (SafeAILab/EAGLE) reads. It loads the target's
      embedding only when config.json has no ``target_hidden_size`` (and reads it from the target's
      sharded ``model.safetensors.index.json``), else keeps a random one, silently. So that key is not
      written (SGLang and vLLM read its absence as ``hidden_size``). ``embeddings`` ([V, H], the
      target's input embedding) writes ``embed_tokens.weight`` as well, together with
      ``target_hidden_size`` so that the official runtime takes the stored copy instead of reading the
      target's files (which it cannot for a target saved as one file); SGLang and vLLM load the copy
      or reuse the target's, the same values.

    The official EAGLE runtimes' config takes ``rope_scaling`` only as ``{type: linear|dynamic,
    factor}`` and computes the head size as hidden / heads; a head outside that is exported with a
    warning (SGLang and vLLM read it).

    ``target_name_or_path`` (default: the head's ``base_model_name_or_path``) names the verifier in
    the speculators config; when it is a local model folder its ``architectures`` are copied too.
    ``speculative_tokens``: the speculators greedy proposal length (vLLM's default
    ``num_speculative_tokens``). The folder is written next to ``out_dir`` and moved into place;
    a non-empty ``out_dir`` is replaced only with ``overwrite=True``. Returns the folder.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown EAGLE export format {fmt!r}; choose one of {list(FORMATS)}")
    if not isinstance(head, EagleHead):
        raise ValueError(f"export_eagle needs an EagleHead, got {type(head).__name__}")
    cfg = head.config
    if cfg.version != _VERSION_OF[fmt]:
        other = "'eagle'" if cfg.version == 1 else "'sglang' or 'speculators'"
        raise ValueError(f"the {fmt!r} layout holds EAGLE-{_VERSION_OF[fmt]} drafters but this head is "
                         f"EAGLE-{cfg.version}; export it as {other}")
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    head.check_draft_vocab()
    _warn_official_config(cfg, fmt)
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    dtype = state["fc.weight"].dtype
    if embeddings is not None:
        if fmt != "sglang":
            raise ValueError(f"embeddings are written only into the 'sglang' layout, not {fmt!r} (the 'eagle' layout "
                             "stores a head's own, with store_embeddings=True)")
        if tuple(embeddings.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"the target's embedding is {list(embeddings.shape)} but the head needs "
                             f"[{cfg.vocab_size}, {cfg.hidden_size}] (vocabulary x hidden size): is it this head's target?")
    meta = {"num_target_layers": cfg.num_target_layers, "base_model_name_or_path": cfg.base_model_name_or_path}
    if fmt == "eagle":
        if cfg.feature_layers != [cfg.num_target_layers]:
            raise ValueError(f"the official EAGLE-1 runtimes feed the target's final-norm output (layer "
                             f"{cfg.num_target_layers}) but this head reads layer(s) {cfg.feature_layers}; "
                             "it cannot be exported to the 'eagle' layout")
        tensors = {"fc.weight": state["fc.weight"]}
        if cfg.fc_bias:
            tensors["fc.bias"] = state["fc.bias"]
        tensors.update({f"layers.0.{k}": state[f"layers.0.{k}"] for k in _LAYER_KEYS})
        if cfg.store_embeddings:
            tensors["embed_tokens.weight"] = state["embed_tokens.weight"]
        config = {"architectures": [EAGLE1_ARCHITECTURE], **_llama_fields(cfg, dtype), "bias": bool(cfg.fc_bias),
                  "headway": meta}
        return write_folder(out_dir, config, tensors, overwrite)

    if cfg.fc_bias:
        raise ValueError(f"the {fmt!r} layout has no fc bias (SGLang, vLLM and speculators build fc without one); "
                         "this EAGLE-3 head has fc_bias=True and cannot be exported")
    if fmt == "sglang" and len(cfg.feature_layers) != 3:
        raise ValueError(f"SGLang and vLLM read exactly 3 target layers for EAGLE-3 (fc is 3 x hidden wide); "
                         f"this head reads {len(cfg.feature_layers)} ({cfg.feature_layers})")
    layers, fc = _sorted_features(cfg.feature_layers, state["fc.weight"], cfg.hidden_size)
    _warn_inexact_layers(layers, cfg.num_target_layers, fmt)
    prefix = "midlayer." if fmt == "sglang" else "layers.0."
    tensors = {"fc.weight": fc}
    tensors.update({prefix + k: state[f"midlayer.{k}"] for k in _EAGLE3_LAYER_KEYS})
    tensors["norm.weight"] = state["norm.weight"]
    tensors["lm_head.weight"] = state["lm_head.weight"]
    draft_vocab = cfg.output_size
    if head.d2t is not None:
        tensors["d2t"], tensors["t2d"] = state["d2t"], state["t2d"]
    elif fmt == "sglang":  # identity mapping: SGLang's hot_token_id = d2t + arange is then arange
        tensors["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    vllm_ids = to_engine_layer_ids(layers, "vllm")
    if fmt == "sglang":
        stored = {}
        if embeddings is not None:
            tensors["embed_tokens.weight"] = embeddings.detach().to("cpu", dtype).contiguous()
            stored = {"target_hidden_size": cfg.hidden_size}
        config = {"architectures": [EAGLE3_ARCHITECTURE], **_llama_fields(cfg, dtype),
                  "draft_vocab_size": draft_vocab, **stored,
                  "norm_before_residual": False,
                  "eagle_aux_hidden_state_layer_ids": vllm_ids,  # vLLM reads this one (its numbering)
                  "eagle_config": {"use_aux_hidden_state": True,  # SGLang reads this one (its numbering)
                                   "eagle_aux_hidden_state_layer_ids": to_engine_layer_ids(layers, "sglang")},
                  "headway": meta}
        return write_folder(out_dir, config, tensors, overwrite)

    verifier = target_name_or_path or cfg.base_model_name_or_path
    config = {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _llama_fields(cfg, dtype),
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": _local_architectures(verifier)},
        },
        "torch_dtype": _dtype_name(dtype),
        "headway": meta,
    }
    return write_folder(out_dir, config, tensors, overwrite)


def _warn_official_config(cfg: EagleConfig, fmt: str) -> None:
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


def _llama_fields(cfg: EagleConfig, dtype: torch.dtype) -> dict:
    """The drafter layer as a one-layer Llama config dict (legacy rope keys: every engine reads them)."""
    return {
        "model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": _dtype_name(dtype),
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sorted_features(layers: list[int], fc: torch.Tensor, hidden: int) -> tuple[list[int], torch.Tensor]:
    """Sort the feature layers ascending (engines concatenate in layer order); permute fc's input blocks."""
    order = sorted(range(len(layers)), key=lambda j: layers[j])
    if order == list(range(len(layers))):
        return list(layers), fc
    return [layers[j] for j in order], torch.cat([fc[:, j * hidden:(j + 1) * hidden] for j in order], dim=1)


def _local_architectures(name_or_path: str | None) -> list[str]:
    path = Path(name_or_path) / CONFIG_NAME if name_or_path else None
    if path is None or not path.is_file():
        return []
    try:
        return list(json.loads(path.read_text()).get("architectures") or [])
    except (json.JSONDecodeError, AttributeError):
        return []


def write_folder(out_dir, config: dict, tensors: dict[str, torch.Tensor], overwrite: bool) -> Path:
    """config.json + model.safetensors, written in a temporary folder beside ``out_dir`` and moved in."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder; choose another output folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; choose another folder or pass overwrite=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_folder(out, f".{out.name}.export-")
    old = None
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        share(tmp)  # mkdtemp and safetensors make them private; the engines may run as another user
        if out.is_dir() and any(out.iterdir()):
            old = temporary_folder(out, f".{out.name}.old-")
            os.replace(out, old)  # onto an empty folder: allowed
        try:
            os.replace(tmp, out)
        except OSError:
            if old is not None and not out.exists():
                os.replace(old, out)  # put the previous contents back
                old = None
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if old is not None:  # the new folder is in place: only now drop the old one
        shutil.rmtree(old, ignore_errors=True)
    return out


# --- import ----------------------------------------------------------------------------------

def detect_eagle_format(folder) -> str:
    """The layout of an exported EAGLE folder: "eagle", "sglang" or "speculators" (ValueError otherwise)."""
    folder = _folder(folder)
    return _detect(folder, _read_config(folder), read_keys(folder))


def import_eagle(folder, fmt: str | None = None, *, version: int | None = None, num_target_layers: int | None = None,
                 base_model_name_or_path: str | None = None, feature_layers: list[int] | None = None) -> EagleHead:
    """Read an EAGLE drafter folder in the "eagle", "sglang" or "speculators" layout into an EagleHead.

    ``fmt`` None detects the layout from config.json and the tensor names; ``fmt`` or ``version``
    (1 or 3) that disagree with the folder are a ValueError naming both. Loading is strict: every
    tensor the layout needs, with its shape; nothing unknown.

    ``num_target_layers`` (the target's depth), ``base_model_name_or_path`` and ``feature_layers``
    (headway ids) fill what the folder lacks: the headway block of an exported config.json, the
    speculators verifier (a local folder gives the depth) and the layer ids in the config come
    first, and a keyword that contradicts them is an error. Without layer ids EAGLE-3 reads the
    engines' default, the inputs of layers 2, L//2, L-3; EAGLE-1 reads ``[L]``.
    ``vocab_size`` is the config's (the target's); a reduced vocabulary must come with ``t2d`` of
    that length and ``d2t`` as long as ``lm_head``. An identity mapping over the whole vocabulary
    imports as ``draft_vocab_size=None``, which is equivalent. Tensors keep their dtype.
    """
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown EAGLE format {fmt!r}; choose one of {list(FORMATS)} or None to detect it")
    if version is not None and version not in (1, 3):
        raise ValueError(f"EAGLE version must be 1 or 3, got {version}")
    folder = _folder(folder)
    config = _read_config(folder)
    weights = read_weights(folder / WEIGHTS_NAME)
    found = _detect(folder, config, set(weights))
    found_version = _VERSION_OF[found]
    if fmt is not None and fmt != found:
        raise ValueError(f"{folder} holds the {found!r} layout (EAGLE-{found_version}) but fmt={fmt!r} "
                         f"(EAGLE-{_VERSION_OF[fmt]}) was asked for; import it with fmt={found!r}")
    if version is not None and version != found_version:
        raise ValueError(f"{folder} holds an EAGLE-{found_version} drafter ({found!r} layout) but EAGLE-{version} "
                         f"was asked for (version={version}); import it with version={found_version}")
    source = str(folder / WEIGHTS_NAME)
    if found == "eagle":
        cfg, state = _parse_eagle1(folder, config, weights, num_target_layers, base_model_name_or_path, feature_layers)
    else:
        cfg, state = _parse_eagle3(folder, found, config, weights, num_target_layers, base_model_name_or_path,
                                   feature_layers)
    head = EagleHead(cfg)
    floats = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(floats) == 1:  # keep the checkpoint's dtype; parameters only (RoPE's inv_freq stays float32)
        dtype = floats.pop()
        for param in head.parameters():
            param.data = param.data.to(dtype)
    load_state_strict(head, state, source)
    head.check_draft_vocab()
    return head.eval()


def _folder(folder) -> Path:
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"no EAGLE drafter folder at {folder}")
    return path


def _read_config(folder: Path) -> dict:
    data = read_json(folder, "an EAGLE drafter")
    if not isinstance(data, dict):
        raise ValueError(f"{folder / CONFIG_NAME} does not hold a JSON object")
    return data


def read_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    path = folder / WEIGHTS_NAME
    if not path.is_file():
        raise ValueError(f"{folder} has no {WEIGHTS_NAME}; headway reads safetensors weights only")
    try:
        with safe_open(str(path), "pt") as f:
            return set(f.keys())
    except Exception as exc:  # safetensors raises its own error types for truncated headers
        raise ValueError(f"{path} is corrupt or truncated ({str(exc).splitlines()[0]})") from None


def _detect(folder: Path, config: dict, keys: set[str]) -> str:
    path = folder / CONFIG_NAME
    if "drafter_type" in config:
        raise ValueError(f"{path} is headway's own format (drafter_type {config['drafter_type']!r}), not an engine "
                         "layout; load it with headway.heads.load_drafter")
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(f"{path} is a speculators {config['speculators_model_type']!r} model; headway imports "
                             "speculators 'eagle3' drafters only")
        return "speculators"
    if any(k.startswith("midlayer.") for k in keys):
        return "sglang"
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        if "lm_head.weight" in keys or "layers.0.hidden_norm.weight" in keys:
            raise ValueError(f"{folder} has EAGLE-3 tensors named layers.0.* but no speculators config "
                             "(speculators_model_type); headway imports EAGLE-3 in the 'sglang' or 'speculators' "
                             "layout")
        return "eagle"
    arch = config.get("architectures")
    raise ValueError(f"{folder} is not an EAGLE drafter in a layout headway imports (architectures {arch}, "
                     f"model_type {config.get('model_type')!r}; expected fc + layers.0.* or midlayer.* tensors "
                     "or a speculators eagle3 config)")


def _llama_config(path: Path, data: dict, what: str) -> dict:
    """Check the one-layer Llama config of a drafter and return EagleConfig's layer fields."""
    if data.get("model_type") != "llama":
        raise ValueError(f"{path}: {what} has model_type {data.get('model_type')!r}; headway imports Llama-layer "
                         "EAGLE drafters (model_type 'llama') only")
    need = ["hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "rms_norm_eps"]
    missing = [k for k in need if data.get(k) is None]
    if missing:
        raise ValueError(f"{path}: {what} lacks {missing}")
    if data.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{path}: {what} has num_hidden_layers {data['num_hidden_layers']}; headway's EAGLE "
                         "drafters have exactly one layer")
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
        hidden_size=hidden, vocab_size=int(data["vocab_size"]), num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or hidden // heads), intermediate_size=int(data["intermediate_size"]),
        hidden_act=data.get("hidden_act", "silu"), rms_norm_eps=float(data["rms_norm_eps"]),
        rope_theta=float(theta), rope_scaling=scaling or None,
        max_position_embeddings=int(data.get("max_position_embeddings") or 8192))


def pick_field(path: Path, name: str, from_folder, given):
    """A value the folder states wins; a keyword fills the gap; both but different is an error."""
    if from_folder is not None and given is not None and from_folder != given:
        raise ValueError(f"{path} says {name}={from_folder!r} but {name}={given!r} was passed; drop the keyword "
                         "or fix the folder")
    return from_folder if from_folder is not None else given


def _depth(path: Path, meta: dict, verifier: str | None, given: int | None) -> int:
    depth = meta.get("num_target_layers")
    if depth is None and verifier:
        vpath = Path(verifier) / CONFIG_NAME
        if vpath.is_file():
            try:
                vcfg = json.loads(vpath.read_text())
                vcfg = vcfg.get("text_config") or vcfg
                depth = vcfg.get("num_hidden_layers")
            except (json.JSONDecodeError, AttributeError):
                depth = None
    depth = pick_field(path, "num_target_layers", depth, given)
    if depth is None:
        raise ValueError(f"{path} does not say how many layers the target has; pass num_target_layers= "
                         "(the target's num_hidden_layers)")
    return int(depth)


def _check_tensors(folder: Path, fmt: str, weights: dict[str, torch.Tensor], expected: dict[str, tuple],
                   optional: set[str] = frozenset()) -> None:
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"{folder / WEIGHTS_NAME} lacks tensor(s) {missing[:6]} that the {fmt!r} layout requires")
    unexpected = sorted(set(weights) - set(expected) - set(optional))
    if unexpected:
        raise ValueError(f"{folder / WEIGHTS_NAME} has tensor(s) {unexpected[:6]} that the {fmt!r} layout does not "
                         "define; headway will not drop weights silently")
    for key, shape in expected.items():
        if tuple(weights[key].shape) != tuple(shape):
            raise ValueError(f"{folder / WEIGHTS_NAME}: {key} has shape {tuple(weights[key].shape)}, the config "
                             f"implies {tuple(shape)}")


def _layer_shapes(f: dict, in_width: int) -> dict[str, tuple]:
    h, q, kv = f["hidden_size"], f["num_attention_heads"] * f["head_dim"], f["num_key_value_heads"] * f["head_dim"]
    i = f["intermediate_size"]
    return {"self_attn.q_proj.weight": (q, in_width), "self_attn.k_proj.weight": (kv, in_width),
            "self_attn.v_proj.weight": (kv, in_width), "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
            "post_attention_layernorm.weight": (h,), "input_layernorm.weight": (h,), "hidden_norm.weight": (h,)}


def _parse_eagle1(folder, config, weights, depth_kw, base_kw, layers_kw):
    path = folder / CONFIG_NAME
    data = config
    if config.get("model_type") == "eagle" and isinstance(config.get("model"), dict):  # vLLM's older wrapper
        outer = {k: v for k, v in config.items() if k not in ("model", "model_type", "architectures")}
        data = {**config["model"], **outer}
    arch = [a for a in (data.get("architectures") or []) if a not in _EAGLE1_ARCHITECTURES]
    if arch:
        raise ValueError(f"{path}: architectures {arch} are not an EAGLE-1 Llama drafter "
                         f"(expected one of {sorted(_EAGLE1_ARCHITECTURES)})")
    fields = _llama_config(path, data, "the EAGLE-1 config")
    meta = config.get("headway") or {}
    depth = _depth(path, meta, None, depth_kw)
    fc_bias = "fc.bias" in weights
    if "bias" in data and bool(data["bias"]) != fc_bias:
        raise ValueError(f"{path} says bias={data['bias']} but {folder / WEIGHTS_NAME} "
                         f"{'has' if fc_bias else 'lacks'} fc.bias; fix the config or the weights")
    layers = pick_field(path, "feature_layers", None, layers_kw) or [depth]
    if list(layers) != [depth]:
        raise ValueError(f"EAGLE-1 drafters read the target's final-norm output (layer {depth}), not {list(layers)}")
    h = fields["hidden_size"]
    expected = {"fc.weight": (h, 2 * h)}
    if fc_bias:
        expected["fc.bias"] = (h,)
    expected.update({f"layers.0.{k}": s for k, s in _layer_shapes(fields, h).items() if k in _LAYER_KEYS})
    store = "embed_tokens.weight" in weights
    if store:
        expected["embed_tokens.weight"] = (fields["vocab_size"], h)
    _check_tensors(folder, "eagle", weights, expected)
    cfg = EagleConfig(version=1, **fields, num_target_layers=depth, feature_layers=[depth], draft_vocab_size=None,
                      fc_bias=fc_bias, store_embeddings=store,
                      base_model_name_or_path=pick_field(path, "base_model_name_or_path",
                                                    meta.get("base_model_name_or_path"), base_kw))
    return cfg, dict(weights)


def _parse_eagle3(folder, fmt, config, weights, depth_kw, base_kw, layers_kw):
    path = folder / CONFIG_NAME
    meta = config.get("headway") or {}
    if fmt == "speculators":
        layer_cfg = config.get("transformer_layer_config")
        if not isinstance(layer_cfg, dict):
            raise ValueError(f"{path} lacks a transformer_layer_config object")
        fields = _llama_config(path, layer_cfg, "transformer_layer_config")
        if "norm_before_residual" not in config:
            raise ValueError(f"{path} lacks norm_before_residual (speculators reads its absence as false, vLLM as "
                             "true); add the value the drafter was trained with")
        odd = [k for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output") if config.get(k)]
        if odd:
            raise ValueError(f"{path} sets {odd}; headway's EAGLE-3 layer has none of these norms")
        verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        ids, engine = config.get("eagle_aux_hidden_state_layer_ids"), "vllm"
        base_from_folder = meta["base_model_name_or_path"] if "base_model_name_or_path" in meta else verifier
        prefix = "layers.0."
    else:
        arch = [a for a in (config.get("architectures") or []) if a not in (EAGLE3_ARCHITECTURE, "LlamaForCausalLM",
                                                                           "Eagle3LlamaForCausalLM")]
        if arch:
            raise ValueError(f"{path}: architectures {arch} are not an EAGLE-3 Llama drafter "
                             f"(expected {EAGLE3_ARCHITECTURE!r})")
        fields = _llama_config(path, config, "the EAGLE-3 config")
        if config.get("norm_before_residual"):
            raise ValueError(f"{path} sets norm_before_residual; headway's EAGLE-3 residual runs on the raw hidden "
                             "state (norm_before_residual false)")
        if config.get("bias"):
            raise ValueError(f"{path} sets bias (an fc bias); headway's EAGLE-3 fc has none")
        ids, engine = _sglang_ids(path, config)
        verifier = None
        base_from_folder = meta.get("base_model_name_or_path")
        prefix = "midlayer."
    h = fields["hidden_size"]
    target_hidden = config.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != h:
        raise ValueError(f"{path}: target_hidden_size {target_hidden} differs from hidden_size {h}; headway's "
                         "drafter layer is as wide as the target")
    depth = _depth(path, meta, verifier, depth_kw)
    if ids:
        layers = from_engine_layer_ids(ids, engine)
        if layers_kw is not None and list(layers_kw) != layers:
            raise ValueError(f"{path} names feature layers {layers} (headway ids; {engine} ids {list(ids)}) but "
                             f"feature_layers={list(layers_kw)} was passed")
    else:
        layers = list(layers_kw) if layers_kw is not None else [2, depth // 2, depth - 3]
    layers = check_feature_layers(layers, depth, source=f"{path}: feature layers")
    vocab = fields["vocab_size"]
    lm_rows = weights["lm_head.weight"].shape[0] if "lm_head.weight" in weights else None
    draft = config.get("draft_vocab_size")
    if lm_rows is None:
        lm_rows = int(draft) if draft is not None else vocab
    if draft is not None and int(draft) != lm_rows:
        raise ValueError(f"{path} says draft_vocab_size {draft} but lm_head.weight has {lm_rows} rows")
    expected = {"fc.weight": (h, len(layers) * h), "norm.weight": (h,), "lm_head.weight": (lm_rows, h)}
    expected.update({prefix + k: s for k, s in _layer_shapes(fields, 2 * h).items()})
    if "fc.weight" in weights and tuple(weights["fc.weight"].shape) != expected["fc.weight"]:
        raise ValueError(f"{folder / WEIGHTS_NAME}: fc.weight has shape {tuple(weights['fc.weight'].shape)}, but "
                         f"{len(layers)} feature layers {layers} of width {h} need {expected['fc.weight']}")
    reduced = lm_rows != vocab
    optional = {"embed_tokens.weight"}
    if reduced:
        expected.update({"d2t": (lm_rows,), "t2d": (vocab,)})
    else:
        optional |= {"d2t", "t2d"}
    _check_tensors(folder, fmt, weights, expected, optional)
    if "embed_tokens.weight" in weights and tuple(weights["embed_tokens.weight"].shape) != (vocab, h):
        raise ValueError(f"{folder / WEIGHTS_NAME}: embed_tokens.weight has shape "
                         f"{tuple(weights['embed_tokens.weight'].shape)}, the config implies {(vocab, h)}")
    state = {("midlayer." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in weights.items()}
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if (d2t is None) != (t2d is None):
        raise ValueError(f"{folder / WEIGHTS_NAME} has only one of d2t/t2d; both or neither")
    if d2t is not None:
        if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise ValueError(f"{folder / WEIGHTS_NAME}: d2t has dtype {d2t.dtype}; it holds int64 id offsets")
        if t2d.dtype != torch.bool and not bool(((t2d == 0) | (t2d == 1)).all()):
            raise ValueError(f"{folder / WEIGHTS_NAME}: t2d has dtype {t2d.dtype} with values other than 0/1; "
                             "it is a bool mask over the target vocabulary")
        if tuple(t2d.shape) != (vocab,) or tuple(d2t.shape) != (lm_rows,):
            raise ValueError(f"{folder / WEIGHTS_NAME}: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not "
                             f"match draft_vocab_size {lm_rows} / vocab_size {vocab}")
        d2t, t2d = d2t.to(torch.long), t2d.to(torch.bool)
        identity = not reduced and not bool(d2t.any()) and bool(t2d.all())
        if reduced or not identity:
            state["d2t"], state["t2d"] = d2t, t2d
    cfg = EagleConfig(version=3, **fields, num_target_layers=depth, feature_layers=layers,
                      draft_vocab_size=lm_rows if "d2t" in state else None, fc_bias=False,
                      store_embeddings="embed_tokens.weight" in state,
                      base_model_name_or_path=pick_field(path, "base_model_name_or_path", base_from_folder, base_kw))
    return cfg, state


def _sglang_ids(path: Path, config: dict):
    """Layer ids of the official/SGLang layout: SGLang's eagle_config ids win; vLLM's top-level ones must agree."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if nested and top and from_engine_layer_ids(nested, "sglang") != from_engine_layer_ids(top, "vllm"):
        raise ValueError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} (SGLang: outputs of "
                         f"those layers) and eagle_aux_hidden_state_layer_ids {list(top)} (vLLM: inputs of those "
                         "layers) name different target layers; fix one, or drop both and pass feature_layers=")
    if nested:
        return list(nested), "sglang"
    return (list(top) if top else None), "vllm"
