"""The run's Accelerator: DeepSpeed's config filled from the run config, trackers checked up front,
the ZeRO stage and FSDP requests read, and a one-process accelerator built."""

import types

import pytest
import torch
from accelerate.utils import DistributedType

from headway.train import accelerator as A
from headway.train.loop import TrainConfig


def test_deepspeed_config_is_filled_from_the_run_config_or_refused():
    import json

    from headway.configs import CONFIG_DIR
    from headway.train.loop import TrainConfig
    from headway.train.accelerator import fill_deepspeed_config

    cfg = TrainConfig(batch_size=4, grad_accum=2, max_grad_norm=0.5)
    ds = json.loads((CONFIG_DIR / "deepspeed" / "zero3.json").read_text())
    fill_deepspeed_config(ds, cfg, processes=2, mixed_precision="no")
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"],
            ds["gradient_clipping"]) == (4, 2, 16, 0.5)
    for key, value, name in [("train_micro_batch_size_per_gpu", 8, "train.batch_size"),
                             ("gradient_accumulation_steps", 4, "train.grad_accum"),
                             ("train_batch_size", 64, "processes")]:
        bad = {**json.loads((CONFIG_DIR / "deepspeed" / "zero2.json").read_text()), key: value}
        with pytest.raises(ValueError, match=f"sets {key}={value} .*{name}"):
            fill_deepspeed_config(bad, cfg, processes=2, mixed_precision="no")
    with pytest.raises(ValueError, match="enables bf16 .*train.mixed_precision=bf16"):
        fill_deepspeed_config({"bf16": {"enabled": True}}, cfg, processes=2, mixed_precision="no")


def test_trackers_are_known_and_installed(monkeypatch):
    A.check_trackers([])
    A.check_trackers(["tensorboard", "all"])
    with pytest.raises(ValueError, match=r"trackers: unknown tracker 'nope'; choose from \[.*'tensorboard'.*\]"):
        A.check_trackers(["nope"])
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])  # as if nothing were installed
    with pytest.raises(ValueError, match=r"trackers: comet_ml is not installed: pip install comet-ml \(or train.trackers=\[\]"):
        A.check_trackers(["comet_ml"])
    A.check_trackers(["all"])  # accelerate's "every installed one" needs nothing installed


def _acc(kind, ds_config=None):
    plugin = types.SimpleNamespace(deepspeed_config=ds_config or {})
    return types.SimpleNamespace(distributed_type=kind, state=types.SimpleNamespace(deepspeed_plugin=plugin))


def test_zero_stage_is_deepspeeds_own_or_zero():
    assert A.zero_stage(_acc(DistributedType.NO)) == 0
    assert A.zero_stage(_acc(DistributedType.MULTI_CPU, {"zero_optimization": {"stage": 3}})) == 0
    assert A.zero_stage(_acc(DistributedType.DEEPSPEED, {"zero_optimization": {"stage": "3"}})) == 3
    assert A.zero_stage(_acc(DistributedType.DEEPSPEED, {})) == 0
    with A.gathered(_acc(DistributedType.DEEPSPEED, {"zero_optimization": {"stage": 2}}), model=None):
        pass  # below ZeRO-3 the parameters are whole already: nothing to gather


def test_fsdp_is_requested_by_the_run_config_or_an_accelerate_fsdp_launch(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert not A.fsdp_requested(TrainConfig(trackers=[]))
    assert A.fsdp_requested(TrainConfig(trackers=[], fsdp=True))
    for value, want in (("true", True), ("1", True), ("YES", True), ("false", False), ("0", False)):
        monkeypatch.setenv("ACCELERATE_USE_FSDP", value)
        assert A.fsdp_requested(TrainConfig(trackers=[])) is want, value


def test_one_process_trains_unsharded(tmp_path, monkeypatch, capsys):
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    cfg = TrainConfig(output_dir=str(tmp_path), trackers=[], mixed_precision="no", fsdp=True)
    acc = A.make_accelerator(cfg)
    assert acc.num_processes == 1 and acc.distributed_type == DistributedType.NO
    assert acc.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert cfg.fsdp is False  # one process has nothing to shard
    assert "train.fsdp with one process has nothing to shard" in capsys.readouterr().out
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="FSDP and DeepSpeed were both asked for; choose one"):
        A.make_accelerator(TrainConfig(output_dir=str(tmp_path), trackers=[], fsdp=True))
