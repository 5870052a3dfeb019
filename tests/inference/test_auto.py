"""tree="auto": each round verifies the part of the draft that pays under the cost curve, down to a
plain step; the output stays exactly the target's (greedy and sampled), for every drafter kind."""

import pytest
import torch

from headway.heads.layerskip import LayerSkipHead
from headway.inference import DraftModelProposer, PromptLookup, SpeculativeGenerator, SuffixDecoding
from headway.inference import cost_curve as cc
from headway.inference.auto import BINS, DECAY, PLAIN_EVERY, PRIOR_WEIGHT, AutoTree, prune
from headway.inference.proposer import Draft, Proposer, as_proposer
from headway.inference.tree import Tree
from tests.inference.eagle_utils import train_eagle
from tests.inference.spec_utils import (PROMPT, SETTINGS, VerifyRecorder, WiringCase, check_wiring, chi2_pvalue,
                                       context_logits, exact_joint, lm_q_ref, made_up_curve, noisy_copy,
                                       reference_generate, tiny_vocab_model, train_medusa)

LONG_PROMPT = PROMPT + [3, 7, 2, 5, 3, 7, 6, 4, 2]


@pytest.fixture(autouse=True)
def made_up_costs_stand(monkeypatch):
    """The made-up curves stand as given: the online correction (tested in test_cost_curve.py) is off."""
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
    gen = SpeculativeGenerator(target, drafters(models)[kind], tree="auto", cost_curve=made_up_curve(0.1))
    for i, prompt in enumerate([LONG_PROMPT, PROMPT[:4], [3, 3, 3, 3, 3, 3]]):
        ids = torch.tensor([prompt])
        out = gen.generate(ids, max_new_tokens=20)
        assert torch.equal(out.sequences, reference_generate(target, ids, 20, eos_token_id=None)), (kind, i)
        assert out.stats.plain_steps <= out.stats.target_forward_passes


@pytest.mark.parametrize("kind,tree", [("medusa", [[0], [1], [0, 0]]), ("draft-model", "tree-7"), ("draft-model", "chain-3"),
                                       ("eagle3", "tree-7"), ("eagle3", "chain-3"), ("layerskip", "chain-3")])
def test_a_fixed_tree_skips_the_scores_only_auto_reads(models, kind, tree, monkeypatch):
    """Draft.scores are tree="auto"'s to read (and a hybrid's under it): with a fixed tree a model drafter computes
    none (DraftContext.scored False: a softmax and a handful of gathers a level saved; LayerSkip's without its early
    stop, which reads each step's probability), under auto every drafted
    round carries them; the output is the target's either way."""
    target = models["target"]
    seen = []
    real = SpeculativeGenerator._accept
    monkeypatch.setattr(SpeculativeGenerator, "_accept",
                        lambda self, draft, *a, **k: seen.append(draft) or real(self, draft, *a, **k))
    for fixed in (tree, "auto"):
        seen.clear()
        curve = made_up_curve(0.01) if fixed == "auto" else None
        drafter = LayerSkipHead.from_target(target, exit_layer=1) if kind == "layerskip" else drafters(models)[kind]
        gen = SpeculativeGenerator(target, drafter, tree=fixed, cost_curve=curve)
        if kind == "layerskip":  # (a CPU's early stop reads each step's probability: CUDA's default has none)
            gen.drafter.early_stop = False
        ids = torch.tensor([LONG_PROMPT])
        out = gen.generate(ids, max_new_tokens=16)
        assert torch.equal(out.sequences, reference_generate(target, ids, 16, eos_token_id=None)), fixed
        drafted = [d for d in seen if d.tree.size > 1]
        assert drafted, fixed
        assert all((d.scores is None) == (fixed != "auto") for d in drafted), fixed


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
    gen = SpeculativeGenerator(target, bad, tree="auto", cost_curve=made_up_curve(0.6, t1=1e-3))
    ids = torch.tensor([PROMPT[:4]])
    out = gen.generate(ids, max_new_tokens=60)
    assert torch.equal(out.sequences, reference_generate(target, ids, 60, eos_token_id=None))
    assert out.stats.plain_steps >= 0.6 * out.stats.target_forward_passes, out.stats.verify_width_per_step
    assert bad.calls < 0.6 * out.stats.target_forward_passes, (bad.calls, out.stats.target_forward_passes)
    good = SpeculativeGenerator(target, DraftModelProposer(target, gamma=4), tree="auto",
                                cost_curve=made_up_curve(0.05))
    out = good.generate(ids, max_new_tokens=40)  # the target as its own draft: every token accepted
    # (the last round has one token left to make: the root alone)
    assert out.stats.plain_steps <= 1 and out.stats.mean_accepted_length >= 4.0, out.stats.accepted_per_step


