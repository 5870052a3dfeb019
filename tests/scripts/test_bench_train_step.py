import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # runs training steps of every variant
def test_bench_train_step_runs_as_typed_and_compares_variants():
    """`python scripts/bench_train_step.py ...` on the tiny EAGLE-3 config: one line per variant, the first the baseline."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_train_step.py"), "--config", "configs/eagle/eagle3-tiny.yaml",
           "--steps", "3", "--rounds", "1", "--variant", "plain=train.group_by_length=0",
           "--variant", "grouped=train.group_by_length=4 train.batch_size=8"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in res.stdout.splitlines() if line.startswith(("plain ", "grouped "))}
    assert set(rows) == {"plain", "grouped"}
    assert rows["plain"][3] == "1.00x" and float(rows["grouped"][1]) > 0 and float(rows["grouped"][2]) > 0
    assert "train.group_by_length=4 train.batch_size=8" in res.stdout


def test_bench_train_step_refuses_a_variant_without_a_name():
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_train_step.py"), "--config", "configs/eagle/eagle3-tiny.yaml",
           "--variant", "train.group_by_length=0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "write NAME=OVERRIDES" in res.stderr
