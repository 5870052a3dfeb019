"""Record readers: ShareGPT and OpenAI records normalised, local files and Hub names loaded."""

import json

import pytest
from tests.train.data_utils import word_records, write_jsonl

from headway.train import records as Rec
from tests.train.data_utils import _isolated  # noqa: F401  (autouse: own HF and headway caches)


def test_normalize_sharegpt():
    rec = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                             {"from": "gpt", "value": "a"}]}
    assert Rec.normalize_record(rec) == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "a"}]


def test_normalize_openai_with_content_parts():
    rec = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}]},
                        {"role": "assistant", "content": "yo"}]}
    assert Rec.normalize_record(rec) == [{"role": "user", "content": "hi you"}, {"role": "assistant", "content": "yo"}]


def test_normalize_errors():
    with pytest.raises(ValueError, match=r"\['prompt', 'response'\].*'messages'.*'conversations'"):
        Rec.normalize_record({"prompt": "p", "response": "r"})
    with pytest.raises(ValueError, match="unknown role 'tool'"):
        Rec.normalize_record({"messages": [{"role": "tool", "content": "x"}]})


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_load_conversations_local(tmp_path, suffix):
    records = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
               for i in range(3)]
    path = tmp_path / f"d{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, records)
    elif suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    convos = Rec.load_conversations(str(path))
    assert convos == [Rec.normalize_record(r) for r in records]


def test_load_conversations_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        Rec.load_conversations(str(tmp_path / "nope.jsonl"))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}])
    with pytest.raises(ValueError, match="record 0: record has keys"):
        Rec.load_conversations(str(bad))

    import datasets

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match="could not load Hub dataset 'org/set'.*ConnectionError"):
        Rec.load_conversations("org/set")


def test_truncated_last_jsonl_line_is_ignored(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", word_records(2))
    with open(path, "a") as f:
        f.write('{"messages": [{"role": "us')
    with pytest.warns(UserWarning, match="truncated last line"):
        assert len(Rec.load_conversations(str(path))) == 2
