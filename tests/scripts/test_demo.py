"""The demo's self-distillation step: several launched processes write the file one process writes."""

import importlib
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CLI = ["--model", "tiny-random-llama", "--num-prompts", "9", "--batch-size", "3", "--max-new-tokens", "8",
       "--threads", "1"]


@pytest.fixture(scope="module")
def demo():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))  # as demo.py itself does, for its sibling scripts
    return importlib.import_module("demo")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_self_distil_in_two_processes_writes_what_one_writes(demo, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    assert demo.self_distil([*CLI, "--out", str(tmp_path / "two.jsonl")], processes=2) == 0
    log = capfd.readouterr()
    # 9 prompts in 3 batches: rank 0 answers batches 0 and 2, rank 1 batch 1
    assert "rank 0 of 2: wrote 6 new records" in log.err + log.out
    assert "rank 1 of 2: wrote 3 new records" in log.err + log.out
    assert demo.self_distil([*CLI, "--out", str(tmp_path / "one.jsonl")], processes=1) == 0
    one = (tmp_path / "one.jsonl").read_bytes()
    assert (tmp_path / "two.jsonl").read_bytes() == one and len(one.splitlines()) == 9