def dip_curve(dip: float = 0.8, t1: float = 1e-3):
    """A prepacked CPU target's shape: passes of 2-3 tokens cost more than one, 4-8 ``dip`` of one, wider more."""
    from headway.inference.cost_curve import CostCurve

    ks = [1, 2, 3, 4, 6, 8, 16, 32]
    rel = [1.0, 1.15, 1.05, dip, dip, dip, 1.5, 2.5]
    return CostCurve(ks, [0], [t1], [rel], [rel], {})


def test_a_pass_runs_at_the_cheapest_width_at_least_as_wide():
    """One sequence (pad_cheapest): a pass runs padded to the cheapest width up to MAX_PAD where that saves more than
    1 - PAD_GAIN of it (a plain step too), and the choice prices it so; off (a batch's rows), the generator's padding
    alone; a step timed for t(1) runs unpadded."""
    from headway.inference.auto import MAX_PAD

    auto = AutoTree(dip_curve())
    assert [auto.width(n) for n in (1, 2, 5, 9)] == [1, 2, 5, 9]  # not asked: the generator's own padding
    auto.pad_cheapest = True
    assert [auto.width(n) for n in (1, 2, 3, 4, 8, 9)] == [4, 4, 4, 4, 8, 9] and MAX_PAD == 8
    assert auto.plain_rate(10) == pytest.approx(1 / 0.8)
    assert auto.pass_width(Tree([-1]), 10) == 4
    auto.timing = True
    assert auto.pass_width(Tree([-1]), 10) is None
    flat = AutoTree(made_up_curve(0.0))
    flat.pad_cheapest = True
    assert flat.width(1) == 1 and flat.plain_rate(10) == 1.0  # no gain: no padding
    # two nodes at 0.8 of a step beat a plain step at 0.8 too: a node worth 0.1 is kept (unpadded: 1.15, dropped)
    draft = Draft(Tree([-1, 0]), torch.tensor([9, 1]), scores=[1.0, 0.1])
    assert auto.select(draft, 10).tree.size == 2 and AutoTree(dip_curve()).select(draft, 10).tree.size == 1


def test_plain_steps_run_padded_where_that_is_cheaper_and_the_output_is_the_targets(models):
    """A drafter that never pays, on a curve where 4-8 tokens cost less than one: its plain steps run padded (the
    padding dropped from the cache), steps timed for t(1) unpadded, and the output is the target's greedy output."""
    target = models["target"]
    gen = SpeculativeGenerator(target, DraftModelProposer(models["draft"], gamma=4), tree="auto",
                               cost_curve=dip_curve(0.8))
    ids = torch.tensor([PROMPT[:4]])
    out = gen.generate(ids, max_new_tokens=60)
    assert torch.equal(out.sequences, reference_generate(target, ids, 60, eos_token_id=None))
    st = out.stats
    plain = [w for w, d in zip(st.verify_width_per_step[1:], st.draft_depth_per_step[1:]) if d == 0]  # root alone
    assert len(plain) >= 0.6 * st.target_forward_passes and set(plain) == {1, 4}, plain
    # every PLAIN_EVERY-th round a step timed for t(1) (while its correction rests on under PLAIN_PASSES: here always)
    assert 1 <= plain.count(1) <= st.target_forward_passes // PLAIN_EVERY, plain


