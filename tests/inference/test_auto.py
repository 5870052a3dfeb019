"""tree="auto": each round verifies the part of the draft that pays under the cost curve, down to a
plain step; the output stays exactly the target's (greedy and sampled), for every drafter kind."""

import json
import warnings

import pytest
import torch

from headway.inference import (DraftModelProposer, MedusaProposer, PromptLookup, SpeculativeGenerator,
                               SuffixDecoding)
from headway.inference import cost_curve as cc
from headway.inference.auto import AutoTree, prune
from headway.inference.proposer import Draft, Proposer, as_proposer
from headway.inference.tree import Tree
from eagle_utils import train_eagle
from spec_utils import (PROMPT, SETTINGS, VerifyRecorder, WiringCase, check_wiring, chi2_pvalue, context_logits,
                        exact_joint, lm_q_ref, noisy_copy, reference_generate, tiny_vocab_model, train_medusa)

LONG_PROMPT = PROMPT + [3, 7, 2, 5, 3, 7, 6, 4, 2]


def curve(step: float, t1: float = 1.0) -> cc.CostCurve:
    """A made-up cost curve: a pass over k tokens costs 1 + step * (k - 1) one-token steps of ``t1``
    seconds (the default makes drafting free next to a step; 1e-3 makes it cost several steps)."""
    ks = [1, 2, 4, 8, 16, 32, 64]
    rel = [1 + step * (k - 1) for k in ks]
    return cc.CostCurve(ks, [0], [t1], [rel], [rel], {})


@pytest.fixture(autouse=True)
def made_up_costs_stand(monkeypatch, request):
    """The made-up curves stand as given: the online correction (tested on its own) is off."""
    if "online" not in request.node.name:
        monkeypatch.setattr(cc.OnlineCost, "observe", lambda *args, **kwargs: None)


@pytest.fixture(scope="module")
def models():
    target = tiny_vocab_model(0)
    return {"target": target, "draft": tiny_vocab_model(1), "good": noisy_copy(target, 0.2, seed=3),
            "heads": train_medusa(target, num_heads=2, steps=200, seed=2, low=0).double(),
            "eagle3": train_eagle(target, 3, seed=2, steps=60, low=0, draft_vocab=6)}


def drafters(m):
    return {"medusa": m["heads"], "draft-model": DraftModelProposer(m["good"], gamma=4), "eagle3": m["eagle3"],
            "lookup": PromptLookup(max_matches=2), "suffix": SuffixDecoding(),
            "hybrid": [m["heads"], PromptLookup()]}


@pytest.mark.parametrize("kind", ["medusa", "draft-model", "eagle3", "lookup", "suffix", "hybrid"])
def test_auto_greedy_equals_generate_for_every_drafter_kind(models, kind):
    target = models["target"]
    gen = SpeculativeGenerator(target, drafters(models)[kind], tree="auto", cost_curve=curve(0.1))
    for i, prompt in enumerate([LONG_PROMPT, PROMPT[:4], [3, 3, 3, 3, 3, 3]]):
        ids = torch.tensor([prompt])
        out = gen.generate(ids, max_new_tokens=20)
        assert torch.equal(out.sequences, reference_generate(target, ids, 20, eos_token_id=None)), (kind, i)
        assert out.stats.plain_steps <= out.stats.target_forward_passes


class Counting(Proposer):
    """A drafter wrapper counting its propose calls."""

    def __init__(self, inner):
        self.inner, self.calls = as_proposer(inner), 0

    def bind(self, target_model):
        self.inner.bind(target_model)
        self.feature_layers = self.inner.feature_layers

    def resolve_tree(self, spec):
        return self.inner.resolve_tree(spec)

    def reset(self):
        self.inner.reset()

    def propose(self, ctx):
        self.calls += 1
        return self.inner.propose(ctx)


def test_a_drafter_that_never_pays_steps_aside(models):
    """A draft model that disagrees with the target, on a costly curve: rounds become plain steps and
    the drafter is called on a fraction of them, backing off; a good one keeps drafting."""
    target = models["target"]
    bad = Counting(DraftModelProposer(models["draft"], gamma=4))
    gen = SpeculativeGenerator(target, bad, tree="auto", cost_curve=curve(0.6, t1=1e-3))
    ids = torch.tensor([PROMPT[:4]])
    out = gen.generate(ids, max_new_tokens=60)
    assert torch.equal(out.sequences, reference_generate(target, ids, 60, eos_token_id=None))
    assert out.stats.plain_steps >= 0.6 * out.stats.target_forward_passes, out.stats.verify_width_per_step
    assert bad.calls < 0.6 * out.stats.target_forward_passes, (bad.calls, out.stats.target_forward_passes)
    good = SpeculativeGenerator(target, DraftModelProposer(target, gamma=4), tree="auto", cost_curve=curve(0.05))
    out = good.generate(ids, max_new_tokens=40)  # the target as its own draft: every token accepted
    # (the last round has one token left to make: the root alone)
    assert out.stats.plain_steps <= 1 and out.stats.mean_accepted_length >= 4.0, out.stats.accepted_per_step


