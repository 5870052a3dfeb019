"""The feature cache writer: several layers per shard, argmax, fingerprint checks, resume; the script."""

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tests.train.feature_utils import H, L, META, make_cache, sample_examples

import headway.train.features as F
from headway.heads.target.tiny import build_tiny_target, tiny_tokenizer
from headway.train.feature_reader import load_cached_features
from headway.train.features import cache_features, feature_fingerprint
from headway.train.batches import last_hidden_state

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target():
    model, tok = build_tiny_target("llama", seed=0)
    return model, tok


@torch.no_grad()
def _reference(model, ids):
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return [h[0] for h in out.hidden_states], out.logits[0].argmax(-1)


def test_features_equal_hidden_states_and_argmax(target, tmp_path):
    model, _ = target
    examples = sample_examples()
    # float32, one sequence per forward: bit-exact
    exact = load_cached_features(make_cache(target, tmp_path / "f32", layers=[0, 1, 2], dtype=torch.float32,
                                       batch_size=1, shard_size=3, examples=examples))
    # bf16 storage, padded batches of mixed lengths: equal to bf16 tolerance
    approx = load_cached_features(make_cache(target, tmp_path / "bf16", layers=[2, 0], batch_size=4, shard_size=3,
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
    examples = sample_examples()
    tokens = sum(len(e["input_ids"]) for e in examples)
    for dtype, size in ((torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)):
        for layers in ([2], [0, 1, 2]):
            out = make_cache(target, tmp_path / f"{dtype}-{len(layers)}", layers=layers, dtype=dtype)
            index = json.loads((out / "index.json").read_text())
            assert index["bytes_per_token"] == size * H * len(layers)
            assert index["num_tokens"] == tokens and index["num_sequences"] == len(examples)
            assert index["layers"] == layers and index["complete"] and index["fingerprint"]["layers"] == layers
            cache = load_cached_features(out)
            assert cache.bytes_per_token == size * H * len(layers) and cache.num_tokens == tokens
    index = json.loads((make_cache(target, tmp_path / "bf16-default", layers=[2]) / "index.json").read_text())
    assert index["dtype"] == "bfloat16"  # the default storage dtype
    no_top = load_cached_features(make_cache(target, tmp_path / "no-argmax", layers=[2], with_argmax=False))
    assert "argmax" not in no_top[0] and not no_top.has_argmax
    with pytest.raises(ValueError, match="not supported"):
        make_cache(target, tmp_path / "int", layers=[2], dtype=torch.int8)


def test_fingerprint_mismatch_says_what_differs(target, tmp_path):
    model, tok = target
    out = make_cache(target, tmp_path / "c", layers=[0, 2])
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
        cache_features(other_weights, sample_examples(), out, layers=[0, 2], meta=META)
    with pytest.raises(ValueError, match=r"feature layers differ \(\[0, 2\] vs \[1, 2\]\)"):
        make_cache(target, out, layers=[1, 2])
    with pytest.raises(ValueError, match="tokenizer vocabulary"):
        make_cache(target, out, layers=[0, 2], fingerprint=feature_fingerprint(model, bigger, [0, 2]))
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        make_cache(target, out, layers=[0, 2], dtype=torch.float32)
    with pytest.raises(ValueError, match="another model or data set"):
        make_cache(target, out, layers=[0, 2], meta={**META, "model": "other"})
    with pytest.raises(ValueError, match="recreate the cache"):
        load_cached_features(out, expect_meta={"model": "other"})
    with pytest.raises(ValueError, match="fingerprint was made for layers"):
        make_cache(target, tmp_path / "d", layers=[0, 2], fingerprint=feature_fingerprint(model, tok, [2]))


def test_resume_rewrites_only_a_missing_shard(target, tmp_path, monkeypatch):
    out = tmp_path / "c"
    make_cache(target, out, layers=[1, 2], shard_size=2)  # 7 sequences: 4 shards
    shards = sorted(out.glob("shard-*.safetensors"))
    assert [p.name for p in shards] == [f"shard-0000{i}.safetensors" for i in range(4)]
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, load_file(str(p))) for p in shards}
    shards[2].unlink()
    calls = []
    real = F.capture_features
    monkeypatch.setattr(F, "capture_features", lambda m, ids, *a, **k: calls.append(ids.shape) or real(m, ids, *a, **k))
    make_cache(target, out, layers=[1, 2], shard_size=2)
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
    make_cache(target, out, layers=[1, 2], shard_size=2)
    assert calls == []
    # data that changed under an existing shard is refused, not mixed in
    changed = sample_examples()
    changed[0] = {"input_ids": [9] * 7, "loss_mask": [1] * 7}
    shards[3].unlink()
    with pytest.raises(ValueError, match="other sequences than this data"):
        make_cache(target, out, layers=[1, 2], shard_size=2, examples=changed)


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
