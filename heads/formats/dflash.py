"""DFlash drafters (``headway.heads.dflash.DFlashHead``) in the two public layouts: export and import.

Both layouts are one folder with ``config.json`` and ``model.safetensors`` holding exactly the drafter's
body under the same names: ``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.{input,post_attention}_layernorm.weight`` and ``norm.weight``. Neither stores the embedding
or the lm_head: a full-vocabulary DFlash drafter scores through the target's own.

- ``"speculators"``: speculators' ``dflash`` model (speculators 0.9: ``models/dflash/config.py``
  ``DFlashSpeculatorConfig``, ``models/dflash/core.py`` ``DFlashDraftModel``, whose layers are
  ``models/dflash/model_definitions.py`` ``Qwen3DFlashDecoderLayer``). config.json: the draft layers as a
  Qwen3 ``transformer_layer_config`` (``num_hidden_layers`` = the drafter's layers), ``draft_vocab_size``
  (= the vocabulary), ``block_size``, ``target_hidden_size``, ``aux_hidden_state_layer_ids`` (transformers
  ``hidden_states`` ids: headway's ``feature_layers`` unchanged), ``mask_token_id``, and the proposal
  (``block_size - 1`` greedy tokens) and verifier in ``speculators_config``. ``DFlashDraftModel`` lists
  ``embed_tokens`` and a full-vocabulary ``lm_head`` as missing-on-load and refills both from the verifier
  (``load_verifier_weights``), so the folder loads with ``DFlashDraftModel.from_pretrained``. The layout
  name is shared with EAGLE-3: ``headway.heads.formats.convert`` sends ``speculators_model_type: "dflash"``
  folders and DFlash heads here.
- ``"z-lab"``: z-lab's DFlash checkpoints (e.g. ``z-lab/Qwen3-8B-DFlash-b16``). config.json: the Qwen3
  fields at the top level, ``architectures: ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers``
  and ``dflash_config: {mask_token_id, target_layer_ids}``, where z-lab's id j reads ``hidden_states[j + 1]``
  (so headway id i is written i - 1, and id 0, the embedding output, cannot be written). No ``auto_map``
  is written: z-lab's modeling code is theirs, so the folder loads with their code, or is converted with
  speculators' ``DFlashConverter`` (speculators 0.9 ``convert/dflash/converter.py``, which maps ids + 1).

Features are written in ascending layer order (the engines capture layers in that order) with ``fc``'s
input blocks permuted to match. The ``"headway"`` block in config.json keeps what the layouts lack
(``num_target_layers``, ``base_model_name_or_path``); readers ignore it.

Import reads either layout back into a ``DFlashHead`` with identical tensors and refuses, in one line,
what the head cannot compute: ``sample_from_anchor``, sliding-window or causal blocks, attention biases,
a reduced draft vocabulary, a missing ``mask_token_id``. The target's depth comes from the folder (the
headway block, z-lab's ``num_target_layers``, a verifier that is a local folder), then from
``num_target_layers=``; a keyword that contradicts the folder is an error.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch

from headway.heads.base import CONFIG_NAME, WEIGHTS_NAME, load_state_strict, read_weights
from headway.heads.dflash import DFlashConfig, DFlashHead
from headway.heads.formats import speculators
from headway.heads.formats.folder import (check_tensors, dtype_name, headway_block, local_model_config, open_folder,
                                          pick_field, read_config, text_config, write_folder)
from headway.heads.formats.llama_layer import (layer_shapes, llama_fields, parse_llama_config, sorted_features,
                                               warn_inexact_layers)
from headway.heads.target.features import check_feature_layers, num_layers

__all__ = ["FORMATS", "LAYOUTS", "export_dflash", "import_dflash", "is_speculators_dflash"]

LAYOUTS = {"z-lab": "DFlash (z-lab)"}  # the layouts this family owns ("speculators" is the EAGLE family's name)
FORMATS = ("speculators", "z-lab")
SPECULATORS_ARCHITECTURE = "DFlashSpeculator"  # DFlashSpeculatorConfig's default
ZLAB_ARCHITECTURE = "DFlashDraftModel"
ALGORITHM = "dflash"
# what speculators refills from the verifier on load (DFlashDraftModel._keys_to_ignore_on_load_missing): a folder may
# carry copies (its DFlashConverter saves through from_pretrained's rules), which carry nothing and are not kept
VERIFIER_COPIES = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


# --- the layer config --------------------------------------------------------------------------

def qwen3_fields(cfg: DFlashConfig, dtype: torch.dtype) -> dict:
    """The draft layers as a Qwen3 config dict: the legacy rope keys (``rope_theta``, ``rope_scaling``) as the EAGLE
    exports write them, and ``rope_parameters`` as transformers 5 writes them; every layer full attention."""
    n = cfg.num_layers
    fields = {k: v for k, v in llama_fields(cfg, dtype).items() if k != "mlp_bias"}
    return {**fields, "model_type": "qwen3", "num_hidden_layers": n,
            "rope_parameters": {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": n,
            "layer_types": ["full_attention"] * n}


def parse_qwen3_config(path: Path, data: dict, what: str) -> dict:
    """DFlashConfig's layer fields (and ``num_layers``) from a Qwen3 layer config, or a one-line ValueError."""
    if data.get("model_type") not in ("qwen3", "llama"):
        raise ValueError(f"{path}: {what} has model_type {data.get('model_type')!r}; headway reads DFlash drafters "
                         "of Qwen3 layers (model_type 'qwen3')")
    if data.get("attention_bias"):
        raise ValueError(f"{path}: {what} sets attention_bias; headway's DFlash attention has no biases (Qwen3's "
                         "default): keep the drafter in the format it came in")
    types = data.get("layer_types") or []
    sliding = [i for i, kind in enumerate(types) if kind != "full_attention"]
    if sliding or (not types and data.get("use_sliding_window") and data.get("sliding_window")):
        raise ValueError(f"{path}: {what} has sliding-window layers {sliding or 'all'}; headway's DFlash layers "
                         "attend to the whole context: only full-attention drafters import")
    depth = data.get("num_hidden_layers")
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"{path}: {what} has num_hidden_layers {depth!r}; a DFlash drafter has >= 1 layer")
    fields = parse_llama_config(path, {**data, "model_type": "llama", "num_hidden_layers": 1}, what)
    return {**fields, "num_layers": depth}


