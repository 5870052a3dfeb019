"""Atomic checkpoints (safetensors + JSON only, never pickle) and resume from the newest one.

A checkpoint is a folder ``checkpoints/step-NNNNNNN`` holding the trainable weights, the
optimizer state, the scheduler and loop state, and each process's RNG state. It is written
under a temporary name and renamed into place, so a kill leaves either a whole checkpoint or
none; resume picks the newest whole one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from headway.heads.files import publish_folder

_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dirs(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / "state.json").is_file()]
    return [p for _, p in sorted(found)]


def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state dict into tensors (for safetensors) and JSON metadata."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_flat(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(root: Path, step: int, *, model_state: dict[str, torch.Tensor] | None,
                    optimizer: torch.optim.Optimizer | None, loop_state: dict, rank: int, is_main: bool,
                    keep: int, barrier=lambda: None, write_state=None) -> Path:
    """Write checkpoint ``step`` atomically. Every rank calls it (each writes its own RNG state).

    ``write_state(tmp_folder)``, when given, is called on every rank instead of writing
    ``model_state`` / ``optimizer`` (a sharded engine's own collective save)."""
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}"
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    save_file({"cpu": torch.get_rng_state()}, str(tmp / f"rng-{rank}.safetensors"))
    if write_state is not None:
        write_state(tmp)
    elif is_main:
        save_file(model_state, str(tmp / "model.safetensors"))
        opt_tensors, opt_meta = optimizer_to_flat(optimizer)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(opt_meta))
    barrier()
    if is_main:
        (tmp / "state.json").write_text(json.dumps(loop_state, indent=2))  # written last: marks completeness
        publish_folder(tmp, final, replace=True)  # shared: a team sharing the run folder reads them too
        for old in checkpoint_dirs(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_state_json(path: Path) -> dict:
    """The loop state (step, scheduler, world size) of a checkpoint folder."""
    try:
        return json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"checkpoint {path} is damaged ({exc}); delete that folder to resume from the one before") from None


def load_checkpoint(path: Path) -> dict:
    """Read a whole-state checkpoint folder back: {'model', 'optimizer', 'optimizer_meta', 'state'}
    (each rank's RNG state: ``load_rng``)."""
    try:
        return {
            "model": load_file(str(path / "model.safetensors")),
            "optimizer": load_file(str(path / "optimizer.safetensors")),
            "optimizer_meta": json.loads((path / "optimizer.json").read_text()),
            "state": json.loads((path / "state.json").read_text()),
        }
    except (SafetensorError, OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"checkpoint {path} is damaged ({exc}); delete that folder to resume from the one before") from None


def load_rng(path: Path, rank: int) -> torch.Tensor | None:
    """Rank ``rank``'s CPU RNG state in a checkpoint folder (None when that rank did not exist)."""
    rng = path / f"rng-{rank}.safetensors"
    return load_file(str(rng))["cpu"] if rng.is_file() else None
