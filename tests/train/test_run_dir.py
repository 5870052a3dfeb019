"""A run's output folder: refusals read without writing, and a failed fresh start undone."""

import json

import pytest

from headway.train.run_dir import claimed, output_dir_problem

RUN = {"model": "m", "train": {"lr": 0.001, "log_every": 10}}


def claim(out, run=RUN, **kw):
    return claimed(out, run, overwrite=kw.get("overwrite", False), resume=True, is_main=True)


def test_a_fresh_run_that_fails_before_a_checkpoint_leaves_the_folder_as_it_was(tmp_path):
    out = tmp_path / "absent"
    with pytest.raises(RuntimeError, match="boom"), claim(out):
        assert json.loads((out / "run_config.json").read_text()) == RUN
        (out / "metrics.jsonl").write_text("{}\n")
        raise RuntimeError("boom")
    assert not out.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError), claim(empty):
        (empty / "logs").mkdir()
        raise RuntimeError("boom")
    assert empty.is_dir() and not any(empty.iterdir())
    # so a different command may take the folder at once
    with claim(out, {**RUN, "train": {"lr": 0.01}}):
        pass


def test_a_run_with_a_checkpoint_or_resumed_keeps_everything(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError), claim(out):
        (out / "checkpoints" / "step-0000001").mkdir(parents=True)
        (out / "checkpoints" / "step-0000001" / "state.json").write_text("{}")
        raise RuntimeError("killed by a bug at step 2")
    assert (out / "run_config.json").is_file() and (out / "checkpoints").is_dir()
    other = tmp_path / "resumed"
    with claim(other):  # a run recorded here before this start
        pass
    (other / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RuntimeError), claim(other, {**RUN, "train": {"lr": 0.001, "log_every": 5}}):
        raise RuntimeError("boom")
    assert (other / "run_config.json").is_file() and (other / "metrics.jsonl").is_file()


def test_refusals_are_read_without_writing(tmp_path):
    def problem(out, run=RUN, overwrite=False):
        return output_dir_problem(out, run, overwrite=overwrite, resume=True)

    (tmp_path / "file").write_text("x")
    assert "is a file" in problem(tmp_path / "file") and "is a file" in problem(tmp_path / "file", overwrite=True)
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "notes.txt").write_text("mine")
    assert "not empty and holds no headway run (notes.txt)" in problem(tmp_path / "stray")
    # overwrite replaces a run's folder, never one of other files, nor one holding this run's own input
    assert "holds files but no headway run (notes.txt)" in problem(tmp_path / "stray", overwrite=True)
    assert problem(tmp_path / "absent", overwrite=True) is None
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run_config.json").write_text(json.dumps(RUN))
    assert problem(tmp_path / "run") is None
    assert problem(tmp_path / "run", {**RUN, "train": {"lr": 0.001, "log_every": 1}}) is None  # resumable field
    assert "differs in train.lr" in problem(tmp_path / "run", {**RUN, "train": {"lr": 0.1, "log_every": 10}})
    assert problem(tmp_path / "run", overwrite=True) is None
    (tmp_path / "run" / "data.jsonl").write_text("{}\n")
    (tmp_path / "run" / "feats").mkdir()
    reads = {**RUN, "data": {"source": str(tmp_path / "run" / "data.jsonl"), "mix": [{"source": "x"}]},
             "features": str(tmp_path / "run" / "feats"), "output_dir": str(tmp_path / "run")}
    assert "would delete" in problem(tmp_path / "run", reads, overwrite=True)
    assert "own input (data.source, features)" in problem(tmp_path, reads, overwrite=True)  # an ancestor too
    (tmp_path / "run" / "data.jsonl").unlink()
    (tmp_path / "run" / "feats").rmdir()
    (tmp_path / "run" / "run_config.json").write_text("{cut")
    assert "not valid JSON" in problem(tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "run", "stray"]
    assert [p.name for p in (tmp_path / "stray").iterdir()] == ["notes.txt"]
