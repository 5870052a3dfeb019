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

An EAGLE-3 drafter of N > 1 layers (``num_layers``; ``num_hidden_layers`` in the config) has plain pre-norm layers
``layers.1`` .. ``layers.{N-1}`` (no ``hidden_norm``, H-wide attention) after the first: speculators builds them
so and vLLM's ``Eagle3LlamaForCausalLM`` reads them (its layer 0 reads 2H, the others H). Only "speculators"
exports them (SGLang's EAGLE-3 model has one ``midlayer``); import also reads a flat config whose first layer is
``midlayer.*`` and the rest ``layers.{i}.*`` (vLLM maps ``midlayer.`` to ``layers.0.``), and ``midlayer.*`` in a
speculators folder.

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

The pieces live by family: the official layouts here, the speculators config in
``headway.heads.formats.speculators``, the one-layer Llama config and the layer-id numbering both
share in ``headway.heads.formats.llama_layer``, folder I/O in ``headway.heads.formats.folder``.

Import reads any of the three back into an :class:`EagleHead` with identical weights. What the
foreign configs lack comes, in this order, from the ``"headway"`` block export writes into
config.json (``num_target_layers``, ``base_model_name_or_path``; engines ignore it), from the
format's own fields (speculators' verifier; a verifier that is a local folder gives the depth),
then from keyword arguments; a keyword that contradicts the folder is a ValueError naming both.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from headway.heads.base import CONFIG_NAME, WEIGHTS_NAME, load_state_strict, read_weights
from headway.heads.eagle import EagleConfig, EagleHead
from headway.heads.peagle import PEagleConfig, PEagleHead
from headway.heads.formats import speculators
from headway.heads.formats.folder import (check_tensors, headway_block, local_model_config, open_folder, pick_field,
                                          read_config, read_keys, text_config, write_folder)
from headway.heads.formats.llama_layer import (EAGLE3_LAYER_KEYS, LAYER_KEYS, deeper_layer_shapes,
                                               deeper_layer_tensors, from_engine_layer_ids, layer_shapes,
                                               llama_fields, parse_llama_config, sorted_features,
                                               to_engine_layer_ids, warn_inexact_layers, warn_official_config)
from headway.heads.formats.speculators import SPECULATORS_VERSION
from headway.heads.target.features import check_feature_layers, num_layers

__all__ = ["FORMATS", "SPECULATORS_VERSION", "detect_eagle_format", "export_eagle", "from_engine_layer_ids",
           "import_eagle", "to_engine_layer_ids"]

