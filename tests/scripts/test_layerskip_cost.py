import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_layerskip_cost_runs_as_typed_and_reports_each_exit_and_chain(tmp_path):
    """`python scripts/layerskip_cost.py ...` on a tiny target: a row per (exit, k), and a bad exit is one line."""
    out = tmp_path / "cost.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "layerskip_cost.py"), "--model", "tiny-random-llama", "--prefix", "16",
           "--exits", "1", "--ks", "1,2", "--reps", "2", "--draft-vocab", "64"]
    res = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert sum(line.startswith("E= 1 k=") for line in res.stdout.splitlines()) == 2
    report = json.loads(out.read_text())
    assert [(r["exit"], r["k"]) for r in report["rows"]] == [(1, 1), (1, 2)]
    assert all(r["resumed"] > 0 and r["full"] > 0 and r["break_even_tau"] > 0 for r in report["rows"])
    res = subprocess.run([*cmd[:-8], "--exits", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2 and "exit layers are 1..1 for this target" in res.stderr
