"""Every distributed mode through accelerate, really launched with 2 processes on CPU (gloo).

DDP, DeepSpeed ZeRO-2 and ZeRO-3, and FSDP (accelerate's FSDP config; headway applies torch's FSDP2
itself, since accelerate's FSDP runs only on GPUs) train the tiny Medusa and EAGLE-3 configs; each
run records its process count, distributed type and every rank's parameter fingerprint
(distributed.json), and the ZeRO and FSDP runs end within float tolerance of the DDP run's exported
weights. Kill-and-resume in every mode reaches the uninterrupted run's weights; a DeepSpeed
checkpoint refuses another world size while DDP (whole state) and FSDP (reshardable per-rank
shards) checkpoints resume with one;
two `accelerate launch` commands with num_machines 2 form one job over loopback. (The first
DeepSpeed start compiles a small op, ~60 s, cached.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"medusa": ROOT / "configs" / "medusa" / "tiny.yaml", "eagle": ROOT / "configs" / "eagle" / "eagle3-tiny.yaml"}
SCRIPTS = {"medusa": ROOT / "train" / "medusa.py", "eagle": ROOT / "train" / "eagle.py"}
MODES = {
    "ddp": ["--multi_gpu"],
    "zero2": ["--use_deepspeed", "--deepspeed_config_file", str(ROOT / "configs" / "deepspeed" / "zero2.json")],
    "zero3": ["--use_deepspeed", "--deepspeed_config_file", str(ROOT / "configs" / "deepspeed" / "zero3.json")],
    "fsdp": ["--config_file", str(ROOT / "configs" / "accelerate" / "cpu-fsdp-2.yaml")],
}
TYPES = {"ddp": "MULTI", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED", "fsdp": "FSDP"}
STEPS = ["train.max_steps=12", "train.batch_size=4", "train.grad_accum=2", "train.trackers=[]"]
_port = iter(range(29600, 29700))

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def launch(method: str, mode: str, out: Path, *overrides, processes: int = 2, launcher: list[str] = (),
           port: int | None = None) -> subprocess.Popen:
    flags = [] if mode == "ddp" and processes == 1 else MODES[mode]  # --multi_gpu needs 2 processes
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--num_processes", str(processes),
           *(launcher or ["--num_machines", "1"]), "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(port or next(_port)),
           str(SCRIPTS[method]), "--config", str(CONFIGS[method]), f"train.output_dir={out}", *STEPS, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    log, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, log[-4000:]
    return log


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def check_in_sync(out: Path, mode: str) -> list:
    info = json.loads((out / "distributed.json").read_text())
    assert info["num_processes"] == 2 and TYPES[mode] in info["distributed_type"], info
    rank0, rank1 = info["fingerprints"]
    assert rank0 == rank1, "ranks diverged: gradients were not synchronised"
    return rank0


def close(a: dict, b: dict, atol: float = 2e-5) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=1e-4) for k in a)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """The DDP reference for both methods (each asserted in sync)."""
    root = tmp_path_factory.mktemp("ddp")
    runs = {}
    for method in CONFIGS:
        finish(launch(method, "ddp", root / method))
        check_in_sync(root / method, "ddp")
        runs[method] = weights(root / method)
    return runs


@pytest.mark.parametrize("method", list(CONFIGS))
@pytest.mark.parametrize("mode", ["zero2", "zero3", "fsdp"])
def test_sharded_modes_match_ddp(ddp_runs, tmp_path, method, mode):
    out = tmp_path / mode
    finish(launch(method, mode, out))
    start = check_in_sync(out, mode)
    assert any(abs(v) > 0 for v in start)
    mine, ref = weights(out), ddp_runs[method]
    diff = max(float((mine[k].float() - ref[k].float()).abs().max()) for k in ref)
    assert close(mine, ref), f"{mode} {method}: max |w - w_ddp| = {diff:.3g}"
    moved = max(float((ref[k].float()).abs().max()) for k in ref)
    assert moved > 0


def kill_at(proc: subprocess.Popen, ckpts: Path, name: str, timeout: float = 600) -> None:
    """SIGKILL the whole launch (launcher and ranks) once checkpoint ``name`` is complete."""
    deadline = time.time() + timeout
    while time.time() < deadline and not (ckpts / name / "state.json").is_file():
        assert proc.poll() is None, "the run ended before it could be killed:\n" + proc.stdout.read()[-3000:]
        time.sleep(0.02)
    import psutil  # accelerate's own dependency

    launcher = psutil.Process(proc.pid)
    for p in launcher.children(recursive=True) + [launcher]:  # the ranks run in their own process groups
        p.send_signal(signal.SIGKILL)
    proc.communicate()


@pytest.mark.parametrize("mode", ["zero2", "zero3", "ddp", "fsdp"])
def test_kill_and_resume_in_every_mode(tmp_path, mode):
    steps = ["train.max_steps=24", "train.save_every=6"]
    ref = tmp_path / "ref"
    finish(launch("medusa", mode, ref, *steps))
    out = tmp_path / "killed"
    kill_at(launch("medusa", mode, out, *steps), out / "checkpoints", "step-0000006")
    assert not (out / "model.safetensors").exists()
    log = finish(launch("medusa", mode, out, *steps))
    assert "resumed from" in log
    check_in_sync(out, mode)
    assert close(weights(out), weights(ref), atol=1e-6)
    state = json.loads(next((out / "checkpoints").glob("step-*/state.json")).read_text())
    assert state["world_size"] == 2 and TYPES[mode] in state["distributed_type"]


def test_sharded_checkpoint_refuses_another_world_size(tmp_path):
    out = tmp_path / "run"
    kill_at(launch("medusa", "zero2", out, "train.max_steps=24", "train.save_every=6"), out / "checkpoints",
            "step-0000006")
    proc = launch("medusa", "zero2", out, "train.max_steps=24", "train.save_every=6", processes=1)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0 and "cannot be resharded" in log and "--num_processes 2" in log


def test_ddp_checkpoint_resumes_with_another_world_size(tmp_path):
    """A DDP checkpoint holds the whole state: a 2-process run resumes and finishes in 1 process."""
    out, steps = tmp_path / "run", ["train.max_steps=24", "train.save_every=6"]
    kill_at(launch("medusa", "ddp", out, *steps), out / "checkpoints", "step-0000006")
    log = finish(launch("medusa", "ddp", out, *steps, processes=1))
    assert "was written by 2 process(es) at step 6; resuming with 1 at step 12" in log
    assert (out / "model.safetensors").is_file()


def test_two_machines_on_loopback_form_one_job(tmp_path):
    """num_machines 2, machine_rank 0 and 1, main address 127.0.0.1: one process per 'machine'."""
    out, port = tmp_path / "multinode", next(_port)
    procs = [launch("medusa", "ddp", out, processes=2, port=port,
                    launcher=["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"])
             for rank in (0, 1)]
    for p in procs:
        finish(p)
    check_in_sync(out, "ddp")


def test_fsdp_checkpoint_resumes_with_another_world_size(tmp_path):
    """FSDP checkpoints are every rank's shards (torch.distributed.checkpoint), resharded on load:
    2 processes resume as 3."""
    out, steps = tmp_path / "run", ["train.max_steps=24", "train.save_every=6"]
    kill_at(launch("medusa", "fsdp", out, *steps), out / "checkpoints", "step-0000006")
    state = json.loads((out / "checkpoints" / "step-0000006" / "state.json").read_text())
    assert state["fsdp"] and state["world_size"] == 2
    log = finish(launch("medusa", "fsdp", out, *steps, processes=3))
    assert "was written by 2 process(es) at step 6; resuming with 3 at step 4" in log
    info = json.loads((out / "distributed.json").read_text())
    assert info["num_processes"] == 3 and info["distributed_type"] == "FSDP"
    assert sorted(p.name for p in (out / "checkpoints" / "step-0000012" / "fsdp").iterdir() if p.suffix == ".distcp") \
        == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]  # one shard file per rank


def test_fsdp_with_deepspeed_and_mode_switches_are_refused(tmp_path):
    """FSDP and DeepSpeed together, and resuming an FSDP checkpoint under DDP, fail in one line."""
    proc = launch("medusa", "zero2", tmp_path / "both", "train.fsdp=true")
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0 and "error: FSDP and DeepSpeed were both asked for; choose one" in log
    out, steps = tmp_path / "switch", ["train.max_steps=24", "train.save_every=6"]
    kill_at(launch("medusa", "fsdp", out, *steps), out / "checkpoints", "step-0000006")
    proc = launch("medusa", "ddp", out, *steps)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0 and "already holds a different run (differs in train.fsdp)" in log
