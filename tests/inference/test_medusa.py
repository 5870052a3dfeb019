"""Medusa heads as a drafter: candidates are each head's top-k along the tree (reduced draft vocabularies
mapped back to target ids), sizes and trees are checked against the target, and the heads are cast and
bound to a shared lm_head once."""

import dataclasses

import pytest
import torch

from headway.heads import MedusaConfig, MedusaHeads, load_drafter
from headway.heads.target.tiny import build_tiny_target
from headway.inference import MedusaProposer, SpeculativeGenerator, as_proposer, load_tree
from tests.inference.spec_utils import draft_context as ctx
from tests.inference.spec_utils import reference_generate


def noisy_heads(target, seed: int) -> MedusaHeads:
    """Three Medusa heads for ``target`` whose blocks are random (not the identity), so their top-k differ."""
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=3))
    torch.manual_seed(seed)
    with torch.no_grad():
        for block in heads.blocks:
            block[0].linear.weight.normal_(0, 0.3)
    return heads


def test_medusa_candidates_follow_head_topk(tiny_llama):
    target, _ = tiny_llama
    heads = noisy_heads(target, 0)
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
    unscored = drafter.propose(dataclasses.replace(ctx([5, 6, 7], hidden, tree), scored=False))
    assert unscored.tokens.tolist() == draft.tokens.tolist() and unscored.scores is None  # ranked on the logits
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


def test_medusa_heads_are_cast_once_at_bind():
    """fp32 heads sharing the lm_head beside a bf16 target: cast at bind, the target's weight used as is."""
    target, _ = build_tiny_target("qwen2", seed=2)
    target = target.to(torch.bfloat16)
    heads = MedusaHeads.from_target(target.float(), MedusaConfig(num_heads=2, share_lm_head=True)).float()
    target = target.to(torch.bfloat16)
    gen = SpeculativeGenerator(target, heads, tree="chain-2")
    assert all(p.dtype == torch.bfloat16 for p in heads.parameters())
    assert heads._shared[0].data_ptr() == target.get_output_embeddings().weight.data_ptr()
    prompt = torch.randint(4, target.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    out = gen.generate(prompt, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(out.sequences, reference_generate(target, prompt, 12, eos_token_id=None))


def test_medusa_scores_multiply_head_probabilities_along_the_path(tiny_llama):
    """A node's score (what tree="auto" reads) is the product of its heads' probabilities of the tokens on its path."""
    target, _ = tiny_llama
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=2))
    drafter = MedusaProposer(heads)
    drafter.bind(target)
    tree = load_tree("tree-7").truncate(2)
    hidden = torch.randn(target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    draft = drafter.propose(ctx([5, 6, 7], hidden, tree))
    with torch.no_grad():
        p = [heads.head_logits(hidden, k).float().softmax(-1) for k in range(2)]
    scores = draft.score_list()  # the drafter leaves them on the device
    assert scores[0] == 1.0 and len(scores) == tree.size
    for node in range(1, tree.size):
        parent = tree.parents[node]
        head = p[tree.depths[node] - 1]
        assert scores[node] == pytest.approx(scores[parent] * float(head[draft.tokens[node]]), rel=1e-5)
    assert all(scores[tree.parents[n]] >= scores[n] for n in range(1, tree.size))


def test_rows_drafted_together_equal_each_row_drafted_alone(tiny_llama):
    """A batch's rows run the heads in one pass (``HeadLogits.run_together``) and get each the draft it
    gets alone, rows cut to different depths by their budgets included."""
    from headway.inference.proposer import run_rows

    target, _ = tiny_llama
    drafter = as_proposer(noisy_heads(target, 1))
    drafter.bind(target)
    tree = load_tree("tree-15")
    contexts = [ctx([5, 6, 7 + r], torch.randn(target.config.hidden_size), tree, max_depth=depth)
                for r, depth in enumerate([3, 1, 2, 3])]
    alone = [drafter.fork().propose(c) for c in contexts]
    together = run_rows([drafter.fork().propose_steps(c) for c in contexts])
    assert [d.tree.depth for d in alone] == [3, 1, 2, 3]
    for a, b in zip(alone, together):
        assert a.tree.parents == b.tree.parents and torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(b.scores, a.scores)


@pytest.mark.parametrize("share", [True, False])
def test_depth_logits_are_each_heads_own_in_one_product_when_shared(tiny_llama, share, monkeypatch):
    """``depth_logits``: heads 0 .. D-1 after each of B rows, each row's as ``head_logits`` gives it; heads that share
    the target's lm_head project all B * D rows in one product, heads with their own lm_heads each their B rows."""
    import headway.inference.medusa as medusa_runtime

    target, _ = tiny_llama
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=3, share_lm_head=share))
    torch.manual_seed(1)
    with torch.no_grad():
        for block in heads.blocks:
            block[0].linear.weight.normal_(0, 0.3)
    heads.bind_target(target)
    calls = []
    real = medusa_runtime.few_rows_linear
    monkeypatch.setattr(medusa_runtime, "few_rows_linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    hidden = torch.randn(2, target.config.hidden_size)
    with torch.no_grad():
        out = medusa_runtime.depth_logits(heads, hidden, 3)  # [B, D, V']
        ref = torch.stack([heads.head_logits(hidden, d) for d in range(3)], 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert calls == ([6] if share else [2, 2, 2])
