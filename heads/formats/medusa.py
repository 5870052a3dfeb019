"""Medusa heads in the layouts other runtimes load: export and import.

Three layouts (``fmt``); head k has ``num_layers`` ResBlocks ``x + SiLU(W x + b)`` then a projection:

- ``"medusa-v0.1"``: the official FasterDecoding/Medusa hub layout. ``config.json``
  {``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``} and
  ``medusa_lm_head.pt``, a torch-saved dict with ``{k}.{j}.linear.weight`` [H, H],
  ``{k}.{j}.linear.bias`` [H] and ``{k}.{L}.weight`` [V, H] (every head has its own projection over
  the whole vocabulary). Read only with ``torch.load(weights_only=True)``; written as a plain dict of
  tensors so that such a load works. The same names in ``medusa_lm_head.safetensors`` (TGI's
  "version 1") are read too.
- ``"medusa-v2"``: text-generation-inference's ``"version": "2"``: ``medusa_lm_head.safetensors``
  with only the ResBlocks; logits go through the base model's own lm_head (headway's
  ``share_lm_head=True``). TGI asserts ``medusa_num_layers == 1`` (server/text_generation_server/
  layers/medusa.py, ``MedusaHeadV2``), so export writes one-block heads only. ``hidden_size`` and
  ``vocab_size`` are written into config.json as well (TGI ignores them) so that import needs no target.
- ``"vllm-medusa"``: vLLM's ``MedusaModel`` (vllm/model_executor/models/medusa.py): ``model_type``
  "medusa", ``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers``,
  ``medusa_fc_bias: true`` (without it vLLM builds the blocks without bias and drops stored biases),
  tensors ``blocks.{k}.layers.{j}.{weight,bias}`` and ``lm_heads.{k}.weight`` in ``model.safetensors``.
  A reduced draft vocabulary is ``truncated_vocab_size`` (its size) plus a ``token_map`` tensor of
  target ids, int64 [V']: vLLM scatters head logits into a full-vocabulary row with
  ``logits[..., token_map] = draft_logits`` (the rest -inf), and slices stored lm_heads that still have
  V rows with ``weight[token_map]``; so ``token_map = d2t + arange``. Heads that share the target's
  lm_head are written with vLLM's ``original_lm_head: true``, where one ``lm_heads.0.weight`` (the
  target's lm_head) serves every head. vLLM's config class also accepts ``medusa_num_heads`` /
  ``medusa_num_layers`` (it renames keys holding "num" and "heads"/"layers"), and its loader strips a
  ``medusa_heads.`` prefix; import does the same.

A layout that cannot hold a drafter is refused with a one-line ``ValueError``: a reduced vocabulary
in ``medusa-v0.1``/``medusa-v2``, own projections in ``medusa-v2`` unless they equal the target's
lm_head, shared projections in ``medusa-v0.1``/``vllm-medusa`` unless the target's lm_head is given
to copy in. Import is strict: every tensor the config implies, with its shape, and nothing else.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import torch

from headway.heads.base import CONFIG_NAME, WEIGHTS_NAME, load_state_strict, read_json, read_weights
from headway.heads.formats.folder import headway_block, local_model_config, pick_field, text_config, write_folder
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.heads.values import first_line

__all__ = ["FORMATS", "PT_NAME", "ST_NAME", "detect_medusa_format", "export_medusa", "import_medusa",
           "read_medusa_pt"]

LAYOUTS = {"medusa-v0.1": "official Medusa v0.1", "medusa-v2": "Medusa version 2 (TGI)",
           "vllm-medusa": "vLLM MedusaModel"}
FORMATS = tuple(LAYOUTS)
PT_NAME = "medusa_lm_head.pt"
ST_NAME = "medusa_lm_head.safetensors"
VLLM_ARCHITECTURE = "MedusaModel"
_VLLM_PREFIX = "medusa_heads."


# --- names -----------------------------------------------------------------------------------

def _layout(cfg: MedusaConfig, fmt: str) -> dict[str, tuple[str, tuple]]:
    """headway tensor name -> (name in ``fmt``, shape) for every ResBlock and own projection."""
    h, depth = cfg.hidden_size, cfg.num_layers
    vllm = fmt == "vllm-medusa"
    names = {}
    for k in range(cfg.num_heads):
        for j in range(depth):
            block = f"blocks.{k}.layers.{j}." if vllm else f"{k}.{j}.linear."
            names[f"blocks.{k}.{j}.linear.weight"] = (block + "weight", (h, h))
            names[f"blocks.{k}.{j}.linear.bias"] = (block + "bias", (h,))
        if not cfg.share_lm_head:
            names[f"lm_heads.{k}.weight"] = (f"lm_heads.{k}.weight" if vllm else f"{k}.{depth}.weight",
                                             (cfg.output_size, h))
    return names


def _check_format(fmt: str | None) -> None:
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown Medusa format {fmt!r}; choose one of {list(FORMATS)}")


# --- export ----------------------------------------------------------------------------------

def export_medusa(heads: MedusaHeads, out_dir, fmt: str, *, target_lm_head: torch.Tensor | None = None,
                  overwrite: bool = False, allow_official_misread: bool = False) -> Path:
    """Write ``heads`` into ``out_dir`` in the layout ``fmt`` (see the module docstring); returns the folder.

    ``target_lm_head`` ([V, H], the target's output projection) is copied in where the layout stores
    projections that the heads share with the target, and compared against where the layout can only
    use the target's (``medusa-v2`` from heads with their own). A non-empty ``out_dir`` is replaced
    only with ``overwrite=True``.

    ``medusa-v0.1`` is read by the official code as one ResBlock object repeated per head
    (``[ResBlock(H)] * medusa_num_layers``), so after loading every block computes with the last
    block's weights. Heads whose blocks differ are refused unless ``allow_official_misread``
    (headway and vLLM read them correctly; the official code will not).
    """
    _check_format(fmt)
    if not isinstance(heads, MedusaHeads):
        raise ValueError(f"export_medusa needs MedusaHeads, got {type(heads).__name__}")
    heads = _unreduced_if_whole(heads)
    cfg = heads.config
    state = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    lm_head = _checked_lm_head(target_lm_head, cfg)
    if cfg.draft_vocab_size and fmt != "vllm-medusa":
        raise ValueError(f"the {fmt!r} layout has no reduced draft vocabulary but these heads score "
                         f"{cfg.draft_vocab_size} of {cfg.vocab_size} tokens; export them as 'vllm-medusa' or "
                         "'headway'")
    if fmt == "medusa-v2":
        return _export_v2(heads, state, lm_head, out_dir, overwrite)
    if fmt == "medusa-v0.1":
        if _distinct_blocks(heads) and not allow_official_misread:
            raise ValueError(f"these heads have {cfg.num_layers} ResBlocks each, but the official Medusa code reads "
                             f"'medusa-v0.1' with one ResBlock object repeated per head (every block gets the last "
                             f"block's weights, so its outputs would be wrong); export them as 'vllm-medusa' or "
                             f"'headway', or pass allow_official_misread=True (--allow-official-misread) to write "
                             f"them anyway for readers that keep the blocks apart")
        source = {**state, **_projections(heads, state, lm_head, fmt)}
        tensors = {name: source[key] for key, (name, _) in _layout(dataclasses.replace(cfg, share_lm_head=False),
                                                                    fmt).items()}
        config = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
                  "base_model_name_or_path": cfg.base_model_name_or_path}
        return write_folder(out_dir, config, tensors, overwrite, weights_name=PT_NAME)
    tensors = {name: state[key] for key, (name, _) in _layout(cfg, fmt).items()}
    config = {"model_type": "medusa", "architectures": [VLLM_ARCHITECTURE], "hidden_size": cfg.hidden_size,
              "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
              "medusa_fc_bias": True}
    if cfg.share_lm_head:  # one stored copy of the target's lm_head serves every head
        if lm_head is None:
            raise _needs_target(fmt)
        tensors["lm_heads.0.weight"] = heads.draft_rows(lm_head).to(_float_dtype(state)).contiguous()
        config["original_lm_head"] = True
    if cfg.draft_vocab_size:
        config["truncated_vocab_size"] = cfg.draft_vocab_size
        tensors["token_map"] = heads.draft_token_ids.to("cpu")
    config["torch_dtype"] = str(_float_dtype(state)).removeprefix("torch.")
    config["headway"] = {"base_model_name_or_path": cfg.base_model_name_or_path}  # vLLM ignores it
    return write_folder(out_dir, config, tensors, overwrite, weights_name=WEIGHTS_NAME)


def _unreduced_if_whole(heads: MedusaHeads) -> MedusaHeads:
    """Heads whose "reduced" draft vocabulary is the whole vocabulary as the same heads without one, which every
    layout holds: vLLM reads ``token_map`` only beside a smaller ``truncated_vocab_size`` (it would take draft row i
    as token i), and the other layouts have no reduced vocabulary at all. Own projections get their rows in target
    id order (draft row i is token ``draft_token_ids[i]``, a permutation of the vocabulary here)."""
    cfg = heads.config
    if heads.d2t is None or heads.reduces_vocabulary:
        return heads
    heads.check_draft_vocab()  # distinct ids in range: as many as the vocabulary, so a permutation of it
    ids = heads.draft_token_ids.cpu()
    state = {k: v for k, v in heads.state_dict().items() if k != "d2t"}
    for i in range(cfg.num_heads if heads.lm_heads is not None else 0):
        rows = state[f"lm_heads.{i}.weight"]  # [V', H], draft order -> [V, H], target order
        state[f"lm_heads.{i}.weight"] = torch.empty_like(rows).index_copy_(0, ids.to(rows.device), rows)
    whole = MedusaHeads(dataclasses.replace(cfg, draft_vocab_size=None))
    whole.load_state_dict(state)
    return whole.to(next(heads.parameters()).dtype)


def _distinct_blocks(heads: MedusaHeads) -> bool:
    """Whether a head's ResBlocks differ (what the official code's repeated ResBlock cannot hold; heads it
    wrote itself carry one block's weights under every block's name)."""
    for blocks in heads.blocks:
        last = blocks[-1].state_dict() if len(blocks) > 1 else {}
        if any(not torch.equal(block.state_dict()[k], v) for block in blocks[:-1] for k, v in last.items()):
            return True
    return False


def _export_v2(heads: MedusaHeads, state, lm_head, out_dir, overwrite: bool) -> Path:
    cfg = heads.config
    if cfg.num_layers != 1:
        raise ValueError(f"the 'medusa-v2' layout holds one ResBlock per head (TGI asserts medusa_num_layers == 1) "
                         f"but these heads have {cfg.num_layers}; export them as 'vllm-medusa' or 'medusa-v0.1'")
    if not cfg.share_lm_head:
        if lm_head is None:
            raise ValueError("the 'medusa-v2' layout scores through the target's own lm_head but these heads have "
                             "their own lm_heads; pass the target (--target) to check that they equal its lm_head, "
                             "or export as 'medusa-v0.1' or 'vllm-medusa'")
        differ = [k for k in range(cfg.num_heads) if not torch.equal(state[f"lm_heads.{k}.weight"],
                                                                     lm_head.to(state[f"lm_heads.{k}.weight"].dtype))]
        if differ:
            raise ValueError(f"the 'medusa-v2' layout scores through the target's own lm_head but the lm_heads of "
                             f"head(s) {differ} differ from it (trained projections); export as 'medusa-v0.1' or "
                             "'vllm-medusa'")
    tensors = {name: state[key] for key, (name, _) in _layout(cfg, "medusa-v2").items() if key.startswith("blocks.")}
    config = {"version": "2", "medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
              "base_model_name_or_path": cfg.base_model_name_or_path,
              "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
    return write_folder(out_dir, config, tensors, overwrite, weights_name=ST_NAME)


def _projections(heads: MedusaHeads, state, lm_head, fmt: str) -> dict[str, torch.Tensor]:
    """``lm_heads.{k}.weight`` [V', H] of every head: its own, or a copy of the target's when shared."""
    if not heads.config.share_lm_head:
        return {k: v for k, v in state.items() if k.startswith("lm_heads.")}
    if lm_head is None:
        raise _needs_target(fmt)
    rows = heads.draft_rows(lm_head).to(_float_dtype(state))
    return {f"lm_heads.{k}.weight": rows.clone() for k in range(heads.config.num_heads)}


def _needs_target(fmt: str) -> ValueError:
    return ValueError(f"these Medusa heads share the target's lm_head (share_lm_head=True) and the {fmt!r} layout "
                      "stores the projection; pass the target (--target) to copy its lm_head in")


def _checked_lm_head(lm_head: torch.Tensor | None, cfg: MedusaConfig) -> torch.Tensor | None:
    if lm_head is None:
        return None
    lm_head = lm_head.detach().to("cpu")
    if tuple(lm_head.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"the target's lm_head is {tuple(lm_head.shape)} but the heads were made for vocab_size "
                         f"{cfg.vocab_size} and hidden_size {cfg.hidden_size}; pass the target they were trained on")
    return lm_head


def _float_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    return next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)


# --- import ----------------------------------------------------------------------------------

def detect_medusa_format(folder, config: dict | None = None) -> str | None:
    """The Medusa layout of ``folder`` ("medusa-v0.1", "medusa-v2" or "vllm-medusa"), or None when its
    config.json does not describe Medusa heads; a Medusa config without head weights is a ValueError."""
    folder = Path(folder)
    config = read_json(folder, "a Medusa drafter") if config is None else config
    if not isinstance(config, dict):
        return None
    if config.get("model_type") == "medusa" or VLLM_ARCHITECTURE in (config.get("architectures") or []):
        return "vllm-medusa"
    if "medusa_num_heads" not in config:
        return None
    if str(config.get("version")) == "2":
        return "medusa-v2"
    if not (folder / PT_NAME).is_file() and not (folder / ST_NAME).is_file():
        raise ValueError(f"{folder} has a Medusa config but neither {PT_NAME} nor {ST_NAME}; a Medusa-2 full model "
                         "(medusa_head.* inside the model weights) is not a heads-only checkpoint headway converts")
    return "medusa-v0.1"


def import_medusa(folder, fmt: str | None = None, *, target_lm_head: torch.Tensor | None = None,
                  vocab_size: int | None = None, base_model_name_or_path: str | None = None) -> MedusaHeads:
    """Read Medusa heads in the layout ``fmt`` (None: detect it) into ``MedusaHeads`` with identical tensors.

    ``vocab_size`` and ``base_model_name_or_path`` fill what the folder lacks (a value that contradicts
    the folder is an error). ``target_lm_head`` ([V, H]) gives the vocabulary size of ``medusa-v2`` heads
    whose config lacks it, and lets ``vllm-medusa`` heads stored with ``original_lm_head`` come back as
    ``share_lm_head=True`` when the stored projection is the target's (otherwise every head gets a copy).
    """
    _check_format(fmt)
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"no Medusa drafter folder at {folder}")
    config = read_json(folder, "a Medusa drafter")
    found = detect_medusa_format(folder, config)
    if found is None:
        raise ValueError(f"{folder / CONFIG_NAME} does not describe Medusa heads (no medusa_num_heads, no model_type "
                         "'medusa')")
    if fmt is not None and fmt != found:
        raise ValueError(f"{folder} holds the {found!r} layout but fmt={fmt!r} was asked for; "
                         f"import it with fmt={found!r}")
    lm_head = None if target_lm_head is None else target_lm_head.detach().to("cpu")
    if found == "vllm-medusa":
        cfg, state, source = _parse_vllm(folder, config, lm_head, vocab_size, base_model_name_or_path)
    else:
        cfg, state, source = _parse_official(folder, found, config, lm_head, vocab_size, base_model_name_or_path)
    if lm_head is not None:
        _checked_lm_head(lm_head, cfg)
    heads = MedusaHeads(cfg)
    floats = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(floats) == 1:  # keep the checkpoint's dtype
        heads.to(floats.pop())
    load_state_strict(heads, state, source)
    return heads.eval()


def read_medusa_pt(path) -> dict[str, torch.Tensor]:
    """The tensors of a torch-saved Medusa checkpoint, loaded with ``weights_only=True`` (no code runs)."""
    path = Path(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is a paragraph; the reason follows "WeightsUnpickler error:" (same or next line)
        tail = str(exc).split("WeightsUnpickler error:", 1)[-1]
        why = next((s.strip() for s in tail.splitlines() if s.strip()), "").split(". ")[0][:200]
        if "global" in why.lower() or "reduce" in why.lower():  # it names code the pickle would import and run
            raise ValueError(f"{path} needs arbitrary code to unpickle, which headway never runs (torch.load with "
                             f"weights_only=True refused it: {why}); re-save it as a plain dict of tensors") from None
        raise ValueError(f"{path} is not a readable torch checkpoint ({why}); re-download or re-export it") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable torch checkpoint ({first_line(exc)}); "
                         "re-download or re-export it") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                             for k, v in data.items()):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a dict of named tensors (a Medusa head "
                         "state dict)")
    return dict(data)


def _parse_official(folder: Path, fmt: str, config: dict, lm_head, vocab_kw, base_kw):
    path = folder / CONFIG_NAME
    num_heads = _positive(path, config, "medusa_num_heads")
    depth = config.get("medusa_num_layers", 1)  # the official config's default
    if not isinstance(depth, int) or depth < 0:
        raise ValueError(f"{path}: medusa_num_layers must be a non-negative integer, found {depth!r}")
    weights_path = folder / ST_NAME if (folder / ST_NAME).is_file() else folder / PT_NAME
    weights = read_weights(weights_path) if weights_path.suffix == ".safetensors" else read_medusa_pt(weights_path)
    if fmt == "medusa-v2":
        probe = "0.0.linear.weight"
        hidden = config.get("hidden_size") or (weights[probe].shape[1] if probe in weights else None)
        vocab = pick_field(path, "vocab_size", config.get("vocab_size"), vocab_kw)
        vocab = vocab or (lm_head.shape[0] if lm_head is not None else None) or _local_vocab(config)
        if vocab is None:
            raise ValueError(f"{path} does not give the target's vocabulary size (medusa-v2 heads score through its "
                             "lm_head); pass the target (--target) or vocab_size=")
        share = True
    else:
        probe = f"0.{depth}.weight"
        vocab, hidden = weights[probe].shape if probe in weights and weights[probe].dim() == 2 else (None, None)
        pick_field(path, "vocab_size", vocab, vocab_kw)
        share = False
    if hidden is None or vocab is None:
        raise ValueError(f"{weights_path} lacks {probe}, which the {fmt!r} layout with {depth} layer(s) per head "
                         "requires")
    cfg = MedusaConfig(hidden_size=int(hidden), vocab_size=int(vocab), num_heads=num_heads, num_layers=depth,
                       share_lm_head=share, base_model_name_or_path=pick_field(
                           path, "base_model_name_or_path", config.get("base_model_name_or_path"), base_kw))
    layout = _layout(cfg, fmt)
    _check_names(weights_path, fmt, weights, dict(layout.values()))
    return cfg, {key: weights[name] for key, (name, _) in layout.items()}, str(weights_path)


def _parse_vllm(folder: Path, config: dict, lm_head, vocab_kw, base_kw):
    path = folder / CONFIG_NAME
    hidden, vocab = _positive(path, config, "hidden_size"), _positive(path, config, "vocab_size")
    pick_field(path, "vocab_size", vocab, vocab_kw)
    num_heads = _positive(path, config, "num_heads" if "num_heads" in config else "medusa_num_heads")
    depth = int(config.get("num_hidden_layers", config.get("medusa_num_layers", 1)))
    truncated = int(config.get("truncated_vocab_size") or vocab)
    if not 1 <= truncated <= vocab:
        raise ValueError(f"{path}: truncated_vocab_size {truncated} must lie in [1, vocab_size {vocab}]")
    weights_path = folder / WEIGHTS_NAME
    weights = {k.removeprefix(_VLLM_PREFIX): v for k, v in read_weights(weights_path).items()}
    token_map = weights.pop("token_map", None)
    reduced = truncated < vocab
    if reduced != (token_map is not None):
        raise ValueError(f"{weights_path}: truncated_vocab_size {truncated} of vocab_size {vocab} "
                         f"{'needs a token_map tensor' if reduced else 'is not reduced, yet a token_map is stored'}; "
                         "vLLM reads token_map only together with a smaller truncated_vocab_size")
    if reduced:
        token_map = _checked_token_map(weights_path, token_map, truncated, vocab)
    shared_in_file = bool(config.get("original_lm_head"))  # one lm_heads.0.weight serves every head
    base = pick_field(path, "base_model_name_or_path", headway_block(config, path).get("base_model_name_or_path"),
                      base_kw)
    cfg = MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, num_layers=depth,
                       draft_vocab_size=truncated if reduced else None, base_model_name_or_path=base)
    blocks = {key: item for key, item in _layout(cfg, "vllm-medusa").items() if key.startswith("blocks.")}
    bias = bool(config.get("medusa_fc_bias"))
    if not bias and any(k.startswith("blocks.") and k.endswith(".bias") for k in weights):
        raise ValueError(f"{weights_path} stores block biases but {path} lacks medusa_fc_bias: true, so vLLM builds "
                         "the blocks without bias and drops them; set medusa_fc_bias true")
    expected = {name: shape for name, shape in blocks.values() if bias or not name.endswith(".bias")}
    projections = ["lm_heads.0.weight"] if shared_in_file else [f"lm_heads.{k}.weight" for k in range(num_heads)]
    for name in projections:  # vLLM slices lm_heads that still have the full vocabulary with token_map
        full = reduced and name in weights and weights[name].shape[0] == vocab
        expected[name] = (vocab if full else truncated, hidden)
    _check_names(weights_path, "vllm-medusa", weights, expected)
    rows = {name: weights[name][token_map] if weights[name].shape[0] != truncated else weights[name]
            for name in projections}
    # bias-free vLLM blocks are headway blocks with zero biases
    state = {key: weights[name] if name in weights else torch.zeros(shape, dtype=_float_dtype(weights))
             for key, (name, shape) in blocks.items()}
    if not shared_in_file:
        state.update({f"lm_heads.{k}.weight": rows[f"lm_heads.{k}.weight"] for k in range(num_heads)})
    elif lm_head is not None and torch.equal(rows["lm_heads.0.weight"], _rows(lm_head, token_map).to(
            rows["lm_heads.0.weight"].dtype)):
        cfg = dataclasses.replace(cfg, share_lm_head=True)  # the stored projection is the target's lm_head
    else:  # no target to compare with, or another projection: every head gets its own copy
        state.update({f"lm_heads.{k}.weight": rows["lm_heads.0.weight"].clone() for k in range(num_heads)})
    if reduced:
        state["d2t"] = token_map - torch.arange(truncated)
    return cfg, state, str(weights_path)


def _rows(weight: torch.Tensor, token_map: torch.Tensor | None) -> torch.Tensor:
    return weight if token_map is None else weight[token_map]


def _checked_token_map(path: Path, token_map: torch.Tensor, size: int, vocab: int) -> torch.Tensor:
    if token_map.dtype.is_floating_point or token_map.dtype == torch.bool or tuple(token_map.shape) != (size,):
        raise ValueError(f"{path}: token_map is {token_map.dtype} {tuple(token_map.shape)}; vLLM needs integer target "
                         f"ids of shape ({size},) (truncated_vocab_size)")
    token_map = token_map.to(torch.long)
    if int(token_map.min()) < 0 or int(token_map.max()) >= vocab or len(torch.unique(token_map)) != size:
        raise ValueError(f"{path}: token_map must hold {size} distinct target ids in [0, {vocab})")
    return token_map


def _check_names(path: Path, fmt: str, weights: dict[str, torch.Tensor], expected: dict[str, tuple]) -> None:
    """Exactly the tensors ``expected`` names, with its shapes, or a one-line error naming the first few wrong."""
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path} does not match its config in the {fmt!r} layout: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; headway will not drop or invent weights")
    wrong = [f"{k} {tuple(weights[k].shape)} (expected {tuple(s)})" for k, s in expected.items()
             if tuple(weights[k].shape) != tuple(s)]
    if wrong:
        raise ValueError(f"{path}: wrong shapes {wrong[:3]} for the {fmt!r} layout")


def _positive(path: Path, config: dict, key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{path} lacks a positive integer {key!r} (found {value!r})")
    return value


def _local_vocab(config: dict) -> int | None:
    """The vocabulary size of ``base_model_name_or_path`` when it is a local model folder."""
    vocab = text_config(local_model_config(config.get("base_model_name_or_path"))).get("vocab_size")
    return vocab if isinstance(vocab, int) else None


# --- the converter registry's entry (headway.heads.formats.convert; detection: detect_medusa_format) ----

def read_layout(path, fmt: str, model, *, vocab_size: int | None = None, base_model_name_or_path: str | None = None,
                **options) -> MedusaHeads:
    lm_head = target_lm_head(model) if fmt != "medusa-v0.1" else None  # v0.1 stores every projection
    return import_medusa(path, fmt, target_lm_head=lm_head, vocab_size=vocab_size,
                         base_model_name_or_path=base_model_name_or_path)


def write_layout(heads: MedusaHeads, out, fmt: str, model, *, overwrite: bool = False,
                 allow_official_misread: bool = False, **options) -> Path:
    return export_medusa(heads, out, fmt, target_lm_head=target_lm_head(model), overwrite=overwrite,
                         allow_official_misread=allow_official_misread)


def target_lm_head(model) -> torch.Tensor | None:
    """The target's output projection [V, H], or None without a target."""
    if model is None:
        return None
    lm_head = model.get_output_embeddings()
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("the target's lm_head has a bias, which no Medusa layout stores; these heads cannot use it")
    return lm_head.weight.detach()
