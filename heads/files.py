"""Writing files atomically and readable by others.

Readers see the old file or the new one, never half of one: each write goes to a temporary name in
the same folder and is moved onto its own (``atomic_file``); a folder is filled beside its place and
moved in whole (``atomic_folder`` / ``publish_folder``). Every atomic write in headway goes through
these. Every file and folder ends with the umask's usual mode (0644 / 0755 under umask 022), not the
0600 / 0700 that temporary files and folders are created with; safetensors itself writes through such a file. A cluster team shares output folders, and a
serving engine may run as another user.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors.torch import save_file

RUN_CONFIG_NAME = "run_config.json"  # a training run's record in its output folder (headway.train.run_dir)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def share(path) -> None:
    """Give ``path`` (a file, or a folder and everything under it) the umask's usual mode."""
    mask = _umask()
    path = Path(path)
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def file_on_path(path) -> Path | None:
    """The first of ``path``'s parents that is a file (nothing can be made at ``path`` then), or None."""
    return next((parent for parent in Path(path).parents if parent.is_file()), None)


def atomic_leftover(path: Path, name: str) -> bool:
    """Whether ``path`` is a temporary file :func:`atomic_file` left beside ``name`` (its process killed mid-write)."""
    return path.is_file() and path.name.startswith(_temporary_prefix(name))


def _temporary_prefix(name: str) -> str:
    return f".{name}."


@contextmanager
def atomic_file(path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; when the block ends without an error, the file is
    shared (see :func:`share`) and moved onto ``path``; otherwise it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(path.name), dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        share(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def save_safetensors(tensors: dict, path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` to ``path`` atomically, readable by others."""
    with atomic_file(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def temporary_folder(beside, prefix: str) -> Path:
    """A new empty folder next to ``beside`` (to fill, :func:`share` and move into place)."""
    beside = Path(beside)
    beside.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=beside.parent))


def publish_folder(tmp, out, *, replace: bool) -> bool:
    """Move the filled folder ``tmp`` onto ``out``, shared (see :func:`share`); True when it moved.

    Where ``out`` exists: with ``replace`` its old contents are moved aside, then removed (and put
    back if the move fails); without, ``tmp`` is removed and False returned (another process made
    ``out`` first)."""
    tmp, out = Path(tmp), Path(out)
    share(tmp)
    if out.exists() and not replace:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    old = None
    if out.exists():
        old = temporary_folder(out, f".{out.name}.old-")
        os.replace(out, old)  # onto an empty folder: allowed
    try:
        os.replace(tmp, out)
    except OSError:
        if old is not None and not out.exists():
            os.replace(old, out)  # put the previous contents back
        raise  # otherwise the previous contents stay in ``old``, never deleted
    if old is not None:  # the new folder is in place: only now drop the old one
        shutil.rmtree(old, ignore_errors=True)
    return True


@contextmanager
def atomic_folder(out, prefix: str, *, replace: bool) -> Iterator[Path]:
    """A new empty folder beside ``out`` to fill; when the block ends without an error it is moved onto
    ``out`` (:func:`publish_folder`); otherwise it is removed."""
    tmp = temporary_folder(out, prefix)
    try:
        yield tmp
        publish_folder(tmp, out, replace=replace)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
