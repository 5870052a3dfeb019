"""Helpers shared by the loss tests: one loss evaluation with its gradients, and two of them compared."""

import pytest
import torch


def loss_and_grads(module, fn, chunk):
    module.zero_grad(set_to_none=True)
    loss, metrics = fn(chunk)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), {k: float(v) for k, v in metrics.items()}, grads


def assert_same(a, b):
    (la, ma, ga), (lb, mb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    assert ma.keys() == mb.keys() and ga.keys() == gb.keys() and ga
    for k in ma:
        assert ma[k] == pytest.approx(mb[k], rel=1e-5, abs=1e-5), k
    assert all(float(ma[k]) == float(mb[k]) for k in ma if not k.endswith("_sum"))  # counts: exact
    for k in ga:
        assert torch.allclose(ga[k], gb[k], rtol=1e-4, atol=1e-6), k
