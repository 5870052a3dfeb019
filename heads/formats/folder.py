"""What every external layout's reader and writer share: a drafter folder written whole and moved
into place, its config.json and safetensors keys read with one-line errors, tensors checked strictly
against a layout, and the config of a local target folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from headway.heads.base import CONFIG_NAME, WEIGHTS_NAME, read_json, read_shapes
from headway.heads.files import RUN_CONFIG_NAME, atomic_folder, file_on_path


def check_output_folder(out_dir, overwrite: bool) -> None:
    """A one-line ValueError when ``out_dir`` cannot take an exported drafter: a file, a path through a file, a
    non-empty folder without ``overwrite``, or (with it) a training run's folder or a folder of other files.
    Checked before anything loads (``convert``) and again when the folder is written."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder; choose another output folder")
    inside = file_on_path(out)
    if inside is not None:
        raise ValueError(f"{out} lies inside {inside}, which is a file; choose another output folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"{out} is not empty; choose another folder or pass overwrite=True (--overwrite) to "
                             "replace it")
        if (out / RUN_CONFIG_NAME).is_file() or (out / "checkpoints").is_dir():  # its drafter beside a run's state
            raise ValueError(f"{out} holds a training run ({RUN_CONFIG_NAME}, checkpoints); overwrite replaces an "
                             "exported drafter's folder only: choose another folder")
        if not (out / CONFIG_NAME).is_file():  # overwrite replaces a drafter's folder, not a folder of other files
            names = ", ".join(sorted(child.name for child in out.iterdir())[:3])
            raise ValueError(f"{out} holds files but no drafter ({names}); overwrite replaces a drafter's folder "
                             "only: choose another folder, or empty that one yourself")


def write_folder(out_dir, config: dict, tensors: dict[str, torch.Tensor], overwrite: bool, *,
                 weights_name: str = WEIGHTS_NAME) -> Path:
    """config.json and the weights (``weights_name``: safetensors, or a plain torch-saved dict of
    tensors for a ``.pt`` name, loadable with ``weights_only=True``), written in a folder beside
    ``out_dir`` and moved in whole; a non-empty ``out_dir`` is replaced only with ``overwrite``."""
    out = Path(out_dir)
    check_output_folder(out, overwrite)
    with atomic_folder(out, f".{out.name}.export-", replace=True) as tmp:
        weights = {k: v.contiguous() for k, v in tensors.items()}
        if weights_name.endswith(".safetensors"):
            save_file(weights, str(tmp / weights_name), metadata={"format": "pt"})
        else:
            torch.save(weights, tmp / weights_name)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


def open_folder(folder, what: str) -> Path:
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"no {what} folder at {folder}")
    return path


def read_config(folder: Path, what: str) -> dict:
    """config.json as a dict, or a one-line ValueError."""
    data = read_json(folder, what)
    if not isinstance(data, dict):
        raise ValueError(f"{folder / CONFIG_NAME} does not hold a JSON object")
    return data


def read_keys(folder: Path) -> set[str]:
    """The tensor names in ``folder``'s model.safetensors, read from its header only (``read_shapes``)."""
    return set(read_shapes(folder / WEIGHTS_NAME))


def headway_block(config: dict, path: Path) -> dict:
    """The ``"headway"`` entry headway writes into a foreign layout's config.json (its own metadata), or {}."""
    meta = config.get("headway") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: its \"headway\" entry is {type(meta).__name__} {meta!r}, not the object of "
                         "metadata headway writes there; remove it or re-export the drafter")
    return meta


def pick_field(path: Path, name: str, from_folder, given):
    """A value the folder states wins; a keyword fills the gap; both but different is an error."""
    if from_folder is not None and given is not None and from_folder != given:
        raise ValueError(f"{path} says {name}={from_folder!r} but {name}={given!r} was passed; drop the keyword "
                         "or fix the folder")
    return from_folder if from_folder is not None else given


def check_tensors(folder: Path, fmt: str, weights: dict[str, torch.Tensor], expected: dict[str, tuple],
                  optional: set[str] = frozenset()) -> None:
    """Every tensor ``expected`` names, with its shape, and nothing but those and ``optional``."""
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


def local_model_config(name_or_path: str | None) -> dict | None:
    """The config.json of ``name_or_path`` when it is a local model folder; None otherwise or when
    unreadable."""
    path = Path(name_or_path) / CONFIG_NAME if name_or_path else None
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def text_config(config: dict | None) -> dict:
    """A model config's language part (``text_config`` when it has one)."""
    if not config:
        return {}
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