def test_a_new_request_recalibrates_quickly():
    """A new request may be on text of another kind: each cell's evidence then weighs at most CELL_CAP tries (its
    share accepted kept, cells with fewer tries untouched), and a drafter that lost waits at most REQUEST_WAIT
    rounds after its next loss (then doubling again), trying at once."""
    from headway.inference.auto import CELL_CAP, MAX_BACKOFF, REQUEST_WAIT

    auto = AutoTree(made_up_curve(0.3))
    auto.cells = {(0, 1, 0): [3.0, 150.0], (0, 2, 1): [1.0, 2.0]}
    for _ in range(6):
        auto.drafter_backoff.lost()
    assert auto.drafter_backoff.wait == MAX_BACKOFF > REQUEST_WAIT and auto.drafter_backoff.skip > 0
    auto.reset()
    assert auto.cells == {(0, 1, 0): [pytest.approx(3.0 * CELL_CAP / 150.0), CELL_CAP], (0, 2, 1): [1.0, 2.0]}
    assert not auto.drafter_backoff.take()  # tried at once
    auto.drafter_backoff.lost()
    assert auto.drafter_backoff.skip == REQUEST_WAIT and auto.drafter_backoff.wait == 2 * REQUEST_WAIT


def test_selection_follows_the_scores_and_the_curve():
    draft = Draft(Tree([-1, 0, 1, 0, 3]), torch.tensor([9, 1, 2, 3, 4]), scores=[1.0, 0.9, 0.8, 0.3, 0.2])
    auto = AutoTree(made_up_curve(0.0))  # verification costs the same at any width: keep everything
    assert auto.select(draft, 10).tree.size == 5
    auto = AutoTree(made_up_curve(0.5))  # each node costs half a step: keep the ones worth more than that
    kept = auto.select(draft, 10)
    assert kept.tokens.tolist() == [9, 1, 2] and kept.scores == [1.0, 0.9, 0.8]
    auto = AutoTree(made_up_curve(5.0))  # prohibitive: a plain step
    assert auto.select(draft, 10).tree.size == 1
    # sampled children stay a prefix of their draw order, and their q rows follow them
    q = torch.eye(10, dtype=torch.float64)[:5]
    sampled = Draft(Tree([-1, 0, 0, 1]), torch.tensor([9, 1, 2, 3]), q=q, scores=[1.0, 0.1, 0.9, 0.05])
    kept = AutoTree(made_up_curve(0.3)).select(sampled, 10)
    # judged by the root's row (one-hot: sure) and ranks, not by the scores of what was drawn: the first
    # draw and its child, not the second draw (a later rank), which could only come after the first anyway
    assert kept.tokens.tolist() == [9, 1, 3] and kept.tree.parents == [-1, 0, 1]
    assert torch.equal(kept.q, q[[0, 1, 3]])
    pruned = prune(Draft(Tree([-1, 0, 0]), torch.tensor([5, 6, 7]), q={0: q[0]}), [0, 2])
    assert pruned.tree.parents == [-1, 0] and pruned.tokens.tolist() == [5, 7] and set(pruned.q) == {0}
    again = prune(Draft(Tree([-1, 0, 0]), torch.tensor([1, 2, 3]), q=None), [0, 2])  # the same cut, another round
    assert again.tree is pruned.tree and pruned.tree.ranks == [0, 1]  # one Tree a shape: its tensors built once


def test_a_cell_estimate_is_the_decayed_share_accepted_with_the_drafters_prior():
    """A cell's estimate is the decayed share of its nodes accepted, the drafter's own figure counted as
    PRIOR_WEIGHT tries."""
    auto = AutoTree(made_up_curve(0.3))
    draft = Draft(Tree([-1, 0]), torch.tensor([1, 2]), scores=[1.0, 0.5])
    for path in ([0, 1], [0], [0, 1]):
        auto.observe(draft, path, 10, drafted=True)
    acc = DECAY ** 2 + 1.0
    tried = DECAY ** 2 + DECAY + 1.0
    assert abs(auto.scores(draft)[1] - (acc + PRIOR_WEIGHT * 0.5) / (tried + PRIOR_WEIGHT)) < 1e-9