LAYOUTS = {"eagle": "EAGLE-1", "sglang": "EAGLE-3 (SGLang)", "speculators": "speculators eagle3"}
FORMATS = tuple(LAYOUTS)
_VERSION_OF = {"eagle": 1, "sglang": 3, "speculators": 3}
# EAGLE-1: the official checkpoints carry "LlamaForCausalLM"; vLLM maps it to EagleLlamaForCausalLM in every
# v1 release (early ones prefix "Eagle" unconditionally, so "EagleLlamaForCausalLM" would become
# "EagleEagleLlamaForCausalLM" there); the official EAGLE code ignores the field.
EAGLE1_ARCHITECTURE = "LlamaForCausalLM"
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
_EAGLE1_ARCHITECTURES = {"LlamaForCausalLM", "EagleLlamaForCausalLM", "LlamaForCausalLMEagle"}


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
    warn_official_config(cfg, fmt)
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
        tensors.update({f"layers.0.{k}": state[f"layers.0.{k}"] for k in LAYER_KEYS})
        if cfg.store_embeddings:
            tensors["embed_tokens.weight"] = state["embed_tokens.weight"]
        config = {"architectures": [EAGLE1_ARCHITECTURE], **llama_fields(cfg, dtype), "bias": bool(cfg.fc_bias),
                  "headway": meta}
        return write_folder(out_dir, config, tensors, overwrite)

    if cfg.fc_bias:
        raise ValueError(f"the {fmt!r} layout has no fc bias (SGLang, vLLM and speculators build fc without one); "
                         "this EAGLE-3 head has fc_bias=True and cannot be exported")
    if fmt == "sglang" and speculators.is_peagle(cfg):
        raise ValueError("this head is P-EAGLE (parallel drafting); SGLang's EAGLE-3 layout cannot carry it: export "
                         "it as 'speculators' (vLLM reads it as parallel_drafting)")
    if fmt == "sglang" and cfg.normalize_features:
        raise ValueError("this head is EAGLE-3.1 (normalize_features: a norm per feature layer, post-norm states fed "
                         "back); the 'sglang' layout has neither: export it as 'speculators' (vLLM's fc_norm + "
                         "norm_output)")
    if fmt == "sglang" and cfg.num_layers > 1:
        raise ValueError(f"this EAGLE-3 head has {cfg.num_layers} decoder layers; SGLang's EAGLE-3 model has one "
                         "(midlayer): export it as 'speculators' (vLLM reads num_hidden_layers layers)")
    if fmt == "sglang" and len(cfg.feature_layers) != 3:
        raise ValueError(f"SGLang and vLLM read exactly 3 target layers for EAGLE-3 (fc is 3 x hidden wide); "
                         f"this head reads {len(cfg.feature_layers)} ({cfg.feature_layers})")
    layers, fc = sorted_features(cfg.feature_layers, state["fc.weight"], cfg.hidden_size)
    warn_inexact_layers(layers, cfg.num_target_layers, fmt)
    prefix = "midlayer." if fmt == "sglang" else speculators.LAYER_PREFIX
    tensors = {"fc.weight": fc}
    if cfg.normalize_features:  # fc_norm.{i}: the norm of the i-th block of fc's input, in the engines' (sorted) order
        order = sorted(range(len(cfg.feature_layers)), key=lambda j: cfg.feature_layers[j])
        tensors.update({f"fc_norm.{i}.weight": state[f"fc_norm.{j}.weight"] for i, j in enumerate(order)})
    tensors.update({prefix + k: state[f"midlayer.{k}"] for k in EAGLE3_LAYER_KEYS})
    tensors.update(deeper_layer_tensors(state, cfg.num_layers))
    tensors["norm.weight"] = state["norm.weight"]
    tensors["lm_head.weight"] = state["lm_head.weight"]
    if speculators.is_peagle(cfg):
        tensors["mask_hidden"] = speculators.peagle_mask_hidden(state, cfg.feature_layers, cfg.hidden_size)
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
        config = {"architectures": [EAGLE3_ARCHITECTURE], **llama_fields(cfg, dtype),
                  "draft_vocab_size": cfg.output_size, **stored,
                  "norm_before_residual": False,
                  "eagle_aux_hidden_state_layer_ids": vllm_ids,  # vLLM reads this one (its numbering)
                  "eagle_config": {"use_aux_hidden_state": True,  # SGLang reads this one (its numbering)
                                   "eagle_aux_hidden_state_layer_ids": to_engine_layer_ids(layers, "sglang")},
                  "headway": meta}
        return write_folder(out_dir, config, tensors, overwrite)

    config = speculators.speculators_config(cfg, dtype, vllm_ids, target_name_or_path or cfg.base_model_name_or_path,
                                            speculative_tokens, meta, normalize_features=cfg.normalize_features)
    return write_folder(out_dir, config, tensors, overwrite)


# --- import ----------------------------------------------------------------------------------

def detect_eagle_format(folder) -> str:
    """The layout of an exported EAGLE folder: "eagle", "sglang" or "speculators" (ValueError otherwise)."""
    folder = open_folder(folder, "EAGLE drafter")
    return _detect(folder, read_config(folder, "an EAGLE drafter"), read_keys(folder))


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
    folder = open_folder(folder, "EAGLE drafter")
    config = read_config(folder, "an EAGLE drafter")
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
    head = PEagleHead(cfg) if speculators.is_peagle(cfg) else EagleHead(cfg)
    floats = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(floats) == 1:  # keep the checkpoint's dtype; parameters only (RoPE's inv_freq stays float32)
        dtype = floats.pop()
        for param in head.parameters():
            param.data = param.data.to(dtype)
    load_state_strict(head, state, source)
    head.check_draft_vocab()
    return head.eval()