def body_shapes(fields: dict, width: int) -> dict[str, tuple]:
    """Every tensor of the layouts with its shape; ``width``: fc's input (hidden size x feature layers)."""
    h, d = fields["hidden_size"], fields["head_dim"]
    layer = {k: s for k, s in layer_shapes(fields, h).items() if k != "hidden_norm.weight"}
    layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    shapes = {"fc.weight": (h, width), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    shapes.update({f"layers.{i}.{k}": s for i in range(fields["num_layers"]) for k, s in layer.items()})
    return shapes


# --- export --------------------------------------------------------------------------------------

def export_dflash(head: DFlashHead, out_dir, fmt: str, *, target_name_or_path: str | None = None,
                  overwrite: bool = False, target=None) -> Path:
    """Write ``head`` into ``out_dir`` in the layout ``fmt`` ("speculators" or "z-lab"; see the module docstring).

    ``target_name_or_path`` (default: the head's ``base_model_name_or_path``) names the speculators verifier (a
    local model folder's ``architectures`` are copied); the proposal drafts ``block_size - 1`` tokens. A head
    reading layer 0 cannot be written as "z-lab". A reduced draft vocabulary goes into "speculators" only, as
    speculators writes it: ``d2t``, ``t2d`` and the target's lm_head rows (``lm_head.weight`` [V', H], which its
    runtimes cannot derive), from ``target`` or the rows the head is bound to. The folder is written beside ``out_dir`` and moved into place;
    a non-empty ``out_dir`` is replaced only with ``overwrite=True``. Returns the folder."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown DFlash export format {fmt!r}; choose one of {list(FORMATS)}")
    if not isinstance(head, DFlashHead):
        raise ValueError(f"export_dflash needs a DFlashHead, got {type(head).__name__}")
    cfg = head.config
    state = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    if head.d2t is not None and fmt == "z-lab":
        if head.reduces_vocabulary:
            raise ValueError(f"this DFlash head scores a draft vocabulary of {cfg.draft_vocab_size} tokens, which "
                             "z-lab's layout cannot hold (its drafters score the target's whole vocabulary); export it "
                             "as 'speculators'")
        # the whole vocabulary in another order: the target's lm_head rows of every token, so scoring the whole
        # vocabulary in target order (z-lab's) proposes the same tokens
        head.check_draft_vocab()
        state.pop("d2t")
        cfg = dataclasses.replace(cfg, draft_vocab_size=None)
    elif head.d2t is not None:
        state.update(draft_vocabulary_tensors(head, target))
    layers, state["fc.weight"] = sorted_features(cfg.feature_layers, state["fc.weight"], cfg.hidden_size)
    dtype = state["fc.weight"].dtype
    meta = {"num_target_layers": cfg.num_target_layers, "base_model_name_or_path": cfg.base_model_name_or_path}
    if fmt == "z-lab":
        config = zlab_config(cfg, dtype, layers, meta)
    else:
        warn_inexact_layers(layers, cfg.num_target_layers, fmt)
        config = speculators_dflash_config(cfg, dtype, layers, target_name_or_path or cfg.base_model_name_or_path,
                                           meta)
    return write_folder(out_dir, config, state, overwrite)


def draft_vocabulary_tensors(head: DFlashHead, target=None) -> dict[str, torch.Tensor]:
    """A reduced vocabulary as speculators stores it: ``t2d`` [V] bool, and ``lm_head.weight``, the target's rows
    of the draft tokens [V', H] (``d2t`` is in the head's state already)."""
    if target is not None:
        head.check_target(target)
        rows = head.draft_rows(target.get_output_embeddings().weight.detach())
    elif head._bound:
        rows = head._bound[1]
    else:
        raise ValueError("a DFlash drafter with a draft vocabulary is written with the target's lm_head rows of it: "
                         "pass target= (headway convert: --target MODEL), or bind_target the head first")
    t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    t2d[head.draft_token_ids.cpu()] = True
    return {"t2d": t2d, "lm_head.weight": rows.detach().to("cpu", head.fc.weight.dtype).contiguous()}


def speculators_dflash_config(cfg: DFlashConfig, dtype: torch.dtype, layers: list[int], verifier: str | None,
                              meta: dict) -> dict:
    """config.json of the "speculators" layout (speculators' ``DFlashSpeculatorConfig``)."""
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": ALGORITHM,
        "speculators_version": speculators.SPECULATORS_VERSION,
        "transformer_layer_config": qwen3_fields(cfg, dtype),
        "draft_vocab_size": cfg.output_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.hidden_size,
        "aux_hidden_state_layer_ids": list(layers),
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": speculators.speculators_block(ALGORITHM, cfg.block_size - 1, verifier),
        "torch_dtype": dtype_name(dtype),
        "headway": meta,
    }


def zlab_config(cfg: DFlashConfig, dtype: torch.dtype, layers: list[int], meta: dict) -> dict:
    """config.json of the "z-lab" layout; ``layers`` in headway's numbering (written - 1)."""
    if 0 in layers:
        raise ValueError(f"this DFlash head reads target layer 0 (the embedding output; feature_layers {layers}), "
                         "which z-lab's target_layer_ids cannot name (they read hidden_states[id + 1]); export it as "
                         "'speculators' or train it on layers >= 1")
    if cfg.num_target_layers in layers:
        warnings.warn(f"this DFlash head reads layer {cfg.num_target_layers} (the target's final-norm output); "
                      "z-lab's code reads it exactly, but speculators' DFlashConverter drops that id (it takes the "
                      "last layer as the verifier's own output), so it cannot convert this folder",
                      UserWarning, stacklevel=3)
    return {
        "architectures": [ZLAB_ARCHITECTURE],
        **qwen3_fields(cfg, dtype),
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": [i - 1 for i in layers]},
        "num_target_layers": cfg.num_target_layers,
        "headway": meta,
    }


# --- import --------------------------------------------------------------------------------------

def is_speculators_dflash(config) -> bool:
    """Whether a config.json (its dict) is speculators' ``dflash`` model."""
    return isinstance(config, dict) and config.get("speculators_model_type") == ALGORITHM


def is_zlab(config) -> bool:
    """Whether a config.json (its dict) is z-lab's DFlash layout (no speculators config, a ``dflash_config``)."""
    return isinstance(config, dict) and not speculators.is_speculators(config) and (
        "dflash_config" in config or ZLAB_ARCHITECTURE in (config.get("architectures") or []))


def holds_speculators_dflash(folder) -> bool:
    """Whether ``folder``'s config.json is speculators' ``dflash`` model (False when unreadable)."""
    return is_speculators_dflash(local_model_config(str(folder)))


def detect_dflash_format(folder: Path, config: dict) -> str:
    """"speculators" or "z-lab", or a one-line ValueError naming what the folder holds instead."""
    path = folder / CONFIG_NAME
    if is_speculators_dflash(config):
        return "speculators"
    if is_zlab(config):
        return "z-lab"
    if "drafter_type" in config:
        raise ValueError(f"{path} is headway's own format (drafter_type {config['drafter_type']!r}), not a DFlash "
                         "layout; load it with headway.heads.load_drafter")
    if speculators.is_speculators(config):
        raise ValueError(f"{path} is a speculators {config['speculators_model_type']!r} model, not a DFlash "
                         "drafter; read it with load_any (the EAGLE importer)")
    raise ValueError(f"{folder} is not a DFlash drafter (architectures {config.get('architectures')}, model_type "
                     f"{config.get('model_type')!r}; expected speculators_model_type 'dflash' or a z-lab "
                     "dflash_config)")


def import_dflash(folder, fmt: str | None = None, *, num_target_layers: int | None = None,
                  base_model_name_or_path: str | None = None, feature_layers: list[int] | None = None) -> DFlashHead:
    """Read a DFlash folder in the "speculators" or "z-lab" layout (``fmt`` None: detected) into a DFlashHead.

    Strict: every body tensor with its shape, nothing else but the verifier copies speculators refills
    (``VERIFIER_COPIES``, identity ``d2t``/``t2d``), which are not kept. ``num_target_layers``,
    ``base_model_name_or_path`` and ``feature_layers`` (headway ids) fill what the folder lacks; one that
    contradicts it is an error. Tensors keep their dtype. The head is unbound: ``bind_target`` it to run it."""
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown DFlash format {fmt!r}; choose one of {list(FORMATS)} or None to detect it")
    folder = open_folder(folder, "DFlash drafter")
    config = read_config(folder, "a DFlash drafter")
    found = detect_dflash_format(folder, config)
    if fmt is not None and fmt != found:
        raise ValueError(f"{folder} holds the {found!r} DFlash layout but fmt={fmt!r} was asked for; import it with "
                         f"fmt={found!r}")
    path = folder / CONFIG_NAME
    parse = _parse_speculators if found == "speculators" else _parse_zlab
    own, ids, depth, base = parse(path, config)
    depth = _depth(path, depth, num_target_layers)
    layers = _feature_layers(path, ids, feature_layers, depth)
    weights = _body(folder, found, read_weights(folder / WEIGHTS_NAME), own, len(layers))
    cfg = DFlashConfig(version=3, **own, num_target_layers=depth, feature_layers=layers,
                       base_model_name_or_path=pick_field(path, "base_model_name_or_path", base,
                                                          base_model_name_or_path))
    head = DFlashHead(cfg)
    floats = {v.dtype for v in weights.values() if v.is_floating_point()}
    if len(floats) == 1:  # keep the checkpoint's dtype; parameters only (RoPE's inv_freq stays float32)
        dtype = floats.pop()
        for param in head.parameters():
            param.data = param.data.to(dtype)
    load_state_strict(head, weights, str(folder / WEIGHTS_NAME))
    return head.eval()


def _parse_speculators(path: Path, config: dict):
    """(DFlashConfig's own fields, layer ids in headway's numbering, the stated depth, the base model)."""
    if config.get("sample_from_anchor"):
        raise ValueError(f"{path} sets sample_from_anchor (the anchor slot drafts too: block_size tokens a pass); "
                         "headway's DFlash drafts from the mask slots only (sample_from_anchor false)")
    layer_cfg = config.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise ValueError(f"{path} lacks a transformer_layer_config object")
    fields = parse_qwen3_config(path, layer_cfg, "transformer_layer_config")
    draft = config.get("draft_vocab_size")
    if draft is not None and not 1 <= int(draft) <= fields["vocab_size"]:
        raise ValueError(f"{path}: draft_vocab_size {draft} is not in 1..{fields['vocab_size']} (the vocabulary)")
    if draft is not None and int(draft) < fields["vocab_size"]:  # the target's rows of d2t's tokens
        fields["draft_vocab_size"] = int(draft)
    target_hidden = config.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != fields["hidden_size"]:
        raise ValueError(f"{path}: target_hidden_size {target_hidden} differs from hidden_size "
                         f"{fields['hidden_size']}; headway's DFlash drafter is as wide as the target")
    meta = headway_block(config, path)
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    depth = meta.get("num_target_layers")
    if depth is None and verifier:  # a verifier that is a local folder gives the depth
        depth = text_config(local_model_config(verifier)).get("num_hidden_layers")
    base = meta["base_model_name_or_path"] if "base_model_name_or_path" in meta else verifier
    own = {**fields, **_block(path, config.get("block_size"), config.get("mask_token_id"))}
    return own, config.get("aux_hidden_state_layer_ids"), depth, base


def _parse_zlab(path: Path, config: dict):
    """As ``_parse_speculators``, for z-lab's config (ids + 1: z-lab reads hidden_states[id + 1])."""
    arch = [a for a in (config.get("architectures") or []) if a != ZLAB_ARCHITECTURE]
    if arch:
        raise ValueError(f"{path}: architectures {arch} are not z-lab's DFlash drafter (expected "
                         f"{ZLAB_ARCHITECTURE!r})")
    flash = config.get("dflash_config")
    if not isinstance(flash, dict):
        raise ValueError(f"{path} lacks a dflash_config object (mask_token_id, target_layer_ids)")
    odd = [k for k in ("sample_from_anchor", "causal", "use_swa") if flash.get(k)]
    if odd:
        raise ValueError(f"{path}: dflash_config sets {odd}; headway's DFlash drafts from the mask slots of a "
                         "bidirectional block over the whole context (all false)")
    fields = parse_qwen3_config(path, config, "the z-lab config")
    draft = config.get("draft_vocab_size")
    if draft is not None and int(draft) != fields["vocab_size"]:
        raise ValueError(f"{path} has a reduced draft vocabulary (draft_vocab_size {draft} of {fields['vocab_size']}); "
                         "headway's DFlash scores the target's whole vocabulary through its lm_head")
    meta = headway_block(config, path)
    depth, noted = config.get("num_target_layers"), meta.get("num_target_layers")
    if depth is not None and noted is not None and depth != noted:
        raise ValueError(f"{path} says num_target_layers {depth} but its headway block says {noted}; fix one")
    depth = noted if depth is None else depth
    ids = flash.get("target_layer_ids")
    block = config.get("block_size") or flash.get("block_size")  # top level in z-lab's Qwen3 drafters
    own = {**fields, **_block(path, block, flash.get("mask_token_id"))}
    return own, None if ids is None else [int(j) + 1 for j in ids], depth, meta.get("base_model_name_or_path")


def _block(path: Path, block_size, mask_token_id) -> dict:
    if mask_token_id is None:
        raise ValueError(f"{path} has no mask_token_id (the token DFlash fills its block with); add the id the "
                         "drafter was trained with")
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"{path} has block_size {block_size!r}; a DFlash block is an integer >= 2 (the anchor and "
                         "its mask slots)")
    return {"block_size": block_size, "mask_token_id": int(mask_token_id)}


