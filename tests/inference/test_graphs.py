"""The drafter's tree levels and the target's verification pass captured as graphs (inference/graphs.py,
inference/target_graphs.py, issue 22 item 4), on a CPU through the traced stand-in (``TracedGraphs``: Python values
frozen at capture, the captured tensors read and written in place, outputs overwritten by the next replay, as under a
CUDA graph): every round's draft and logits equal the eager one's, across requests that reuse the captured buffers and
a prompt that outgrows them; sampled rounds draw the same; and the flag's bad input. The real CUDA capture runs in
tests/gpu/test_cuda.py."""

import logging

import pytest
import torch

from headway.inference import PromptLookup, SpeculativeGenerator
from headway.inference.graphs import CaptureError, TracedGraphs
from tests.inference.spec_utils import assert_batch_equals_rows, reference_generate

CASES = {  # name: (EAGLE version, tree, EagleProposer.tensor_rounds)
    "eagle3-tree": (3, "tree-15", False),
    "eagle3-dynamic-host": (3, {"depth": 3, "top_k": 4, "total_tokens": 8}, False),
    "eagle3-dynamic-tensors": (3, {"depth": 3, "top_k": 4, "total_tokens": 8}, True),
    "eagle1-chain": (1, "chain-4", False),
    "eagle3-3-layers-tree": ("3 layers", "tree-15", False),  # midlayer then two plain layers, each its own cache
}


def recorded(gen):
    """Record each round's draft (tokens, parents, scores) of ``gen``'s drafter, the logits it was verified with, and
    how many passes ran captured (``gen._verify_graphs``)."""
    rounds, logits, graphed = [], [], [0]
    propose, accept = gen.drafter.propose, gen._accept

    def record(ctx):
        draft = propose(ctx)
        rounds.append((draft.tokens.tolist(), list(draft.tree.parents), draft.score_list()))
        return draft

    def verified(draft, round_logits, *rest):
        logits.append(round_logits.clone())
        return accept(draft, round_logits, *rest)

    gen.drafter.propose, gen._accept = record, verified
    if gen._verify_graphs is not None:
        verify = gen._verify_graphs.verify

        def counted(*args):
            out = verify(*args)
            graphed[0] += out is not None
            return out

        gen._verify_graphs.verify = counted
    return rounds, logits, graphed


def prompts_with_a_long_one(family, n: int = 6):
    """``n`` of the family's prompts, then one of 300 tokens: past the draft cache's first buffer (128 slots) and
    the target cache's (256), so both are captured again on the grown ones mid-request."""
    g = torch.Generator().manual_seed(1)
    long = torch.randint(4, family.target.config.vocab_size, (1, 300), generator=g)
    return list(zip(family.prompts[:n], family.max_new[:n])) + [(long, 30)]


SLOW_CASES = ("eagle3-dynamic-host", "eagle1-chain")  # the default lane keeps a static and a tensor-op dynamic tree


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES])
def test_graphed_levels_draft_what_eager_levels_draft(family, eagle, name):
    compare_rounds(family, eagle, name)


def test_never_written_slots_cannot_leak_into_graphed_steps(family, eagle, monkeypatch):
    """A captured step attends over the whole cache buffer, masked: memory never written (NaN or inf as often as
    not, on a GPU too) must not reach it. Every new draft-cache and target-cache buffer is poisoned past what was
    written."""
    from headway.heads import eagle_layer
    from headway.inference import kv_cache

    write = eagle_layer.write_slots

    def poisoned(buffer, start, new, capacity=0):
        out = write(buffer, start, new, capacity)
        if out is not buffer:
            out[:, :, start + new.shape[2]:] = float("nan")
        return out

    monkeypatch.setattr(eagle_layer, "write_slots", poisoned)
    monkeypatch.setattr(kv_cache, "write_slots", poisoned)
    compare_rounds(family, eagle, "eagle3-dynamic-tensors")


def deep_head(family):
    """An EAGLE-3 head of 3 decoder layers on the family's target (its lm_head the target's rows, the rest random)."""
    from headway.heads import EagleHead

    torch.manual_seed(0)
    head = EagleHead.from_target(family.target, version=3, num_layers=3, draft_vocab_size=150,
                                 draft_tokens=list(range(150)))
    return head.to(next(family.target.parameters()).dtype).eval()


