"""SpeculativeGenerator.generate: its contract (exact stopping, stats, seeds, lossy flag and clear errors on
bad input), and greedy speculative output equal to target.generate(do_sample=False) token for token, for
every drafter, tree and model family, with non-trivial acceptance. (Sampling: test_generator_sampling.py.)"""

import warnings

import pytest
import torch

from headway.heads.target.tiny import build_tiny_target
from headway.inference import DraftModelProposer, PromptLookup, SpeculativeGenerator
from headway.inference.generator import GenerationStats
from tests.inference.spec_utils import noisy_copy, reference_generate


@pytest.fixture(scope="module")
def target():
    return build_tiny_target("llama", seed=0)[0]


@pytest.fixture(scope="module")
def self_draft():
    return build_tiny_target("llama", seed=0)[0]  # identical to the target: every draft is accepted


def test_stops_exactly_and_reports_stats(target, self_draft):
    gen = SpeculativeGenerator(target, self_draft, tree="chain-4")
    ids = torch.tensor([[5, 6, 7, 8]])
    for n in [1, 2, 3, 5, 6, 11, 23]:
        out = gen.generate(ids, max_new_tokens=n)
        s = out.stats
        assert out.sequences.shape == (1, 4 + n) and s.new_tokens == n
        assert s.accepted_per_step[:-1] == [5] * (len(s.accepted_per_step) - 1)  # a perfect drafter: gamma + 1 per pass
        assert s.target_forward_passes == -(-n // 5) and s.mean_accepted_length == n / s.target_forward_passes
        assert all(r == 1.0 for r in s.depth_acceptance)
        assert min(s.time_draft, s.time_verify, s.time_bookkeeping, s.time_prefill) >= 0 and not s.lossy
        assert set(s.as_dict()) >= {"new_tokens", "mean_accepted_length", "depth_acceptance", "time_total"}
    # 1-D input and a one-token prompt work too
    assert gen.generate(torch.tensor([5]), max_new_tokens=3).sequences.shape == (1, 4)


def test_sampling_seeded_by_generator(target):
    """A seed reproduces sampled output under a fixed tree (under tree="auto" the verified shapes follow measured
    timings, README: a loaded machine may draw otherwise, as a .ci/run once did)."""
    gen = SpeculativeGenerator(target, PromptLookup(max_matches=2), tree=None)
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    run = lambda seed: gen.generate(ids, max_new_tokens=20, temperature=1.0, top_p=0.9,
                                    generator=torch.Generator().manual_seed(seed)).sequences
    assert torch.equal(run(0), run(0)) and not torch.equal(run(0), run(1))
    torch.manual_seed(3)
    a = gen.generate(ids, max_new_tokens=20, temperature=1.0).sequences
    torch.manual_seed(3)
    assert torch.equal(a, gen.generate(ids, max_new_tokens=20, temperature=1.0).sequences)


def test_typical_acceptance_is_flagged_lossy(target, self_draft):
    gen = SpeculativeGenerator(target, self_draft, tree="tree-7", acceptance="typical")
    out = gen.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=10, temperature=0.7,
                       generator=torch.Generator().manual_seed(0))
    assert out.stats.lossy and out.stats.acceptance == "typical" and out.sequences.shape == (1, 13)
    greedy = gen.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=10)
    assert not greedy.stats.lossy  # temperature 0 is plain greedy verification


def test_context_is_respected(target):
    gen = SpeculativeGenerator(target, PromptLookup())
    long = torch.full((1, 1024), 5)
    with pytest.raises(ValueError, match="context is 1024"):
        gen.generate(long, max_new_tokens=1)
    with pytest.warns(UserWarning, match="exceeds the model's context"):
        out = gen.generate(long[:, :1020], max_new_tokens=10)
    assert out.sequences.shape[1] == 1024


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
])
def test_bad_generation_arguments(target, kwargs, match):
    gen = SpeculativeGenerator(target, PromptLookup())
    with pytest.raises(ValueError, match=match):
        gen.generate(torch.tensor([[5, 6]]), **{"max_new_tokens": 4, **kwargs})


def test_bad_inputs_and_settings(target, tmp_path):
    gen = SpeculativeGenerator(target, PromptLookup())
    assert gen.generate(torch.tensor([[5, 6], [7, 8]]), max_new_tokens=2).sequences.shape == (2, 4)  # a batch (test_batch)
    with pytest.raises(ValueError, match="non-empty"):
        gen.generate(torch.tensor([[]], dtype=torch.long))
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        gen.generate(torch.tensor([[5, 10_000]]))
    with pytest.raises(ValueError, match="acceptance"):
        SpeculativeGenerator(target, PromptLookup(), acceptance="fast")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- [0]\n- [1, 1]\n")
    with pytest.raises(ValueError, match="prefix \\[1\\] is missing"):
        SpeculativeGenerator(target, PromptLookup(), tree=bad)


def test_no_future_warning_from_the_cache_keyword(target, self_draft):
    gen = SpeculativeGenerator(target, self_draft, tree="tree-7")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, temperature=1.0)


