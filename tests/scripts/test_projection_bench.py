import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_projection_bench_runs_as_typed_and_reports_each_shape():
    """`python scripts/projection_bench.py ...`: a row per (weight, rows), every kernel timed, few_rows_linear's
    product checked against F.linear's; a bad shape is a one-line usage error."""
    cmd = [sys.executable, str(ROOT / "scripts" / "projection_bench.py"), "--shapes", "2048x64,1024x32",
           "--rows", "1,4", "--reps", "6", "--no-evict"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout.splitlines()[-1])
    assert [(r["vocab"], r["hidden"], r["rows"]) for r in report["rows"]] == [
        (2048, 64, 1), (2048, 64, 4), (1024, 32, 1), (1024, 32, 4)]
    assert all(r[f"{k}_ms"] > 0 for r in report["rows"] for k in ("one_row", "linear", "transposed", "few_rows_linear"))
    assert all(r["max_abs_diff"] < 1e-3 for r in report["rows"]) and report["evict"] is False
    bad = subprocess.run(cmd[:2] + ["--shapes", "2048by64"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--shapes takes VOCABxHIDDEN" in bad.stderr.splitlines()[-1]