def compare_rounds(family, eagle, name):
    """Every round with graphs (the drafter's levels and the target's pass captured) equals the eager round: the same
    draft, the same logits (fp64), the same output; each request's passes after its first run captured."""
    version, tree, tensor_rounds = CASES[name]
    head = eagle[version] if version in eagle else deep_head(family)
    backend = TracedGraphs()
    runs = {}
    for label, flag in (("eager", False), ("graphs", backend)):
        gen = SpeculativeGenerator(family.target, head, tree=tree, cuda_graphs=flag)
        gen.drafter.tensor_rounds = tensor_rounds
        runs[label] = recorded(gen)
        for i, (prompt, max_new) in enumerate(prompts_with_a_long_one(family)):
            out = gen.generate(prompt, max_new_tokens=max_new)
            ref = reference_generate(family.target, prompt, max_new)
            assert torch.equal(out.sequences, ref), f"{family.name}/{name}/{label}: prompt {i} differs from generate"
            if label == "graphs" and i == 5:  # before the long prompt: one capture per width seen, reused since
                captured = len(gen.drafter._graphs._calls) + len(gen._verify_graphs._calls)
                assert backend.captures == captured > 0
    (eager, eager_logits, _), (graphed, graphed_logits, passes) = runs["eager"], runs["graphs"]
    assert len(eager) == len(graphed) > 20 and len(eager_logits) == len(graphed_logits)
    for r, (a, b) in enumerate(zip(eager, graphed)):
        assert a[:2] == b[:2], f"{family.name}/{name}: round {r} drafted another tree under graphs"
        assert a[2] == pytest.approx(b[2], abs=1e-9), f"{family.name}/{name}: round {r} scores differ"
    for r, (a, b) in enumerate(zip(eager_logits, graphed_logits)):
        assert torch.allclose(a, b, rtol=0, atol=1e-9), f"{family.name}/{name}: round {r} verified other logits"
    assert passes[0] == len(graphed_logits) - 7  # every pass but each request's first (the prompt's) captured
    # the long prompt grew both caches: what it ran was captured again on the grown buffers, once per width
    assert backend.captures - captured == len(gen.drafter._graphs._calls) + len(gen._verify_graphs._calls) > 0


def test_graphed_sampled_rounds_draw_what_eager_rounds_draw(family, eagle):
    """A sampled static tree: the same seed gives the same output with and without graphs (the drafts' q feed the
    random draws, so any difference in a draft distribution would show)."""
    outs = []
    for flag in (False, TracedGraphs()):
        gen = SpeculativeGenerator(family.target, eagle[3], tree="tree-15", cuda_graphs=flag)
        g = torch.Generator().manual_seed(7)
        outs.append([gen.generate(p, max_new_tokens=m, temperature=0.8, top_k=20, generator=g).sequences
                     for p, m in zip(family.prompts[:6], family.max_new[:6])])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_batch_and_a_hybrid_run_beside_graphs(family, eagle):
    """A batch's rows draft with forks that keep no graphs (their levels run stacked); a hybrid captures its model
    part: both equal the eager runs."""
    assert_batch_equals_rows(SpeculativeGenerator(family.target, eagle[3], tree="tree-15", cuda_graphs=TracedGraphs()),
                             family)
    backend = TracedGraphs()
    gen = SpeculativeGenerator(family.target, [eagle[3], PromptLookup()], tree="tree-15", cuda_graphs=backend)
    for prompt, max_new, ref in list(zip(family.prompts, family.max_new, family.references))[:6]:
        assert torch.equal(gen.generate(prompt, max_new_tokens=max_new).sequences, ref)
    assert backend.captures > 0


