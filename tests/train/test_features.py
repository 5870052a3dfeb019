"""The feature cache: several layers per shard, argmax, fingerprint checks, lazy reads, resume."""

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import headway.train.feature_reader as R
import headway.train.features as F
from headway.heads.target.tiny import build_tiny_target, tiny_tokenizer
from headway.train.data import frequent_tokens
from headway.train.feature_reader import CachedExample, load_cached_features
from headway.train.features import cache_features, feature_fingerprint
from headway.train.batches import last_hidden_state, pad_batch

ROOT = Path(__file__).resolve().parents[2]
H = 64  # the tiny targets' hidden size
L = 2  # and their depth
META = {"model": "tiny-random-llama", "data": {"source": "hand-made"}}


@pytest.fixture(scope="module")
def target():
    model, tok = build_tiny_target("llama", seed=0)
    return model, tok


def _examples(lengths=(7, 12, 5, 9, 16, 3, 11)):
    out = []
    for k, n in enumerate(lengths):
        ids = [(5 + 7 * k + 3 * i) % 200 + 4 for i in range(n)]
        out.append({"input_ids": ids, "loss_mask": [0] * min(2, n - 1) + [1] * (n - min(2, n - 1))})
    return out


def _make(target, out, layers=(0, 1, 2), **kw):
    model, tok = target
    kw.setdefault("fingerprint", feature_fingerprint(model, tok, list(layers)))
    return cache_features(model, kw.pop("examples", _examples()), out, layers=list(layers),
                          meta=kw.pop("meta", META), **kw)


@torch.no_grad()
def _reference(model, ids):
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return [h[0] for h in out.hidden_states], out.logits[0].argmax(-1)


def test_features_equal_hidden_states_and_argmax(target, tmp_path):
    model, _ = target
    examples = _examples()
    # float32, one sequence per forward: bit-exact
    exact = load_cached_features(_make(target, tmp_path / "f32", layers=[0, 1, 2], dtype=torch.float32,
                                       batch_size=1, shard_size=3, examples=examples))
    # bf16 storage, padded batches of mixed lengths: equal to bf16 tolerance
    approx = load_cached_features(_make(target, tmp_path / "bf16", layers=[2, 0], batch_size=4, shard_size=3,
                                        examples=examples))
    assert len(exact) == len(approx) == len(examples)
    assert exact.dtype == torch.float32 and approx.dtype == torch.bfloat16
    for e, x, y in zip(examples, exact, approx):
        hs, top = _reference(model, e["input_ids"])
        assert x["input_ids"] == y["input_ids"] == e["input_ids"] and x["loss_mask"] == e["loss_mask"]
        assert x["features"].shape == (len(e["input_ids"]), 3 * H)
        assert torch.equal(x["features"], torch.cat([hs[0], hs[1], hs[2]], dim=-1))
        assert y["features"].shape == (len(e["input_ids"]), 2 * H) and y["features"].dtype == torch.bfloat16
        torch.testing.assert_close(y["features"].float(), torch.cat([hs[2], hs[0]], dim=-1), rtol=1e-2, atol=1e-2)
        assert x["argmax"].dtype == torch.long and torch.equal(x["argmax"], top)
        assert torch.equal(y["argmax"], top)
        # the final layer is the last hidden state that Medusa reads
        assert torch.equal(x["features"][:, 2 * H:], last_hidden_state(model, torch.tensor([e["input_ids"]]))[0])


def test_index_records_bytes_per_token_and_tokens(target, tmp_path):
    examples = _examples()
    tokens = sum(len(e["input_ids"]) for e in examples)
    for dtype, size in ((torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)):
        for layers in ([2], [0, 1, 2]):
            out = _make(target, tmp_path / f"{dtype}-{len(layers)}", layers=layers, dtype=dtype)
            index = json.loads((out / "index.json").read_text())
            assert index["bytes_per_token"] == size * H * len(layers)
            assert index["num_tokens"] == tokens and index["num_sequences"] == len(examples)
            assert index["layers"] == layers and index["complete"] and index["fingerprint"]["layers"] == layers
            cache = load_cached_features(out)
            assert cache.bytes_per_token == size * H * len(layers) and cache.num_tokens == tokens
    index = json.loads((_make(target, tmp_path / "bf16-default", layers=[2]) / "index.json").read_text())
    assert index["dtype"] == "bfloat16"  # the default storage dtype
    no_top = load_cached_features(_make(target, tmp_path / "no-argmax", layers=[2], with_argmax=False))
    assert "argmax" not in no_top[0] and not no_top.has_argmax
    with pytest.raises(ValueError, match="not supported"):
        _make(target, tmp_path / "int", layers=[2], dtype=torch.int8)


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
    out = _make(target, tmp_path / "c", layers=[0, 1, 2], shard_size=3)
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
    assert frequent_tokens(cache, 5, 300) == frequent_tokens(_examples(), 5, 300)
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
    assert len(view) == 3 and view[1]["input_ids"] == _examples()[3]["input_ids"]
    assert not [r for r in log if r[0] == "slice"]
    assert len(cache[-2:]) == 2 and cache[-1]["input_ids"] == _examples()[-1]["input_ids"]
    with pytest.raises(IndexError):
        cache[len(cache)]