@pytest.mark.parametrize("parents", [[-1, 0, 1, 2, 3], [-1, 0, 0, 1, 2]], ids=["chain", "tree"])
def test_a_sampled_draft_is_cut_without_looking_at_its_draws(parents):
    """The verifier treats a sampled node as a draw from q; keeping it because of what was drawn (its own
    draft probability, or its descendants') would favour the drafter's likely tokens and bias the output
    (measured before: 20,000 draft-model samples, chi-square p = 6e-15). Drafts that share the root's row
    of q but drew other tokens, with other scores and other deeper rows, are cut to the same shape."""
    gen = torch.Generator().manual_seed(0)
    root_row = torch.softmax(torch.randn(8, dtype=torch.float64, generator=gen) * 2, 0)
    shapes = set()
    for trial in range(12):
        q = torch.softmax(torch.randn(len(parents), 8, dtype=torch.float64, generator=gen) * 3, -1)
        q[0] = root_row
        scores = [1.0]
        for node in range(1, len(parents)):
            scores.append(scores[parents[node]] * float(torch.rand((), generator=gen, dtype=torch.float64)))
        draft = Draft(Tree(parents), torch.randint(0, 8, (len(parents),), generator=gen), q=q, scores=scores)
        auto = AutoTree(made_up_curve(0.3))
        auto.cells = {(0, d, b): [3.0, 4.0] for d in range(1, 5) for b in range(5)}  # some history, the same each trial
        shapes.add(tuple(auto.select(draft, 10).tree.parents))
    assert len(shapes) == 1, shapes

def test_a_sampled_drafts_device_scores_are_never_read():
    """A sampled draft is judged by the root's row of q alone, so the scores a drafter left on the device are
    not read (a sync on a GPU for nothing): here they sit on the meta device, where any read fails."""
    q = {0: torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64), 1: torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)}
    draft = Draft(Tree([-1, 0, 1]), torch.tensor([2, 0, 1]), q=q, scores=torch.ones(3, device="meta"))
    auto = AutoTree(made_up_curve(0.3))
    kept = auto.select(draft, 10)
    assert kept.tree.size >= 1 and kept.scores.device.type == "meta"
    auto.observe(kept, list(range(kept.tree.size)), 10, drafted=True)


def test_auto_sampling_is_exact(models, monkeypatch):
    """Node by node (the wiring check) and in distribution, with pruned sampled trees (a draft model's q)."""
    target = models["target"]
    case = WiringCase(DraftModelProposer(models["draft"]), "auto", q_ref=lm_q_ref(models["draft"]), fixed_shape=False)
    recorder = VerifyRecorder(monkeypatch)
    gen = SpeculativeGenerator(target, case.drafter, tree="auto", cost_curve=made_up_curve(0.15))
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
        gen = SpeculativeGenerator(target, drafter, tree="auto", cost_curve=made_up_curve(0.15))
        g = torch.Generator().manual_seed(1)
        params = SETTINGS["T0.7-p0.9"]
        samples = torch.stack([gen.generate(torch.tensor([PROMPT]), max_new_tokens=3, temperature=params.temperature,
                                            top_p=params.top_p, generator=g).sequences[0, -3:] for _ in range(1000)])
        assert chi2_pvalue(samples, joint) > 1e-3