class Refuses:
    """A graph backend whose capture fails (as an op that cannot be captured would)."""

    def capture(self, run):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_step_that_cannot_be_captured(family, eagle, caplog):
    gen = SpeculativeGenerator(family.target, eagle[3], tree="tree-15", cuda_graphs=Refuses())
    with pytest.raises(CaptureError, match=r"cuda_graphs=True: the EAGLE drafter's step cannot be captured .*"
                                           r"operation not permitted.*cuda_graphs=None"):
        gen.generate(family.prompts[0], max_new_tokens=8)
    # not asked for (the CUDA default): logged once, every level eager, the output unchanged
    gen = SpeculativeGenerator(family.target, eagle[3], tree="tree-15", cuda_graphs=False)
    gen.drafter.use_graphs(Refuses(), strict=False)
    with caplog.at_level(logging.WARNING, logger="headway.inference.graphs"):
        for prompt, max_new, ref in list(zip(family.prompts, family.max_new, family.references))[:3]:
            assert torch.equal(gen.generate(prompt, max_new_tokens=max_new).sequences, ref)
    assert [r.message for r in caplog.records].count(
        "the EAGLE drafter's step cannot be captured in a graph (RuntimeError: operation not permitted when stream "
        "is capturing); drafting without graphs") == 1


def test_the_flag(family, eagle):
    from headway.heads.target.tiny import build_tiny_target

    # on a CPU the default and True are no-ops: nothing captured
    for flag in (None, True):
        assert SpeculativeGenerator(family.target, eagle[3], cuda_graphs=flag).drafter._graphs is None
    with pytest.raises(ValueError, match="cuda_graphs must be None, True, False or a graph backend, got 'yes'"):
        SpeculativeGenerator(family.target, eagle[3], cuda_graphs="yes")
    # asked for, with a drafter whose step is not captured: one line naming it
    with pytest.raises(CaptureError, match="cuda_graphs=True: the draft model's step is not captured in a graph"):
        SpeculativeGenerator(family.target, family.draft, cuda_graphs=TracedGraphs())
    # retrieval has no model step: nothing to capture, nothing refused; the target's pass is captured
    gen = SpeculativeGenerator(family.target, PromptLookup(), cuda_graphs=TracedGraphs())
    for prompt, max_new, ref in list(zip(family.prompts, family.max_new, family.references))[:4]:
        assert torch.equal(gen.generate(prompt, max_new_tokens=max_new).sequences, ref)
    assert gen._verify_graphs._calls
    # a target outside the decoders whose pass is captured: one line naming it, or (the default) eager
    gpt2, _ = build_tiny_target("gpt2", seed=3)
    with pytest.raises(CaptureError, match=r"cuda_graphs=True: the target's verification pass \(GPT2LMHeadModel, "
                                           r"model_type 'gpt2'\) is captured for llama, qwen2, qwen3, mistral "
                                           r"decoders only; pass cuda_graphs=None"):
        SpeculativeGenerator(gpt2, PromptLookup(), cuda_graphs=TracedGraphs())


def test_auto_prices_a_captured_pass_at_its_padded_width(family, eagle):
    """tree="auto" with captured passes: a cut of k nodes costs the power of two it is padded to (5 nodes cost 8),
    and the output is generate's."""
    from tests.inference.spec_utils import made_up_curve

    gen = SpeculativeGenerator(family.target, [eagle[3], PromptLookup()], tree="auto", cost_curve=made_up_curve(0.05),
                               cuda_graphs=TracedGraphs())
    for prompt, max_new, ref in list(zip(family.prompts, family.max_new, family.references))[:6]:
        assert torch.equal(gen.generate(prompt, max_new_tokens=max_new).sequences, ref)
    auto = gen._controller
    assert auto.graphed and [auto.width(n) for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 16]
    eager = SpeculativeGenerator(family.target, eagle[3], tree="auto", cost_curve=made_up_curve(0.05), pad_to=1)
    eager.generate(family.prompts[0], max_new_tokens=4)
    assert not eager._controller.graphed and eager._controller.width(5) == 5


def test_requests_in_and_out_of_inference_mode(family, eagle):
    """The captured steps' buffers persist across requests: one made under ``torch.inference_mode`` cannot be written
    outside it (nor the reverse), so such a request starts new ones."""
    gen = SpeculativeGenerator(family.target, eagle[3], tree="tree-15", cuda_graphs=TracedGraphs())
    cases = list(zip(family.prompts, family.max_new, family.references))[:3]  # in, out, in again
    for i, (prompt, max_new, ref) in enumerate(cases):
        with torch.inference_mode(i % 2 == 0):
            assert torch.equal(gen.generate(prompt, max_new_tokens=max_new).sequences, ref)


