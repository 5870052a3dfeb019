"""Prompt lookup ranks matches by the continuation they offer, builds its draft trie from them, and stays exact
under greedy decoding."""

import pytest
import torch

from headway.inference import DraftContext, PromptLookup, SpeculativeGenerator, load_tree
from headway.inference.prompt_lookup import (build_trie, continuations_at, expected_accepted, find_continuations,
                                             rank_continuations, rank_few)
from tests.inference.spec_utils import copy_prompt_tau, tiny_vocab_model
from tests.inference.spec_utils import draft_context as ctx

# "5 6" occurs at 0 (then 1 2 3 4 9) and at 7, whose continuation 1 2 5 6 is cut short by the end
CUT_SHORT = [5, 6, 1, 2, 3, 4, 9, 5, 6, 1, 2, 5, 6]
# "7" occurs at 0 and 4 (both then 1 2 3) and at 8 (then 4 4 4, the most recent)
AGREEING = [7, 1, 2, 3, 7, 1, 2, 3, 7, 4, 4, 4, 8, 7]


def test_cut_short_recent_match_loses_to_the_full_earlier_one():
    conts = torch.tensor([[1, 2, 3, 4, 9], [1, 2, 5, 6, -1]])
    score, group = expected_accepted(conts, torch.tensor([5, 4]))
    # k=1,2: both agree (2/2); k=3,4: each alone (1/2); k=5: only the full one has a token (1/1)
    assert score.tolist() == [4.0, 3.0] and group.tolist() == [0, 1]
    assert find_continuations(torch.tensor(CUT_SHORT), 2, 1, 5, 1) == [[1, 2, 3, 4, 9]]
    assert find_continuations(torch.tensor(CUT_SHORT), 2, 1, 5, 3) == [[1, 2, 3, 4, 9], [1, 2, 5, 6]]


def test_agreeing_occurrences_rank_first():
    assert find_continuations(torch.tensor(AGREEING), 3, 1, 3, 1) == [[1, 2, 3]]
    assert find_continuations(torch.tensor(AGREEING), 3, 1, 3, 4) == [[1, 2, 3], [4, 4, 4]]  # duplicates merged
    score, group = expected_accepted(torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 4]]), torch.tensor([3, 3, 3]))
    assert torch.allclose(score, torch.tensor([2.0, 2.0, 1.0])) and group[0] == group[1] != group[2]
    draft = PromptLookup(max_matches=2, num_pred_tokens=3).propose(
        DraftContext(torch.tensor(AGREEING), None, None, 10, None, None))
    assert draft.tokens.tolist() == [7, 1, 2, 3, 4, 4, 4] and list(draft.tree.parents) == [-1, 0, 1, 2, 0, 4, 5]


def test_ties_go_to_the_most_recent_and_are_stable():
    conts = torch.tensor([[3, 9, 1], [4, 5, 7], [3, 9, 1], [8, 8, 8]])
    lengths = torch.tensor([3, 3, 3, 3])
    # [3 9 1] twice (score 3 x 2/4) ranks first, kept once (its later copy, row 2); rows 1 and 3 tie
    # (3 x 1/4): the later one (row 3) first
    assert rank_continuations(conts, lengths).tolist() == [2, 3, 1]
    assert rank_continuations(conts, lengths).tolist() == [2, 3, 1]  # deterministic
    toks = torch.tensor([1, 2, 3, 9, 1, 2, 4, 5, 7, 1, 2])  # "1 2": two full, distinct continuations
    assert find_continuations(toks, 3, 1, 3, 4) == [[4, 5, 7], [3, 9, 1]]


def test_longest_ngram_still_wins():
    # "8 5 6" occurs once (then 0 0) while "5 6" alone has an agreeing pair (then 1 1)
    toks = torch.tensor([5, 6, 1, 1, 5, 6, 1, 1, 8, 5, 6, 0, 0, 3, 8, 5, 6])
    assert find_continuations(toks, 3, 1, 2, 1) == [[0, 0]]
    assert find_continuations(toks, 2, 1, 2, 1) == [[1, 1]]


def test_greedy_equals_generate_on_copy_prompts():
    model = tiny_vocab_model(seed=3)
    g = torch.Generator().manual_seed(0)
    for drafter in (PromptLookup(), PromptLookup(max_matches=4, max_nodes=16)):
        # the drafter's own tree every round: tree="auto"'s choices follow measured timings, so its tau moves
        # with the machine's load (auto's exactness and payoff: test_auto.py)
        tau = copy_prompt_tau(model, SpeculativeGenerator(model, drafter, tree=None), g)  # a passage and the start of its copy
        assert tau > 2.5, f"{drafter.max_matches} matches: tau {tau:.2f}"


