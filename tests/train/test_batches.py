"""Examples into padded batches (cached features and argmax included)."""

import pytest
import torch
from tests.train.feature_utils import H, make_cache

from headway.heads.target.tiny import build_tiny_target
from headway.train.batches import pad_batch
from headway.train.feature_reader import load_cached_features


@pytest.fixture(scope="module")
def target():
    model, tok = build_tiny_target("llama", seed=0)
    return model, tok


def test_pad_batch_pads_features_and_argmax(target, tmp_path):
    cache = load_cached_features(make_cache(target, tmp_path / "c", layers=[0, 2], shard_size=3))
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


def test_token_ids_are_padded_with_pad_id_and_padding_never_counts():
    batch = pad_batch([{"input_ids": [4, 5, 6], "loss_mask": [0, 1, 1]}, {"input_ids": [7], "loss_mask": [1]}], pad_id=9)
    assert batch["input_ids"].tolist() == [[4, 5, 6], [7, 9, 9]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(v.dtype == torch.long for v in batch.values())
