"""data.mix: SOURCE:WEIGHT entries, each source's share of the largest exact mix, a seeded interleaving,
and the weighted training set build_datasets makes of it."""

import json

import pytest

from headway.train import mix
from headway.train.data import DataConfig, build_datasets


def test_mix_entries_sizes_and_order():
    assert mix.parse_mix(["sharegpt:3", "a:b.jsonl:1"]) == [("sharegpt", 3.0), ("a:b.jsonl", 1.0)]
    for bad in (["sharegpt"], ["sharegpt:0"], ["sharegpt:-1"], [":2"], ["x:abc"]):
        with pytest.raises(ValueError, match="SOURCE:WEIGHT"):
            mix.parse_mix(bad)
    with pytest.raises(ValueError, match="twice"):
        mix.parse_mix(["a:1", "a:2"])
    assert mix.mix_sizes([100, 100], [3, 1]) == [100, 33]  # the second source's share of the largest exact mix
    assert mix.mix_sizes([30, 1000], [1, 1]) == [30, 30]
    a, b = [f"a{i}" for i in range(100)], [f"b{i}" for i in range(10)]
    out = mix.mix_conversations([("a", a, 3.0), ("b", b, 1.0)], seed=0)
    assert len(out) == 40 and sum(x.startswith("b") for x in out) == 10 and len(set(out)) == 40
    assert out == mix.mix_conversations([("a", a, 3.0), ("b", b, 1.0)], seed=0) != \
        mix.mix_conversations([("a", a, 3.0), ("b", b, 1.0)], seed=1)
    with pytest.raises(ValueError, match="'b' holds no conversations"):
        mix.mix_conversations([("a", a, 1.0), ("b", [], 1.0)])


def test_data_mix_builds_a_weighted_training_set(tmp_path, tiny_llama):
    _, tokenizer = tiny_llama

    def chats(path, word, n):
        path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hello {word} {i}"},
                                                         {"role": "assistant", "content": f"{word} is good"}]}) + "\n"
                                for i in range(n)))
        return str(path)

    a, b = chats(tmp_path / "a.jsonl", "cat", 60), chats(tmp_path / "b.jsonl", "dog", 60)
    cfg = DataConfig(mix=[f"{a}:2", f"{b}:1"], heldout_fraction=0.0, max_length=32, cache_dir=str(tmp_path / "c"))
    train, held = build_datasets(cfg, tokenizer, "tiny")
    cat, dog = tokenizer.convert_tokens_to_ids("cat"), tokenizer.convert_tokens_to_ids("dog")
    assert len(train) == 90 and not held
    assert sum(cat in e["input_ids"] for e in train) == 60 and sum(dog in e["input_ids"] for e in train) == 30
    assert build_datasets(cfg, tokenizer, "tiny")[0] == train  # from the cache
    with pytest.raises(ValueError, match="mix entry 'x' is not SOURCE:WEIGHT"):
        DataConfig(mix=["x"])
    with pytest.raises(FileNotFoundError, match="data.source: no data file at nope.jsonl"):
        build_datasets(DataConfig(mix=[f"{a}:1", "nope.jsonl:1"]), tokenizer, "tiny")


def test_a_prefix_of_the_mix_keeps_about_its_proportions():
    a, b = [f"a{i}" for i in range(300)], [f"b{i}" for i in range(100)]
    out = mix.mix_conversations([("a", a, 1.0), ("b", b, 1.0)], seed=3)
    assert mix.mix_sizes([300, 100], [1.0, 1.0]) == [100, 100] and len(out) == 200
    for n in (50, 100):
        assert abs(sum(x.startswith("b") for x in out[:n]) - n / 2) <= n / 5
    assert mix.parse_mix(["x.jsonl:0.5", " spaced :2"]) == [("x.jsonl", 0.5), ("spaced", 2.0)]
    with pytest.raises(ValueError, match="positive weight"):
        mix.parse_mix(["x:inf"])
