"""End to end: the first 3 tokens of SpeculativeGenerator.generate(temperature > 0) follow the
target's exact distribution (enumerated on an 8-token model) for every drafter, chain and tree.

Each sample is a full generate call (~6 ms here), so the default run uses 1,000 samples on six
cases (a broken acceptance rule is rejected at p < 1e-8 with that many, see
test_broken_rule_fails_end_to_end); the slow-marked run (`make test` runs it) repeats all twelve
cases (every drafter, chain and tree, both settings) with 20,000 samples each, and the acceptance
rules themselves are checked with 20,000 samples in test_verify.py."""

import pytest
import torch

import headway.inference.verify as verify_mod
from headway.inference import DraftModelDrafter, PromptLookup, SpeculativeGenerator
from spec_utils import PROMPT, SETTINGS, chi2_pvalue, context_logits, exact_joint, tiny_vocab_model, train_medusa

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]


@pytest.fixture(scope="module")
def setup():
    target, draft = tiny_vocab_model(0), tiny_vocab_model(1)
    heads = train_medusa(target, num_heads=2, steps=200, seed=2, low=0).double()  # right often, not always
    joints = {name: exact_joint(context_logits(target, PROMPT), params) for name, params in SETTINGS.items()}
    drafters = {
        "medusa-chain": (heads, "chain-2"), "medusa-tree": (heads, TREE),
        "draft-chain": (DraftModelDrafter(draft), "chain-2"), "draft-tree": (DraftModelDrafter(draft), TREE),
        "lookup-chain": (PromptLookup(), None), "lookup-tree": (PromptLookup(max_matches=3, max_ngram_size=2), None),
    }
    return target, drafters, joints


def sample_first3(target, drafter, tree, params, n, seed):
    gen = SpeculativeGenerator(target, drafter, tree=tree)
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([PROMPT])
    out = [gen.generate(ids, max_new_tokens=3, temperature=params.temperature, top_k=params.top_k,
                        top_p=params.top_p, generator=g).sequences[0, -3:] for _ in range(n)]
    return torch.stack(out)


DEFAULT_CASES = [("medusa-chain", "T1"), ("medusa-tree", "T0.7-p0.9"), ("draft-chain", "T0.7-p0.9"),
                 ("draft-tree", "T1"), ("lookup-chain", "T1"), ("lookup-tree", "T0.7-p0.9")]
ALL_CASES = [(d, s) for d in ["medusa-chain", "medusa-tree", "draft-chain", "draft-tree", "lookup-chain", "lookup-tree"]
             for s in SETTINGS]


@pytest.mark.parametrize("drafter, setting", DEFAULT_CASES)
def test_sampling_matches_target_end_to_end(setup, drafter, setting):
    target, drafters, joints = setup
    samples = sample_first3(target, *drafters[drafter], SETTINGS[setting], n=1000, seed=1)
    assert chi2_pvalue(samples, joints[setting]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("drafter, setting", ALL_CASES)
def test_sampling_matches_target_end_to_end_long(setup, drafter, setting):
    target, drafters, joints = setup
    samples = sample_first3(target, *drafters[drafter], SETTINGS[setting], n=20_000, seed=2)
    assert chi2_pvalue(samples, joints[setting]) > 1e-3


def test_broken_rule_fails_end_to_end(setup, monkeypatch):
    """The same end-to-end test rejects a generator whose residual is p instead of norm(max(0, p - q))."""
    target, drafters, joints = setup
    monkeypatch.setattr(verify_mod, "residual", lambda p, q: p)
    samples = sample_first3(target, *drafters["draft-chain"], SETTINGS["T1"], n=1000, seed=1)
    assert chi2_pvalue(samples, joints["T1"]) < 1e-6


def test_same_seed_same_output(setup):
    target, drafters, _ = setup
    a = sample_first3(target, *drafters["draft-tree"], SETTINGS["T1"], n=5, seed=3)
    b = sample_first3(target, *drafters["draft-tree"], SETTINGS["T1"], n=5, seed=3)
    assert torch.equal(a, b)
