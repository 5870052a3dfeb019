"""FSDP2 in one process (a gloo group of one): only the trainable parameters are sharded state,
checkpoints round-trip through torch.distributed.checkpoint, and the export reads plain tensors."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from headway.train import fsdp


@pytest.fixture
def group(tmp_path):
    assert not dist.is_initialized(), "an earlier test left a process group initialised in this process"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded():
    """A two-layer module with one frozen parameter, sharded, and its optimizer (built afterwards)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].bias.requires_grad_(False)
    fsdp.shard(model)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)


def _step(model, optimizer, x):
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_trainable_state_is_whole_and_leaves_frozen_parameters_out(group):
    model, _ = _sharded()
    assert isinstance(model[0].weight, DTensor)
    state = fsdp.trainable_state(model)
    assert sorted(state) == ["0.weight", "1.bias", "1.weight"]
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in state.values())
    assert state["0.weight"].shape == (3, 4) and torch.equal(state["0.weight"], model[0].weight.full_tensor())


def test_a_saved_state_resumes_to_the_same_training(group, tmp_path):
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    model, optimizer = _sharded()
    _step(model, optimizer, x1)
    fsdp.save_state(model, optimizer, tmp_path / "ckpt")
    resumed, resumed_opt = _sharded()  # fresh initialisation: differs from the trained weights
    assert not torch.equal(fsdp.trainable_state(resumed)["1.weight"], fsdp.trainable_state(model)["1.weight"])
    fsdp.load_state(resumed, resumed_opt, tmp_path / "ckpt")
    for m, o in ((model, optimizer), (resumed, resumed_opt)):  # the next step needs the optimizer's moments too
        _step(m, o, x2)
    a, b = fsdp.trainable_state(model), fsdp.trainable_state(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unshard_for_export_gives_plain_parameters_with_the_same_values(group):
    model, _ = _sharded()
    before = fsdp.trainable_state(model)
    fsdp.unshard_for_export(model)
    assert all(not isinstance(p, DTensor) for p in model.parameters() if p.requires_grad)
    assert all(torch.equal(dict(model.named_parameters())[k].detach(), v) for k, v in before.items())
    assert isinstance(model[0].bias, DTensor) and not model[0].bias.requires_grad  # the frozen one is untouched
