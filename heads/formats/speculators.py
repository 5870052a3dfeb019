"""EAGLE-3 drafters as vLLM's ``speculators`` package (0.9.0) writes and reads them
(``speculators_model_type: "eagle3"``): the config (the drafter layer as ``transformer_layer_config``,
the verifier, the proposal method) and its reading back. Tensors: ``fc.weight``, ``layers.0.*`` (and
``layers.{i}.*`` for a drafter of ``num_hidden_layers`` > 1), ``norm.weight``, ``lm_head.weight``,
``d2t``/``t2d`` when the vocabulary is reduced, and for EAGLE-3.1
(``fc_norm: true``, ``norm_output: true``: a norm per captured layer before ``fc``, the post-norm
state fed to the next step) ``fc_norm.{i}.weight`` in the order of the layer ids. Layer ids
use vLLM's numbering (headway's ids unchanged). Folder writing and the tensor checks are
``headway.heads.formats.eagle``'s, which exports and imports this layout beside the official ones."""

from __future__ import annotations

from pathlib import Path

import torch

from headway.heads.eagle import EagleConfig
from headway.heads.formats.folder import dtype_name, local_model_config
from headway.heads.formats.llama_layer import llama_fields, parse_llama_config, sorted_features

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose eagle3 config and tensor names are matched
SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"
PEAGLE_ARCHITECTURE = "PEagleSpeculator"  # speculators' PEagleSpeculatorConfig default
LAYER_PREFIX = "layers.0."  # the drafter layer's tensors (headway's midlayer.*)
_EXTRA_NORMS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
EAGLE31_NORMS = ("fc_norm", "norm_output")  # EAGLE-3.1 as vLLM reads it: both set, together


def speculators_config(cfg: EagleConfig, dtype, layer_ids: list[int], verifier: str | None, speculative_tokens: int,
                       meta: dict, *, normalize_features: bool = False) -> dict:
    """config.json of the layout; ``layer_ids`` in vLLM's numbering, ``verifier`` the target's name or folder
    (a local folder's ``architectures`` are copied), ``meta`` headway's own block (engines ignore it). A P-EAGLE
    head's config (``parallel_depths``) is written as speculators' ``peagle`` model: its ``mask_token_id``, and
    its depths as the proposal's ``speculative_tokens`` (what vLLM drafts per pass)."""
    peagle = is_peagle(cfg)
    algorithm = "peagle" if peagle else "eagle3"
    if peagle:
        speculative_tokens = cfg.parallel_depths
    return {
        "architectures": [PEAGLE_ARCHITECTURE if peagle else SPECULATORS_ARCHITECTURE],
        "speculators_model_type": algorithm,
        **({"mask_token_id": cfg.mask_token_id} if peagle else {}),
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": llama_fields(cfg, dtype),
        "draft_vocab_size": cfg.output_size,
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": layer_ids,
        **{norm: False for norm in _EXTRA_NORMS},
        **({name: True for name in EAGLE31_NORMS} if normalize_features else {}),
        "speculators_config": speculators_block(algorithm, speculative_tokens, verifier),
        "torch_dtype": dtype_name(dtype),
        "headway": meta,
    }


def speculators_block(algorithm: str, speculative_tokens: int, verifier: str | None) -> dict:
    """The ``speculators_config`` object: the greedy proposal of ``speculative_tokens`` and the verifier (a local
    folder's ``architectures`` are copied); the DFlash export (``headway.heads.formats.dflash``) shares it."""
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": verifier,
                     "architectures": list((local_model_config(verifier) or {}).get("architectures") or [])},
    }


def is_speculators(config: dict) -> bool:
    return "speculators_model_type" in config


def check_model_type(path: Path, config: dict) -> None:
    if config["speculators_model_type"] not in ("eagle3", "peagle"):
        raise ValueError(f"{path} is a speculators {config['speculators_model_type']!r} model; headway's EAGLE "
                         "importer reads speculators 'eagle3' and 'peagle' drafters only (read a 'dflash' one with "
                         "load_any or headway.heads.formats.dflash.import_dflash)")


def is_peagle(cfg) -> bool:
    """Whether a drafter config is P-EAGLE's (it drafts ``parallel_depths`` tokens per pass)."""
    return getattr(cfg, "parallel_depths", None) is not None


def peagle_mask_hidden(state: dict, layers: list[int], hidden: int) -> torch.Tensor:
    """A P-EAGLE head's ``mask_hidden`` [F] in the engines' (sorted) layer order, as speculators stores it [1, 1, F]:
    it is fc's input, whose blocks the export sorts."""
    return sorted_features(layers, state["mask_hidden"][None], hidden)[1].reshape(1, 1, -1)


def peagle_fields(path: Path, config: dict, weights: dict, width: int) -> dict:
    """PEagleConfig's own fields of a speculators ``peagle`` folder (the depths drafted per pass and the mask
    token), after checking ``mask_hidden`` [1, 1, width] (or [width]) is there; the tensor is reshaped in place."""
    if config.get("mask_token_id") is None:
        raise ValueError(f"{path} is a speculators peagle model without mask_token_id (vLLM needs it too); add the "
                         "token id the drafter was trained with")
    mask = weights.get("mask_hidden")
    if mask is None or mask.numel() != width:
        raise ValueError(f"{path.parent / 'model.safetensors'}: a P-EAGLE drafter needs mask_hidden of {width} values "
                         f"(fc's input width), got {None if mask is None else tuple(mask.shape)}")
    weights["mask_hidden"] = mask.reshape(width)
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    depths = methods[0].get("speculative_tokens")
    if not isinstance(depths, int) or depths < 2:
        raise ValueError(f"{path}: a P-EAGLE drafter's speculators_config.proposal_methods[0].speculative_tokens (the "
                         f"tokens drafted per pass) must be an integer >= 2, got {depths!r}")
    return {"parallel_depths": depths, "mask_token_id": int(config["mask_token_id"])}


def read_speculators_config(path: Path, config: dict) -> tuple[dict, list[int] | None, str | None, bool]:
    """(EagleConfig's layer fields, the layer ids in vLLM's numbering or None, the verifier's name or folder,
    whether it is EAGLE-3.1: ``fc_norm`` and ``norm_output`` both set)."""
    layer_cfg = config.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise ValueError(f"{path} lacks a transformer_layer_config object")
    fields = parse_llama_config(path, layer_cfg, "transformer_layer_config", many_layers=True)
    if "norm_before_residual" not in config:
        raise ValueError(f"{path} lacks norm_before_residual (speculators reads its absence as false, vLLM as "
                         "true); add the value the drafter was trained with")
    normalized = all(config.get(k) for k in EAGLE31_NORMS)
    odd = [k for k in _EXTRA_NORMS if config.get(k) and not (normalized and k in EAGLE31_NORMS)]
    if odd:
        raise ValueError(f"{path} sets {odd}; headway reads EAGLE-3 (none of these norms) and EAGLE-3.1 (fc_norm and "
                         "norm_output together), not this combination")
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return fields, config.get("eagle_aux_hidden_state_layer_ids"), verifier, normalized
