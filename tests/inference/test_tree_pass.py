"""One verification pass over a tree equals causal runs over every root-to-node path; compaction
keeps exactly the accepted path (Llama, Qwen2, GPT-2; sdpa and eager)."""

import pytest
import torch

from headway.heads.target.tiny import build_tiny_target
from headway.inference.kv_cache import check_compactable, compact_cache, new_cache
from headway.inference.tree import load_tree, node_path
from headway.inference.target_forward import check_attention, prefill, tree_forward

FAMILIES = ["llama", "qwen2", "gpt2"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    model, _ = build_tiny_target(request.param, seed=3)
    return model.to(torch.float64)


def _prefilled(model, tree, prompt_len: int, seed: int):
    """Random prompt and tree tokens (node 0 = the prompt's last token); a cache prefilled with
    the prompt minus its last token."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, 200, (prompt_len,), generator=g)
    nodes = torch.randint(4, 200, (tree.size,), generator=g)
    nodes[0] = prompt[-1]
    cache = new_cache(model)
    with torch.no_grad():
        prefill(model, cache, prompt[None, :-1])
    return prompt, nodes, cache


def _causal_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None]).logits[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("tree_name", ["tree-15", "chain-2"])
def test_tree_pass_matches_causal_paths(family_model, attn, tree_name):
    model = family_model
    model.set_attn_implementation(attn)
    check_attention(model)
    tree = load_tree(tree_name)
    prompt, nodes, cache = _prefilled(model, tree, prompt_len=9, seed=0)
    with torch.no_grad():
        logits, width = tree_forward(model, cache, tree, nodes, prefix_len=8, pad_to=4)
    assert width == max(tree.size, 4) and cache.get_seq_length() == 8 + width
    tol = 1e-10 if attn == "sdpa" else 1e-6  # eager runs its softmax in fp32 even for fp64 models
    for i in range(tree.size):
        ids = torch.cat([prompt[:-1], nodes[node_path(tree.parents, i)]])
        torch.testing.assert_close(logits[i], _causal_logits(model, ids)[-1], rtol=0, atol=tol)
    model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("keep_leaf", [3, 14])
def test_compaction_leaks_nothing(family_model, keep_leaf):
    model = family_model
    tree = load_tree("tree-15")
    prompt, nodes, cache = _prefilled(model, tree, prompt_len=7, seed=1)
    with torch.no_grad():
        tree_forward(model, cache, tree, nodes, prefix_len=6)
        path = node_path(tree.parents, keep_leaf)
        compact_cache(cache, 6, path, tree.size)
        assert cache.get_seq_length() == 6 + len(path)
        # the next forward (two tokens) sees exactly prompt + accepted path
        nxt = torch.tensor([11, 12])
        out = model(input_ids=nxt[None], position_ids=torch.arange(6 + len(path), 8 + len(path))[None],
                    cache=cache, use_cache=True).logits[0]
    fresh = _causal_logits(model, torch.cat([prompt[:-1], nodes[path], nxt]))[-2:]
    torch.testing.assert_close(out, fresh, rtol=0, atol=1e-10)


def test_sliding_window_cache_refused():
    from transformers import DynamicCache, MistralConfig

    cfg = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64, sliding_window=16)
    with pytest.raises(ValueError, match="sliding"):
        check_compactable(DynamicCache(config=cfg))


def test_flash_attention_refused(tiny_llama):
    model, _ = tiny_llama
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="4D attention mask"):
            check_attention(model)
    finally:
        model.config._attn_implementation = "sdpa"
