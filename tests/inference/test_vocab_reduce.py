"""The chunked argmax and top-k over the vocabulary (issue 22: a CPU's unvectorized argmax/topk were most of
verification's own work): torch's own results, ties, NaN and -inf included; and every drafter drafting the same
trees through them as through torch's calls."""

import pytest
import torch

from headway.inference import Lookahead, PromptLookup, SpeculativeGenerator, vocab_reduce


def cases(v: int):
    g = torch.Generator().manual_seed(0)
    yield torch.randn(3, v, generator=g)  # distinct values
    yield torch.randint(0, 3, (16, v), generator=g).float()  # many ties, the maximum in several chunks (argmax's too)
    late = torch.zeros(2, v)
    late[:, [2 * 128 + 5, 4 * 128, 7 * 128 + 1]] = 1.0  # tied maxima in later chunks: the first one's, 261
    yield late
    nan = torch.randn(2, v, generator=g)
    nan[1, 7], nan[1, v - 3] = float("nan"), float("nan")
    yield nan  # a NaN is the maximum, the first one's index
    yield torch.full((2, v), float("-inf"))  # nothing allowed: index 0, as torch
    yield torch.randn(v, 3, generator=g).t()  # rows read with a stride (torch's call)
    yield torch.randn(2, 2 * v, generator=g)[:, :v]  # rows apart, each contiguous
    yield torch.randn(2, 2, v, generator=g)  # more leading dimensions
    yield torch.randn(v, generator=g)  # one row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v", [16384, 49152])
def test_argmax_and_topk_are_torchs(v, dtype):
    for x in cases(v):
        x = x.to(dtype)
        for k, least in ((1, vocab_reduce.ARGMAX_MIN), (4, vocab_reduce.TOPK_MIN)):
            assert vocab_reduce._chunked(x, k) == (x.reshape(-1, v).shape[0] * v >= least and x.stride(-1) == 1)
        assert torch.equal(vocab_reduce.argmax(x), x.argmax(-1))
        for k in (1, 2, 4):
            values, indices = vocab_reduce.topk(x, k)
            want = x.topk(k, dim=-1)
            torch.testing.assert_close(values, want.values, rtol=0, atol=0, equal_nan=True)
            found = x.gather(-1, indices)  # each index holds its value, a NaN's a NaN
            assert ((found == values) | (found.isnan() & values.isnan())).all()
            if x.unique().numel() == x.numel():  # distinct values: the same indices too
                assert torch.equal(indices, want.indices)


def test_the_first_chunk_holding_the_maximum_wins():
    """Tied maxima in chunks 2, 4 and 7 of 8: index 261, the first (torch's topk(1) over the chunks' maxima gives
    chunk 4 here, so picking the chunk by anything but argmax fails)."""
    x = torch.zeros(256, 8 * vocab_reduce.CHUNK)
    x[:, [2 * 128 + 5, 4 * 128, 7 * 128 + 1]] = 1.0
    assert vocab_reduce._chunked(x)
    assert vocab_reduce.argmax(x).tolist() == [261] * 256 == x.argmax(-1).tolist()


def test_small_inputs_and_other_vocabularies_take_torchs_call():
    for x in (torch.randn(16384), torch.randn(4, 50257), torch.randn(300, 64), torch.tensor(3.0)):
        assert not vocab_reduce._chunked(x)
        assert torch.equal(vocab_reduce.argmax(x), x.argmax(-1))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # one row through max(-1): argmax's index
        for row in cases(16384):
            x = row.reshape(-1, 16384)[-1].to(dtype)
            assert not vocab_reduce._chunked(x)
            assert torch.equal(vocab_reduce.argmax(x), x.argmax(-1))
    x = torch.randn(4, 256 * vocab_reduce.CHUNK)  # 131,072 logits: a top-k's chunks
    assert vocab_reduce._chunked(x, 256) and not vocab_reduce._chunked(x, 257)  # k above the chunks: torch's


DRAFTERS = {"lookup": (None, None), "lookahead": ("lookahead", None), "medusa tree-7": ("medusa", "tree-7"),
            "eagle-1 chain-3": (1, "chain-3"), "eagle-3 tree-7": (3, "tree-7"),
            "eagle-3 dynamic": (3, {"depth": 4, "top_k": 3, "total_tokens": 8})}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_every_drafter_drafts_the_same_through_chunks(family, eagle, name, monkeypatch):
    """Greedy output equals generate with the argmax and top-k calls chunked (the tiny vocabularies, 218 and EAGLE-3's
    150, in chunks of two: verification, lookahead's outputs, Medusa's heads, greedy candidates where their rows are
    contiguous, EAGLE-2 dynamic levels), and each round accepts exactly what
    it accepts through torch's calls (the same drafts: verification alone would hide a wrong draft)."""
    kind, tree = DRAFTERS[name]
    drafter = {None: PromptLookup, "lookahead": lambda: Lookahead(window=4, ngram=3, guesses=3),
               "medusa": lambda: family.heads}.get(kind, lambda: eagle[kind])()
    gen = SpeculativeGenerator(family.target, drafter, tree=tree)
    rows = list(zip(family.prompts, family.max_new, family.references))[:8]
    plain = [gen.generate(p, max_new_tokens=m).stats.accepted_per_step for p, m, _ in rows]
    with monkeypatch.context() as patch:
        patch.setattr(vocab_reduce, "CHUNK", 2)
        patch.setattr(vocab_reduce, "ARGMAX_MIN", 0)
        patch.setattr(vocab_reduce, "TOPK_MIN", 0)
        for (prompt, max_new, ref), accepted in zip(rows, plain):
            out = gen.generate(prompt, max_new_tokens=max_new)
            assert torch.equal(out.sequences, ref)
            assert out.stats.accepted_per_step == accepted
    assert sum(map(sum, plain)) > sum(map(len, plain))  # it drafted: more tokens than passes
