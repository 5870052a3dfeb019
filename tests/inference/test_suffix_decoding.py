"""Suffix decoding: the suffix trie's counts, best-first trees, exact greedy output, and the
cross-request cache (a repeated request drafts from the earlier output)."""

import torch

from headway.inference import DraftContext, PromptLookup, SpeculativeGenerator, SuffixDecoding
from headway.inference.suffix_decoding import COUNT, NEXT, SuffixTrie, speculate
from tests.inference.spec_utils import copy_prompt_tau, reference_generate, tiny_vocab_model


def test_trie_counts_every_substring_up_to_its_depth():
    trie = SuffixTrie(max_depth=3)
    trie.append([1, 2, 1, 2, 3])
    assert trie.find([1])[COUNT] == 2 and trie.find([1, 2])[COUNT] == 2 and trie.find([2, 1, 2])[COUNT] == 1
    assert trie.find([1, 2, 1, 2]) is None  # longer than the depth
    assert sorted(trie.find([1, 2])[NEXT]) == [1, 3]
    trie.start()  # a second sequence: no substring runs across the boundary
    trie.append([3, 1])
    assert trie.find([3, 1])[COUNT] == 1 and trie.find([2, 3, 3]) is None and trie.tokens == 7


def test_best_first_tree_follows_the_frequencies():
    trie = SuffixTrie(max_depth=4)
    for cont in ([5, 6], [5, 6], [5, 7], [8, 9]):  # after 4: 5 three times (then 6 twice, 7 once), 8 once
        trie.start()
        trie.append([4, *cont])
    parents, tokens, expected, scores = speculate(trie.find([4]), budget=3, depth=2, min_prob=0.0)
    assert scores == [1.0, 0.75, 0.5, 0.25]
    assert tokens == [5, 6, 8] and parents == [-1, 0, 1, 0]  # 5 (0.75), then 5-6 (0.5), then 8 (0.25)
    assert abs(expected - (0.75 + 0.5 + 0.25)) < 1e-12
    _, tokens, _, _ = speculate(trie.find([4]), budget=10, depth=2, min_prob=0.3)
    assert tokens == [5, 6]  # 8 (0.25) and 5-7 (0.25) fall under the floor


def test_greedy_equals_generate_and_a_repeat_drafts_from_the_earlier_output():
    model = tiny_vocab_model(seed=3)
    g = torch.Generator().manual_seed(0)
    for drafter in (SuffixDecoding(), SuffixDecoding(max_spec_factor=1.0, max_nodes=16)):
        tau = copy_prompt_tau(model, SpeculativeGenerator(model, drafter), g)
        assert tau > 2.0, f"tau {tau:.2f}"
    # the same unrepetitive prompt twice: the second request copies the first one's output
    prompt = torch.tensor([[2, 5, 3, 7]])
    ref = reference_generate(model, prompt, 20, eos_token_id=None)
    drafter = SuffixDecoding()
    gen = SpeculativeGenerator(model, drafter)
    first, second = gen.generate(prompt, max_new_tokens=20), gen.generate(prompt, max_new_tokens=20)
    assert torch.equal(first.sequences, ref) and torch.equal(second.sequences, ref)
    assert second.stats.mean_accepted_length > first.stats.mean_accepted_length + 1, \
        (first.stats.mean_accepted_length, second.stats.mean_accepted_length)
    no_cache = SpeculativeGenerator(model, SuffixDecoding(cross_request=False))
    no_cache.generate(prompt, max_new_tokens=20)
    assert no_cache.generate(prompt, max_new_tokens=20).stats.mean_accepted_length < \
        second.stats.mean_accepted_length


def test_the_cache_keeps_the_newest_outputs_within_its_size():
    drafter = SuffixDecoding(cache_tokens=10)
    for out in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        drafter.remember(out)
    assert drafter.outputs == [[5, 6, 7, 8], [9, 10, 11, 12]] and drafter.cache.tokens == 8
    assert drafter.cache.find([1, 2]) is None and drafter.cache.find([9, 10])[COUNT] == 1


def test_no_match_is_a_plain_step_and_the_depth_budget_holds():
    drafter = SuffixDecoding()
    drafter.reset()
    ctx = DraftContext(tokens=torch.tensor([1, 2, 3, 4]), features=None, tree=None, max_depth=5, sampling=None,
                       generator=None)
    assert drafter.propose(ctx).tree.size == 1  # nothing occurred twice
    drafter.reset()
    ctx = DraftContext(tokens=torch.tensor([1, 2, 3, 4, 5, 6, 1, 2, 3]), features=None, tree=None, max_depth=2,
                       sampling=None, generator=None)
    draft = drafter.propose(ctx)
    assert draft.tokens.tolist() == [3, 4, 5] and draft.tree.depth == 2  # the match 1 2 3 continues 4 5 (6 cut)
    assert PromptLookup().propose(ctx).tokens.tolist()[:3] == [3, 4, 5]
