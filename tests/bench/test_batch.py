import json
import subprocess
import sys
from pathlib import Path

import pytest

from headway.bench.batch import left_pad, row_tokens

ROOT = Path(__file__).resolve().parents[2]


def test_batch_bench_runs_as_typed(tmp_path):
    """`python scripts/batch_bench.py ... --layerskip DIR --drafter DIR --drafter DIR` on the tiny target: a plain, a
    lookup, a LayerSkip, a P-EAGLE and a DFlash row per batch size, every row of every batch identical to plain batched
    generate's, the width chosen reported."""
    from headway.heads.dflash import DFlashHead
    from headway.heads.layerskip import LayerSkipHead
    from headway.heads.peagle import PEagleHead
    from headway.heads.target import load_target

    target, _ = load_target("tiny-random-llama")
    LayerSkipHead.from_target(target, exit_layer=1, num_draft=3).save_pretrained(tmp_path / "ls")
    PEagleHead.from_target(target, parallel_depths=3).save_pretrained(tmp_path / "pe")
    DFlashHead.from_target(target, block_size=4, num_layers=1).save_pretrained(tmp_path / "df")
    cmd = [sys.executable, str(ROOT / "scripts" / "batch_bench.py"), "--model", "tiny-random-llama", "--batches", "1,2",
           "--prompts", "2", "--groups", "chat,copy", "--max-new-tokens", "6", "--layerskip", str(tmp_path / "ls"),
           "--drafter", str(tmp_path / "pe"), "--drafter", str(tmp_path / "df"), "--out", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert set(results) == {"1", "2"}
    for b, rows in results.items():
        assert set(rows) == {"plain", "lookup", "layerskip", "peagle", "dflash"} and rows["plain"]["ratio"] == 1.0
        for name in ("lookup", "layerskip", "peagle", "dflash"):
            assert rows[name]["identical"] and rows[name]["tau"] >= 1.0 and rows[name]["mean_width"] >= 1.0, (b, name)
    assert "vs plain" in res.stdout


def test_batch_bench_refuses_bad_batches():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "batch_bench.py"), "--batches", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "--batches must be >= 1" in res.stderr


def test_rows_are_left_padded_and_cut_at_their_eos():
    ids, mask = left_pad([[5, 6, 7], [8]], pad=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    import torch

    assert row_tokens(torch.tensor([[1, 2, 9, 3, 4], [1, 5, 6, 7, 9]]), 1, eos=9) == [[2, 9], [5, 6, 7, 9]]
    with pytest.raises(SystemExit):
        from headway.bench.batch import main

        main(["--groups", "nope"])
