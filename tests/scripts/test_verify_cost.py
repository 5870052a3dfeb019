import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # measures the default target's verification cost
def test_verify_cost_runs_as_typed_and_reports_each_ratio():
    """`python scripts/verify_cost.py ...` as gpu_check.sh runs it (here on CPU with a tiny target)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "verify_cost.py"), "--model", "tiny-random-llama", "--device", "cpu",
           "--prefix", "16", "--ks", "2,4", "--trees", "tree-7", "--reps", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert any(line.startswith("chain t(2)/t(1) = ") for line in lines)
    assert any(line.startswith("chain t(4)/t(1) = ") for line in lines)
    assert any(line.startswith("tree-7 (8 nodes, tree mask)") for line in lines)
    import json

    report = json.loads(lines[-1])
    assert report["device"] == "cpu" and report["t1_ms"] > 0 and set(report["chain"]) == {"2", "4"}
    assert report["packed_linears"] is True and "packed" in next(x for x in lines if x.startswith("tiny-random-llama"))
    res = subprocess.run([*cmd, "--no-pack-linears"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0 and json.loads(res.stdout.splitlines()[-1])["packed_linears"] is False
    res = subprocess.run([*cmd, "--compare-packing"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout.splitlines()[-1])
    assert report["variants"] == ["as loaded", "packed"]
    assert set(report["tree"]["tree-7"]) == {"as loaded", "packed"} and all(r > 0 for r in report["tree"]["tree-7"].values())
    assert any(x.startswith("chain t(2)/t(1) = ") and "as loaded" in x and "packed" in x for x in res.stdout.splitlines())
