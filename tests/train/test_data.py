"""Data sets: config checks, deterministic train/held-out splits, the tokenized cache, the default source."""

import pytest
from tests.train.data_utils import word_records, word_tokenizer, write_jsonl

from headway.train import data as D
from tests.train.data_utils import _isolated  # noqa: F401  (autouse: own HF and headway caches)


def test_config_validation():
    with pytest.raises(ValueError, match="heldout_fraction"):
        D.DataConfig(heldout_fraction=1.0)
    with pytest.raises(ValueError, match="max_length"):
        D.DataConfig(max_length=4)
    with pytest.raises(ValueError, match="max_examples"):
        D.DataConfig(max_examples=0)


def test_split_deterministic(tmp_path):
    tok, path = word_tokenizer(), write_jsonl(tmp_path / "d.jsonl", word_records(40))
    cfg = dict(source=str(path), heldout_fraction=0.25, cache_dir=str(tmp_path / "c"))
    train, held = D.build_datasets(D.DataConfig(**cfg, seed=0), tok, "m")
    assert (len(train), len(held)) == (30, 10)
    assert all(set(e) == {"input_ids", "loss_mask"} and any(e["loss_mask"]) for e in train + held)
    assert D.build_datasets(D.DataConfig(**cfg, seed=0), tok, "m") == (train, held)
    train1, held1 = D.build_datasets(D.DataConfig(**cfg, seed=1), tok, "m")
    assert held1 != held
    key = lambda e: tuple(e["input_ids"])  # noqa: E731
    assert sorted(map(key, train + held)) == sorted(map(key, train1 + held1))
    capped, _ = D.build_datasets(D.DataConfig(**cfg, max_examples=8), tok, "m")
    assert len(capped) == 6


def test_cache_reuse(tmp_path, monkeypatch):
    tok, path = word_tokenizer(), write_jsonl(tmp_path / "d.jsonl", word_records(10))
    cfg = D.DataConfig(source=str(path), heldout_fraction=0.2)
    first = D.build_datasets(cfg, tok, "m")
    assert len(list((tmp_path / "cache" / "tokenized").glob("*.json"))) == 1

    def boom(*a, **k):
        raise AssertionError("re-tokenized despite a cache")

    monkeypatch.setattr(D, "tokenize_conversation", boom)
    assert D.build_datasets(cfg, tok, "m") == first
    with pytest.raises(AssertionError):  # another max_length is another cache entry
        D.build_datasets(D.DataConfig(source=str(path), heldout_fraction=0.2, max_length=9), tok, "m")


def test_empty_after_filtering(tmp_path):
    long_user = {"messages": [{"role": "user", "content": " ".join(["hello"] * 20)},
                              {"role": "assistant", "content": "fine"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [long_user] * 3)
    with pytest.raises(ValueError, match=r"no training examples left.*3 records loaded.*max_length=8"):
        D.build_datasets(D.DataConfig(source=str(path), max_length=8), word_tokenizer(), "m")


def test_default_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="generate_data.py --model org/m"):
        D.build_datasets(D.DataConfig(), word_tokenizer(), "org/m")
    path = D.default_data_path("org/m")
    assert path.parent == tmp_path / "cache" / "data" and path.name == "org--m-selfdistill.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, word_records(5))
    train, held = D.build_datasets(D.DataConfig(), word_tokenizer(), "org/m")
    assert len(train) + len(held) == 5
