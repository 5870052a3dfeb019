"""Convert drafters between headway's own format and the public layouts engines load (``headway convert``).

``FORMATS`` names every layout: ``"headway"`` (``save_pretrained`` / ``load_drafter``), the Medusa
layouts of :mod:`headway.heads.medusa_formats` (``"medusa-v0.1"``, ``"medusa-v2"``, ``"vllm-medusa"``)
and the EAGLE layouts of :mod:`headway.heads.eagle_formats` (``"eagle"``, ``"sglang"``,
``"speculators"``). ``load_any`` reads any of them into a headway drafter (``MedusaHeads`` or
``EagleHead``), ``export_any`` writes a drafter in any layout that can hold it, and ``convert`` does both.

The ``target`` keyword (a loaded causal LM, or a model name or folder that is then loaded on the CPU)
supplies what a layout leaves to the target: the lm_head that ``share_lm_head`` Medusa heads use
(copied into ``medusa-v0.1``/``vllm-medusa``, compared against for ``medusa-v2``), the vocabulary size
of ``medusa-v2`` heads, the depth of EAGLE targets; and a drafter read with a target is checked against it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from headway.heads import eagle_formats, medusa_formats
from headway.heads.base import CONFIG_NAME, Drafter, load_drafter, read_json
from headway.heads.registry import kind_of, kinds
from headway.heads.eagle_formats import read_keys, write_folder, detect_eagle_format, export_eagle, import_eagle
from headway.heads.features import num_layers
from headway.heads.medusa_formats import detect_medusa_format, export_medusa, import_medusa

__all__ = ["FORMATS", "convert", "detect_format", "export_any", "load_any"]

FORMATS = ("headway", *medusa_formats.FORMATS, *eagle_formats.FORMATS)
_DESCRIBES = {"headway": "headway's own format", "medusa-v0.1": "official Medusa v0.1",
              "medusa-v2": "Medusa version 2 (TGI)", "vllm-medusa": "vLLM MedusaModel", "eagle": "EAGLE-1",
              "sglang": "EAGLE-3 (SGLang)", "speculators": "speculators eagle3"}


def _check_format(fmt: str, what: str = "format") -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown {what} {fmt!r}; choose one of {list(FORMATS)}")


def detect_format(path) -> str:
    """The format of the drafter checkpoint folder ``path`` (one of ``FORMATS``); a one-line ValueError
    that names what was found when the folder is not a drafter checkpoint headway reads."""
    folder = Path(path)
    if not folder.is_dir():
        found = "a file" if folder.exists() else "nothing"
        raise ValueError(f"{path} is not a drafter checkpoint folder (found {found} there); pass the folder that "
                         f"holds config.json and the weights")
    if not (folder / CONFIG_NAME).is_file():
        names = sorted(p.name for p in folder.iterdir())
        raise ValueError(f"{folder} has no {CONFIG_NAME}, so it is not a drafter checkpoint (found {names[:6]}"
                         f"{' ...' if len(names) > 6 else ''})")
    config = read_json(folder, "a drafter checkpoint")
    if isinstance(config, dict) and "drafter_type" in config:
        return "headway"
    medusa = detect_medusa_format(folder, config)
    if medusa is not None:
        return medusa
    if isinstance(config, dict) and ("speculators_model_type" in config or _has_eagle_tensors(folder)):
        return detect_eagle_format(folder)  # its errors say precisely what is wrong with the EAGLE folder
    found = {k: config.get(k) for k in ("architectures", "model_type") if k in config} if isinstance(config, dict) \
        else type(config).__name__
    raise ValueError(f"{folder} is not a drafter checkpoint headway reads (found config {found}, files "
                     f"{sorted(p.name for p in folder.iterdir())[:6]}); formats: {list(FORMATS)}")


def _has_eagle_tensors(folder: Path) -> bool:
    try:
        return "fc.weight" in read_keys(folder)
    except ValueError:  # no (readable) model.safetensors
        return False


def load_any(path, fmt: str | None = None, *, target=None, vocab_size: int | None = None,
             num_target_layers: int | None = None, base_model_name_or_path: str | None = None,
             feature_layers: list[int] | None = None) -> Drafter:
    """Read the drafter folder ``path`` in ``fmt`` (None: :func:`detect_format`) into a headway drafter.

    ``target`` (model, name or folder) fills what the folder leaves to the target and is checked
    against the drafter; ``vocab_size`` (``medusa-v2``), ``num_target_layers`` and ``feature_layers``
    (EAGLE) and ``base_model_name_or_path`` fill what the folder lacks; one that contradicts the folder
    is a ValueError naming both. A keyword the format has no use for is ignored (headway's own format
    carries everything).
    """
    if fmt is None:
        fmt = detect_format(path)
    _check_format(fmt)
    model = _target_model(target)
    if fmt == "headway":
        drafter = load_drafter(path)
    elif fmt in medusa_formats.FORMATS:
        lm_head = _lm_head(model) if fmt != "medusa-v0.1" else None  # v0.1 stores every projection
        drafter = import_medusa(path, fmt, target_lm_head=lm_head, vocab_size=vocab_size,
                                base_model_name_or_path=base_model_name_or_path)
    else:
        if num_target_layers is None and model is not None:
            num_target_layers = num_layers(model)
        drafter = import_eagle(path, fmt, num_target_layers=num_target_layers,
                               base_model_name_or_path=base_model_name_or_path, feature_layers=feature_layers)
    if model is not None:
        drafter.check_target(model)
    return drafter


def export_any(drafter: Drafter, out, to: str, *, overwrite: bool = False, target=None,
               speculative_tokens: int = 3, target_name_or_path: str | None = None, widen_vocab: bool = False,
               with_embeddings: bool = False, allow_official_misread: bool = False) -> Path:
    """Write ``drafter`` into the folder ``out`` in the format ``to``; returns the folder.

    ``target`` supplies the lm_head that Medusa layouts store or compare against (see the module
    docstring). ``speculative_tokens`` and ``target_name_or_path`` go to the speculators config.
    ``widen_vocab``: write an EAGLE-1 head with a reduced draft vocabulary in the ``eagle`` layout,
    which has none, so that it proposes from the whole vocabulary (otherwise that is refused).
    ``with_embeddings``: copy the target's input embedding into an ``sglang`` export (``target`` is
    needed), for the official EAGLE-3 runtime with a target saved as one file.
    ``allow_official_misread``: write Medusa heads of several ResBlocks as ``medusa-v0.1`` although
    the official Medusa code computes them wrongly (see ``export_medusa``).
    A non-empty ``out`` is replaced only with ``overwrite=True``.
    """
    _check_format(to, "target format")
    kind = kind_of(drafter)
    if kind is None:
        raise ValueError(f"cannot convert a {type(drafter).__name__}: no registered drafter kind has that class "
                         f"(known: {[k.name for k in kinds()]})")
    holds = ("headway", *kind.exports)
    if to not in holds:
        raise ValueError(f"{kind.title} drafters cannot be written as {to!r} ({_DESCRIBES[to]}): that layout holds another "
                         f"kind of drafter; choose one of {list(holds)}")
    model = _target_model(target)
    if model is not None:
        drafter.check_target(model)
    if to == "headway":
        return _save_headway(drafter, out, overwrite)
    if to in medusa_formats.FORMATS:
        return export_medusa(drafter, out, to, target_lm_head=_lm_head(model), overwrite=overwrite,
                             allow_official_misread=allow_official_misread)
    if to == "eagle" and drafter.d2t is not None and not widen_vocab:
        raise ValueError(f"the 'eagle' layout has no reduced draft vocabulary but this EAGLE-1 head scores "
                         f"{drafter.config.draft_vocab_size} of {drafter.config.vocab_size} tokens; keep it in "
                         "'headway', or pass widen_vocab=True (--widen-vocab) to score the whole vocabulary")
    if target_name_or_path is None and isinstance(target, (str, os.PathLike)):
        target_name_or_path = str(target)
    embeddings = None
    if with_embeddings:
        if model is None:
            raise ValueError("with_embeddings copies the target's input embedding into the export: name the target "
                             "(target=..., --target MODEL)")
        embeddings = model.get_input_embeddings().weight
    return export_eagle(drafter, out, to, target_name_or_path=target_name_or_path,
                        speculative_tokens=speculative_tokens, overwrite=overwrite, embeddings=embeddings)


def convert(src, out, to: str, *, fmt_from: str | None = None, overwrite: bool = False, target=None,
            **kwargs) -> Path:
    """Read the drafter folder ``src`` (in ``fmt_from``, detected when None) and write it into ``out``
    in the format ``to``; returns ``out``. ``kwargs`` are :func:`load_any`'s (``vocab_size``,
    ``num_target_layers``, ``base_model_name_or_path``, ``feature_layers``) and :func:`export_any`'s
    (``speculative_tokens``, ``target_name_or_path``, ``widen_vocab``, ``with_embeddings``,
    ``allow_official_misread``)."""
    _check_format(to, "target format")
    if fmt_from is not None:
        _check_format(fmt_from, "source format")
    load_keys = {"vocab_size", "num_target_layers", "base_model_name_or_path", "feature_layers"}
    export_keys = {"speculative_tokens", "target_name_or_path", "widen_vocab", "with_embeddings",
                   "allow_official_misread"}
    unknown = sorted(set(kwargs) - load_keys - export_keys)
    if unknown:
        raise ValueError(f"convert got unknown option(s) {unknown}; known: {sorted(load_keys | export_keys)}")
    if Path(out).resolve() == Path(src).resolve():
        raise ValueError(f"the output folder {out} is the source folder; write the conversion elsewhere")
    model = _target_model(target)
    drafter = load_any(src, fmt_from, target=model, **{k: v for k, v in kwargs.items() if k in load_keys})
    if "target_name_or_path" not in kwargs and isinstance(target, (str, os.PathLike)):
        kwargs["target_name_or_path"] = str(target)
    return export_any(drafter, out, to, overwrite=overwrite, target=model,
                      **{k: v for k, v in kwargs.items() if k in export_keys})


def _save_headway(drafter: Drafter, out, overwrite: bool) -> Path:
    """headway's own format, as ``save_pretrained`` writes it (config.json, model.safetensors, README.md),
    moved into place atomically like the engine layouts."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
    folder = write_folder(out, drafter.config.to_dict(), state, overwrite)
    drafter.generate_model_card().save(folder / "README.md")
    return folder


def _target_model(target):
    """``target`` as a loaded model: a model as is, a name or folder loaded on the CPU in its own dtype."""
    if target is None or isinstance(target, torch.nn.Module):
        return target
    if not isinstance(target, (str, os.PathLike)):
        raise ValueError(f"target must be a loaded causal LM or a model name or folder, got {type(target).__name__}")
    from transformers import AutoModelForCausalLM

    from headway.heads.target import resolve_model_path

    try:  # the checkpoint's own dtype: a copied lm_head keeps its exact values
        return AutoModelForCausalLM.from_pretrained(resolve_model_path(str(target)), dtype="auto").eval()
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the target {str(target)!r} ({str(exc).splitlines()[0][:200]}); pass a local "
                         "model folder, a Hub model id or 'smollm2-135m'") from None


def _lm_head(model) -> torch.Tensor | None:
    """The target's output projection [V, H], or None without a target."""
    if model is None:
        return None
    lm_head = model.get_output_embeddings()
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("the target's lm_head has a bias, which no Medusa layout stores; these heads cannot use it")
    return lm_head.weight.detach()