def test_selection_follows_the_scores_and_the_curve():
    draft = Draft(Tree([-1, 0, 1, 0, 3]), torch.tensor([9, 1, 2, 3, 4]), scores=[1.0, 0.9, 0.8, 0.3, 0.2])
    auto = AutoTree(curve(0.0))  # verification costs the same at any width: keep everything
    assert auto.select(draft, 10).tree.size == 5
    auto = AutoTree(curve(0.5))  # each node costs half a step: keep the ones worth more than that
    kept = auto.select(draft, 10)
    assert kept.tokens.tolist() == [9, 1, 2] and kept.scores == [1.0, 0.9, 0.8]
    auto = AutoTree(curve(5.0))  # prohibitive: a plain step
    assert auto.select(draft, 10).tree.size == 1
    # sampled children stay a prefix of their draw order, and their q rows follow them
    q = torch.eye(10, dtype=torch.float64)[:5]
    sampled = Draft(Tree([-1, 0, 0, 1]), torch.tensor([9, 1, 2, 3]), q=q, scores=[1.0, 0.1, 0.9, 0.05])
    kept = AutoTree(curve(0.3)).select(sampled, 10)
    assert kept.tokens.tolist()[:2] == [9, 1]  # child 2 (0.9) only after child 1 was kept
    assert torch.equal(kept.q, q[[0, *range(1, kept.tree.size)]][:kept.tree.size])
    pruned = prune(Draft(Tree([-1, 0, 0]), torch.tensor([5, 6, 7]), q={0: q[0]}), [0, 2])
    assert pruned.tree.parents == [-1, 0] and pruned.tokens.tolist() == [5, 7] and set(pruned.q) == {0}


def test_auto_sampling_is_exact(models, monkeypatch):
    """Node by node (the wiring check) and in distribution, with pruned sampled trees (a draft model's q)."""
    target = models["target"]
    case = WiringCase(DraftModelProposer(models["draft"]), "auto", q_ref=lm_q_ref(models["draft"]), fixed_shape=False)
    recorder = VerifyRecorder(monkeypatch)
    gen = SpeculativeGenerator(target, case.drafter, tree="auto", cost_curve=curve(0.15))
    g = torch.Generator().manual_seed(0)
    widths = []
    for _ in range(3):
        out = gen.generate(torch.tensor([LONG_PROMPT]), max_new_tokens=12, temperature=1.0, generator=g)
        check_wiring(target, case, None, LONG_PROMPT, SETTINGS["T1"], 12, recorder.take(), out)
        widths += out.stats.verify_width_per_step
    assert len(set(widths)) > 1, widths  # the controller varied the width
    monkeypatch.undo()
    joint = exact_joint(context_logits(target, PROMPT), SETTINGS["T0.7-p0.9"])
    for drafter in (DraftModelProposer(models["draft"]), [models["heads"], PromptLookup()]):
        gen = SpeculativeGenerator(target, drafter, tree="auto", cost_curve=curve(0.15))
        g = torch.Generator().manual_seed(1)
        params = SETTINGS["T0.7-p0.9"]
        samples = torch.stack([gen.generate(torch.tensor([PROMPT]), max_new_tokens=3, temperature=params.temperature,
                                            top_p=params.top_p, generator=g).sequences[0, -3:] for _ in range(1000)])
        assert chi2_pvalue(samples, joint) > 1e-3