def _detect(folder: Path, config: dict, keys: set[str]) -> str:
    path = folder / CONFIG_NAME
    if "drafter_type" in config:
        raise ValueError(f"{path} is headway's own format (drafter_type {config['drafter_type']!r}), not an engine "
                         "layout; load it with headway.heads.load_drafter")
    if speculators.is_speculators(config):
        speculators.check_model_type(path, config)
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


def _depth(path: Path, meta: dict, verifier: str | None, given: int | None) -> int:
    depth = meta.get("num_target_layers")
    if depth is None and verifier:  # a verifier that is a local folder gives the depth
        depth = text_config(local_model_config(verifier)).get("num_hidden_layers")
    depth = pick_field(path, "num_target_layers", depth, given)
    if depth is None:
        raise ValueError(f"{path} does not say how many layers the target has; pass num_target_layers= "
                         "(the target's num_hidden_layers)")
    return int(depth)


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
    fields = parse_llama_config(path, data, "the EAGLE-1 config")
    meta = headway_block(config, path)
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
    expected.update({f"layers.0.{k}": s for k, s in layer_shapes(fields, h).items() if k in LAYER_KEYS})
    store = "embed_tokens.weight" in weights
    if store:
        expected["embed_tokens.weight"] = (fields["vocab_size"], h)
    check_tensors(folder, "eagle", weights, expected)
    cfg = EagleConfig(version=1, **fields, num_target_layers=depth, feature_layers=[depth], draft_vocab_size=None,
                      fc_bias=fc_bias, store_embeddings=store,
                      base_model_name_or_path=pick_field(path, "base_model_name_or_path",
                                                    meta.get("base_model_name_or_path"), base_kw))
    return cfg, dict(weights)


