import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_vocab_reduce_bench_runs_as_typed_and_reports_each_shape():
    """`python scripts/vocab_reduce_bench.py ...`: a row per (vocabulary, rows), both ways timed, the chunked path
    taken where the input is large enough."""
    cmd = [sys.executable, str(ROOT / "scripts" / "vocab_reduce_bench.py"), "--vocabs", "16384,49152", "--rows", "1,2",
           "--reps", "20"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout.splitlines()[-1])
    assert [(r["vocab"], r["rows"], r["chunked"]) for r in report["rows"]] == [
        (16384, 1, False), (16384, 2, True), (49152, 1, True), (49152, 2, True)]
    assert all(r[f"{op}_{way}_us"] > 0 for r in report["rows"]
               for op in ("argmax", "topk") for way in ("torch", "chunked"))