def test_prepare_loads_the_curve_before_the_first_call(models, monkeypatch):
    calls = []
    monkeypatch.setattr(cc, "load_cost_curve",
                        lambda target, refresh=False: calls.append(refresh) or made_up_curve(0.1))
    gen = SpeculativeGenerator(models["target"], PromptLookup(), tree="auto").prepare()
    assert calls == [False]
    gen.generate(torch.tensor([PROMPT]), max_new_tokens=4)
    assert calls == [False]  # loaded once
    assert SpeculativeGenerator(models["target"], PromptLookup(), tree=None).prepare()._controller is None
    assert SpeculativeGenerator(models["target"], PromptLookup()).auto  # tree="auto" is the default


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
    gen = SpeculativeGenerator(target, [reader, PromptLookup()], tree="auto", cost_curve=made_up_curve(0.05))
    ids = torch.tensor([PROMPT[:4] * 6])  # copy-heavy: retrieval finds the continuation
    for _ in range(2):
        out = gen.generate(ids, max_new_tokens=60)
        assert torch.equal(out.sequences, reference_generate(target, ids, 60, eos_token_id=None))
    rounds = 2 * out.stats.target_forward_passes
    assert reader.calls < 0.6 * rounds, (reader.calls, rounds)


def test_a_hybrid_whose_model_part_never_pays_still_retrieves_every_round(models):
    """The model part's backoff skips the model part only: retrieval (nearly free) drafts every round,
    as it would alone, also after rounds where nothing was retrieved and the model drafted alone and lost."""
    target = models["target"]
    bad = Counting(DraftModelProposer(models["draft"], gamma=4))
    lookup = Counting(PromptLookup())
    gen = SpeculativeGenerator(target, [bad, lookup], tree="auto", cost_curve=made_up_curve(0.6, t1=1e-3))
    ids = torch.tensor([PROMPT[:4]])
    out = gen.generate(ids, max_new_tokens=60)
    assert torch.equal(out.sequences, reference_generate(target, ids, 60, eos_token_id=None))
    passes = out.stats.target_forward_passes  # less every PLAIN_EVERY-th: a plain step timing t(1)
    assert lookup.calls >= passes - passes // PLAIN_EVERY, (lookup.calls, passes)
    assert bad.calls < 0.6 * passes, (bad.calls, passes)


def _probe_case(models, kind):
    """(a bound proposer of ``kind``, tokens [L], the target's features [L, F] at its layers)."""
    from headway.heads.target.features import capture_features

    target = models["target"]
    proposer = as_proposer(models["eagle3" if kind == "eagle" else "heads"])
    proposer.bind(target)
    proposer.reset()
    tokens = reference_generate(target, torch.tensor([LONG_PROMPT]), 12, eos_token_id=None)[0]  # [L]
    with torch.no_grad():
        feats = capture_features(target, tokens[None], proposer.feature_layers)[0]  # [L, F]
    return proposer, tokens, feats


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_probe_scores_the_drafters_first_guesses_against_what_followed(models, kind):
    """Proposer.probe: the drafter's first guess after each of the last m positions but the root's, its own
    probability and whether it is the token that followed, as the drafter computes them in a full causal pass."""
    from headway.inference.proposer import DraftContext

    proposer, tokens, feats = _probe_case(models, kind)
    length, m = tokens.shape[0], 5
    ctx = DraftContext(tokens, feats[:length - 1], None, 8, None, None)  # positions 0 .. L-2, the root's last
    found = proposer.probe(ctx, m)
    with torch.no_grad():
        if kind == "eagle":  # entry j pairs f[j] with x[j+1] and guesses x[j+2]
            head = models["eagle3"]
            h = head(tokens[None, 1:length - 1], head.input_hidden(feats[None, :length - 2]),
                     torch.arange(length - 2)[None])[0]  # [L-2, H], causal, no cache
            logits, to_ids = head.logits(h[-m:]), head.to_target_ids
        else:  # head 0 at position j guesses x[j+2]
            heads = models["heads"]
            logits, to_ids = heads.head_logits(feats[length - 2 - m:length - 2], 0), heads.to_target_ids
    conf, top = logits.float().softmax(-1).max(-1)
    assert found.hits == (to_ids(top) == tokens[length - m:]).tolist()
    torch.testing.assert_close(torch.tensor(found.confidence, dtype=conf.dtype), conf, rtol=1e-6, atol=1e-6)


