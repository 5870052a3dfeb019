"""Prepacked oneDNN GEMM for a CPU target: same products within rounding, one-row and autograd calls
untouched, repacked after an in-place weight change, removable, and greedy speculative output on a
packed float32 target equals plain greedy on the unpacked one."""

import gc
import io
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headway.heads.target.tiny import build_tiny_target
from headway.inference import DraftModelProposer, PromptLookup, SpeculativeGenerator
from headway.inference import cpu_gemm
from headway.inference.cpu_gemm import few_rows_linear, is_packed, pack_linears, packing_available, unpack_linears
from tests.inference.spec_utils import noisy_copy, reference_generate

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
    """A PackedLinear whose weight changes in place, or whose data is replaced, repacks before its next call."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    pack_linears(lin)
    x = torch.randn(4, 16)
    with torch.no_grad():
        lin(x)
        lin.weight.mul_(-2.0)  # an optimizer step or a load_state_dict copies in place
        assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-6)
        lin.weight.data = torch.randn(8, 16)  # replaced: a new storage at version 0, as the packed one was
        assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-6)


def test_pack_is_idempotent_and_unpack_restores():
    target, _ = build_tiny_target("llama", seed=0)
    n = pack_linears(target)
    assert n > 0 and pack_linears(target) == n
    assert unpack_linears(target) == n and not is_packed(target)
    assert type(target.lm_head) is nn.Linear  # a plain Linear again


def test_a_copy_of_a_packed_model_computes_with_its_own_weights():
    import copy

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    pack_linears(net)
    twin = copy.deepcopy(net)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        x = torch.randn(5, 16)
        ref = torch.nn.functional.linear(torch.nn.functional.linear(x, twin[0].weight, twin[0].bias), twin[1].weight,
                                         twin[1].bias)
        assert is_packed(twin) and torch.allclose(twin(x), ref, atol=1e-5)
        assert not torch.allclose(net(x), ref, atol=1e-3)  # the original keeps its own weights
        twin.to(torch.float64)  # cast later: off float32, the plain kernel
        assert twin(x.double()).dtype == torch.float64


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
    for drafter, tree in [(DraftModelProposer(draft), "tree-7"), (PromptLookup(max_matches=3), None)]:
        gen = SpeculativeGenerator(target, drafter, tree=tree)
        for prompt, ref in zip(prompts, refs):
            out = gen.generate(prompt, max_new_tokens=24)
            assert torch.equal(out.sequences, ref)
            multi += sum(a > 1 for a in out.stats.accepted_per_step)
    assert multi > 10 and calls and min(calls) > 1  # the verification passes ran through the packed kernel


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 16])
def test_few_rows_linear_is_the_same_product(rows, monkeypatch):
    """Under PACKED_ROWS rows F.linear bit for bit; from there, after the weight's first call, oneDNN's kernel on
    the packed copy kept on the weight (the same product, summed in another order), for a parameter or a detached
    view kept of one (a head's bound target rows); a copy made per call is never packed."""
    torch.manual_seed(rows)
    lin = nn.Linear(24, 300, bias=False)
    x, bound = torch.randn(rows, 24), lin.weight.detach()
    calls = []
    packed_linear = cpu_gemm._packed_linear
    monkeypatch.setattr(cpu_gemm, "_packed_linear", lambda *a: calls.append(a[0].shape[0]) or packed_linear(*a))
    packed = rows >= cpu_gemm.PACKED_ROWS
    with torch.no_grad():
        for w in (lin.weight, bound):
            first = few_rows_linear(x, w)
            assert torch.equal(first, F.linear(x, lin.weight)) and not calls  # the first call: F.linear
            out = few_rows_linear(x, w)
            assert out.shape == (rows, 300) and torch.allclose(out, F.linear(x, lin.weight), atol=1e-5)
            assert calls == [rows] if packed else torch.equal(out, first) and not calls
            calls.clear()
        for _ in range(3):
            assert torch.equal(few_rows_linear(x, lin.weight.detach().clone()), F.linear(x, lin.weight))
        assert not calls


def test_few_rows_linear_repacks_a_changed_weight(monkeypatch):
    """The packed copy is made once per weight and remade when the weight changes in place (a load, an optimizer
    step) or its data is replaced (``param.data = ...``, a cast and back): never a stale product."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 40, bias=False)
    x = torch.randn(cpu_gemm.PACKED_ROWS, 16)
    made = []
    packed = cpu_gemm._Packed
    monkeypatch.setattr(cpu_gemm, "_Packed", lambda *a: made.append(len(a)) or packed(*a))
    with torch.no_grad():
        for change in [None, None, None, lambda: lin.weight.mul_(-2.0),
                       lambda: setattr(lin.weight, "data", torch.randn(40, 16)), lambda: lin.double().float(),
                       lambda: lin.load_state_dict({"weight": torch.randn(40, 16)})]:
            if change:
                change()
            assert torch.allclose(few_rows_linear(x, lin.weight), F.linear(x, lin.weight), atol=1e-5)
    assert made == [0] + [1] * 5  # marked at the first call, packed at the second, not again at the third
    replaced = weakref.ref(lin.weight.untyped_storage())
    with torch.no_grad():
        lin.weight.data = torch.randn(40, 16)
    gc.collect()
    assert replaced() is None  # the packed copy does not keep a replaced weight's storage alive
def test_few_rows_linear_takes_f_linear_off_its_path():
    """Gradients through the weight or the input (oneDNN's linear has no autograd kernel), float64, or a weight made
    under inference mode (no version counter): F.linear."""
    torch.manual_seed(1)
    lin = nn.Linear(8, 20, bias=False)
    x = torch.randn(4, 8)
    out = few_rows_linear(x, lin.weight)
    out.sum().backward()
    assert out.requires_grad and lin.weight.grad is not None and not hasattr(lin.weight, "_headway_packed")
    bound, rows = lin.weight.detach(), x.clone().requires_grad_()  # a frozen bound weight, an input with gradients
    for _ in range(3):
        out = few_rows_linear(rows, bound)
        assert out.grad_fn is not None and type(out.grad_fn).__name__ == "MmBackward0"
    assert not hasattr(bound, "_headway_packed")
    lin64 = nn.Linear(8, 20, bias=False).double()
    with torch.no_grad():
        assert torch.equal(few_rows_linear(x.double(), lin64.weight), F.linear(x.double(), lin64.weight))
    with torch.inference_mode():
        frozen = nn.Linear(8, 20, bias=False)
        assert torch.equal(few_rows_linear(x, frozen.weight), F.linear(x, frozen.weight))


def test_packed_target_verifies_two_and_three_rows_unpadded():
    """MKL's 2-3 row GEMMs cost more than 4 rows, so an unpacked CPU target pads those widths to 4;
    packed, 2-3 rows cost less than 4 and are not padded. The output is the same."""
    target, _ = build_tiny_target("llama", seed=5)
    gen = SpeculativeGenerator(target, DraftModelProposer(noisy_copy(target, seed=5), gamma=2), tree=None)
    prompt = torch.randint(4, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    plain = gen.generate(prompt, max_new_tokens=16)
    assert set(plain.stats.verify_width_per_step) - {1} == {4}  # 3 nodes (root + 2 drafts) padded to 4; 1: the last token
    pack_linears(target)
    packed = gen.generate(prompt, max_new_tokens=16)
    assert torch.equal(packed.sequences, plain.sequences)
    assert set(packed.stats.verify_width_per_step) - {1} <= {2, 3} and 3 in packed.stats.verify_width_per_step
    forced = SpeculativeGenerator(target, DraftModelProposer(noisy_copy(target, seed=5), gamma=2), tree=None,
                                  pad_to=4)
    assert set(forced.generate(prompt, max_new_tokens=16).stats.verify_width_per_step) - {1} == {4}