def test_the_cost_curve_is_measured_once_and_never_taken_from_another_setup(models, tmp_path, monkeypatch):
    target = models["target"]
    path = tmp_path / "curve.json"
    measured = cc.load_cost_curve(target, path=path)
    assert path.is_file() and measured.ks[0] == 1 and measured.rel(1, 50) == pytest.approx(1.0)
    assert all(len(row) == len(measured.ks) for row in measured.chain + measured.tree)
    monkeypatch.setattr(cc, "measure", lambda t: (_ for _ in ()).throw(AssertionError("measured again")))
    assert cc.load_cost_curve(target, path=path) == measured  # from the file
    data = json.loads(path.read_text())
    data["fingerprint"]["dtype"] = "torch.bfloat16"
    path.write_text(json.dumps(data))
    with pytest.raises(AssertionError, match="measured again"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cc.load_cost_curve(target, path=path)
    assert any("measured for another setup (dtype" in str(w.message) for w in seen)
    with pytest.raises(AssertionError, match="measured again"):
        cc.load_cost_curve(target, path=path.with_name("other.json"), refresh=True)
    assert MedusaProposer  # exported


def test_prepare_loads_the_curve_before_the_first_call(models, monkeypatch):
    calls = []
    monkeypatch.setattr(cc, "load_cost_curve", lambda target, refresh=False: calls.append(refresh) or curve(0.1))
    gen = SpeculativeGenerator(models["target"], PromptLookup(), tree="auto").prepare()
    assert calls == [False]
    gen.generate(torch.tensor([PROMPT]), max_new_tokens=4)
    assert calls == [False]  # loaded once
    assert SpeculativeGenerator(models["target"], PromptLookup(), tree=None).prepare()._controller is None
    assert SpeculativeGenerator(models["target"], PromptLookup()).auto  # tree="auto" is the default


def test_online_correction_replaces_a_wrong_curve_with_the_timed_passes():
    """The curve claims every width costs one step; generation times one-token passes at 0.5 s and
    four-token passes at 1 s: within a few rounds t(4)/t(1) reads about 2, and a draft worth 1.6
    tokens is no longer verified."""
    online = cc.OnlineCost(curve(0.0))
    assert online.rel(4, 10) == pytest.approx(1.0)
    for _ in range(20):
        online.observe(1, 10, True, 0.5)
        online.observe(4, 10, False, 1.0)
    assert online.rel(4, 10) == pytest.approx(2.0, rel=0.1) and online.plain_passes() > 4
    auto = AutoTree(curve(0.0))
    auto.cost = online
    draft = Draft(Tree([-1, 0, 0, 1]), torch.tensor([9, 1, 2, 3]), scores=[1.0, 0.4, 0.1, 0.1])
    assert auto.select(draft, 10).tree.size == 1  # 1.6 tokens for 2 steps: a plain step


def test_the_curve_times_a_one_token_step_as_t1(models, monkeypatch):
    """t(k) is a pass over k tokens, t(1) one token (not a one-token chain below the root: two)."""
    import time

    def fake_forward(target, cache, tree, tokens, prefix_len, **kwargs):
        assert tokens.shape[0] == tree.size
        time.sleep(0.003 * tree.size)  # a pass costing its width

    monkeypatch.setattr(cc, "tree_forward", fake_forward)
    measured = cc.measure(models["target"], ks=(1, 2, 4), prefixes=(8,), reps=3)
    assert measured.rel(2, 8, True) == pytest.approx(2.0, rel=0.25)
    assert measured.rel(4, 8, True) == pytest.approx(4.0, rel=0.25) and measured.rel(4, 8) == pytest.approx(4.0, rel=0.25)


class FeatureReader(Proposer):
    """A model drafter reading the target's last layer that never finds anything, checking that it is
    shown every position's features exactly once, in order, whether or not it drafted each round."""

    def __init__(self, layer: int):
        self.feature_layers, self.calls, self.seen = [layer], 0, 0

    def reset(self):
        self.seen = 0

    def propose(self, ctx):
        self.calls += 1
        self.seen += ctx.features.shape[0]
        assert self.seen == ctx.tokens.shape[0] - 1, (self.seen, ctx.tokens.shape[0])
        return Draft(Tree([-1]), ctx.tokens[-1:].clone(), scores=[1.0])


def test_a_hybrid_model_part_that_adds_nothing_to_retrieval_sits_out_and_keeps_its_features(models):
    target = models["target"]
    reader = FeatureReader(target.config.num_hidden_layers)
    gen = SpeculativeGenerator(target, [reader, PromptLookup()], tree="auto", cost_curve=curve(0.05))
    ids = torch.tensor([PROMPT[:4] * 6])  # copy-heavy: retrieval finds the continuation
    for _ in range(2):
        out = gen.generate(ids, max_new_tokens=60)
        assert torch.equal(out.sequences, reference_generate(target, ids, 60, eos_token_id=None))
    rounds = 2 * out.stats.target_forward_passes
    assert reader.calls < 0.6 * rounds, (reader.calls, rounds)
