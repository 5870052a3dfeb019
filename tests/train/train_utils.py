"""Helpers shared by the training tests."""

import json
import os
import signal
import socket
import subprocess
import sys
import time


def kill_at_checkpoint(proc, ckpts, name: str, timeout: float = 300) -> None:
    """SIGKILL ``proc`` as soon as checkpoint folder ``ckpts/name`` exists; assert it was still running."""
    deadline = time.time() + timeout
    while time.time() < deadline and not (ckpts.is_dir() and any(p.name == name for p in ckpts.iterdir())):
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"


def kill_and_resume(launch, tmp_path, steps: list[str], checkpoint: str):
    """The kill-and-resume check's runs: ``launch(out, *steps, module=)`` an uninterrupted reference run
    into tmp_path/ref; the same run into tmp_path/killed by path, SIGKILLed once ``checkpoint`` exists;
    then rerun as a module. Asserts both finished runs succeeded and the rerun resumed; returns
    (reference folder, resumed folder)."""
    ref = launch(tmp_path / "ref", *steps)
    log, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, log
    out = tmp_path / "killed"
    proc = launch(out, *steps, module=False)  # also covers running the entry point by path
    kill_at_checkpoint(proc, out / "checkpoints", checkpoint)
    assert not (out / "model.safetensors").exists()
    resumed = launch(out, *steps)
    log, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, log
    assert "resumed from" in log
    return tmp_path / "ref", out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_process_cpu_run(script, config, out, *overrides) -> tuple[subprocess.CompletedProcess, dict]:
    """``accelerate launch --multi_gpu --num_processes 2`` of a training entry point on CPU (gloo, a free
    port); asserts it succeeded and the ranks' parameter fingerprints agree; returns the run and its
    distributed.json."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), str(script), "--config", str(config),
           f"train.output_dir={out}", "train.trackers=[]", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    info = json.loads((out / "distributed.json").read_text())
    # `--multi_gpu` with ACCELERATE_USE_CPU: accelerate reports MULTI_CPU (gloo), two real processes
    assert info["num_processes"] == 2 and "MULTI" in info["distributed_type"], info
    rank0, rank1 = info["fingerprints"]
    assert rank0 == rank1, "ranks diverged: gradients were not synchronised"
    return res, info


def failed_run(main, config, out, override: str, capsys) -> tuple[str, list[str]]:
    """A training entry point run with one bad ``override``: asserts it exits with status 2 and returns (its stderr,
    the lines of it that start with ``error:``)."""
    import pytest

    with pytest.raises(SystemExit) as exc:
        main(["--config", str(config), f"train.output_dir={out}", override])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    return err, [line for line in err.splitlines() if line.startswith("error:")]
