"""Lookahead decoding: the Jacobi window steps with the target's own outputs, the pool collects the
trajectories' n-grams, pool candidates are verified beside the window, and the output is the target's
own (greedy on both families and under tree="auto"; sampling: test_generator_sampling's wiring case)."""

import pytest
import torch

from headway.inference import Lookahead, PromptLookup, SpeculativeGenerator
from headway.inference.lookahead import NgramPool
from tests.inference.spec_utils import copy_prompt_tau, draft_context, tiny_vocab_model


def test_the_pool_keeps_the_newest_continuations_per_first_token():
    pool = NgramPool(3, per_key=2)
    for gram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7], [2, 2, 2]):
        pool.add(gram)
    assert pool.lookup(1, 5) == [[6, 7], [2, 3]]  # [4, 5] was the oldest of three: dropped
    assert pool.lookup(1, 1) == [[6, 7]] and pool.lookup(9, 3) == [] and len(pool) == 3
    text = NgramPool(3, per_key=4)
    text.add_text([5, 6, 7, 8, 9], start=3)  # the n-grams ending at index 3 or later
    assert text.lookup(6, 4) == [[7, 8]] and text.lookup(7, 4) == [[8, 9]] and text.lookup(5, 4) == []


def _outputs(draft, base):
    return [base + i for i in range(draft.tree.size)]  # a distinct "target token" after every node


def test_the_window_steps_by_jacobi_and_its_trajectories_feed_the_pool():
    la = Lookahead(window=3, ngram=3, guesses=2, pool_from_prompt=False)
    host = [10, 11, 12]
    d1 = la.propose(draft_context(host))
    assert d1.tokens.tolist() == [12, 10, 12, 11] and list(d1.tree.parents) == [-1, 0, 1, 2]  # guesses from the context
    la.observe_outputs(d1, _outputs(d1, 100))  # o_0..o_3 = 100..103 at positions 3..6
    host = host + [100]  # the round accepted o_0 alone
    d2 = la.propose(draft_context(host))
    assert d2.tokens.tolist()[1:] == [101, 102, 103]  # the next guesses: the Jacobi step's outputs, shifted
    la.observe_outputs(d2, _outputs(d2, 200))
    # each n-gram follows one trajectory: round 1's guess at p, round 2's at p+1 (round 1's output there), its output
    assert la.pool.lookup(10, 2) == [[101, 201]] and la.pool.lookup(12, 2) == [[102, 202]]
    assert la.pool.lookup(11, 2) == [[103, 203], [12, 100]]  # and the accepted text's own n-gram, older
    host = host + [200, 201]
    d3 = la.propose(draft_context(host))
    assert d3.tokens.tolist()[1:] == [202, 203, host[(8 * 7919) % 6]]  # past the outputs: filled from the context


def test_pool_candidates_are_verified_beside_the_window():
    la = Lookahead(window=2, ngram=3, guesses=2, pool_from_prompt=False)
    la.pool.add([7, 8, 9])
    la.pool.add([7, 8, 5])
    draft = la.propose(draft_context([3, 4, 7]))
    paths = {tuple(draft.tokens[i].item() for i in _path(draft.tree.parents, leaf))
             for leaf in range(1, draft.tree.size) if leaf not in draft.tree.parents}
    assert {(8, 5), (8, 9)} <= paths and len(paths) == 3  # two candidates sharing 8, and the window's chain
    assert draft.tree.depth == 2 and draft.q is None  # deterministic: verified one-hot, exact under sampling
    d = la.propose(draft_context([3, 4, 7], max_depth=1))  # the token budget caps every branch
    assert d.tree.depth == 1


def _path(parents, leaf):
    out = []
    while leaf > 0:
        out.append(leaf)
        leaf = parents[leaf]
    return out[::-1]


@pytest.mark.parametrize("tree", [None, "auto"])
def test_greedy_equals_generate(family, tree):
    gen = SpeculativeGenerator(family.target, Lookahead(window=4, ngram=3, guesses=3), tree=tree)
    new = passes = 0
    for i, (prompt, max_new, ref) in enumerate(list(zip(family.prompts, family.max_new, family.references))[:15]):
        out = gen.generate(prompt, max_new_tokens=max_new)
        assert torch.equal(out.sequences, ref), f"{family.name}: prompt {i} differs from generate"
        new, passes = new + out.stats.new_tokens, passes + out.stats.target_forward_passes
    if tree is None:
        assert new / passes > 1.1, f"{family.name}: tau {new / passes:.2f}"


def test_on_copy_heavy_prompts_it_accepts_several_tokens_a_pass():
    model = tiny_vocab_model(0, vocab=12)
    g = torch.Generator().manual_seed(4)
    tau = copy_prompt_tau(model, SpeculativeGenerator(model, Lookahead(window=4, ngram=4, guesses=3), tree=None), g)
    lookup = copy_prompt_tau(model, SpeculativeGenerator(model, PromptLookup(), tree=None), torch.Generator().manual_seed(4))
    assert tau > 1.5 and tau > 0.7 * lookup, (tau, lookup)


def test_bad_settings_and_a_hybrid_are_refused():
    with pytest.raises(ValueError, match="window >= 1, ngram >= 2 and guesses >= 0"):
        Lookahead(window=0)
    model = tiny_vocab_model(0, vocab=12)  # 128 positions
    with pytest.raises(ValueError, match="verifies up to 181 tokens a pass, more than the target's 128 positions"):
        SpeculativeGenerator(model, Lookahead(window=20, ngram=9, guesses=20))
    with pytest.raises(ValueError, match="Lookahead cannot join a hybrid list"):
        SpeculativeGenerator(model, [Lookahead(), PromptLookup()])
