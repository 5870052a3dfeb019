"""EAGLE drafters in the runtime: greedy output equals target.generate token for token (20 prompts) for EAGLE-1 and
EAGLE-3 over static and EAGLE-2 dynamic trees on two model families (with non-trivial acceptance),
the drafter's cache stays the context, and bad trees are refused (the dynamic trees' expansion itself:
test_expand.py)."""

import pytest
import torch

from headway.inference import DynamicTree, EagleProposer, SpeculativeGenerator, as_proposer

CASES = {  # name: (version, tree, floor on tau over the first 20 prompts)
    "eagle1-chain": (1, "chain-4", 1.2),
    "eagle1-dynamic": (1, {"depth": 4, "top_k": 3, "total_tokens": 10}, 1.35),
    "eagle3-chain": (3, "chain-4", 1.3),
    "eagle3-tree": (3, "tree-15", 1.5),
    "eagle3-dynamic": (3, None, 1.5),  # the default: EAGLE-2 dynamic settings for this device
}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_equals_generate(family, eagle, name):
    version, tree, floor = CASES[name]  # floors: tau over the 20 prompts
    gen = SpeculativeGenerator(family.target, eagle[version], tree=tree)
    new = passes = 0
    for i, (prompt, max_new, ref) in enumerate(list(zip(family.prompts, family.max_new, family.references))[:20]):
        out = gen.generate(prompt, max_new_tokens=max_new)
        assert torch.equal(out.sequences, ref), f"{family.name}/{name}: prompt {i} differs from generate"
        assert out.stats.new_tokens == ref.shape[1] - prompt.shape[1] == sum(out.stats.accepted_per_step)
        new, passes = new + out.stats.new_tokens, passes + out.stats.target_forward_passes
    tau = new / passes
    assert tau > floor, f"{family.name}/{name}: tau {tau:.2f} (floor {floor})"


def test_greedy_eager_attention_and_eos(family, eagle):
    family.target.set_attn_implementation("eager")
    try:
        gen = SpeculativeGenerator(family.target, eagle[3], tree={"depth": 4, "top_k": 3, "total_tokens": 8})
        for prompt, max_new, ref in list(zip(family.prompts, family.max_new, family.references))[:10]:
            assert torch.equal(gen.generate(prompt, max_new_tokens=max_new).sequences, ref)
    finally:
        family.target.set_attn_implementation("sdpa")
    prompt, ref = family.prompts[3], family.references[3]
    eos = int(ref[0, prompt.shape[1] + 4])
    first = (ref[0, prompt.shape[1]:] == eos).nonzero()[0, 0]
    out = SpeculativeGenerator(family.target, eagle[1]).generate(prompt, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(out.sequences[0], ref[0, :prompt.shape[1] + first + 1])


def test_draft_cache_holds_the_context_only(family, eagle):
    drafter = as_proposer(eagle[3])
    assert isinstance(drafter, EagleProposer) and drafter.feature_layers == eagle[3].config.feature_layers
    gen = SpeculativeGenerator(family.target, drafter, tree="tree-15")
    out = gen.generate(family.prompts[0], max_new_tokens=20)
    # after the last round the cache holds one entry per context position that had a feature
    assert len(drafter._cache) == drafter._seen == out.sequences.shape[1] - 1 - out.stats.accepted_per_step[-1]


def test_bad_trees(family, eagle):
    with pytest.raises(ValueError, match="unknown dynamic tree setting"):
        SpeculativeGenerator(family.target, eagle[3], tree={"depth": 4, "width": 3})
    with pytest.raises(ValueError, match="must be >= 1"):
        SpeculativeGenerator(family.target, eagle[3], tree={"depth": 0})
    with pytest.raises(ValueError, match="prune: expected true/false"):
        SpeculativeGenerator(family.target, eagle[3], tree={"depth": 3, "prune": "sometimes"})
    assert not DynamicTree.from_spec({"prune": "false"}).prune and DynamicTree.from_spec({"prune": "yes"}).prune
    with pytest.raises(ValueError, match="offers only top-150"):
        SpeculativeGenerator(family.target, eagle[3], tree=[[0], [200]])
    with pytest.raises(ValueError, match="grow their own tree"):
        SpeculativeGenerator(family.target, family.heads, tree={"depth": 3})  # Medusa: static trees only
