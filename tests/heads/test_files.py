"""Atomic writes, and outputs readable by others (0644 / 0755 under umask 022, not 0600 / 0700)."""

import os
import stat

import pytest
import torch

from headway.heads import EagleHead, MedusaHeads
from headway.heads.formats.convert import export_any
from headway.heads.files import atomic_file, atomic_write_text, save_safetensors
from headway.train.checkpoint import save_checkpoint


@pytest.fixture(autouse=True)
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def modes(folder):
    """{relative path: permission bits} of ``folder`` and everything under it."""
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.rglob("*")]}


def test_atomic_writes_replace_whole_files_or_leave_the_old_one(tmp_path):
    path = tmp_path / "a.json"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError, match="stop"):
        with atomic_file(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("stop")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]
    save_safetensors({"w": torch.ones(2)}, tmp_path / "w.safetensors")  # safetensors alone writes 0600
    assert {k: v for k, v in modes(tmp_path).items() if k != "."} == {"a.json": 0o644, "w.safetensors": 0o644}


def test_drafters_exports_and_checkpoints_are_readable_by_the_group(tiny_llama, tmp_path):
    target, _ = tiny_llama
    heads = MedusaHeads.from_target(target, num_heads=2)
    heads.save_pretrained(tmp_path / "saved")
    assert set(modes(tmp_path / "saved").values()) == {0o755, 0o644}
    for fmt in ("headway", "vllm-medusa"):
        out = export_any(heads, tmp_path / fmt, fmt, target=target)
        assert modes(out) == {".": 0o755, **{p.name: 0o644 for p in out.iterdir()}}, fmt
    head = EagleHead.from_target(target, version=3)
    with pytest.warns(UserWarning):  # the tiny target's layers have no exact engine counterpart
        out = export_any(head, tmp_path / "sglang", "sglang")
    assert set(modes(out).values()) == {0o755, 0o644}
    opt = torch.optim.AdamW(heads.parameters())
    step = save_checkpoint(tmp_path / "ckpt", 1, model_state=heads.state_dict(), optimizer=opt, loop_state={"step": 1},
                           is_main=True, rank=0, keep=1)
    assert set(modes(step).values()) == {0o755, 0o644}


def test_a_failed_folder_move_never_deletes_the_previous_contents(tmp_path, monkeypatch):
    """publish_folder moves the old folder aside first; if the new one then cannot land (here: another
    process made ``out`` meanwhile), the old contents are put back or, failing that, kept aside."""
    from headway.heads import files

    out = tmp_path / "out"
    out.mkdir()
    (out / "weights.bin").write_text("previous")
    tmp = files.temporary_folder(out, ".new-")
    (tmp / "weights.bin").write_text("new")
    real = os.replace

    def racing(src, dst):
        if str(src) == str(tmp):
            os.mkdir(dst)  # someone else's folder appears at out
            raise OSError("destination taken")
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", racing)
    with pytest.raises(OSError, match="destination taken"):
        files.publish_folder(tmp, out, replace=True)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]
    assert len(kept) == 1 and (kept[0] / "weights.bin").read_text() == "previous"
