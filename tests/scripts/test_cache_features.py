"""Feature caching split across processes: rank r writes shards r, r+N, ...; rank 0 the index;
the cache equals a single process's (tensors bit-identical, index and fingerprint byte-identical)."""

import importlib.util
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import headway.train.features as F
from headway.heads.target.tiny import build_tiny_target
from headway.train.features import cache_features, feature_fingerprint
from headway.train.feature_reader import load_cached_features

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "cache_features.py"
META = {"model": "tiny-random-llama", "data": {"source": "hand-made"}}


def fake_rank(rank, world):
    """What the split reads of accelerate's PartialState, for one rank run in this process (ranks
    run one after the other, so the barriers have nothing to wait for)."""
    return types.SimpleNamespace(process_index=rank, num_processes=world, wait_for_everyone=lambda: None)


def same_cache(a: Path, b: Path) -> None:
    """Equal index.json bytes and bit-identical tensors in every shard (safetensors headers may
    list their metadata in another order, so the shard files are compared by content)."""
    assert (a / "index.json").read_bytes() == (b / "index.json").read_bytes()
    names = sorted(p.name for p in a.glob("shard-*.safetensors"))
    assert names and names == sorted(p.name for p in b.glob("shard-*.safetensors"))
    for name in names:
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x), name


def _examples(n=9):
    return [{"input_ids": [(3 + 5 * k + 7 * i) % 200 + 4 for i in range(4 + (k * 5) % 11)],
             "loss_mask": [0] + [1] * (3 + (k * 5) % 11)} for k in range(n)]


def test_ranks_write_their_own_shards_and_rank0_the_index(tmp_path, monkeypatch):
    model, tok = build_tiny_target("llama", seed=0)
    kw = dict(layers=[1, 2], meta=META, shard_size=2, batch_size=2, fingerprint=feature_fingerprint(model, tok, [1, 2]))
    one = cache_features(model, _examples(), tmp_path / "one", **kw)
    calls = []
    real = F.capture_features
    monkeypatch.setattr(F, "capture_features", lambda m, ids, *a, **k: calls.append(ids.shape[0]) or real(m, ids, *a, **k))
    two = tmp_path / "two"
    cache_features(model, _examples(), two, state=fake_rank(1, 2), **kw)  # 9 sequences: 5 shards, rank 1 has 1 and 3
    assert sorted(p.name for p in two.iterdir()) == ["shard-00001.safetensors", "shard-00003.safetensors"]
    assert sum(calls) == 4
    cache_features(model, _examples(), two, state=fake_rank(0, 2), **kw)  # shards 0, 2, 4 and the index
    assert sum(calls) == 9
    same_cache(one, two)
    assert len(load_cached_features(two, expect_meta=META, expect_fingerprint=kw["fingerprint"])) == 9


def _launch(out: Path, *args):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
           str(SCRIPT), "--out", str(out), *args]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_cache_what_one_caches(tmp_path):
    args = ["--config", str(ROOT / "configs" / "eagle" / "eagle3-tiny.yaml"), "--shard-size", "4",
            "data.max_examples=24"]
    log = _launch(tmp_path / "two", *args)
    # 24 sequences less the held-out ones: 6 train shards of 4, split 0, 2, 4 / 1, 3, 5
    assert "rank 0 of 2: wrote train shards [0, 2, 4]" in log and "rank 1 of 2: wrote train shards [1, 3, 5]" in log, log
    spec = importlib.util.spec_from_file_location("cache_features_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out", str(tmp_path / "one"), *args])
    for split in ("train", "heldout"):
        same_cache(tmp_path / "one" / split, tmp_path / "two" / split)
    cache = load_cached_features(tmp_path / "two" / "train")
    assert cache.layers == [0, 1, 2] and cache.has_argmax and len(cache) == 22