def test_a_rank_reads_only_the_feature_rows_of_its_share(target, tmp_path, monkeypatch):
    out = _make(target, tmp_path / "c", layers=[0, 1, 2], shard_size=3)  # shards: examples 0-2, 3-5, 6
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
    out = _make(target, tmp_path / "c", layers=[0, 1, 2], dtype=torch.float32)
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


def test_fingerprint_mismatch_says_what_differs(target, tmp_path):
    model, tok = target
    out = _make(target, tmp_path / "c", layers=[0, 2])
    load_cached_features(out, expect_fingerprint=feature_fingerprint(model, tok, [0, 2]))

    def refused(fp, match):
        with pytest.raises(ValueError, match=match) as info:
            load_cached_features(out, expect_fingerprint=fp)
        assert "\n" not in str(info.value) and "scripts/cache_features.py" in str(info.value)

    other_weights, _ = build_tiny_target("llama", seed=5)
    refused(feature_fingerprint(other_weights, tok, [0, 2]), "another target.*target weights")
    other_family, _ = build_tiny_target("qwen2", seed=0)
    refused(feature_fingerprint(other_family, tok, [0, 2]), "another target.*target config")
    bigger = tiny_tokenizer()
    bigger.add_tokens(["zebra"])
    refused(feature_fingerprint(model, bigger, [0, 2]), "tokenizer vocabulary differs")
    refused(feature_fingerprint(model, tok, [1]), r"holds layers \[0, 2\], this run needs \[1\]")
    # resuming into a folder of another target or layer set is refused as well
    with pytest.raises(ValueError, match="another target.*target weights"):
        cache_features(other_weights, _examples(), out, layers=[0, 2], meta=META)
    with pytest.raises(ValueError, match=r"feature layers differ \(\[0, 2\] vs \[1, 2\]\)"):
        _make(target, out, layers=[1, 2])
    with pytest.raises(ValueError, match="tokenizer vocabulary"):
        _make(target, out, layers=[0, 2], fingerprint=feature_fingerprint(model, bigger, [0, 2]))
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        _make(target, out, layers=[0, 2], dtype=torch.float32)
    with pytest.raises(ValueError, match="another model or data set"):
        _make(target, out, layers=[0, 2], meta={**META, "model": "other"})
    with pytest.raises(ValueError, match="recreate the cache"):
        load_cached_features(out, expect_meta={"model": "other"})
    with pytest.raises(ValueError, match="fingerprint was made for layers"):
        _make(target, tmp_path / "d", layers=[0, 2], fingerprint=feature_fingerprint(model, tok, [2]))


def test_resume_rewrites_only_a_missing_shard(target, tmp_path, monkeypatch):
    out = tmp_path / "c"
    _make(target, out, layers=[1, 2], shard_size=2)  # 7 sequences: 4 shards
    shards = sorted(out.glob("shard-*.safetensors"))
    assert [p.name for p in shards] == [f"shard-0000{i}.safetensors" for i in range(4)]
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, load_file(str(p))) for p in shards}
    shards[2].unlink()
    calls = []
    real = F.capture_features
    monkeypatch.setattr(F, "capture_features", lambda m, ids, *a, **k: calls.append(ids.shape) or real(m, ids, *a, **k))
    _make(target, out, layers=[1, 2], shard_size=2)
    assert sum(shape[0] for shape in calls) == 2, "only the deleted shard's two sequences may run again"
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, load_file(str(p))) for p in sorted(out.glob("shard-*"))}
    assert after.keys() == before.keys()
    for name in before:
        if name == shards[2].name:
            a, b = after[name][2], before[name][2]  # rewritten with the same content
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        else:
            assert after[name][:2] == before[name][:2]  # untouched
    assert not list(out.glob("*.tmp"))
    # a complete cache with all shards is kept as is
    calls.clear()
    _make(target, out, layers=[1, 2], shard_size=2)
    assert calls == []
    # data that changed under an existing shard is refused, not mixed in
    changed = _examples()
    changed[0] = {"input_ids": [9] * 7, "loss_mask": [1] * 7}
    shards[3].unlink()
    with pytest.raises(ValueError, match="other sequences than this data"):
        _make(target, out, layers=[1, 2], shard_size=2, examples=changed)


