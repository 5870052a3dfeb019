"""The training loop's pure parts: the epoch order (a plain shuffle by default, length-grouped batches on
request) and the learning-rate schedule (the loop itself runs in every method's tests and test_distributed.py)."""

import random

import pytest
import torch

from headway.train.loop import TrainConfig, epoch_order, lr_lambda


def _padding(lengths, order, batch):
    padded = sum(max(lengths[i] for i in b) * len(b) for b in order.split(batch))
    return 1 - sum(lengths) / padded


def test_plain_order_is_the_seeded_shuffle_it_always_was():
    lengths = list(range(50))
    want = torch.randperm(50, generator=torch.Generator().manual_seed(3 * 100_003 + 2))
    assert torch.equal(epoch_order(lengths, epoch=2, seed=3, batch=8), want)


def test_grouped_order_covers_every_sequence_once_and_cuts_padding():
    rng = random.Random(0)
    lengths = [rng.randint(40, 206) for _ in range(1000)]  # the spread of the demo's conversations
    plain = epoch_order(lengths, epoch=0, seed=0, batch=8)
    grouped = epoch_order(lengths, epoch=0, seed=0, batch=8, group=16)
    assert sorted(grouped.tolist()) == list(range(1000))
    assert torch.equal(grouped, epoch_order(lengths, epoch=0, seed=0, batch=8, group=16))  # resumable
    assert not torch.equal(grouped, epoch_order(lengths, epoch=1, seed=0, batch=8, group=16))  # new each epoch
    assert _padding(lengths, plain, 8) > 0.3 and _padding(lengths, grouped, 8) < 0.05
    # within a group the batches are shuffled, not served longest first
    first = [max(lengths[i] for i in b) for b in grouped[:16 * 8].split(8)]
    assert first != sorted(first, reverse=True)


def test_negative_group_is_refused():
    with pytest.raises(ValueError, match="group_by_length must be >= 0"):
        TrainConfig(group_by_length=-1)


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    total, warmup, floor = 110, 10, 0.1
    assert [lr_lambda(s, total, warmup, floor) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_lambda(warmup, total, warmup, floor) == pytest.approx(1.0)  # the peak, then the decay
    assert lr_lambda(60, total, warmup, floor) == pytest.approx(floor + (1 - floor) * 0.5)  # half way down
    assert lr_lambda(total, total, warmup, floor) == pytest.approx(floor)
    assert lr_lambda(total + 50, total, warmup, floor) == pytest.approx(floor)  # stays at the floor
    lrs = [lr_lambda(s, total, warmup, floor) for s in range(warmup, total + 1)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lr_lambda(0, 5, 0, 0.0) == 1.0 and lr_lambda(5, 5, 0, 0.0) == pytest.approx(0.0)  # no warmup