def _parse_eagle3(folder, fmt, config, weights, depth_kw, base_kw, layers_kw):
    path = folder / CONFIG_NAME
    meta = headway_block(config, path)
    normalized, own = False, {}
    if fmt == "speculators":
        fields, ids, verifier, normalized = speculators.read_speculators_config(path, config)
        peagle = config["speculators_model_type"] == "peagle"
        engine = "vllm"
        base_from_folder = meta["base_model_name_or_path"] if "base_model_name_or_path" in meta else verifier
        prefix = speculators.LAYER_PREFIX
    else:
        arch = [a for a in (config.get("architectures") or []) if a not in (EAGLE3_ARCHITECTURE, "LlamaForCausalLM",
                                                                           "Eagle3LlamaForCausalLM")]
        if arch:
            raise ValueError(f"{path}: architectures {arch} are not an EAGLE-3 Llama drafter "
                             f"(expected {EAGLE3_ARCHITECTURE!r})")
        fields = parse_llama_config(path, config, "the EAGLE-3 config", many_layers=True)
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
    if fmt == "speculators" and any(k.startswith("midlayer.") for k in weights):  # vLLM reads it as layers.0.
        if any(k.startswith(prefix) for k in weights):
            raise ValueError(f"{folder / WEIGHTS_NAME} holds both midlayer.* and {prefix}* tensors: one first layer")
        weights = {(prefix + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in weights.items()}
    expected.update({prefix + k: s for k, s in layer_shapes(fields, 2 * h).items()})
    expected.update(deeper_layer_shapes(fields, fields["num_layers"]))
    if fmt == "speculators" and peagle:
        own = speculators.peagle_fields(path, config, weights, len(layers) * h)
        expected["mask_hidden"] = (len(layers) * h,)
    if normalized:  # EAGLE-3.1: one norm per feature layer
        expected.update({f"fc_norm.{i}.weight": (h,) for i in range(len(layers))})
    if "fc.weight" in weights and tuple(weights["fc.weight"].shape) != expected["fc.weight"]:
        raise ValueError(f"{folder / WEIGHTS_NAME}: fc.weight has shape {tuple(weights['fc.weight'].shape)}, but "
                         f"{len(layers)} feature layers {layers} of width {h} need {expected['fc.weight']}")
    reduced = lm_rows != vocab
    optional = {"embed_tokens.weight"}
    if reduced:
        expected.update({"d2t": (lm_rows,), "t2d": (vocab,)})
    else:
        optional |= {"d2t", "t2d"}
    check_tensors(folder, fmt, weights, expected, optional)
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
    cfg = (PEagleConfig if own else EagleConfig)(
        version=3, **fields, num_target_layers=depth, feature_layers=layers,
        draft_vocab_size=lm_rows if "d2t" in state else None, fc_bias=False,
        store_embeddings="embed_tokens.weight" in state, normalize_features=normalized,
        base_model_name_or_path=pick_field(path, "base_model_name_or_path", base_from_folder, base_kw), **own)
    return cfg, state


def _sglang_ids(path: Path, config: dict):
    """Layer ids of the official/SGLang layout: SGLang's eagle_config ids win; vLLM's top-level ones must agree."""
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if nested and top and from_engine_layer_ids(nested, "sglang") != from_engine_layer_ids(top, "vllm"):
        raise ValueError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} (SGLang: outputs of "
                         f"those layers) and eagle_aux_hidden_state_layer_ids {list(top)} (vLLM: inputs of those "
                         "layers) name different target layers; fix one, or drop both and pass feature_layers= "
                         "(headway convert: --feature-layers I,J,K)")
    if nested:
        return list(nested), "sglang"
    return (list(top) if top else None), "vllm"


# --- the converter registry's entry (headway.heads.formats.convert) ---------------------------


def detect_layout(folder: Path, config) -> str | None:
    if not isinstance(config, dict):
        return None
    if speculators.is_speculators(config) or _has_fc(folder):
        return detect_eagle_format(folder)  # its errors say precisely what is wrong with the EAGLE folder
    return None


def _has_fc(folder: Path) -> bool:
    try:
        return "fc.weight" in read_keys(folder)
    except ValueError:  # no (readable) model.safetensors
        return False


def read_layout(path, fmt: str, model, *, num_target_layers: int | None = None,
                base_model_name_or_path: str | None = None, feature_layers: list[int] | None = None,
                **options) -> EagleHead:
    if num_target_layers is None and model is not None:
        num_target_layers = num_layers(model)
    return import_eagle(path, fmt, num_target_layers=num_target_layers,
                        base_model_name_or_path=base_model_name_or_path, feature_layers=feature_layers)


def write_layout(head: EagleHead, out, fmt: str, model, *, overwrite: bool = False, widen_vocab: bool = False,
                 with_embeddings: bool = False, speculative_tokens: int = 3, target_name_or_path: str | None = None,
                 **options) -> Path:
    if fmt == "eagle" and head.reduces_vocabulary and not widen_vocab:
        raise ValueError(f"the 'eagle' layout has no reduced draft vocabulary but this EAGLE-1 head scores "
                         f"{head.config.draft_vocab_size} of {head.config.vocab_size} tokens; keep it in "
                         "'headway', or pass widen_vocab=True (--widen-vocab) to score the whole vocabulary")
    embeddings = None
    if with_embeddings:
        if model is None:
            raise ValueError("with_embeddings copies the target's input embedding into the export: name the target "
                             "(target=..., --target MODEL)")
        embeddings = model.get_input_embeddings().weight
    return export_eagle(head, out, fmt, target_name_or_path=target_name_or_path,
                        speculative_tokens=speculative_tokens, overwrite=overwrite, embeddings=embeddings)
