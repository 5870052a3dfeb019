"""P-EAGLE's runtime: the catch-up, the root's prediction and K - 1 mask slots in one pass, verified as a chain;
the output is the target's own (greedy on both families, under tree="auto", in a batch; sampling:
test_generator_sampling's wiring case)."""

import pytest
import torch

from headway.heads.peagle import PEagleHead
from headway.inference import SpeculativeGenerator
from headway.inference.peagle import PEagleProposer
from tests.inference.spec_utils import assert_batch_equals_rows


@pytest.fixture(scope="module")
def heads():
    return {}


def peagle_for(family, heads, layers: int = 1):
    """The family's P-EAGLE head of ``layers`` decoder layers (midlayer, then plain ones: the published drafters')."""
    if (family.name, layers) not in heads:
        torch.manual_seed(0)
        heads[family.name, layers] = PEagleHead.from_target(family.target, parallel_depths=3, draft_vocab_size=150,
                                                            draft_tokens=list(range(150)), num_layers=layers)
    return heads[family.name, layers]


@pytest.mark.parametrize("tree,layers", [(None, 1), ("auto", 1), ("chain-2", 1), (None, 3)])
def test_greedy_equals_generate(family, heads, tree, layers):
    gen = SpeculativeGenerator(family.target, peagle_for(family, heads, layers), tree=tree)
    for i, (prompt, max_new, ref) in enumerate(list(zip(family.prompts, family.max_new, family.references))[:12]):
        out = gen.generate(prompt, max_new_tokens=max_new)
        assert torch.equal(out.sequences, ref), f"{family.name}: prompt {i} differs from generate"
        if tree is None and i == 0:
            assert max(out.stats.draft_depth_per_step) == 3  # the whole chain, from one drafter pass


def test_one_drafter_pass_per_round(family, heads, monkeypatch):
    """A round is one drafter forward: the catch-up's root and the K - 1 slots run the whole layer together (the
    earlier new positions only write their keys/values), and the drafter's cache is left holding the context."""
    head = peagle_for(family, heads)
    calls = []
    real = PEagleHead.forward
    monkeypatch.setattr(PEagleHead, "forward", lambda self, ids, *a, **kw: calls.append(ids.shape[1]) or
                        real(self, ids, *a, **kw))
    gen = SpeculativeGenerator(family.target, head, tree=None)
    out = gen.generate(family.prompts[1], max_new_tokens=20)
    depths = out.stats.draft_depth_per_step
    # the prompt's round drafts nothing (no target feature yet); a round asked for depth 0 still catches up
    assert max(depths) == 3 and depths[0] == 0 and calls == [max(d, 1) for d in depths[1:]], (calls, depths)
    assert len(gen.drafter._cache) == gen.drafter._seen


@pytest.mark.parametrize("layers", [1, 3])
def test_the_one_pass_equals_the_catch_up_then_the_slots(family, heads, layers):
    """The round's one forward gives the rows the catch-up and a separate slots pass give (the root's at position
    L-2, slot j's at L-2+j) and leaves the cache holding the context only (every layer's)."""
    head = peagle_for(family, heads, layers)
    one, two = PEagleProposer(head), PEagleProposer(head)
    for p in (one, two):
        p.bind(family.target)
        p.reset()
    torch.manual_seed(1)
    n = 6
    tokens = torch.randint(3, 100, (n + 1,))  # L = n + 1: the root at position n - 1
    features = torch.randn(n, head.config.feature_width)
    rows = one._take_in(tokens, features, after=head.slot_inputs(2, torch.device("cpu")))  # [3, H]
    root = two._take_in(tokens, features)  # [1, H]
    slots = head.slots(torch.arange(n, n + 2)[None], cache=two._cache)[0]  # [2, H]
    torch.testing.assert_close(rows, torch.cat([root, slots]), rtol=1e-4, atol=1e-5)
    assert len(one._cache) == one._seen == n
    assert [len(one._cache.layer(i)) for i in range(layers)] == [n] * layers
    # the same rows as one plain forward over the whole context and the slots, without a cache
    ids, hidden = head.slot_inputs(2, torch.device("cpu"))
    whole = head(torch.cat([tokens[1:], ids])[None], torch.cat([head.input_hidden(features), hidden])[None],
                 torch.arange(n + 2)[None])[0, n - 1:]
    torch.testing.assert_close(rows, whole, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layers", [1, 3])
def test_a_batchs_passes_are_one_pass_giving_each_row_its_own(family, heads, layers):
    """Rows with contexts of their own (3 and 5 positions seen, then 2 and 1 new) and 2 and 1 mask slots: one pass
    over their stacked caches (``catch_up_rows``) gives each row the root's and slots' h' its own pass gives, and
    leaves each row's cache as its own pass does (the context only)."""
    from headway.inference.eagle import CatchUp, catch_up_rows

    head = peagle_for(family, heads, layers)
    rows, alone = [PEagleProposer(head) for _ in range(2)], [PEagleProposer(head) for _ in range(2)]
    for p in rows + alone:
        p.bind(family.target)
        p.reset()
    torch.manual_seed(2)
    requests, expected = [], []
    for r, (seen, new, slots) in enumerate(((3, 2, 2), (5, 1, 1))):
        tokens = torch.randint(3, 100, (seen + new + 1,))
        features = torch.randn(seen + new, head.config.feature_width)
        for p in (rows[r], alone[r]):
            p._take_in(tokens, features[:seen])
        expected.append(alone[r]._take_in(tokens, features[seen:], after=head.slot_inputs(slots, torch.device("cpu"))))
        requests.append(CatchUp(rows[r], tokens, features[seen:], slots=slots))
    out = catch_up_rows(requests)
    for r in range(2):
        assert out[r].shape == expected[r].shape
        torch.testing.assert_close(out[r], expected[r], rtol=1e-5, atol=1e-6)
        assert rows[r]._seen == alone[r]._seen and len(rows[r]._cache) == rows[r]._seen
        for i in range(layers):
            torch.testing.assert_close(rows[r]._cache.layer(i).keys, alone[r]._cache.layer(i).keys, rtol=1e-5,
                                       atol=1e-6)


@pytest.mark.parametrize("layers", [1, 3])
def test_a_batch_equals_its_rows_alone(family, heads, monkeypatch, layers):
    """Each row of a batch equals its own generate, the rows' passes run as one (``catch_up_rows`` with slots)."""
    import headway.inference.eagle as eagle_mod

    passes = []
    real = eagle_mod.catch_up_rows
    monkeypatch.setattr(eagle_mod, "catch_up_rows", lambda requests: passes.append(
        [r.slots for r in requests]) or real(requests))
    gen = SpeculativeGenerator(family.target, peagle_for(family, heads, layers), tree=None)
    assert_batch_equals_rows(gen, family)
    assert any(len(p) > 1 and all(s for s in p) for p in passes), passes


def test_bad_trees_are_refused(family, heads):
    head = peagle_for(family, heads)
    with pytest.raises(ValueError, match="P-EAGLE drafts a chain of at most parallel_depths=3"):
        SpeculativeGenerator(family.target, head, tree="tree-7")
    with pytest.raises(ValueError, match="P-EAGLE drafts a chain of at most parallel_depths=3"):
        SpeculativeGenerator(family.target, head, tree="chain-4")