def test_moved_weights_are_captured_again(family, eagle):
    """A captured step reads the weights at the addresses it saw: after the target's lm_head is replaced (a reload,
    a ``.to()``) the next request captures again and computes with the new weights."""
    target = family.target
    backend = TracedGraphs()
    gen = SpeculativeGenerator(target, eagle[3], tree="tree-15", cuda_graphs=backend)
    prompt, max_new = family.prompts[1], family.max_new[1]
    gen.generate(prompt, max_new_tokens=max_new)
    old = target.lm_head.weight
    g = torch.Generator().manual_seed(0)
    try:
        target.lm_head.weight = torch.nn.Parameter(old.detach() + torch.randn(old.shape, generator=g, dtype=old.dtype),
                                                   requires_grad=False)
        ref = reference_generate(target, prompt, max_new)
        assert not torch.equal(ref, family.references[1])  # the new weights change the output
        before = backend.captures
        assert torch.equal(gen.generate(prompt, max_new_tokens=max_new).sequences, ref)
        assert backend.captures > before
    finally:
        target.lm_head.weight = old


def test_auto_learns_nothing_from_a_round_that_captured(family, eagle, monkeypatch):
    """A capture (warm-up runs, the capture itself) inside a round would read as a slow pass and a slow draft:
    tree="auto" takes neither time from such a round."""
    from tests.inference.spec_utils import made_up_curve

    backend = TracedGraphs()
    gen = SpeculativeGenerator(family.target, eagle[3], tree="auto", cost_curve=made_up_curve(0.05),
                               cuda_graphs=backend)
    seen, captured = [], [False]
    capture = backend.capture
    monkeypatch.setattr(backend, "capture", lambda run: captured.__setitem__(0, True) or capture(run))
    gen.prepare()
    observe = gen._controller.observe

    def observed(draft, path, prefix_len, drafted, verify_seconds=0.0, width=None):
        seen.append((captured[0], verify_seconds))
        captured[0] = False
        return observe(draft, path, prefix_len, drafted, verify_seconds, width)

    monkeypatch.setattr(gen._controller, "observe", observed)
    for prompt, max_new, ref in list(zip(family.prompts, family.max_new, family.references))[:4]:
        assert torch.equal(gen.generate(prompt, max_new_tokens=max_new).sequences, ref)
    assert any(c for c, _ in seen) and all(s == 0.0 for c, s in seen if c)
    assert any(s > 0 for c, s in seen if not c)


def test_features_kept_over_plain_rounds_outlive_the_next_replay(family, eagle, monkeypatch):
    """Under tree="auto" a plain round keeps its features for the drafter's next round, past the next verification
    pass; a captured pass's feature rows live in its buffer, written again by every replay of its width, so what the
    pass hands over (``VerifyGraphs.verify``) is a copy, which a chain's path keeps as a slice. auto's choices scripted: every round drafts and is cut to its root (verified at width 1), and
    every other round is a plain step (width 1 again) before the drafter reads those features: the drafts under
    graphs equal the eager run's round for round (a view of the buffer would hand the drafter the next pass's rows)."""
    from headway.inference.auto import AutoTree
    from headway.inference.proposer import ROOT_ONLY, Draft

    rounds = {"n": 0}

    def alternate(self, gated=False):
        rounds["n"] += 1
        return rounds["n"] % 2 == 0

    monkeypatch.setattr(AutoTree, "should_draft", alternate)
    monkeypatch.setattr(AutoTree, "probe_first", lambda self, proposer, ctx: (True, False))
    monkeypatch.setattr(AutoTree, "select", lambda self, draft, *args, **kwargs: Draft(ROOT_ONLY, draft.tokens[:1]))
    runs = {}
    for label, flag in (("eager", False), ("graphs", TracedGraphs())):
        gen = SpeculativeGenerator(family.target, eagle[3], tree="auto", cuda_graphs=flag)
        runs[label] = recorded(gen)[0]
        for prompt, max_new in zip(family.prompts[:3], family.max_new[:3]):
            rounds["n"] = 0
            out = gen.generate(prompt, max_new_tokens=max_new)
            assert torch.equal(out.sequences, reference_generate(family.target, prompt, max_new))
    assert len(runs["eager"]) == len(runs["graphs"]) > 5
    for r, (a, b) in enumerate(zip(runs["eager"], runs["graphs"])):
        assert a[:2] == b[:2], f"round {r} drafted another tree under graphs"