def _depth(path: Path, stated, given: int | None) -> int:
    depth = pick_field(path, "num_target_layers", stated, given)
    if depth is None:
        raise ValueError(f"{path} does not say how many layers the target has; pass num_target_layers= "
                         "(the target's num_hidden_layers)")
    return int(depth)


def _feature_layers(path: Path, ids, given, depth: int) -> list[int]:
    """Layer ids in headway's numbering: the folder's, else ``feature_layers=``; both must agree."""
    if ids is not None and given is not None and list(given) != list(ids):
        raise ValueError(f"{path} names feature layers {list(ids)} (headway ids) but feature_layers={list(given)} "
                         "was passed; drop the keyword or fix the folder")
    layers = ids if ids is not None else given
    if layers is None:
        raise ValueError(f"{path} does not name the target layers it reads; pass feature_layers= (headway ids; "
                         "headway convert: --feature-layers I,J,K)")
    return check_feature_layers(layers, depth, source=f"{path}: feature layers")


def _body(folder: Path, fmt: str, weights: dict, own: dict, count: int) -> dict:
    """The body tensors, checked strictly; verifier copies and identity vocabulary maps dropped."""
    expected = body_shapes(own, count * own["hidden_size"])
    fc = weights.get("fc.weight")
    if fc is not None and tuple(fc.shape) != expected["fc.weight"]:
        raise ValueError(f"{folder / WEIGHTS_NAME}: fc.weight has shape {tuple(fc.shape)}, but {count} feature "
                         f"layer(s) of width {own['hidden_size']} need {expected['fc.weight']}")
    rows = own.get("draft_vocab_size") or own["vocab_size"]
    if own.get("draft_vocab_size"):
        expected["d2t"] = (rows,)
        _check_draft_vocabulary(folder, weights, own["vocab_size"], rows)
    else:
        _check_full_vocabulary(folder, weights, own["vocab_size"])
    check_tensors(folder, fmt, weights, expected, optional={*VERIFIER_COPIES, "d2t", "t2d"})
    for key in VERIFIER_COPIES:
        shape = (own["hidden_size"],) if key == "verifier_norm.weight" else \
            (rows if key == "lm_head.weight" else own["vocab_size"], own["hidden_size"])
        if key in weights and tuple(weights[key].shape) != shape:
            raise ValueError(f"{folder / WEIGHTS_NAME}: {key} has shape {tuple(weights[key].shape)}; the target's "
                             f"would be {shape}")
    return {k: v for k, v in weights.items() if k in expected}


