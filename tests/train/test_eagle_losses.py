"""EAGLE-1 and EAGLE-3 losses: which rows count at each unrolled step, how the loss is made of the
counts, short batches that keep every parameter in the graph, and chunked = plain."""

import pytest
import torch
from tests.train.loss_utils import assert_same, loss_and_grads

from headway.heads import EagleHead
from headway.heads.target.features import capture_features
from headway.train.eagle_losses import eagle1_loss, eagle3_loss


def _batch(target, version, t=8, layers=1):
    """A head of ``version`` (and ``layers`` decoder layers) with non-zero weights, and its inputs on a [2, t] batch
    whose row 1 answers from token 5 on."""
    torch.manual_seed(version)
    head = EagleHead.from_target(target, version=version, num_layers=layers)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    head.bind_target(target)
    ids = torch.randint(5, 120, (2, t), generator=torch.Generator().manual_seed(t))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        feats = capture_features(target, ids, [0, 1, 2])
    rows = head.draft_rows(target.lm_head.weight.detach()).float()
    return head, feats, ids, mask, rows


def test_eagle3_counts_the_answer_rows_of_each_step_and_weights_the_steps_by_decay(tiny_llama):
    target = tiny_llama[0]
    head, feats, ids, mask, rows = _batch(target, 3)
    loss, counts = eagle3_loss(head, feats, feats[..., -64:], ids, mask, rows, head.draft_index(), steps=3, decay=0.5,
                               chunk_size=0)
    loss = loss.detach()
    assert set(counts) == {f"step{i}/{k}" for i in range(3) for k in ("loss_sum", "top1", "top5", "count")}
    # row t of step i predicts x[t+2+i]: row 0 has 6 - i such tokens (t + i <= 5), row 1 the 3 answer tokens 5..7
    assert [int(counts[f"step{i}/count"]) for i in range(3)] == [9, 8, 7]
    for i in range(3):
        assert 0 <= int(counts[f"step{i}/top1"]) <= int(counts[f"step{i}/top5"]) <= int(counts[f"step{i}/count"])
    # full vocabulary: every counted row learns, so the loss is sum_i decay**i * mean cross-entropy of step i
    want = sum(0.5 ** i * float(counts[f"step{i}/loss_sum"]) / int(counts[f"step{i}/count"]) for i in range(3))
    assert float(loss) == pytest.approx(want, rel=1e-6) and float(loss) > 0
    # the target's own argmax as labels changes the accuracy counts only, never the loss
    with torch.no_grad():
        argmax = target(input_ids=ids).logits.argmax(-1)
        again, _ = eagle3_loss(head, feats, feats[..., -64:], ids, mask, rows, head.draft_index(), argmax, steps=3,
                               decay=0.5, chunk_size=0)
    assert float(again) == pytest.approx(float(loss), rel=1e-6)


def test_eagle1_loss_is_the_weighted_regression_plus_cross_entropy(tiny_llama):
    target = tiny_llama[0]
    head, feats, ids, mask, rows = _batch(target, 1)
    last = feats[..., -64:]
    loss, counts = eagle1_loss(head, last, ids, mask, rows, head.draft_index(), noise=0.0, ce_weight=0.3,
                               reg_weight=2.0, chunk_size=0)
    loss = loss.detach()
    n = int(counts["step0/count"])
    assert n == 6 + 3  # x[t+2] is an answer token: t = 0..5 in row 0, t = 3..5 in row 1
    want = 2.0 * float(counts["step0/reg_sum"]) / n + 0.3 * float(counts["step0/loss_sum"]) / n
    assert float(loss) == pytest.approx(want, rel=1e-6)
    # noise on the input features changes the loss, and a seeded generator makes it repeatable
    with torch.no_grad():
        weights = {"ce_weight": 0.3, "reg_weight": 2.0, "chunk_size": 0}
        plain = float(eagle1_loss(head, last, ids, mask, rows, None, noise=0.0, **weights)[0])
        noisy = [float(eagle1_loss(head, last, ids, mask, rows, None, noise=0.5, **weights,
                                   generator=torch.Generator().manual_seed(1))[0]) for _ in range(2)]
    assert plain == pytest.approx(float(loss), rel=1e-6)
    assert noisy[0] == noisy[1] != pytest.approx(plain)


@pytest.mark.parametrize("version,layers", [(1, 1), (3, 1), (3, 3)])
def test_batches_with_nothing_to_learn_give_zero_and_reach_every_parameter(tiny_llama, version, layers):
    """Too short a sequence, or no answer token: a zero loss whose graph still holds every trainable
    parameter (DDP reduces all of them every step; a drafter of several layers: every layer's), and zero counts."""
    target = tiny_llama[0]
    for t, answers in ((2, True), (6, False)):
        head, feats, ids, mask, rows = _batch(target, version, t, layers)
        if not answers:
            mask = torch.zeros_like(mask)
        if version == 1:
            loss, counts = eagle1_loss(head, feats[..., -64:], ids, mask, rows, None)
        else:
            loss, counts = eagle3_loss(head, feats, feats[..., -64:], ids, mask, rows, None, steps=2)
        assert float(loss.detach()) == 0.0
        assert all(int(v) == 0 for k, v in counts.items() if k.endswith("/count"))
        head.zero_grad(set_to_none=True)
        loss.backward()
        assert all(p.grad is not None and not p.grad.any() for p in head.parameters() if p.requires_grad), (t, answers)


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_losses_chunked_equal_plain(tiny_llama, version):
    target = tiny_llama[0]
    torch.manual_seed(version)
    extra = {"draft_vocab_size": 60, "draft_tokens": torch.arange(5, 65)} if version == 3 else {}
    head = EagleHead.from_target(target, version=version, **extra)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    head.bind_target(target)
    ids = torch.randint(5, 120, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    layers = head.config.feature_layers + [2] * (2 not in head.config.feature_layers)
    with torch.no_grad():
        feats, logits = capture_features(target, ids, layers, with_logits=True)
    last = feats[..., -64:]
    rows = head.draft_rows(target.lm_head.weight.detach()).float()
    draft_index = head.draft_index()

    def run(chunk):
        if version == 1:
            return eagle1_loss(head, last, ids, mask, rows, draft_index, noise=0.0, chunk_size=chunk)
        return eagle3_loss(head, feats[..., :head.config.feature_width], last, ids, mask, rows, draft_index,
                           logits.argmax(-1), steps=3, chunk_size=chunk)

    assert_same(loss_and_grads(head, run, 0), loss_and_grads(head, run, 4))