def test_after_a_probe_the_eagle_drafter_drafts_what_it_would_have_drafted(models):
    """A probe is a catch-up over all but the root's feature: the next round, handed that feature again, drafts
    the same tree as a drafter that never probed."""
    from headway.inference.proposer import DraftContext

    probed, tokens, feats = _probe_case(models, "eagle")
    plain = probed.fork()
    length = tokens.shape[0]
    assert probed.probe(DraftContext(tokens, feats[:length - 1], None, 8, None, None), 4) is not None
    tree = probed.resolve_tree({"depth": 3, "top_k": 2, "total_tokens": 6})
    with torch.no_grad():
        a = probed.propose(DraftContext(tokens, feats[length - 2:length - 1], tree, 8, None, None))
        b = plain.propose(DraftContext(tokens, feats[:length - 1], tree, 8, None, None))
    assert a.tree.parents == b.tree.parents and torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(torch.tensor(a.score_list()), torch.tensor(b.score_list()))


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_a_drafter_that_lost_is_probed_before_it_is_tried_again(models, kind, monkeypatch):
    """tree="auto" tests a drafter whose last try lost on the tokens made since (no target pass) and tries
    a round only when the probe says it may pay; the output stays the target's, whichever way each
    probe goes (forced here: every other probe says try)."""
    target = models["target"]
    drafter = models[kind if kind == "eagle3" else "heads"]
    verdicts = []

    def probed(self, probe, prefix_len, real=AutoTree.probed, **kwargs):
        real(self, probe, prefix_len, **kwargs)  # learns from it
        verdicts.append(len(verdicts) % 2 == 0)
        return verdicts[-1]

    monkeypatch.setattr(AutoTree, "wants_probe", lambda self: True)  # every try after the first is probed
    monkeypatch.setattr(AutoTree, "probed", probed)
    gen = SpeculativeGenerator(target, drafter, tree="auto", cost_curve=made_up_curve(0.1))
    for prompt in (LONG_PROMPT, PROMPT[:4]):
        ids = torch.tensor([prompt])
        out = gen.generate(ids, max_new_tokens=24)
        assert torch.equal(out.sequences, reference_generate(target, ids, 24, eos_token_id=None))
        assert out.stats.probes >= 5, out.stats.probes
    assert True in verdicts and False in verdicts


def test_probes_keep_a_losing_drafter_from_trying_rounds(models):
    """Untrained Medusa heads on a costly curve: after the first losing tries, probes stand in for tries, so the
    rounds verified wider than the root are few and the probes many."""
    from headway.heads import MedusaHeads

    target = models["target"]
    heads = MedusaHeads.from_target(target, num_heads=2).double()  # untrained: they guess almost nothing
    gen = SpeculativeGenerator(target, heads, tree="auto", cost_curve=made_up_curve(0.6, t1=1e-3))
    tried = probes = passes = 0
    for prompt in (LONG_PROMPT, PROMPT[:4], PROMPT[2:7]):
        ids = torch.tensor([prompt])
        out = gen.generate(ids, max_new_tokens=40)
        assert torch.equal(out.sequences, reference_generate(target, ids, 40, eos_token_id=None))
        passes += out.stats.target_forward_passes
        tried += out.stats.target_forward_passes - out.stats.plain_steps
        probes += out.stats.probes
    assert probes >= 3 and tried <= probes, (tried, probes, passes)


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_a_hybrids_model_part_is_probed_and_keeps_its_features_in_step(models, kind, monkeypatch):
    """In a hybrid the gate probes a model part whose last try lost (forced here on every round, the verdicts
    alternating): probed rounds it sits out keep its last feature for it, rounds it drafts after a probe read
    only the root's, and the output stays the target's."""
    from headway.inference import auto

    target = models["target"]
    verdicts = []

    def rate(self, probe, source, prefix_len, real=AutoTree._probe_rate):
        real(self, probe, source, prefix_len)
        verdicts.append(len(verdicts) % 2 == 0)
        return 100.0 if verdicts[-1] else 0.0

    monkeypatch.setattr(auto.Backoff, "take", lambda self: False)
    monkeypatch.setattr(auto.Backoff, "paid", lambda self: None)
    monkeypatch.setattr(auto.Backoff, "__init__", lambda self: setattr(self, "wait", 2) or setattr(self, "skip", 0))
    monkeypatch.setattr(AutoTree, "_probe_rate", rate)
    drafter = models[kind if kind == "eagle3" else "heads"]
    gen = SpeculativeGenerator(target, [drafter, PromptLookup()], tree="auto", cost_curve=made_up_curve(0.1))
    for prompt in (LONG_PROMPT, PROMPT[:4] * 3):
        ids = torch.tensor([prompt])
        out = gen.generate(ids, max_new_tokens=24)
        assert torch.equal(out.sequences, reference_generate(target, ids, 24, eos_token_id=None))
        assert out.stats.probes >= 4, out.stats.probes
    assert True in verdicts and False in verdicts


