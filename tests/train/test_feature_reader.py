"""Reading the feature cache: lazy rows, a rank's share, layer subsets, refused caches."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tests.train.feature_utils import H, L, META, make_cache, sample_examples

import headway.train.feature_reader as R
from headway.heads.target.tiny import build_tiny_target
from headway.train.data import frequent_tokens
from headway.train.feature_reader import CachedExample, load_cached_features
from headway.train.features import feature_fingerprint


@pytest.fixture(scope="module")
def target():
    model, tok = build_tiny_target("llama", seed=0)
    return model, tok


class _RecordingSlice:
    def __init__(self, log, key, real):
        self.log, self.key, self.real = log, key, real

    def get_shape(self):
        return self.real.get_shape()

    def __getitem__(self, idx):
        self.log.append(("slice", self.key, idx))
        return self.real[idx]


class _RecordingHandle:
    def __init__(self, log, real):
        self.log, self.real = log, real

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def keys(self):
        return self.real.keys()

    def get_tensor(self, key):
        self.log.append(("tensor", key))
        return self.real.get_tensor(key)

    def get_slice(self, key):
        return _RecordingSlice(self.log, key, self.real.get_slice(key))


def test_reading_is_lazy_and_reads_only_the_rows_asked_for(target, tmp_path, monkeypatch):
    out = make_cache(target, tmp_path / "c", layers=[0, 1, 2], shard_size=3)
    log = []
    real_open = R.safe_open
    monkeypatch.setattr(R, "safe_open", lambda *a, **k: _RecordingHandle(log, real_open(*a, **k)))
    cache = load_cached_features(out)
    assert ("tensor", "features") not in log and ("tensor", "argmax") not in log
    assert not [r for r in log if r[0] == "slice"], "opening the cache read feature rows"
    # token ids and masks (e.g. for the draft vocabulary) never touch the features
    for e in cache:
        assert isinstance(e, CachedExample) and isinstance(e, dict)
        assert len(e["input_ids"]) == len(e["loss_mask"]) and "features" in e
    assert frequent_tokens(cache, 5, 300) == frequent_tokens(list(cache.token_lists()), 5, 300)
    assert frequent_tokens(cache, 5, 300) == frequent_tokens(sample_examples(), 5, 300)
    assert not [r for r in log if r[0] == "slice"], "iterating token ids read feature rows"
    # one example: exactly its rows of its own shard (example 4, 16 tokens, is the second of shard 1: rows 9..25)
    example = cache[4]
    assert example["features"].shape == (16, 3 * H)
    example["features"]  # read once, then kept
    assert [r for r in log if r[0] == "slice"] == [("slice", "features", slice(9, 25))]
    example["argmax"]
    assert log[-1] == ("slice", "argmax", slice(9, 25))
    # a layer subset reads only its columns
    log.clear()
    sub = load_cached_features(out, layers=[1])
    sub[4]["features"]
    assert [r for r in log if r[0] == "slice"] == [("slice", "features", (slice(9, 25), slice(H, 2 * H)))]
    # slices are lazy views too
    log.clear()
    view = cache[1::2]
    assert len(view) == 3 and view[1]["input_ids"] == sample_examples()[3]["input_ids"]
    assert not [r for r in log if r[0] == "slice"]
    assert len(cache[-2:]) == 2 and cache[-1]["input_ids"] == sample_examples()[-1]["input_ids"]
    with pytest.raises(IndexError):
        cache[len(cache)]


def test_a_rank_reads_only_the_feature_rows_of_its_share(target, tmp_path, monkeypatch):
    out = make_cache(target, tmp_path / "c", layers=[0, 1, 2], shard_size=3)  # shards: examples 0-2, 3-5, 6
    log = []
    real_open = R.safe_open
    monkeypatch.setattr(R, "safe_open", lambda *a, **k: _RecordingHandle(log, real_open(*a, **k)))
    cache = load_cached_features(out)
    share = cache[1::2]  # rank 1 of 2 (the training loop's evaluation split; its batches index like this)
    for e in share:
        e["features"]
    # examples 1, 3, 5: rows 7..19 of shard 0, 0..9 and 25..28 of shard 1; nothing of examples 0, 2, 4, 6
    assert [r[2] for r in log if r[0] == "slice"] == [slice(7, 19), slice(0, 9), slice(25, 28)]
    monkeypatch.setattr(R, "safe_open", real_open)
    shard1 = load_file(str(out / "shard-00001.safetensors"))["features"]
    assert torch.equal(share[1]["features"], shard1[0:9]) and torch.equal(share[2]["features"], shard1[25:28])


def test_layer_subset_is_a_column_slice(target, tmp_path):
    out = make_cache(target, tmp_path / "c", layers=[0, 1, 2], dtype=torch.float32)
    full = load_cached_features(out)
    for layers in ([2], [0], [2, 0], [1, 2], [0, 1, 2]):
        sub = load_cached_features(out, layers=layers)
        assert sub.layers == layers and sub.cached_layers == [0, 1, 2] and sub.feature_width == len(layers) * H
        want = torch.cat([full[3]["features"][:, i * H:(i + 1) * H] for i in layers], dim=-1)
        assert torch.equal(sub[3]["features"], want)
        assert torch.equal(full.with_layers(layers)[3]["features"], want)
    # the run's fingerprint names the layers it needs: a Medusa run takes [L] from an EAGLE-3 cache
    model, tok = target
    medusa = load_cached_features(out, expect_meta=META, expect_fingerprint=feature_fingerprint(model, tok, [L]))
    assert medusa.layers == [L] and torch.equal(medusa[0]["features"], full[0]["features"][:, 2 * H:])
    with pytest.raises(ValueError, match=r"holds layers \[0, 1, 2\].*missing \[3\].*cache_features.py"):
        load_cached_features(out, layers=[3])


def test_incomplete_old_or_corrupt_caches_are_refused(target, tmp_path):
    out = make_cache(target, tmp_path / "c", layers=[2], shard_size=3)
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps({**index, "complete": False}))
    with pytest.raises(ValueError, match="incomplete"):
        load_cached_features(out)
    (out / "index.json").write_text(json.dumps({"meta": META, "shards": index["shards"], "complete": True}))
    with pytest.raises(ValueError, match="older headway.*cache_features.py"):
        load_cached_features(out)
    (out / "index.json").write_text(json.dumps(index))
    (out / "shard-00001.safetensors").write_bytes(b"not a shard")
    with pytest.raises(ValueError, match="shard-00001.safetensors is missing or corrupt") as info:
        load_cached_features(out)
    assert "\n" not in str(info.value)
    make_cache(target, out, layers=[2], shard_size=3)  # an unreadable shard is written again on resume
    assert len(load_cached_features(out)) == 7
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps({**index, "shards": index["shards"][:-1]}))
    with pytest.raises(ValueError, match="shards hold 6 sequences but its index lists 7"):
        load_cached_features(out)
    (out / "index.json").write_text("{cut")
    with pytest.raises(ValueError, match=r"index.json is not valid JSON \(.*\); recreate the cache"):
        load_cached_features(out)
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="not a feature cache"):
        load_cached_features(tmp_path / "nothing")
