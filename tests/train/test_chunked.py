"""The fused, row-chunked linear cross-entropy equals the plain loss (value, counts, every gradient)
and keeps no [n, V] tensor for backward (the Medusa and EAGLE losses chunked: test_losses.py,
test_eagle_losses.py)."""

import pytest
import torch
import torch.nn.functional as F

from headway.train.chunked import linear_cross_entropy

N, H, V = 11, 6, 17


def _inputs(seed: int, frozen: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g).requires_grad_(not frozen)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[[2, 7]] = -1  # outside the (draft) vocabulary: no loss, a miss
    return x, w, labels


def _reference_counts(logits, labels):
    top = logits.topk(5, -1).indices  # [n, 5]
    return int((top[:, 0] == labels).sum()), int((top == labels[:, None]).any(-1).sum())


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t.requires_grad])


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("frozen", [False, True])
def test_hard_labels_match_cross_entropy(chunk, frozen):
    x, w, labels = _inputs(0, frozen)
    logits = x @ w.T
    want = F.cross_entropy(logits, labels, reduction="sum", ignore_index=-1)
    loss, top1, top5 = linear_cross_entropy(x, w, labels, chunk_size=chunk)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-5)
    assert (int(top1), int(top5)) == _reference_counts(logits.detach(), labels)
    for got, ref in zip(_grads(2.5 * loss, x, w), _grads(2.5 * want, x, w)):
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert x.grad is None and (frozen or w.grad is None)


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("own_labels", [False, True])
def test_soft_targets_match_soft_cross_entropy(chunk, own_labels):
    x, w, labels = _inputs(1)
    g = torch.Generator().manual_seed(2)
    tx, tw = torch.randn(N, 3, generator=g), torch.randn(V, 3, generator=g)
    learn = torch.rand(N, generator=g) > 0.3
    p = (tx @ tw.T).softmax(-1)
    logits = x @ w.T
    want = -(p * logits.log_softmax(-1)).sum(-1)[learn].sum()
    loss, top1, top5 = linear_cross_entropy(x, w, None if own_labels else labels, learn=learn, target=(tx, tw),
                                            chunk_size=chunk)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-5)
    assert (int(top1), int(top5)) == _reference_counts(logits.detach(), p.argmax(-1) if own_labels else labels)
    for got, ref in zip(_grads(loss, x, w), _grads(want, x, w)):
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 4, 64])
def test_soft_targets_as_log_probabilities_equal_targets_as_a_projection(chunk):
    """EAGLE-3 projects the target once per batch and hands each unrolled step its rows' log-probabilities."""
    x, w, labels = _inputs(4)
    g = torch.Generator().manual_seed(5)
    tx, tw = torch.randn(N, 3, generator=g), torch.randn(V, 3, generator=g)
    learn = torch.rand(N, generator=g) > 0.3
    a = linear_cross_entropy(x, w, labels, learn=learn, target=(tx, tw), chunk_size=chunk)
    b = linear_cross_entropy(x, w, labels, learn=learn, target=(tx @ tw.T).log_softmax(-1), chunk_size=chunk)
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
    assert (int(a[1]), int(a[2])) == (int(b[1]), int(b[2]))
    for got, ref in zip(_grads(b[0], x, w), _grads(a[0], x, w)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_no_gradient_is_computed_or_kept_without_grad_mode():
    """Forward computes the gradients; under no_grad (evaluation) it must skip them and save nothing."""
    x, w, labels = _inputs(6)
    with torch.no_grad():
        saved = _saved_numels(lambda: linear_cross_entropy(x, w, labels, chunk_size=4))
        loss = linear_cross_entropy(x, w, labels, chunk_size=4)[0]
    assert saved == [] and not loss.requires_grad
    torch.testing.assert_close(loss, linear_cross_entropy(x, w, labels, chunk_size=4)[0].detach())


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 4, -1, 2, 2, 1, 3])
    target = (torch.randn(7, 2, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64))
    learn = torch.tensor([1, 1, 0, 1, 0, 1, 1], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy(a, b, labels, chunk_size=3)[0], (x, w))
    assert torch.autograd.gradcheck(
        lambda a, b: linear_cross_entropy(a, b, target=target, learn=learn, chunk_size=3)[0], (x, w))


def _saved_numels(fn) -> list[int]:
    """Sizes of every tensor autograd saves for backward while ``fn`` runs."""
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_backward_keeps_no_logits():
    n, h, v = 64, 4, 200  # n * v dwarfs every input
    x, w = torch.randn(n, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    fused = _saved_numels(lambda: linear_cross_entropy(x, w, labels, chunk_size=16))
    plain = _saved_numels(lambda: linear_cross_entropy(x, w, labels, chunk_size=0))
    assert max(fused) == v * h and sum(fused) <= v * h + n * h  # d_W and d_x only, computed in forward
    assert max(plain) == n * v  # the plain path keeps the [n, V] log-softmax


def test_negative_chunk_size_is_refused():
    x, w, labels = _inputs(0)
    with pytest.raises(ValueError, match="chunk_size must be >= 0"):
        linear_cross_entropy(x, w, labels, chunk_size=-1)


def test_zero3_partitioned_weight_goes_through_its_module():
    """ZeRO-3 gathers a weight only in its module's forward: the loss then calls the module."""
    lin = torch.nn.Linear(H, V, bias=False)
    lin.weight.ds_id = 0  # how DeepSpeed ZeRO-3 marks a partitioned parameter
    calls = []

    def project(x):
        calls.append(tuple(x.shape))
        return lin(x)

    x, _, labels = _inputs(0)
    loss, _, _ = linear_cross_entropy(x, lin.weight, labels, project=project, chunk_size=4)
    assert calls == [(N, H)]
    torch.testing.assert_close(loss, F.cross_entropy(lin(x), labels, reduction="sum", ignore_index=-1))
