"""Hybrid drafting: a list of drafters is one drafter whose trees are merged for one verification pass."""

import pytest
import torch

from headway.heads import MedusaConfig, MedusaHeads
from headway.inference import (Draft, DraftModelProposer, HybridProposer, PromptLookup, SpeculativeGenerator,
                               SuffixDecoding, Tree)
from headway.inference import hybrid
from headway.inference.hybrid import merge_drafts, stack_drafts
from tests.inference.spec_utils import noisy_copy, reference_generate, tiny_vocab_model


def draft(parents, tokens):
    return Draft(Tree(parents), torch.tensor(tokens))


def test_merge_keeps_the_first_tree_and_adds_what_the_trie_lacks():
    model = draft([-1, 0, 1, 0], [9, 4, 5, 6])  # root 9: 4-5 and 6
    copied = draft([-1, 0, 1, 2], [9, 4, 5, 7])  # 4-5-7: 4 and 5 shared, 7 new below 5
    other = draft([-1, 0, 1], [9, 8, 3])
    merged = merge_drafts([model, copied, other], max_extra_nodes=16)
    assert merged.tree.parents == [-1, 0, 1, 0, 2, 0, 5] and merged.tokens.tolist() == [9, 4, 5, 6, 7, 8, 3]
    assert merged.sources == [0, 0, 0, 0, 1, 2, 2]  # who proposed each node (tree="auto" calibrates each apart)
    capped = merge_drafts([model, draft([-1, 0, 1, 2], [9, 8, 3, 2])], max_extra_nodes=1)
    assert capped.tokens.tolist() == [9, 4, 5, 6, 8]  # 3 and 2 hang below a node that was left out
    root = draft([-1], [9])
    assert merge_drafts([root, root], 4).tree.size == 1
    alone = merge_drafts([model, root], 4, ids=[3, 1])
    assert alone.tree is model.tree and alone.sources == [3] * 4


def test_stacking_hangs_each_drafts_nodes_below_the_root_unmerged_and_reuses_its_shapes():
    model = draft([-1, 0, 1, 0], [9, 4, 5, 6])
    copied = draft([-1, 0, 1, 2], [9, 4, 5, 7])  # 4-5 shared with the model's tree: stacked, not merged
    stacked = stack_drafts([model, copied], max_extra_nodes=16, ids=[0, 1])
    assert stacked.tree.parents == [-1, 0, 1, 0, 0, 4, 5] and stacked.tokens.tolist() == [9, 4, 5, 6, 4, 5, 7]
    assert stacked.sources == [0, 0, 0, 0, 1, 1, 1] and stacked.scores is None
    capped = stack_drafts([model, copied, draft([-1, 0], [9, 3])], max_extra_nodes=2, ids=[0, 1, 2])
    assert capped.tree.parents == [-1, 0, 1, 0, 0, 4, 0] and capped.tokens.tolist() == [9, 4, 5, 6, 4, 5, 3]
    again = stack_drafts([model, draft([-1, 0, 1, 2], [9, 8, 3, 2])], max_extra_nodes=16, ids=[0, 1])
    assert again.tree is stacked.tree and again.tokens.tolist() == [9, 4, 5, 6, 8, 3, 2]  # one Tree per shape


def test_a_greedy_hybrid_reads_no_draft_and_accepts_what_the_merged_trie_accepts(monkeypatch):
    """Without tree="auto" a greedy hybrid stacks its drafts (no read to merge them): every round accepts the same
    tokens as the merged trie's (verification takes the deepest accepted node of either copy)."""
    target = tiny_vocab_model(seed=3)
    draft_model = noisy_copy(target, scale=0.7, seed=1)
    g = torch.Generator().manual_seed(1)
    prompts = []
    for i in range(3):
        segment = torch.randint(2, 8, (int(torch.randint(5, 12, (), generator=g)),), generator=g)
        prompts.append(torch.cat([segment, segment[: 3 + i]])[None])
    runs, stacked = {}, []

    def stack(drafts, cap, ids):
        out = stack_drafts(drafts, cap, ids)
        stacked.append(id(out.tree))
        return out

    for how in ("stacked", "merged"):
        monkeypatch.setattr(hybrid, "stack_drafts", stack if how == "stacked" else  # "merged": the trie every round
                            lambda drafts, cap, ids: merge_drafts(drafts, cap, ids))
        gen = SpeculativeGenerator(target, [DraftModelProposer(draft_model, gamma=3), PromptLookup(), SuffixDecoding()],
                                   tree="chain-3")
        runs[how] = []
        for prompt in prompts:
            out = gen.generate(prompt, max_new_tokens=24)
            assert torch.equal(out.sequences, reference_generate(target, prompt, 24, eos_token_id=None)), how
            runs[how].append((out.stats.new_tokens, out.stats.target_forward_passes, out.stats.accepted_per_step))
    assert runs["stacked"] == runs["merged"] and max(max(r[2]) for r in runs["stacked"]) > 1, runs
    assert len(stacked) > 10 and len(set(stacked)) < len(stacked)  # stacked every round, a shape's tree reused


def test_hybrid_greedy_equals_generate_and_copies_where_the_model_misses():
    target = tiny_vocab_model(seed=3)
    draft_model = noisy_copy(target, scale=2.0, seed=1)  # a poor draft model
    g = torch.Generator().manual_seed(0)
    taus = {}
    for name, drafter in (("model", DraftModelProposer(draft_model, gamma=3)),
                          ("hybrid", [DraftModelProposer(draft_model, gamma=3), PromptLookup()]),
                          ("hybrid-suffix", [DraftModelProposer(draft_model, gamma=3), SuffixDecoding()])):
        gen = SpeculativeGenerator(target, drafter)
        new = passes = 0
        g.manual_seed(0)
        for i in range(4):
            segment = torch.randint(2, 8, (int(torch.randint(5, 12, (), generator=g)),), generator=g)
            prompt = torch.cat([segment, segment[: 3 + i % 3]])[None]
            out = gen.generate(prompt, max_new_tokens=24)
            assert torch.equal(out.sequences, reference_generate(target, prompt, 24, eos_token_id=None)), (name, i)
            new, passes = new + out.stats.new_tokens, passes + out.stats.target_forward_passes
        taus[name] = new / passes
    assert taus["hybrid"] > taus["model"] and taus["hybrid-suffix"] > taus["model"], taus


def test_a_hybrid_refuses_two_feature_readers_and_names_a_drafter_for_another_target():
    target = tiny_vocab_model(seed=3)
    hidden = target.config.hidden_size
    heads = [MedusaHeads(MedusaConfig(hidden_size=hidden, vocab_size=8, num_heads=2)) for _ in range(2)]
    with pytest.raises(ValueError, match="2 drafters that read the target's features"):
        SpeculativeGenerator(target, [heads[0], heads[1]])
    wrong = MedusaHeads(MedusaConfig(hidden_size=hidden, vocab_size=300, num_heads=2))
    with pytest.raises(ValueError, match=r"hybrid drafter 1 \(MedusaProposer\) does not fit the target: .*300"):
        SpeculativeGenerator(target, [PromptLookup(), wrong])
    with pytest.raises(ValueError, match="at least one drafter"):
        HybridProposer([])
    assert isinstance(SpeculativeGenerator(target, (PromptLookup(), SuffixDecoding())).drafter, HybridProposer)
