"""Convert drafters between headway's own format and the public layouts engines load (``headway convert``).

The converter registry: one ``Converter`` per family of layouts (headway's own, ``"headway"``:
``save_pretrained`` / ``load_drafter``; the Medusa layouts of :mod:`headway.heads.formats.medusa`,
``"medusa-v0.1"``, ``"medusa-v2"``, ``"vllm-medusa"``; z-lab's DFlash layout of
:mod:`headway.heads.formats.dflash`, ``"z-lab"``; the EAGLE layouts of
:mod:`headway.heads.formats.eagle`, ``"eagle"``, ``"sglang"``, ``"speculators"``), each saying how
to recognise, read and write its layouts. ``"speculators"`` also holds DFlash drafters
(``speculators_model_type: "dflash"``): the EAGLE family's entry sends those folders, and DFlash
heads, to :mod:`headway.heads.formats.dflash`. ``formats()`` (and ``FORMATS``, headway's built-in ones)
names them; ``load_any`` reads any of them into a headway drafter, ``export_any`` writes a drafter
in any layout its kind exports (``headway.heads.registry``), and ``convert`` does both. A family
defined elsewhere joins with ``register_converter``.

The ``target`` keyword (a loaded causal LM, or a model name or folder that is then loaded on the CPU)
supplies what a layout leaves to the target: the lm_head that ``share_lm_head`` Medusa heads use
(copied into ``medusa-v0.1``/``vllm-medusa``, compared against for ``medusa-v2``), the vocabulary size
of ``medusa-v2`` heads, the depth of EAGLE and DFlash targets; and a drafter read with a target is checked against it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import torch

from headway.heads.base import CONFIG_NAME, Drafter, built_from_config, load_drafter, read_json, read_shapes
from headway.heads.dflash import DFlashHead
from headway.heads.formats import dflash, eagle, medusa
from headway.heads.formats.folder import check_output_folder, write_folder
from headway.heads.registry import kind_of, kinds
from headway.heads.values import first_line

__all__ = ["FORMATS", "Converter", "convert", "converters", "detect_format", "export_any", "formats", "load_any",
           "register_converter"]

LOAD_OPTIONS = ("vocab_size", "num_target_layers", "base_model_name_or_path", "feature_layers")
EXPORT_OPTIONS = ("speculative_tokens", "target_name_or_path", "widen_vocab", "with_embeddings",
                  "allow_official_misread")


@dataclasses.dataclass(frozen=True)
class Converter:
    """A family of layouts. ``detect(folder, config)``: the folder's layout, or None when it is not one of
    this family's; ``read(path, fmt, model, **LOAD_OPTIONS)`` -> a drafter; ``write(drafter, out, fmt,
    model, overwrite=, **EXPORT_OPTIONS)`` -> the folder. ``model`` is the loaded target or None; an
    option the family has no use for is ignored."""

    name: str
    layouts: dict[str, str]  # layout -> how a person calls it ("vLLM MedusaModel")
    detect: Callable[[Path, dict], str | None]
    read: Callable[..., Drafter]
    write: Callable[..., Path]


_CONVERTERS: list[Converter] = []


def register_converter(converter: Converter) -> Converter:
    """Add (or replace, by name) a family of layouts; detection tries families in registration order."""
    clash = [f for c in _CONVERTERS if c.name != converter.name for f in c.layouts if f in converter.layouts]
    if clash:
        raise ValueError(f"layout(s) {clash} already belong to another converter")
    _CONVERTERS[:] = [c for c in _CONVERTERS if c.name != converter.name] + [converter]
    return converter


def converters() -> list[Converter]:
    return list(_CONVERTERS)


def formats() -> tuple[str, ...]:
    """Every registered layout, headway's own first."""
    return tuple(f for c in _CONVERTERS for f in c.layouts)


def _converter(fmt: str, what: str = "format") -> Converter:
    found = next((c for c in _CONVERTERS if fmt in c.layouts), None)
    if found is None:
        raise ValueError(f"unknown {what} {fmt!r}; choose one of {list(formats())}")
    return found


def _describe(fmt: str) -> str:
    return _converter(fmt).layouts[fmt]


