"""A run's output folder: which run it may hold, checked before anything loads, and put back as it
was when a run fails before its first checkpoint (so the fixed command runs).

A folder holds one run, recorded in ``run_config.json``. The same run resumes from its newest
checkpoint; a different one is refused unless ``train.overwrite=true``; a non-empty folder holding
no run is refused too. ``output_dir_problem`` says why a folder is refused without writing to it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from headway.heads.files import RUN_CONFIG_NAME, atomic_leftover, atomic_write_text, file_on_path
from headway.train import checkpoint as ckpt

# Fields that may differ when a run is resumed (they do not change what is trained).
# The world size is checked against each checkpoint instead (a DDP run may resume with another).
RESUMABLE_DIFFS = {"overwrite", "resume", "log_every", "eval_every", "save_every", "keep_checkpoints", "trackers",
                   "num_processes", "train_sequences", "heldout_sequences",
                   "output_dir"}  # the folder itself: spelled another way (relative, absolute) or moved since


def config_diff(old: dict, new: dict, ignore=RESUMABLE_DIFFS, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two run configs, the fields in ``ignore`` left out."""
    diff = []
    for k in sorted(set(old) | set(new)):
        if k in ignore:
            continue
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            diff += config_diff(a, b, ignore, prefix + k + ".")
        elif json.dumps(a, default=str) != json.dumps(b, default=str):
            diff.append(prefix + k)
    return diff


def inputs_inside(out: Path, run_config: dict) -> list[str]:
    """Dotted keys of ``run_config`` naming an existing file or folder that is ``out`` or lies inside it (the run's
    data, features, initial heads ...): what replacing ``out`` would delete."""
    root, found = out.resolve(), []

    def walk(value, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if k != "output_dir":
                    walk(v, f"{key}.{k}" if key else k)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, key)
        elif isinstance(value, str) and value:
            try:
                path = Path(value).expanduser().resolve()
            except (OSError, RuntimeError, ValueError):
                return
            if (path == root or root in path.parents) and path.exists() and key not in found:
                found.append(key)

    walk(run_config, "")
    return found


def output_dir_problem(out: Path, run_config: dict, *, overwrite: bool, resume: bool,
                       ignore=RESUMABLE_DIFFS) -> str | None:
    """Why ``out`` cannot take this run (None: it can), read without writing anything. ``overwrite`` replaces a
    folder that holds a headway run (or nothing), never one holding other files or this run's own inputs."""
    if out.exists() and not out.is_dir():
        return f"train.output_dir {out} is a file; the output folder must be a folder (or not exist yet)"
    inside = file_on_path(out)
    if inside is not None:
        return f"train.output_dir {out} lies inside {inside}, which is a file; choose a folder's path"
    if not out.is_dir():
        return None
    saved = out / RUN_CONFIG_NAME
    # a temporary file of run_config.json's atomic write (killed mid-write): the run never started
    others = [child.name for child in sorted(out.iterdir()) if not atomic_leftover(child, RUN_CONFIG_NAME)]
    if overwrite:
        inside = inputs_inside(out, run_config)
        if inside:
            return (f"train.overwrite would delete {out}, which holds this run's own input ({', '.join(inside)}); "
                    "choose another train.output_dir")
        if others and not saved.is_file():
            return (f"{out} holds files but no headway run ({', '.join(others[:3])}); train.overwrite replaces a "
                    "run's folder only: choose another train.output_dir, or empty that folder yourself")
        return None
    if not saved.is_file():
        if others:
            return (f"{out} is not empty and holds no headway run ({', '.join(others[:3])}); choose another "
                    "train.output_dir")
        return None
    try:
        old = json.loads(saved.read_text())
    except json.JSONDecodeError:
        return f"{saved} is not valid JSON; pass train.overwrite=true to start over in {out}"
    diff = config_diff(old, json.loads(json.dumps(run_config, default=str)), ignore)
    if diff:
        return (f"{out} already holds a different run (differs in {', '.join(diff[:4])}); choose another "
                "train.output_dir, or pass train.overwrite=true to replace it")
    if not resume and ckpt.checkpoint_dirs(out / "checkpoints"):
        return f"{out} holds checkpoints of this run and train.resume=false; pass train.overwrite=true to start over"
    return None


def check_output_dir(out: str | Path, run_config: dict, *, overwrite: bool, resume: bool, ignore=RESUMABLE_DIFFS) -> None:
    """Raise a one-line ValueError when ``out`` cannot take this run."""
    problem = output_dir_problem(Path(out), run_config, overwrite=overwrite, resume=resume, ignore=ignore)
    if problem:
        raise ValueError(problem)


@contextlib.contextmanager
def claimed(out: Path, run_config: dict, *, overwrite: bool, resume: bool, is_main: bool):
    """Check ``out`` and record the run in it (main process only; with ``overwrite`` a folder holding
    another run is emptied first), then run the body. A fresh run that fails before its first
    checkpoint puts ``out`` back as it was (absent, or empty): nothing of it could be resumed, and a
    run_config.json left behind would refuse the fixed command as "a different run". A run that was
    resumed, or that has written a checkpoint, keeps everything."""
    saved = out / RUN_CONFIG_NAME
    existed, fresh = out.is_dir(), overwrite or not saved.is_file()
    if is_main:
        check_output_dir(out, run_config, overwrite=overwrite, resume=resume)
        if overwrite and out.is_dir():
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(saved, json.dumps(run_config, indent=2, default=str))
    try:
        yield out
    except Exception:
        if is_main and fresh and out.is_dir() and not ckpt.checkpoint_dirs(out / "checkpoints"):
            if not existed:
                shutil.rmtree(out)
            else:
                for child in out.iterdir():
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        raise