def test_a_probe_decides_by_its_calibrated_first_guesses_and_the_drafting_cost():
    """Sure, right first guesses where a node costs half a step: try a round; wrong ones (or drafting that costs more than any
    chain can win back): sit out twice as long. The guesses land in the depth-1 calibration cells."""
    from headway.inference.proposer import Probe

    right, wrong = Probe([0.95] * 8, [True] * 8), Probe([0.95] * 8, [False] * 8)
    auto = AutoTree(made_up_curve(0.5))
    auto.drafter_backoff.lost()
    assert auto.probed(right, 10) and auto.cells[(0, 1, BINS - 1)] == [8.0, 8.0]
    auto = AutoTree(made_up_curve(0.5))
    auto.drafter_backoff.lost()
    wait = auto.drafter_backoff.wait
    assert not auto.probed(wrong, 10) and auto.drafter_backoff.wait == 2 * wait
    auto = AutoTree(made_up_curve(0.5))
    auto.draft_cost = 5.0  # drafting a round costs five plain steps: no chain of 4 pays for it
    assert not auto.probed(right, 10)


@pytest.mark.parametrize("band", [None, 1])
def test_a_failed_probe_in_a_hybrid_also_backs_off_the_bands_that_ask_more(band):
    """The gate's probe judges the model drafter, and a band of stronger retrieval only raises the bar its chain
    must clear: a probe that fails in one band sits out that band and every band above it, not the ones below."""
    from headway.inference.auto import PROBE_AFTER, RETRIEVAL_BANDS
    from headway.inference.proposer import Probe

    auto = AutoTree(made_up_curve(0.5))
    auto.made = PROBE_AFTER
    rate = 0.0 if band is None else (RETRIEVAL_BANDS[band - 1] + RETRIEVAL_BANDS[band]) / 2
    auto._best = lambda draft, prefix_len, steps: ([0, 1], rate)  # retrieval alone in the band asked for
    asked = auto.drafter_backoff if band is None else auto.model_backoff[band]
    asked.lost()
    asked.take()  # its wait is over: the gate probes before it tries a round
    retrieval = Draft(Tree([-1, 0]), torch.tensor([1, 2])) if band is not None else Draft(Tree([-1]), torch.tensor([1]))
    wrong = Probe([0.95] * 8, [False] * 8)
    assert not auto.gate(retrieval, 0.0, 10, probe=lambda rows: wrong)
    assert auto.probes == 1 and asked.wait == 4 and asked.skip == 2
    higher = auto.model_backoff if band is None else auto.model_backoff[band + 1:]
    lower = [] if band is None else [auto.drafter_backoff, *auto.model_backoff[:band]]
    assert all((b.skip, b.wait) == (2, 4) for b in higher)
    assert all((b.skip, b.wait) == (0, 1) for b in lower)