def test_incomplete_old_or_corrupt_caches_are_refused(target, tmp_path):
    out = _make(target, tmp_path / "c", layers=[2], shard_size=3)
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
    _make(target, out, layers=[2], shard_size=3)  # an unreadable shard is written again on resume
    assert len(load_cached_features(out)) == 7
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps({**index, "shards": index["shards"][:-1]}))
    with pytest.raises(ValueError, match="shards hold 6 sequences but its index lists 7"):
        load_cached_features(out)
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="not a feature cache"):
        load_cached_features(tmp_path / "nothing")


def test_pad_batch_pads_features_and_argmax(target, tmp_path):
    cache = load_cached_features(_make(target, tmp_path / "c", layers=[0, 2], shard_size=3))
    batch = pad_batch(cache[1:4])  # lengths 12, 5, 9
    assert batch["features"].shape == (3, 12, 2 * H) and batch["features"].dtype == torch.bfloat16
    assert batch["argmax"].shape == (3, 12) and batch["argmax"].dtype == torch.long
    assert torch.equal(batch["features"][1, :5], cache[2]["features"]) and not batch["features"][1, 5:].any()
    assert torch.equal(batch["argmax"][1, :5], cache[2]["argmax"]) and (batch["argmax"][1, 5:] == -1).all()
    assert batch["attention_mask"].sum(1).tolist() == [12, 5, 9]
    assert batch["input_ids"][2, :9].tolist() == cache[3]["input_ids"]
    assert batch["loss_mask"][2, :9].tolist() == cache[3]["loss_mask"]
    plain = pad_batch([{"input_ids": [1, 2], "loss_mask": [0, 1]}])
    assert set(plain) == {"input_ids", "loss_mask", "attention_mask"}


def test_script_layers_from_the_run_config(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("cache_features_script", ROOT / "scripts" / "cache_features.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    small = ["data.max_examples=12"]
    # a Medusa config: [L], bf16
    script.main(["--config", str(ROOT / "configs" / "medusa" / "tiny.yaml"), "--out", str(tmp_path / "m"), *small])
    medusa = load_cached_features(tmp_path / "m" / "train")
    assert medusa.layers == [L] and medusa.dtype == torch.bfloat16 and medusa.has_argmax
    assert medusa.index["meta"]["split"] == "train" and medusa.index["fingerprint"]["tokenizer_vocab"]
    assert f"{2 * H} feature bytes per token" in capsys.readouterr().out
    # an EAGLE config (the registry's EAGLE training method, checked whole): the version's feature layers plus L
    eagle_yaml = tmp_path / "eagle.yaml"
    eagle_yaml.write_text(yaml.safe_dump({"model": "tiny-random-llama", "features": "online",
                                          "data": {"source": "packaged", "max_length": 64, "heldout_fraction": 0.1},
                                          "eagle": {"version": 3}, "loss": {"ttt_steps": 7}, "train": {"lr": 1e-4}}))
    script.main(["--config", str(eagle_yaml), "--out", str(tmp_path / "e"), *small])
    eagle = load_cached_features(tmp_path / "e" / "heldout")
    assert eagle.layers == [0, 1, 2] and len(eagle) >= 1
    assert f"{2 * 3 * H} feature bytes per token" in capsys.readouterr().out
    script.main(["--config", str(eagle_yaml), "--out", str(tmp_path / "e1"), "eagle.version=1", *small])
    assert load_cached_features(tmp_path / "e1" / "train").layers == [L]
    script.main(["--config", str(eagle_yaml), "--out", str(tmp_path / "x"), "--layers", "1,0", "--dtype", "float32",
                 "--no-argmax", *small])
    custom = load_cached_features(tmp_path / "x" / "train")
    assert custom.layers == [1, 0] and custom.dtype == torch.float32 and not custom.has_argmax
    # the same data as the Medusa cache: the Medusa run's expectations hold
    assert medusa.index["meta"]["data"] == eagle.index["meta"]["data"]
    # bad input is one line
    with pytest.raises(SystemExit, match=r"error: --layers \[0, 5\] has ids \[5\]"):
        script.main(["--config", str(eagle_yaml), "--out", str(tmp_path / "y"), "--layers", "0,5", *small])
    with pytest.raises(SystemExit, match="error: unknown config key 'data.bogus'"):
        script.main(["--config", str(eagle_yaml), "--out", str(tmp_path / "y"), "data.bogus=1"])
    with pytest.raises(SystemExit, match="error: unknown config key 'eagle.ttt_steps'"):  # a key of the loss section
        script.main(["--config", str(eagle_yaml), "--out", str(tmp_path / "y"), "eagle.ttt_steps=3"])
    with pytest.raises(SystemExit, match=r"sections \['bogus', 'model'\] that fit no training method"):
        script.main(["--out", str(tmp_path / "y"), "bogus.x=1", "model=tiny-random-llama"])
    assert not os.path.exists(tmp_path / "y" / "train" / "index.json")