def test_prompt_lookup_matches_and_tree():
    toks = torch.tensor([1, 2, 3, 9, 1, 2, 4, 5, 7, 1, 2])
    assert find_continuations(toks, 3, 1, 3, 1) == [[4, 5, 7]]  # "1 2": most recent occurrence first
    conts = find_continuations(toks, 3, 1, 3, 4)
    assert conts[:2] == [[4, 5, 7], [3, 9, 1]]
    parents, tokens = build_trie([[4, 5, 7], [3, 9, 1], [4, 6]], max_nodes=32)
    assert parents == [-1, 0, 1, 2, 0, 4, 5, 1] and tokens == [4, 5, 7, 3, 9, 1, 6]
    assert build_trie([[4, 5, 7], [3, 9, 1]], max_nodes=4)[1] == [4, 5, 7, 3]
    drafter = PromptLookup(max_matches=2, num_pred_tokens=3)
    draft = drafter.propose(ctx(toks.tolist()))
    assert draft.tokens.tolist() == [2, 4, 5, 7, 3, 9, 1] and draft.tree.depth == 3 and draft.q is None
    assert drafter.propose(ctx(toks.tolist(), max_depth=1)).tree.depth == 1
    # a tree given to the generator caps the depth and the number of matches
    assert drafter.propose(ctx(toks.tolist(), tree=load_tree("chain-2"))).tree.size == 3
    assert PromptLookup().propose(ctx([1, 2, 3, 4])).tree.size == 1  # no match: root only
    assert PromptLookup().propose(ctx([3])).tree.size == 1
    with pytest.raises(ValueError):
        PromptLookup(min_ngram_size=3, max_ngram_size=2)


def test_the_ngram_index_finds_what_a_scan_finds():
    """A context grown a few tokens a round (small vocabularies: many repeats), searched through ``NgramIndex`` and by
    the scan: the same matches every round, for several n-gram ranges, depths and match counts; a context that is
    not the indexed one grown is indexed afresh."""
    from headway.inference.prompt_lookup import NgramIndex, find_matches

    g = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(30):
        vocab, (min_n, max_n) = 3 + trial % 5, [(1, 3), (2, 4), (1, 1)][trial % 3]
        depth, matches = 1 + trial % 6, 1 + trial % 4
        index = NgramIndex(min_n, max_n)
        tokens = torch.randint(0, vocab, (1 + trial % 7,), generator=g).tolist()
        for _ in range(12):
            tokens += torch.randint(0, vocab, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
            index.extend(tokens)
            ctx = torch.tensor(tokens)
            assert find_matches(ctx, max_n, min_n, depth, matches, index.starts) == \
                find_matches(ctx, max_n, min_n, depth, matches), (trial, tokens)
            checked += 1
    assert checked == 360
    index = NgramIndex(1, 2)
    index.extend([1, 2, 1, 2, 3])
    index.extend([5, 1, 2, 1, 2])  # another context: indexed afresh (the old one's (1, 2) at 0 and 2 forgotten)
    assert index.starts(2) == [1] and index.starts(1) == [2]


def test_a_few_occurrences_are_ranked_in_exact_arithmetic_as_the_tensor_ranking_ranks_them():
    """``rank_few`` (lists, up to FEW_OCCURRENCES) against an oracle in fractions (sum over k of the share of
    occurrences with k + 1 tokens that agree on them; best first, ties to the later occurrence, duplicates after
    their first dropped) and against ``rank_continuations`` wherever its float scores tie exactly where the exact
    ones do; and ``find_matches`` gives the same matches through either ranking."""
    from fractions import Fraction

    import headway.inference.prompt_lookup as lookup

    g = torch.Generator().manual_seed(3)
    compared = 0
    for trial in range(400):
        m, depth, vocab = 1 + trial % 9, 1 + trial % 5, 2 + trial % 3
        conts = [torch.randint(0, vocab, (int(torch.randint(1, depth + 1, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(m)]
        valid = [sum(len(c) > k for c in conts) for k in range(depth)]
        exact = [sum(Fraction(sum(o[:k + 1] == c[:k + 1] for o in conts if len(o) > k), valid[k])
                     for k in range(len(c))) for c in conts]
        want, seen = [], set()
        for i in sorted(range(m), key=lambda i: (-exact[i], -i)):
            if tuple(conts[i]) not in seen:
                seen.add(tuple(conts[i]))
                want.append(i)
        assert rank_few(conts) == want, conts
        padded = torch.tensor([c + [-1] * (depth - len(c)) for c in conts])
        score, _ = expected_accepted(padded, torch.tensor([len(c) for c in conts]))
        if all((exact[i] == exact[j]) == (score[i] == score[j]) for i in range(m) for j in range(m)):
            assert rank_continuations(padded, torch.tensor([len(c) for c in conts])).tolist() == want
            compared += 1
    assert compared > 350
    tokens = torch.randint(0, 3, (60,), generator=g)
    few = lookup.find_matches(tokens, 3, 1, 4, 3)
    saved, lookup.FEW_OCCURRENCES = lookup.FEW_OCCURRENCES, 0
    try:
        assert lookup.find_matches(tokens, 3, 1, 4, 3) == few and few
    finally:
        lookup.FEW_OCCURRENCES = saved
    conts, lengths = continuations_at(torch.tensor([1, 2, 3]), torch.tensor([1, 2]), 3)
    assert conts.tolist() == [[2, 3, -1], [3, -1, -1]] and lengths.tolist() == [2, 1]
