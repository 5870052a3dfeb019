import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_vocab_reduce_bench_runs_as_typed_and_reports_each_shape():
    """`python scripts/vocab_reduce_bench.py ...`: a row per (vocabulary, rows), every way timed (``--cold``: after a
    projection), the chunked path taken where the input is large enough."""
    cmd = [sys.executable, str(ROOT / "scripts" / "vocab_reduce_bench.py"), "--vocabs", "16384,49152", "--rows", "1,6",
           "--reps", "20", "--cold", "--hidden", "64"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stdout.splitlines()[-1])
    assert [(r["vocab"], r["rows"], r["argmax_chunked"], r["topk_chunked"]) for r in report["rows"]] == [
        (16384, 1, False, False), (16384, 6, False, True), (49152, 1, False, False), (49152, 6, True, True)]
    assert all(r[f"{op}_{way}_us"] > 0 for r in report["rows"]
               for op, way in (("argmax", "torch"), ("argmax", "max"), ("argmax", "chunks"), ("topk", "torch"),
                               ("topk", "chunks")))