DRAFTERS = {  # name: (build drafter from the family fixture, tree, floor on tau over all prompts)
    "medusa-tree": (lambda f: f.heads, None, 1.3),
    "medusa-chain": (lambda f: f.heads, "chain-3", 1.12),
    "draft-chain": (lambda f: DraftModelProposer(f.draft, gamma=4), None, 1.5),
    "draft-tree": (lambda f: DraftModelProposer(f.draft), "tree-7", 1.7),
    "lookup-chain": (lambda f: PromptLookup(), None, 1.15),
    "lookup-tree": (lambda f: PromptLookup(max_matches=4), None, 1.2),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_equals_generate(family, name):
    make, tree, floor = DRAFTERS[name]
    gen = SpeculativeGenerator(family.target, make(family), tree=tree)
    new = passes = multi = 0
    for i, (prompt, max_new, ref) in enumerate(zip(family.prompts, family.max_new, family.references)):
        out = gen.generate(prompt, max_new_tokens=max_new)
        assert torch.equal(out.sequences, ref), f"{family.name}/{name}: prompt {i} differs from generate"
        s = out.stats
        assert s.new_tokens == ref.shape[1] - prompt.shape[1] == sum(s.accepted_per_step)
        assert s.target_forward_passes == len(s.accepted_per_step)
        new, passes = new + s.new_tokens, passes + s.target_forward_passes
        multi += sum(a > 1 for a in s.accepted_per_step)
    tau = new / passes
    assert tau > floor and multi > 20, f"{family.name}/{name}: tau {tau:.2f} (floor {floor}), {multi} multi-token"


def test_greedy_eos_stops_like_generate(family):
    gen = SpeculativeGenerator(family.target, family.heads)
    checked = 0
    for prompt, ref in zip(family.prompts[:25], family.references[:25]):
        new = ref[0, prompt.shape[1]:]
        if new.shape[0] < 6:
            continue
        eos = int(new[new.shape[0] // 2])  # a token that does occur: generation must stop at its first occurrence
        expected = reference_generate(family.target, prompt, 40, eos_token_id=eos)
        out = gen.generate(prompt, max_new_tokens=40, eos_token_id=eos)
        assert torch.equal(out.sequences, expected)
        assert out.sequences[0, -1] == eos and out.stats.new_tokens == expected.shape[1] - prompt.shape[1]
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("name", ["medusa-tree", "draft-tree", "lookup-tree"])
def test_greedy_eager_attention(family, name):
    make, tree, _ = DRAFTERS[name]
    family.target.set_attn_implementation("eager")
    try:
        gen = SpeculativeGenerator(family.target, make(family), tree=tree)
        for prompt, max_new, ref in list(zip(family.prompts, family.max_new, family.references))[:12]:
            assert torch.equal(gen.generate(prompt, max_new_tokens=max_new).sequences, ref)
    finally:
        family.target.set_attn_implementation("sdpa")


@pytest.mark.parametrize("family_name", ["llama", "gpt2"])
def test_greedy_fp32_and_gpt2(family_name):
    """The dtype the default runs in (fp32), and a third family with absolute positions (GPT-2)."""
    target, _ = build_tiny_target(family_name, seed=7)
    draft = noisy_copy(target, seed=7)
    g = torch.Generator().manual_seed(7)
    for drafter, tree in [(DraftModelProposer(draft), "tree-7"), (PromptLookup(max_matches=3), None)]:
        gen = SpeculativeGenerator(target, drafter, tree=tree)
        for _ in range(8):
            length = int(torch.randint(2, 12, (), generator=g))
            prompt = torch.randint(4, target.config.vocab_size, (1, length), generator=g)
            with torch.no_grad():
                ref = reference_generate(target, prompt, 24)
            assert torch.equal(gen.generate(prompt, max_new_tokens=24).sequences, ref)


def test_stats_summarise_the_rounds():
    """tau, acceptance per depth and the total time, from the per-round lists."""
    s = GenerationStats(new_tokens=9, target_forward_passes=4, accepted_per_step=[3, 1, 4, 1],
                        draft_depth_per_step=[3, 2, 3, 0], time_prefill=0.5, time_draft=0.25, time_verify=1.0,
                        time_bookkeeping=0.25)
    assert s.mean_accepted_length == 9 / 4 and s.time_total == 2.0
    # depth 1: rounds 0-2 reach it, 0 and 2 accept >= 1 draft token; depth 2: the same; depth 3: rounds 0 and 2
    # reach it, round 2 accepts 3
    assert s.depth_acceptance == [2 / 3, 2 / 3, 1 / 2]
    d = s.as_dict()
    assert d["mean_accepted_length"] == 9 / 4 and d["depth_acceptance"] == [2 / 3, 2 / 3, 1 / 2]
    assert d["time_total"] == 2.0 and d["accepted_per_step"] == [3, 1, 4, 1] and d["lossy"] is False
    empty = GenerationStats()
    assert empty.mean_accepted_length == 0.0 and empty.depth_acceptance == [] and empty.time_total == 0.0


@pytest.mark.parametrize("tree, folded", [("chain-4", 1), ("tree-15", 0)])
def test_the_prompt_runs_in_the_first_pass_when_the_first_tree_is_a_chain(target, self_draft, tree, folded):
    """A chain (plain causal attention) is verified in the prompt's own pass, which saves one target pass;
    a tree would need a 4D mask over the whole prompt, so the prompt runs on its own first. Both give
    the target's tokens, and a perfect drafter's first pass accepts its whole first tree either way."""
    gen = SpeculativeGenerator(target, DraftModelProposer(self_draft), tree=tree)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    out = gen.generate(ids, max_new_tokens=12)
    assert torch.equal(out.sequences, reference_generate(target, ids, 12))
    assert out.stats.prefill_passes == folded and out.stats.accepted_per_step[0] == 1 + gen.tree.depth
