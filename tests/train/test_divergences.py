"""loss.kind: every divergence through the chunked path equals its textbook formula (value and
gradients, written here independently of headway's), is zero where the drafter matches the target,
and trains a drafter toward higher acceptance."""

import math

import pytest
import torch
import torch.nn.functional as F

from headway.train.chunked import linear_cross_entropy
from headway.train.divergences import KINDS, check_kind, row_losses

N, H, V = 13, 6, 19


def _reference(logits: torch.Tensor, t_logits: torch.Tensor, kind: str, decay: float = 3.0) -> torch.Tensor:
    """[n] row losses, each written out from its definition."""
    q, p = logits.softmax(-1), t_logits.softmax(-1)
    kl_pq = F.kl_div(logits.log_softmax(-1), p, reduction="none").sum(-1)  # KL(p || q)
    alpha = torch.minimum(p, q).sum(-1)
    if kind == "ce":
        return -(p * logits.log_softmax(-1)).sum(-1)
    if kind == "kl":
        return kl_pq
    if kind == "rkl":
        return (q * (q.log() - p.log())).sum(-1)
    if kind == "jsd":
        m = (p + q) / 2
        return 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    if kind == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    if kind == "lk_alpha":
        return -alpha.log()
    if kind == "lk_lambda":
        w = torch.exp(-decay * alpha).detach()
        return w * kl_pq + (1 - w) * 0.5 * (p - q).abs().sum(-1)  # KL and TV mixed
    raise AssertionError(kind)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    tx, tw = torch.randn(N, 4, generator=g, dtype=torch.float64), torch.randn(V, 4, generator=g, dtype=torch.float64)
    learn = torch.rand(N, generator=g) > 0.3
    return x, w, tx, tw, learn


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [0, 1, 5, 64])
def test_each_kind_matches_its_definition_in_value_and_gradient(kind, chunk):
    x, w, tx, tw, learn = _inputs(KINDS.index(kind))
    want = _reference(x @ w.T, tx @ tw.T, kind)[learn].sum()
    loss, top1, _ = linear_cross_entropy(x, w, None, learn=learn, target=(tx, tw), chunk_size=chunk, kind=kind)
    torch.testing.assert_close(loss.double(), want, rtol=1e-9, atol=1e-10)
    assert int(top1) == int(((x @ w.T).argmax(-1) == (tx @ tw.T).argmax(-1)).sum())
    got = torch.autograd.grad(1.7 * loss, [x, w])
    ref = torch.autograd.grad(1.7 * want, [x, w])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_target_given_as_log_probabilities_gives_the_same_loss(kind):
    x, w, tx, tw, learn = _inputs(11)
    a = linear_cross_entropy(x, w, None, learn=learn, target=(tx, tw), chunk_size=4, kind=kind)[0]
    b = linear_cross_entropy(x, w, None, learn=learn, target=(tx @ tw.T).log_softmax(-1), chunk_size=4, kind=kind)[0]
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "ce"])
def test_a_drafter_equal_to_the_target_has_zero_loss(kind):
    logits = torch.randn(5, V, dtype=torch.float64)
    rows = row_losses(logits.log_softmax(-1), logits.log_softmax(-1), kind)
    torch.testing.assert_close(rows, torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)


def test_tv_is_one_minus_acceptance_and_lk_alpha_its_negative_log():
    g = torch.Generator().manual_seed(3)
    logq, logp = torch.randn(7, V, generator=g).log_softmax(-1), torch.randn(7, V, generator=g).log_softmax(-1)
    alpha = torch.minimum(logq.exp(), logp.exp()).sum(-1)
    torch.testing.assert_close(row_losses(logq, logp, "tv"), 1 - alpha)
    torch.testing.assert_close(row_losses(logq, logp, "lk_alpha"), -alpha.log())


@pytest.mark.parametrize("kind", KINDS)
def test_training_on_each_kind_raises_acceptance(kind):
    """A linear drafter fitted to a fixed target distribution with each loss: alpha = sum min(p, q)
    rises well above where it started (a sign error or a dropped term would not)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    t_logits = 2.0 * x @ torch.randn(8, 32, generator=g) / math.sqrt(8)  # a target the drafter can reach
    w = torch.zeros(32, 8, requires_grad=True)
    opt = torch.optim.Adam([w], lr=0.05)

    def alpha():
        return float(torch.minimum((x @ w.detach().T).softmax(-1), t_logits.softmax(-1)).sum(-1).mean())

    start = alpha()
    for _ in range(150):
        loss = linear_cross_entropy(x, w, None, target=t_logits.log_softmax(-1), chunk_size=16, kind=kind)[0] / 64
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert alpha() > start + 0.25, (kind, start, alpha())


def test_unknown_kind_and_hard_labels_with_a_divergence_are_refused():
    x, w = torch.randn(3, H), torch.randn(V, H)
    with pytest.raises(ValueError, match="unknown loss kind 'kld'.*ce, kl, rkl"):
        linear_cross_entropy(x, w, torch.zeros(3, dtype=torch.long), kind="kld")
    with pytest.raises(ValueError, match="hard labels take 'ce' only"):
        linear_cross_entropy(x, w, torch.zeros(3, dtype=torch.long), kind="rkl")
    with pytest.raises(ValueError, match="loss.kind: unknown"):
        check_kind("KL")
