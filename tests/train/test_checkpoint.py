"""Checkpoints: the optimizer state through safetensors + JSON, atomic step folders, which folders
count as checkpoints, pruning, and damaged checkpoints named in one line."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.train import checkpoint as ckpt


def _trained_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    for _ in range(2):
        model(torch.randn(4, 3)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _save(root, step, model, optimizer, keep=0, **kw):
    return ckpt.save_checkpoint(root, step, model_state=model.state_dict(), optimizer=optimizer,
                                loop_state={"step": step}, rank=0, is_main=True, keep=keep, **kw)


def test_optimizer_state_round_trips_through_safetensors_and_json(tmp_path):
    model, optimizer = _trained_optimizer()
    tensors, meta = ckpt.optimizer_to_flat(optimizer)
    assert sorted(tensors) == ["0.exp_avg", "0.exp_avg_sq", "0.step", "1.exp_avg", "1.exp_avg_sq", "1.step"]
    assert all(v.is_contiguous() and v.device.type == "cpu" for v in tensors.values())
    save_file(tensors, str(tmp_path / "opt.safetensors"))
    (tmp_path / "opt.json").write_text(json.dumps(meta))  # JSON only: no pickle anywhere

    twin = torch.nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    restored = torch.optim.AdamW(twin.parameters(), lr=1.0)  # another lr: the groups come from the checkpoint
    ckpt.optimizer_from_flat(restored, load_file(str(tmp_path / "opt.safetensors")),
                             json.loads((tmp_path / "opt.json").read_text()))
    a, b = optimizer.state_dict(), restored.state_dict()
    assert b["param_groups"][0]["lr"] == 0.1 and tuple(b["param_groups"][0]["betas"]) == (0.8, 0.9)
    assert a["state"].keys() == b["state"].keys()
    for pid in a["state"]:
        assert a["state"][pid].keys() == b["state"][pid].keys()
        for name, value in a["state"][pid].items():
            assert torch.equal(value, b["state"][pid][name]), (pid, name)
    # the restored optimizer takes the very step the original takes
    x = torch.randn(4, 3)
    for m, o in ((model, optimizer), (twin, restored)):
        m(x).pow(2).sum().backward()
        o.step()
    assert torch.equal(model.weight, twin.weight) and torch.equal(model.bias, twin.bias)


def test_checkpoint_dirs_lists_whole_checkpoints_by_step_number(tmp_path):
    assert ckpt.checkpoint_dirs(tmp_path / "none") == []
    for name in ("step-10", "step-9", "step-0000011"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.json").write_text("{}")
    (tmp_path / "step-12").mkdir()  # killed before state.json: incomplete
    (tmp_path / ".tmp-step-0000013").mkdir()
    (tmp_path / ".tmp-step-0000013" / "state.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "state.json").write_text("{}")
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["step-9", "step-10", "step-0000011"]


def test_save_and_load_a_checkpoint_keeping_the_newest(tmp_path):
    model, optimizer = _trained_optimizer()
    root = tmp_path / "checkpoints"
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    paths = [_save(root, step, model, optimizer, keep=2) for step in (2, 4, 6)]
    assert [p.name for p in paths] == ["step-0000002", "step-0000004", "step-0000006"]
    assert ckpt.checkpoint_dirs(root) == paths[1:]  # keep=2 pruned the oldest
    assert not list(root.glob(".tmp-*"))
    back = ckpt.load_checkpoint(paths[-1])
    assert back["state"] == {"step": 6} == ckpt.load_state_json(paths[-1])
    assert back["model"].keys() == model.state_dict().keys()
    assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())
    assert back["optimizer_meta"]["param_groups"] == json.loads(json.dumps(optimizer.state_dict()["param_groups"]))
    assert back["optimizer"].keys() == ckpt.optimizer_to_flat(optimizer)[0].keys()
    assert torch.equal(ckpt.load_rng(paths[-1], 0), rng) and ckpt.load_rng(paths[-1], 1) is None
    _save(root, 8, model, optimizer, keep=0)
    assert len(ckpt.checkpoint_dirs(root)) == 3  # keep=0: every one


def test_a_sharded_engine_writes_its_own_state(tmp_path):
    model, optimizer = _trained_optimizer()
    seen = []

    def write_state(folder):
        seen.append(folder.name)
        (folder / "engine").mkdir()

    path = _save(tmp_path, 3, model, optimizer, write_state=write_state)
    assert seen == [".tmp-step-0000003"]  # written before the folder is published
    assert (path / "engine").is_dir() and (path / "rng-0.safetensors").is_file()
    assert not (path / "model.safetensors").exists() and not (path / "optimizer.safetensors").exists()


def test_a_damaged_checkpoint_is_named_in_one_line(tmp_path):
    model, optimizer = _trained_optimizer()
    path = _save(tmp_path, 1, model, optimizer)
    (path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=r"checkpoint .*step-0000001 is damaged .*delete that folder") as info:
        ckpt.load_checkpoint(path)
    assert "\n" not in str(info.value)
    (path / "state.json").write_text('{"step": ')
    with pytest.raises(ValueError, match="is damaged"):
        ckpt.load_state_json(path)
