"""The target's verification pass captured per width (inference/target_graphs.py) through the traced stand-in of a
CUDA graph: its logits, its feature rows and the cache it leaves equal the eager pass's (``tree_forward`` with the
feature hooks), for trees padded to the captured width, on Llama and Qwen2; the cache persists across requests while
it holds them; what cannot be captured says so. (End to end with a drafter: test_graphs.py.)"""

import pytest
import torch

from headway.heads.target.features import FeatureCapture
from headway.heads.target.tiny import build_tiny_target
from headway.inference.graphs import TracedGraphs, graph_width
from headway.inference.kv_cache import compact_cache, new_cache
from headway.inference.target_forward import prefill, tree_forward
from headway.inference.target_graphs import VerifyGraphs, why_not
from headway.inference.tree import chain, load_tree


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    model, _ = build_tiny_target(request.param, seed=3)
    return model.to(torch.float64)


def test_graph_widths_are_powers_of_two():
    assert [graph_width(n) for n in (1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 60)] == [1, 2, 4, 4, 8, 8, 16, 16, 16, 32, 64]


@pytest.mark.parametrize("tree", ["chain-1", "chain-3", "chain-4", "tree-7", "tree-15"])
def test_a_captured_pass_equals_the_eager_pass(target, tree):
    """Two rounds (a capture, then a replay on a longer prefix after a compaction): logits, the features (the
    embeddings, layer 1's input, after the final norm) and the kept cache entries all equal the eager pass's."""
    tree = chain(int(tree.split("-")[1])) if tree.startswith("chain") else load_tree(tree)
    layers = [0, 1, target.config.num_hidden_layers]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 200, (20,), generator=g)
    graphs = VerifyGraphs(target, TracedGraphs(), layers, strict=True)
    results = {}
    with torch.no_grad(), FeatureCapture(target, layers) as capture:
        for label in ("eager", "graphs"):
            cache = graphs.cache(64) if label == "graphs" else new_cache(target, 64)
            prefill(target, cache, prompt[None, :-1])
            capture.pop()
            prefix, out = prompt.shape[0] - 1, []
            for round_ in range(2):
                nodes = torch.randint(4, 200, (tree.size,), generator=torch.Generator().manual_seed(round_))
                nodes[0] = prompt[-1] if round_ == 0 else nodes[0]
                if label == "eager":
                    logits, width = tree_forward(target, cache, tree, nodes, prefix)
                    rows = capture.pop()[0]
                else:
                    logits, width, rows = graphs.verify(cache, tree, nodes, prefix)
                    assert width == graph_width(tree.size)
                path = list(range(tree.size)) if tree.is_chain else [0, 1]  # a root-to-node path
                out.append((logits, rows[:tree.size]))
                compact_cache(cache, prefix, path, width)
                prefix += len(path)
            assert cache.get_seq_length() == prefix
            kept = torch.cat([torch.cat([layer.keys, layer.values]) for layer in cache.layers])  # [2L, Hkv, S, D]
            results[label] = (out, kept)
    (eager, eager_kept), (graphed, graphed_kept) = results["eager"], results["graphs"]
    for (a_logits, a_rows), (b_logits, b_rows) in zip(eager, graphed):
        assert torch.allclose(a_logits, b_logits, rtol=0, atol=1e-10)
        assert torch.allclose(a_rows, b_rows, rtol=0, atol=1e-10)
    assert torch.allclose(eager_kept, graphed_kept, rtol=0, atol=1e-10)


def test_the_cache_persists_while_it_holds_the_request(target):
    graphs = VerifyGraphs(target, TracedGraphs(), [])
    first = graphs.cache(100)
    assert graphs.cache(200) is first  # 256 slots: it holds 200
    prefill(target, first, torch.randint(4, 200, (1, 30)))
    assert graphs.cache(256) is first and first.get_seq_length() == 0  # emptied for the next request
    assert graphs.cache(257) is not first  # outgrown: a new one (512), its passes captured again


def test_what_cannot_be_captured_says_so(target):
    assert why_not(target) is None
    gpt2, _ = build_tiny_target("gpt2", seed=3)
    assert why_not(gpt2) == ("the target's verification pass (GPT2LMHeadModel, model_type 'gpt2') is captured for "
                             "llama, qwen2, qwen3, mistral decoders only")
    graphs = VerifyGraphs(target, TracedGraphs(), [])
    other = new_cache(target, 64)  # not the one it keeps: its passes would write elsewhere
    prefill(target, other, torch.randint(4, 200, (1, 10)))
    assert graphs.verify(other, chain(1), torch.tensor([5, 6]), 10) is None


def test_a_dynamic_rope_or_autocast_is_not_captured(target):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=218, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert why_not(LlamaForCausalLM(cfg)) == ("the target's verification pass cannot be captured in a graph: its RoPE "
                                              "is 'dynamic' (frequencies updated on the host)")
    from headway.heads import EagleHead
    from headway.inference.graphs import EagleStepGraphs

    head = EagleHead.from_target(LlamaForCausalLM(cfg), version=3)
    assert EagleStepGraphs(head, TracedGraphs()).failed.startswith("the EAGLE drafter's step cannot be captured")
    # under autocast a replay would read the cast weights autocast frees when it ends: eager instead
    backend = TracedGraphs()
    graphs = VerifyGraphs(target, backend, [])
    cache = graphs.cache(64)
    prefill(target, cache, torch.randint(4, 200, (1, 10)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert graphs.verify(cache, chain(1), torch.tensor([5, 6]), 10) is None
    assert graphs.verify(cache, chain(1), torch.tensor([5, 6]), 10) is not None and backend.captures == 1