def _check_draft_vocabulary(folder: Path, weights: dict, vocab: int, rows: int) -> None:
    """A reduced vocabulary: ``d2t`` [V'] mapping to distinct target ids, and ``t2d`` (when there) marking exactly
    them. Its ``lm_head`` (the target's rows, frozen in speculators) is not kept: headway binds the target's."""
    d2t, t2d = weights.get("d2t"), weights.get("t2d")
    if d2t is None or d2t.numel() != rows:
        raise ValueError(f"{folder / WEIGHTS_NAME}: a draft vocabulary of {rows} tokens needs d2t of {rows} offsets, "
                         f"got {None if d2t is None else tuple(d2t.shape)}")
    ids = d2t.long().flatten() + torch.arange(rows)
    bad = int(ids.min()) < 0 or int(ids.max()) >= vocab or len(torch.unique(ids)) != rows
    if not bad and t2d is not None:
        bad = t2d.numel() != vocab or int(t2d.bool().sum()) != rows or not bool(t2d.bool().flatten()[ids].all())
    if bad:
        raise ValueError(f"{folder / WEIGHTS_NAME}: d2t/t2d do not map {rows} draft tokens to distinct ids of the "
                         f"vocabulary of {vocab}; re-export the drafter")


def _check_full_vocabulary(folder: Path, weights: dict, vocab: int) -> None:
    """A reduced vocabulary (an lm_head of fewer rows, a non-identity d2t/t2d) is refused."""
    rows = weights["lm_head.weight"].shape[0] if "lm_head.weight" in weights else vocab
    d2t, t2d = weights.get("d2t"), weights.get("t2d")
    identity = (d2t is None or (d2t.numel() == vocab and not bool(d2t.any()))) and \
        (t2d is None or (t2d.numel() == vocab and bool(t2d.bool().all())))
    if rows != vocab or not identity:
        raise ValueError(f"{folder / WEIGHTS_NAME} has a reduced draft vocabulary (lm_head rows {rows} of {vocab}, "
                         "or d2t/t2d that are not the identity); headway's DFlash scores the target's whole "
                         "vocabulary through its lm_head")


