"""Prepacked oneDNN GEMM for a CPU target: same products within rounding, one-row and autograd calls
untouched, repacked after an in-place weight change, removable, and greedy speculative output on a
packed float32 target equals plain greedy on the unpacked one."""

import pytest
import torch
from torch import nn

from headway.heads.tiny import build_tiny_target
from headway.inference import DraftModelDrafter, PromptLookup, SpeculativeGenerator
from headway.inference import cpu_gemm
from headway.inference.cpu_gemm import few_rows_linear, is_packed, pack_linears, packing_available, unpack_linears
from spec_utils import noisy_copy, reference_generate

pytestmark = pytest.mark.skipif(packing_available(nn.Linear(2, 2)) is not None, reason="no oneDNN linear in this build")


def test_packed_linear_matches_and_one_row_is_bit_identical():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(48, 96), nn.Linear(96, 40, bias=False))
    x = torch.randn(3, 5, 48)
    with torch.no_grad():
        ref, ref_row = net(x), net(x[:1, :1])
        assert pack_linears(net) == 2 and is_packed(net)
        out, row = net(x), net(x[:1, :1])
    assert out.shape == ref.shape == (3, 5, 40)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(row, ref_row)  # plain decoding's one-row call keeps the original kernel


def test_autograd_calls_keep_the_original_path_and_train():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    pack_linears(lin)
    x = torch.randn(6, 16)
    lin(x).sum().backward()  # needs gradients: the unpacked kernel, which autograd differentiates
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, x.sum(0).expand(8, 16))


def test_in_place_weight_change_is_repacked():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    pack_linears(lin)
    x = torch.randn(4, 16)
    with torch.no_grad():
        lin(x)
        lin.weight.mul_(-2.0)  # an optimizer step or a load_state_dict copies in place
        assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-6)


def test_pack_is_idempotent_and_unpack_restores():
    target, _ = build_tiny_target("llama", seed=0)
    n = pack_linears(target)
    assert n > 0 and pack_linears(target) == n
    assert unpack_linears(target) == n and not is_packed(target)
    assert "forward" not in vars(target.lm_head)  # the class's forward again


def test_not_packed_off_float32_cpu():
    target, _ = build_tiny_target("llama", seed=0)
    target = target.to(torch.float64)
    assert "float64" in packing_available(target)
    assert pack_linears(target) == 0 and not is_packed(target)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_target_greedy_equals_unpacked_generate(family, monkeypatch):
    """fp32, as the default runs: the packed verification passes pick the same tokens as plain greedy."""
    target, _ = build_tiny_target(family, seed=3)
    draft = noisy_copy(target, seed=3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, target.config.vocab_size, (1, int(torch.randint(2, 14, (), generator=g))), generator=g)
               for _ in range(10)]
    with torch.no_grad():
        refs = [reference_generate(target, p, 24) for p in prompts]  # before packing
    assert pack_linears(target) > 0
    calls = []
    packed_linear = cpu_gemm._packed_linear
    monkeypatch.setattr(cpu_gemm, "_packed_linear", lambda *a: calls.append(a[0].shape[0]) or packed_linear(*a))
    multi = 0
    for drafter, tree in [(DraftModelDrafter(draft), "tree-7"), (PromptLookup(max_matches=3), None)]:
        gen = SpeculativeGenerator(target, drafter, tree=tree)
        for prompt, ref in zip(prompts, refs):
            out = gen.generate(prompt, max_new_tokens=24)
            assert torch.equal(out.sequences, ref)
            multi += sum(a > 1 for a in out.stats.accepted_per_step)
    assert multi > 10 and calls and min(calls) > 1  # the verification passes ran through the packed kernel


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6])
def test_few_rows_linear_is_the_same_product(rows):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 24), torch.randn(300, 24)
    out = few_rows_linear(x, w)
    assert out.shape == (rows, 300) and torch.allclose(out, torch.nn.functional.linear(x, w), atol=1e-5)
