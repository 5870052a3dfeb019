"""Greedy speculative output equals target.generate(do_sample=False) token for token, for every
drafter, tree and model family, with non-trivial acceptance."""

import pytest
import torch

from headway.heads.target.tiny import build_tiny_target
from headway.inference import DraftModelProposer, PromptLookup, SpeculativeGenerator
from spec_utils import noisy_copy, reference_generate

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