# --- the converter registry's entry (headway.heads.formats.convert) ---------------------------------

def detect_layout(folder: Path, config) -> str | None:
    """"z-lab" for a z-lab folder; None otherwise (speculators' ``dflash`` folders are detected by the EAGLE
    family, which owns the "speculators" name, and sent here by ``convert``)."""
    return "z-lab" if is_zlab(config) else None


def read_layout(path, fmt: str, model, *, num_target_layers: int | None = None,
                base_model_name_or_path: str | None = None, feature_layers: list[int] | None = None,
                **options) -> DFlashHead:
    """The registry's reader; ``model`` (the target) gives the depth and is bound."""
    if num_target_layers is None and model is not None:
        num_target_layers = num_layers(model)
    head = import_dflash(path, fmt, num_target_layers=num_target_layers,
                         base_model_name_or_path=base_model_name_or_path, feature_layers=feature_layers)
    return head if model is None else head.bind_target(model)


def write_layout(head: DFlashHead, out, fmt: str, model, *, overwrite: bool = False,
                 target_name_or_path: str | None = None, **options) -> Path:
    """The registry's writer; EAGLE's options (``speculative_tokens``: DFlash drafts ``block_size - 1``) are
    ignored."""
    return export_dflash(head, out, fmt, target_name_or_path=target_name_or_path, overwrite=overwrite, target=model)
