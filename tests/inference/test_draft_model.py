"""A separate draft model as drafter: greedy candidates are its rank-r tokens after each path, sampled
trees report q, its cache rolls back to the context, it stops drafting past its own context, and its
vocabulary and tokenizer are checked against the target's (padding rows allowed, never proposed)."""

import pytest
import torch

from headway.heads.target.tiny import build_tiny_target
from headway.inference import DraftModelProposer, DynamicTree, SpeculativeGenerator, load_tree
from headway.inference.draft_model import local_tokenizer_vocab, vocab_size
from headway.inference.tree import chain
from headway.inference.verify import SamplingParams
from tests.inference.spec_utils import draft_context as ctx
from tests.inference.spec_utils import noisy_copy, reference_generate


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


def test_draft_model_with_padded_embeddings_is_accepted(family):
    """Same tokenizer, embedding padded by 8 rows (as Qwen2.5-0.5B vs 7B): accepted when the
    tokenizers show the shared vocabulary; padding ids are never proposed; output unchanged."""
    from headway.heads.target.tiny import tiny_tokenizer

    target, tokenizer = build_tiny_target(family.name, seed=5)
    draft = noisy_copy(target, seed=5)
    vocab = target.config.vocab_size
    draft.resize_token_embeddings(vocab + 8, mean_resizing=False)
    with torch.no_grad():
        draft.get_output_embeddings().weight[vocab:] = 50.0  # padding rows that would win every argmax
    with pytest.raises(ValueError, match="tokenizer="):
        SpeculativeGenerator(target, DraftModelProposer(draft))
    drafter = DraftModelProposer(draft, tokenizer=tiny_tokenizer(), target_tokenizer=tokenizer)
    gen = SpeculativeGenerator(target, drafter, tree="tree-7")
    prompt = torch.randint(4, vocab, (1, 8), generator=torch.Generator().manual_seed(1))
    out = gen.generate(prompt, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(out.sequences, reference_generate(target, prompt, 24, eos_token_id=None))
    assert out.stats.mean_accepted_length > 1.3  # drafts are real tokens, not padding
    q = drafter.fit_vocab(torch.zeros(2, vocab + 8))
    assert q.shape == (2, vocab) and torch.isfinite(q).all()


def test_draft_model_with_another_tokenizer_is_refused(tmp_path):
    """Same vocabulary size, different token ids: refused by comparing the saved tokenizers."""
    from transformers import AutoModelForCausalLM

    from headway.heads.target.tiny import build_tiny_target

    target, tok = build_tiny_target("llama", seed=0)
    draft, dtok = build_tiny_target("llama", seed=1)
    target.save_pretrained(tmp_path / "t")
    tok.save_pretrained(tmp_path / "t")
    vocab = dtok.get_vocab()
    a, b = "hello", "robot"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # swap two ids: same size, other tokenizer
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer, backend.pre_tokenizer = dtok.backend_tokenizer.normalizer, dtok.backend_tokenizer.pre_tokenizer
    swapped = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")
    draft.save_pretrained(tmp_path / "d")
    swapped.save_pretrained(tmp_path / "d")
    t = AutoModelForCausalLM.from_pretrained(tmp_path / "t")
    d = AutoModelForCausalLM.from_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match="tokenizer differs"):
        SpeculativeGenerator(t, DraftModelProposer(d))
    with pytest.raises(ValueError, match="tokenizer differs"):
        SpeculativeGenerator(target, DraftModelProposer(draft, tokenizer=swapped, target_tokenizer=tok))
    SpeculativeGenerator(target, DraftModelProposer(draft, tokenizer=dtok, target_tokenizer=tok))  # same: accepted


def test_trees_and_vocabulary_fitting_without_padding(tiny_llama):
    target, _ = tiny_llama
    drafter = DraftModelProposer(build_tiny_target("llama", seed=5)[0], gamma=3)
    assert drafter.default_tree().parents == chain(3).parents and drafter.resolve_tree(None).is_chain
    assert drafter.resolve_tree("tree-7").size == load_tree("tree-7").size
    assert drafter.resolve_tree({"depth": 3, "top_k": 2}) == DynamicTree(depth=3, top_k=2)
    drafter.bind(target)  # same vocabulary, no tokenizers to compare
    logits = torch.randn(2, vocab_size(target))
    assert drafter.fit_vocab(logits) is logits  # nothing to cut or widen
    assert local_tokenizer_vocab(target) is None  # built in memory: no folder with a tokenizer


def test_local_tokenizer_vocab_reads_the_tokenizer_saved_beside_the_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model, tokenizer = build_tiny_target("llama", seed=0)
    model.save_pretrained(tmp_path)
    assert local_tokenizer_vocab(AutoModelForCausalLM.from_pretrained(tmp_path)) is None  # no tokenizer saved yet
    tokenizer.save_pretrained(tmp_path)
    assert local_tokenizer_vocab(AutoModelForCausalLM.from_pretrained(tmp_path)) == tokenizer.get_vocab()
