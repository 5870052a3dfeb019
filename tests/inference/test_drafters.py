"""Each drafter behind the one interface: what it proposes, its checks, and its own state."""

import pytest
import torch

from headway.heads import MedusaConfig, MedusaHeads, load_drafter
from headway.heads.target.tiny import build_tiny_target
from headway.inference import (DraftContext, DraftModelProposer, MedusaProposer, PromptLookup, SpeculativeGenerator,
                               as_proposer, load_tree)
from headway.inference.prompt_lookup import build_trie, find_continuations
from headway.inference.verify import SamplingParams


def ctx(tokens, hidden=None, tree=None, max_depth=10, sampling=None, generator=None):
    features = None if hidden is None else hidden[None]  # [1, H]: the state that predicted the root
    return DraftContext(torch.tensor(tokens), features, tree, max_depth, sampling, generator)


def test_medusa_candidates_follow_head_topk(tiny_llama):
    target, _ = tiny_llama
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=3))
    torch.manual_seed(0)
    with torch.no_grad():
        for block in heads.blocks:
            block[0].linear.weight.normal_(0, 0.3)
    drafter = as_proposer(heads)
    assert isinstance(drafter, MedusaProposer)
    drafter.bind(target)
    assert drafter.feature_layers == [target.config.num_hidden_layers]  # the final-norm output only
    tree = load_tree("tree-15")
    hidden = torch.randn(target.config.hidden_size)
    draft = drafter.propose(ctx([5, 6, 7], hidden, tree))
    assert draft.q is None and draft.tokens[0] == 7 and draft.tree.size == tree.size
    top = torch.stack([heads.head_logits(hidden, k) for k in range(3)]).topk(tree.top_k, dim=-1).indices
    for node in range(1, tree.size):
        assert draft.tokens[node] == top[tree.depths[node] - 1, tree.ranks[node]]
    assert drafter.propose(ctx([5, 6, 7], None, tree)).tree.size == 1  # no hidden state yet: root only
    assert drafter.propose(ctx([5, 6, 7], hidden, tree, max_depth=1)).tree.depth == 1
    assert drafter.default_tree().depth == 3  # tree-15 fits 3 heads


def test_medusa_checks(tiny_llama, tiny_qwen2, tmp_path):
    target, _ = tiny_llama
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=2))
    with pytest.raises(ValueError, match="depth 3 .* at most 2"):
        SpeculativeGenerator(target, heads, tree="chain-3")
    other = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=target.config.vocab_size, num_heads=2))
    with pytest.raises(ValueError, match="hidden_size 32 .* hidden_size 64"):
        SpeculativeGenerator(target, other)
    wrong_vocab = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=999, num_heads=2))
    with pytest.raises(ValueError, match="vocab_size 999"):
        SpeculativeGenerator(target, wrong_vocab)
    # heads sharing the target's lm_head are bound by the generator after loading from disk
    shared = MedusaHeads.from_target(target, MedusaConfig(num_heads=2, share_lm_head=True))
    shared.save_pretrained(tmp_path)
    gen = SpeculativeGenerator(target, load_drafter(tmp_path))
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                          eos_token_id=None)
    assert torch.equal(gen.generate(ids, max_new_tokens=12).sequences, ref)


def test_draft_model_vocab_mismatch(tiny_llama):
    from transformers import LlamaConfig, LlamaForCausalLM

    target, _ = tiny_llama
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=target.config.vocab_size + 7)
    with pytest.raises(ValueError, match="vocab_size .* does not match .* tokenizer"):
        SpeculativeGenerator(target, LlamaForCausalLM(cfg))
    with pytest.raises(ValueError, match="gamma"):
        DraftModelProposer(target, gamma=0)


@pytest.mark.parametrize("tree", ["chain-3", "tree-7"])
def test_draft_model_greedy_candidates_and_rollback(tiny_llama, tree):
    target, _ = tiny_llama
    draft_model, _ = build_tiny_target("llama", seed=5)
    drafter = DraftModelProposer(draft_model)
    drafter.bind(target)
    drafter.reset()
    tree = load_tree(tree)
    tokens = [5, 6, 7, 8, 9]
    for step in range(2):
        draft = drafter.propose(ctx(tokens, tree=tree))
        assert drafter._cache.get_seq_length() == len(tokens)  # draft entries rolled back
        for node in range(1, tree.size):  # each child is the rank-r token after its own path
            path = [node]
            while path[-1] != 0:
                path.append(tree.parents[path[-1]])
            parent_path = draft.tokens[path[::-1][1:-1]].tolist()
            with torch.no_grad():
                logits = draft_model(torch.tensor([tokens + parent_path])).logits[0, -1]
            assert draft.tokens[node] == logits.topk(tree.top_k).indices[tree.ranks[node]]
        tokens = tokens + draft.tokens[1:3].tolist() + [11]  # accept two, then a bonus token


def test_draft_model_sampled_tree_reports_q(tiny_llama):
    target, _ = tiny_llama
    drafter = DraftModelProposer(build_tiny_target("llama", seed=5)[0])
    drafter.bind(target)
    drafter.reset()
    tree = load_tree("tree-7")
    draft = drafter.propose(ctx([5, 6, 7], tree=tree, sampling=SamplingParams(0.8, 0, 0.9),
                                generator=torch.Generator().manual_seed(0)))
    parents_with_children = {n for n in range(tree.size) if tree.children[n]}
    assert set(draft.q) == parents_with_children
    for n in parents_with_children:
        q = draft.q[n]
        assert abs(float(q.sum()) - 1) < 1e-5
        kids = draft.tokens[tree.children[n]]
        assert len(set(kids.tolist())) == len(kids)  # drawn without replacement
        assert bool((q[kids[:1]] > 0).all())


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


def test_unknown_drafter_rejected(tiny_llama):
    with pytest.raises(ValueError, match="unsupported drafter"):
        SpeculativeGenerator(tiny_llama[0], object())


def test_draft_model_with_a_shorter_context(tiny_llama):
    """A draft model whose position table ends early stops drafting instead of failing."""
    from transformers import GPT2Config, GPT2LMHeadModel

    target, _ = tiny_llama
    torch.manual_seed(0)
    short = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16,
                                       vocab_size=target.config.vocab_size)).eval()
    gen = SpeculativeGenerator(target, short, tree="chain-3")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                          eos_token_id=None)
    out = gen.generate(ids, max_new_tokens=20)
    assert torch.equal(out.sequences, ref) and out.stats.draft_depth_per_step[-1] == 0


def test_medusa_reduced_draft_vocabulary(tiny_llama):
    """Heads that score only part of the vocabulary propose target ids from that part; output stays exact."""
    target, _ = tiny_llama
    ids = torch.tensor([[5, 6, 7, 8, 5, 6]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                          eos_token_id=None)
    keep = torch.unique(torch.cat([ref[0], torch.arange(40, 80)]))  # includes the tokens generate will pick
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=3, draft_vocab_size=len(keep)), draft_tokens=keep)
    drafter = MedusaProposer(heads)
    drafter.bind(target)
    draft = drafter.propose(ctx([5, 6, 7], torch.randn(target.config.hidden_size), load_tree("tree-7")))
    assert set(draft.tokens[1:].tolist()) <= set(keep.tolist())
    out = SpeculativeGenerator(target, heads, tree="tree-7").generate(ids, max_new_tokens=16)
    assert torch.equal(out.sequences, ref)