def detect_format(path) -> str:
    """The format of the drafter checkpoint folder ``path`` (one of ``formats()``); a one-line ValueError
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
    for converter in _CONVERTERS:
        found = converter.detect(folder, config)
        if found is not None:
            return found
    for weights in sorted(folder.glob("*.safetensors")):  # a layout may go unrecognised for its unreadable weights
        read_shapes(weights)
    found = {k: config.get(k) for k in ("architectures", "model_type") if k in config} if isinstance(config, dict) \
        else type(config).__name__
    raise ValueError(f"{folder} is not a drafter checkpoint headway reads (found config {found}, files "
                     f"{sorted(p.name for p in folder.iterdir())[:6]}); formats: {list(formats())}")


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
    converter = _converter(fmt)
    model = _target_model(target)
    drafter = built_from_config(lambda: converter.read(
        path, fmt, model, vocab_size=vocab_size, num_target_layers=num_target_layers,
        base_model_name_or_path=base_model_name_or_path, feature_layers=feature_layers), Path(path) / CONFIG_NAME)
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
    converter = _converter(to, "target format")
    kind = kind_of(drafter)
    if kind is None:
        raise ValueError(f"cannot convert a {type(drafter).__name__}: no registered drafter kind has that class "
                         f"(known: {[k.name for k in kinds()]})")
    holds = ("headway", *kind.exports)
    if to not in holds:
        raise ValueError(f"{kind.title} drafters cannot be written as {to!r} ({_describe(to)}): that layout holds "
                         f"another kind of drafter; choose one of {list(holds)}")
    model = _target_model(target)
    if model is not None:
        drafter.check_target(model)
    if target_name_or_path is None and isinstance(target, (str, os.PathLike)):
        target_name_or_path = str(target)
    return converter.write(drafter, out, to, model, overwrite=overwrite, speculative_tokens=speculative_tokens,
                           target_name_or_path=target_name_or_path, widen_vocab=widen_vocab,
                           with_embeddings=with_embeddings, allow_official_misread=allow_official_misread)


def convert(src, out, to: str, *, fmt_from: str | None = None, overwrite: bool = False, target=None,
            **kwargs) -> Path:
    """Read the drafter folder ``src`` (in ``fmt_from``, detected when None) and write it into ``out``
    in the format ``to``; returns ``out``. ``kwargs`` are :func:`load_any`'s (``vocab_size``,
    ``num_target_layers``, ``base_model_name_or_path``, ``feature_layers``) and :func:`export_any`'s
    (``speculative_tokens``, ``target_name_or_path``, ``widen_vocab``, ``with_embeddings``,
    ``allow_official_misread``)."""
    _converter(to, "target format")
    if fmt_from is not None:
        _converter(fmt_from, "source format")
    unknown = sorted(set(kwargs) - set(LOAD_OPTIONS) - set(EXPORT_OPTIONS))
    if unknown:
        raise ValueError(f"convert got unknown option(s) {unknown}; known: {sorted(LOAD_OPTIONS + EXPORT_OPTIONS)}")
    if Path(out).resolve() == Path(src).resolve():
        raise ValueError(f"the output folder {out} is the source folder; write the conversion elsewhere")
    if Path(out).resolve() in Path(src).resolve().parents:
        raise ValueError(f"the output folder {out} holds the source folder {src}; write the conversion elsewhere")
    check_output_folder(out, overwrite)  # before the drafter and the target load (minutes for a big target)
    model = _target_model(target)
    drafter = load_any(src, fmt_from, target=model, **{k: v for k, v in kwargs.items() if k in LOAD_OPTIONS})
    if "target_name_or_path" not in kwargs and isinstance(target, (str, os.PathLike)):
        kwargs["target_name_or_path"] = str(target)
    return export_any(drafter, out, to, overwrite=overwrite, target=model,
                      **{k: v for k, v in kwargs.items() if k in EXPORT_OPTIONS})


# --- headway's own format --------------------------------------------------------------------

def _detect_headway(folder: Path, config) -> str | None:
    return "headway" if isinstance(config, dict) and "drafter_type" in config else None


def _read_headway(path, fmt: str, model, **options) -> Drafter:
    return load_drafter(path)


def _save_headway(drafter: Drafter, out, fmt: str, model, *, overwrite: bool = False, **options) -> Path:
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
        raise ValueError(f"cannot load the target {str(target)!r} ({first_line(exc)}); pass a local "
                         "model folder, a Hub model id or 'smollm2-135m'") from None


# --- the "speculators" layout holds EAGLE-3, P-EAGLE and DFlash drafters ---------------------------

def _detect_eagle(folder: Path, config) -> str | None:
    """The EAGLE family's layouts, and speculators' ``dflash`` folders as "speculators"."""
    return "speculators" if dflash.is_speculators_dflash(config) else eagle.detect_layout(folder, config)


def _read_eagle(path, fmt: str, model, **options) -> Drafter:
    """A "speculators" folder of a ``dflash`` model is DFlash's reader's; everything else EAGLE's."""
    reader = dflash.read_layout if fmt == "speculators" and dflash.holds_speculators_dflash(path) else eagle.read_layout
    return reader(path, fmt, model, **options)


def _write_eagle(drafter: Drafter, out, fmt: str, model, **options) -> Path:
    """A DFlash head (written as "speculators": its kind exports no other EAGLE layout) goes to DFlash's writer."""
    writer = dflash.write_layout if isinstance(drafter, DFlashHead) else eagle.write_layout
    return writer(drafter, out, fmt, model, **options)


register_converter(Converter("headway", {"headway": "headway's own format"}, _detect_headway, _read_headway,
                             _save_headway))
register_converter(Converter("medusa", medusa.LAYOUTS, medusa.detect_medusa_format, medusa.read_layout, medusa.write_layout))
# z-lab's DFlash before EAGLE: EAGLE's detection would take its fc + layers.0.* tensors for an EAGLE-1 drafter
register_converter(Converter("dflash", dflash.LAYOUTS, dflash.detect_layout, dflash.read_layout,
                             dflash.write_layout))
register_converter(Converter("eagle", eagle.LAYOUTS, _detect_eagle, _read_eagle, _write_eagle))
FORMATS = formats()  # headway's built-in layouts
