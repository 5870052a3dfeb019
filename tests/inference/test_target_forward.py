"""The target's forwards: one verification pass over a tree equals causal runs over every root-to-node
path (Llama, Qwen2, GPT-2; sdpa and eager), a chain equals a plain forward, padding and the prefill and
chain forwards; attention kernels that would ignore the tree mask are refused."""

import pytest
import torch

from headway.inference.kv_cache import new_cache
from headway.inference.tree import Tree, chain, load_tree, node_path
from headway.inference.target_forward import (chain_forward, check_attention, padded_tree_tensors, prefill,
                                              tree_forward, verify_width)
from tests.inference.spec_utils import causal_logits, prefilled


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("tree_name", ["tree-15", "chain-2"])
def test_tree_pass_matches_causal_paths(family_model, attn, tree_name):
    model = family_model
    model.set_attn_implementation(attn)
    check_attention(model)
    tree = load_tree(tree_name)
    prompt, nodes, cache = prefilled(model, tree, prompt_len=9, seed=0)
    with torch.no_grad():
        logits, width = tree_forward(model, cache, tree, nodes, prefix_len=8, pad_to=4)
    assert width == max(tree.size, 4) and cache.get_seq_length() == 8 + width
    tol = 1e-10 if attn == "sdpa" else 1e-6  # eager runs its softmax in fp32 even for fp64 models
    for i in range(tree.size):
        ids = torch.cat([prompt[:-1], nodes[node_path(tree.parents, i)]])
        torch.testing.assert_close(logits[i], causal_logits(model, ids)[-1], rtol=0, atol=tol)
    model.set_attn_implementation("sdpa")


def test_flash_attention_refused(tiny_llama):
    model, _ = tiny_llama
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="4D attention mask"):
            check_attention(model)
    finally:
        model.config._attn_implementation = "sdpa"


def test_chain_pass_equals_a_plain_forward(family_model):
    """A chain verified after a prefilled prefix: every node's logits are the plain causal forward's at
    that position, padded or not; padding past the context is dropped."""
    model = family_model
    tree = chain(4)
    prompt, nodes, cache = prefilled(model, tree, prompt_len=6, seed=2)
    with torch.no_grad():
        logits, width = tree_forward(model, cache, tree, nodes, prefix_len=5)
    assert width == 5 and logits.shape == (5, model.config.vocab_size) and cache.get_seq_length() == 10
    plain = causal_logits(model, torch.cat([prompt[:-1], nodes]))[5:]  # the positions of the chain's nodes
    torch.testing.assert_close(logits, plain, rtol=0, atol=1e-10)
    short = chain(1)  # two tokens, padded to four
    prompt, nodes, cache = prefilled(model, short, prompt_len=6, seed=2)
    with torch.no_grad():
        padded, width = tree_forward(model, cache, short, nodes, prefix_len=5, pad_to=4)
        assert width == 4 and padded.shape[0] == 2 and cache.get_seq_length() == 9
        prompt, nodes, cache = prefilled(model, short, prompt_len=6, seed=2)
        unpadded, width = tree_forward(model, cache, short, nodes, prefix_len=5, pad_to=4, max_positions=8)
    assert width == 2 and cache.get_seq_length() == 7  # 5 + 4 would pass position 8: not padded
    torch.testing.assert_close(padded, unpadded, rtol=0, atol=1e-10)
    torch.testing.assert_close(padded, causal_logits(model, torch.cat([prompt[:-1], nodes]))[5:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("tree_name", ["chain-4"])
def test_a_pass_with_pending_prompt_tokens_equals_prefill_then_the_tree(family_model, tree_name):
    """The prompt's pass (the prefill and the first tree in one forward, ``pending``): every node's logits
    are those of a causal run over prompt + its path, and the cache then holds what a prefill plus
    the tree pass leave, so compaction and the next round are unchanged."""
    model = family_model
    tree = load_tree(tree_name)
    prompt, nodes, cache = prefilled(model, tree, prompt_len=9, seed=3)
    empty = new_cache(model)
    with torch.no_grad():
        apart, _ = tree_forward(model, cache, tree, nodes, prefix_len=8, pad_to=4)
        folded, width = tree_forward(model, empty, tree, nodes, prefix_len=8, pad_to=4, pending=prompt[:-1])
    assert width == max(tree.size, 4) and empty.get_seq_length() == 8 + width
    for i in range(tree.size):
        ids = torch.cat([prompt[:-1], nodes[node_path(tree.parents, i)]])
        torch.testing.assert_close(folded[i], causal_logits(model, ids)[-1], rtol=0, atol=1e-10)
    torch.testing.assert_close(folded, apart, rtol=0, atol=1e-10)
    for a, b in zip(cache.layers, empty.layers):
        torch.testing.assert_close(b.keys, a.keys, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="prefill them first"):
        tree_forward(model, new_cache(model), load_tree("tree-15"), nodes, prefix_len=8, pending=prompt[:-1])


def test_prefill_and_chain_forward_return_the_last_positions_logits(family_model):
    model = family_model
    ids = torch.tensor([7, 9, 11, 13, 15, 17])
    plain = causal_logits(model, ids)  # [6, V]
    cache = new_cache(model)
    with torch.no_grad():
        last = prefill(model, cache, ids[None, :4])
        assert cache.get_seq_length() == 4
        torch.testing.assert_close(last, plain[3], rtol=0, atol=1e-10)
        nxt = chain_forward(model, cache, ids[4:], prefix_len=4)
    assert nxt.shape == (model.config.vocab_size,) and cache.get_seq_length() == 6
    torch.testing.assert_close(nxt, plain[5], rtol=0, atol=1e-10)


def test_widths_2_to_pad_to_are_padded():
    assert [verify_width(n, 4) for n in range(1, 7)] == [1, 4, 4, 4, 5, 6]
    assert [verify_width(n, 1) for n in range(1, 4)] == [1, 2, 3]  # pad_to 1: never padded


def test_padding_nodes_see_only_the_prefix_and_themselves():
    tree = Tree([-1, 0, 0, 1])  # root, two children, a grandchild under the first
    low = torch.finfo(torch.float32).min
    mask, depths = padded_tree_tensors(tree, 6, torch.device("cpu"), torch.float32)
    assert mask.shape == (6, 6) and depths.tolist() == [0, 1, 1, 2, 0, 0]
    real, _ = tree.device_tensors(torch.device("cpu"), torch.float32)
    assert torch.equal(mask[:4, :4], real)
    assert (mask[:4, 4:] == low).all()  # no real node sees the padding
    assert torch.equal(mask[4:], torch.tensor([[low] * 4 + [0.0, low], [low] * 5 + [0.0]]))
    assert (mask[3] == 0).tolist() == [True, True, False, True, False, False]  # the grandchild: its path
    assert padded_tree_tensors(tree, 6, torch.device("cpu"), torch.float32) is \
        padded_tree_tensors(tree, 6, torch.device("cpu"), torch.float32)  # memoised on the tree
    same, _ = padded_tree_tensors(tree, 4, torch.device("cpu"), torch.float32)
    assert torch.equal(same, real)  # no padding asked for: the tree's own mask


def test_sdpa_and_eager_are_accepted(tiny_llama):
    model, _ = tiny_llama
    for impl in ("sdpa", "eager"):
        model.config._attn_implementation = impl
        check_attention(model)
    model.config._attn_implementation = "sdpa"
