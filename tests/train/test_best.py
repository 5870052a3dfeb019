"""train.select_best: the best held-out evaluation's drafter is kept on disk, survives a resume that
predates nothing it needs, and is what the run exports."""

import json

import pytest
import torch

from headway.train.best import BestKeeper
from headway.train.loop import TrainConfig


class _Acc:  # what BestKeeper asks of accelerate's Accelerator in one plain process
    from accelerate.utils import DistributedType

    distributed_type = DistributedType.NO


def _module(seed):
    torch.manual_seed(seed)
    m = torch.nn.Linear(3, 2)
    m.bias.requires_grad_(False)  # frozen: not kept, not restored
    return m


def test_the_best_evaluation_is_kept_and_restored(tmp_path):
    keeper = BestKeeper(tmp_path, "simulated_tau", is_main=True)
    model = _module(0)
    scores = {0: 9.0, 5: 1.2, 10: 1.5, 15: 1.4, 20: 1.5}  # step 0 (untrained) never counts; ties do not replace
    weights = {}
    for step, score in scores.items():
        with torch.no_grad():
            model.weight.add_(1.0)
        weights[step] = model.weight.detach().clone()
        kept = keeper.consider(_Acc(), step, {"simulated_tau": score, "step0/top1": score / 10}, model, fsdp=False)
        assert kept == (step in (5, 10))
    assert (keeper.step, keeper.score) == (10, 1.5)
    record = json.loads((tmp_path / "best" / "best.json").read_text())
    assert record["step"] == 10 and record["metrics"]["step0/top1"] == pytest.approx(0.15)

    bias = model.bias.detach().clone()
    assert keeper.load_into(model, last_step=20)
    assert torch.equal(model.weight, weights[10]) and torch.equal(model.bias, bias)
    assert keeper.chosen(20, {"simulated_tau": 1.5}) == {"simulated_tau": 1.5, "step0/top1": pytest.approx(0.15),
                                                         "selected_step": 10}

    again = BestKeeper(tmp_path, "simulated_tau", is_main=True)  # a resume from a checkpoint after step 10
    again.restore(resumed_step=12)
    assert (again.step, again.score) == (10, 1.5)
    stale = BestKeeper(tmp_path, "simulated_tau", is_main=True)  # a resume from before it: steps 9-10 run again
    stale.restore(resumed_step=8)
    assert stale.step is None
    assert stale.consider(_Acc(), 10, {"simulated_tau": 1.1}, model, fsdp=False)


def test_last_keeps_nothing_and_changes_nothing(tmp_path):
    keeper = BestKeeper(tmp_path, "last", is_main=True)
    assert not keeper.consider(_Acc(), 5, {"simulated_tau": 2.0}, _module(1), fsdp=False)
    assert not (tmp_path / "best").exists()
    assert keeper.chosen(5, {"a": 1.0}) == {"a": 1.0}


def test_the_last_evaluation_when_best_carries_its_own_step(tmp_path):
    keeper = BestKeeper(tmp_path, "simulated_tau", is_main=True)
    model = _module(2)
    keeper.consider(_Acc(), 4, {"simulated_tau": 1.1}, model, fsdp=False)
    keeper.consider(_Acc(), 8, {"simulated_tau": 1.3}, model, fsdp=False)
    assert not keeper.load_into(model, last_step=8)
    assert keeper.chosen(8, {"simulated_tau": 1.3}) == {"simulated_tau": 1.3, "selected_step": 8}


@pytest.mark.parametrize("kwargs, message", [
    ({"select_best": "loss"}, "select_best must be one of last, simulated_tau"),
    ({"select_best": "simulated_tau"}, "set eval_every"),
])
def test_bad_select_best_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)
