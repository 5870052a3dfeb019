"""EAGLE-3 drafters as vLLM's ``speculators`` package (0.9.0) writes and reads them
(``speculators_model_type: "eagle3"``): the config (the drafter layer as ``transformer_layer_config``,
the verifier, the proposal method) and its reading back. Tensors: ``fc.weight``, ``layers.0.*``,
``norm.weight``, ``lm_head.weight``, ``d2t``/``t2d`` when the vocabulary is reduced, and for EAGLE-3.1
(``fc_norm: true``, ``norm_output: true``: a norm per captured layer before ``fc``, the post-norm
state fed to the next step) ``fc_norm.{i}.weight`` in the order of the layer ids. Layer ids
use vLLM's numbering (headway's ids unchanged). Folder writing and the tensor checks are
``headway.heads.formats.eagle``'s, which exports and imports this layout beside the official ones."""

from __future__ import annotations

from pathlib import Path

from headway.heads.eagle import EagleConfig
from headway.heads.formats.folder import dtype_name, local_model_config
from headway.heads.formats.llama_layer import llama_fields, parse_llama_config

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose eagle3 config and tensor names are matched
SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"
LAYER_PREFIX = "layers.0."  # the drafter layer's tensors (headway's midlayer.*)
_EXTRA_NORMS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
EAGLE31_NORMS = ("fc_norm", "norm_output")  # EAGLE-3.1 as vLLM reads it: both set, together


def speculators_config(cfg: EagleConfig, dtype, layer_ids: list[int], verifier: str | None, speculative_tokens: int,
                       meta: dict, *, normalize_features: bool = False) -> dict:
    """config.json of the layout; ``layer_ids`` in vLLM's numbering, ``verifier`` the target's name or folder
    (a local folder's ``architectures`` are copied), ``meta`` headway's own block (engines ignore it)."""
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": llama_fields(cfg, dtype),
        "draft_vocab_size": cfg.output_size,
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": layer_ids,
        **{norm: False for norm in _EXTRA_NORMS},
        **({name: True for name in EAGLE31_NORMS} if normalize_features else {}),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier,
                         "architectures": list((local_model_config(verifier) or {}).get("architectures") or [])},
        },
        "torch_dtype": dtype_name(dtype),
        "headway": meta,
    }


def is_speculators(config: dict) -> bool:
    return "speculators_model_type" in config


def check_model_type(path: Path, config: dict) -> None:
    if config["speculators_model_type"] != "eagle3":
        raise ValueError(f"{path} is a speculators {config['speculators_model_type']!r} model; headway imports "
                         "speculators 'eagle3' drafters only")


def read_speculators_config(path: Path, config: dict) -> tuple[dict, list[int] | None, str | None, bool]:
    """(EagleConfig's layer fields, the layer ids in vLLM's numbering or None, the verifier's name or folder,
    whether it is EAGLE-3.1: ``fc_norm`` and ``norm_output`` both set)."""
    layer_cfg = config.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise ValueError(f"{path} lacks a transformer_layer_config object")
    fields = parse_llama_config(path, layer_cfg, "transformer_layer_config")
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
