"""Helpers shared by the training tests."""

import signal
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
