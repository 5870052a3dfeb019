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
