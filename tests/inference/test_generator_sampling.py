"""Sampling through SpeculativeGenerator.generate(temperature > 0), for every drafter, chain and tree.

The acceptance rules themselves are checked statistically in test_verify.py (20,000 samples per
case against the exact distribution). Here the generator's side is checked:

- Wiring (exact, default lane): a recorder around ``verify_sampling`` captures what generate hands
  to verification over several rounds; for every node of every verified tree, p[i] must equal the
  target's processed distribution after context + the node's path (plain forward), q[i] the
  drafter's own distribution there (None for deterministic drafters, whose candidates are checked
  instead), and the output must be the accepted root-to-node paths plus the next tokens. To cover
  a new drafter add one line to ``WIRING`` (q_ref: its processed distribution at a node).
- End to end (statistical): the first 3 generated tokens follow the target's exact distribution
  (enumerated on an 8-token model). Each sample is a full generate call (6-14 ms on an idle core
  here, more under load): the default lane runs 1,000 samples on six cases (a broken acceptance
  rule is rejected at p < 1e-6 with that many, see test_broken_rule_fails_end_to_end), the slow
  lane 4,000 samples on four other (drafter, setting) pairs, one per drafter kind and both settings.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import LogitsProcessorList, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

import headway.inference.generator as generator_mod
import headway.inference.processors as processors_mod
import headway.inference.verify as verify_mod
from headway.inference.verify import probs
from headway.heads.dflash import DFlashHead
from headway.heads.eagle_layer import DraftCache
from headway.heads.layerskip import LayerSkipHead
from headway.heads.peagle import PEagleHead
from headway.heads.target.features import capture_features
from headway.inference import (DraftModelProposer, Lookahead, PromptLookup, RetrievalChoice, SpeculativeGenerator,
                               SuffixDecoding)
from tests.inference.eagle_utils import eagle_q_ref, train_eagle
from tests.inference.spec_utils import (PROMPT, SETTINGS, VerifyRecorder, WiringCase, check_wiring, chi2_pvalue, context_logits,
                        exact_joint, lm_q_ref, lookup_check, medusa_check, tiny_vocab_model, train_medusa)

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]
LONG_PROMPT = PROMPT + [3, 7, 2, 5, 3, 7, 6, 4, 2]  # repeats: prompt lookup drafts on most rounds


@dataclasses.dataclass
class Models:
    target: torch.nn.Module
    draft: torch.nn.Module  # a separate draft model
    heads: torch.nn.Module  # Medusa heads self-distilled from the target
    eagle1: torch.nn.Module  # EAGLE-1 head (full vocabulary) self-distilled from the target
    eagle3: torch.nn.Module  # EAGLE-3 head over a reduced 6-token draft vocabulary
    eagle31: torch.nn.Module  # EAGLE-3.1 (normalize_features): norms per feature layer, post-norm states fed back
    layerskip: torch.nn.Module  # a LayerSkip exit head after layer 1 of 2, over a reduced 6-token draft vocabulary
    peagle: torch.nn.Module  # P-EAGLE (3 tokens a pass) over a reduced 6-token draft vocabulary, its mask_hidden random
    dflash: torch.nn.Module  # DFlash (blocks of 4: 3 slots a pass), two layers, a 6-token draft vocabulary, perturbed


# name -> how to build its WiringCase(drafter, tree, q_ref, check_draft) from the Models: a new drafter
# is one more line here (the wiring test, and the end-to-end fixture, pick it up).
WIRING = {
    "medusa-chain": lambda m: WiringCase(m.heads, "chain-2", check_draft=medusa_check(m.target, m.heads)),
    "medusa-tree": lambda m: WiringCase(m.heads, TREE, check_draft=medusa_check(m.target, m.heads)),
    "draft-chain": lambda m: WiringCase(DraftModelProposer(m.draft), "chain-2", q_ref=lm_q_ref(m.draft)),
    "draft-tree": lambda m: WiringCase(DraftModelProposer(m.draft), TREE, q_ref=lm_q_ref(m.draft)),
    "lookup-chain": lambda m: lookup_case(PromptLookup()),
    "lookup-tree": lambda m: lookup_case(PromptLookup(max_matches=3, max_ngram_size=2)),
    # suffix decoding's every path follows an earlier occurrence of a context suffix, as prompt lookup's does
    "suffix": lambda m: WiringCase(SuffixDecoding(cross_request=False, max_spec_factor=4.0, min_token_prob=0.0),
                                   check_draft=lookup_check(SimpleNamespace(min_ngram_size=1, max_ngram_size=12))),
    # both retrievers each round, one draft handed on (the one that would have been accepted more so far)
    "choice": lambda m: WiringCase(RetrievalChoice([SuffixDecoding(cross_request=False, min_token_prob=0.0),
                                                    PromptLookup(max_matches=2)], margin=1),
                                   check_draft=lookup_check(SimpleNamespace(min_ngram_size=1, max_ngram_size=12))),
    # lookahead decoding: the Jacobi window and pool candidates, deterministic, verified one-hot
    "lookahead": lambda m: WiringCase(Lookahead(window=3, ngram=3, guesses=2), fixed_shape=False),
    # hybrids: deterministic trees merge (Medusa's top-k with copied branches), sampled ones (a draft
    # model's q) verify alone, the retrieval draft set aside that round
    "hybrid-medusa": lambda m: WiringCase([m.heads, PromptLookup(max_matches=2, max_ngram_size=2)], TREE,
                                          fixed_shape=False),
    "hybrid-draft": lambda m: WiringCase([DraftModelProposer(m.draft), SuffixDecoding(cross_request=False)], "chain-2",
                                         q_ref=lm_q_ref(m.draft)),
    # EAGLE over static trees samples its children: q is the head's own distribution at the node (the head
    # run over the target's features of the context, then over its own states along the path)
    "eagle1-chain": lambda m: WiringCase(m.eagle1, "chain-2", q_ref=eagle_q_ref(m.target, m.eagle1)),
    "eagle3-tree": lambda m: WiringCase(m.eagle3, TREE, q_ref=eagle_q_ref(m.target, m.eagle3)),
    "eagle31-tree": lambda m: WiringCase(m.eagle31, TREE, q_ref=eagle_q_ref(m.target, m.eagle31)),
    # LayerSkip: the target's own first layer and an exit head started from the target's sample the chain; q is the
    # head's distribution on the target's layer-1 state after the node's path (plain forward)
    "layerskip-chain": lambda m: WiringCase(m.layerskip, "chain-3", q_ref=layerskip_q_ref(m.target, m.layerskip),
                                            fixed_shape=False),  # it stops after an unlikely token (min_prob)
    # P-EAGLE: the root's row and two mask slots from one pass; node j's child is drawn from row j, which reads the
    # context alone (never the drafted tokens)
    "peagle-chain": lambda m: WiringCase(m.peagle, "chain-3", q_ref=peagle_q_ref(m.target, m.peagle)),
    # DFlash: one block's slots; every depth-d node's children drawn from slot d + 1's row, which reads the context
    # and the block (never the drafted tokens): a tree whose siblings' subtrees share their candidates' distribution
    "dflash-tree": lambda m: WiringCase(m.dflash, TREE, q_ref=dflash_q_ref(m.target, m.dflash)),
    # DFlash's dynamic tree: EAGLE-2's rule over the block's rows, deterministic (verified one-hot)
    "dflash-dynamic": lambda m: WiringCase(m.dflash, {"depth": 3, "top_k": 2, "total_tokens": 5}, fixed_shape=False),
    # EAGLE-2 dynamic trees draft deterministically (top-k by cumulative log-probability)
    "eagle3-dynamic": lambda m: WiringCase(m.eagle3, {"depth": 3, "top_k": 2, "total_tokens": 5}, fixed_shape=False),
}


def lookup_case(drafter):
    return WiringCase(drafter, check_draft=lookup_check(drafter))


@pytest.fixture(scope="module")
def models():
    target, draft = tiny_vocab_model(0), tiny_vocab_model(1)
    heads = train_medusa(target, num_heads=2, steps=200, seed=2, low=0).double()  # right often, not always
    eagle1 = train_eagle(target, 1, seed=2, steps=60, low=0)
    eagle3 = train_eagle(target, 3, seed=2, steps=60, low=0, draft_vocab=6)
    eagle31 = train_eagle(target, 3, seed=3, steps=60, low=0, draft_vocab=6, normalize_features=True)
    layerskip = LayerSkipHead.from_target(target, exit_layer=1, draft_vocab_size=6, draft_tokens=[0, 1, 2, 4, 5, 7])
    torch.manual_seed(4)
    peagle = PEagleHead.from_target(target, parallel_depths=3, draft_vocab_size=6, draft_tokens=[0, 1, 2, 4, 5, 7])
    with torch.no_grad():
        peagle.mask_hidden.normal_()
    dflash = DFlashHead.from_target(target, block_size=4, num_layers=2, draft_vocab_size=6,
                                    draft_tokens=[0, 1, 2, 4, 5, 7])
    with torch.no_grad():
        for p in dflash.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return Models(target, draft, heads, eagle1, eagle3, eagle31, layerskip, peagle, dflash)


def dflash_q_ref(target, head):
    """Slot d + 1 of DFlash's block after the context ``ids[:context_len]`` (d = the node's depth): the context's
    features from one plain forward, the block [root, mask, ...] at the next positions seeing all of it."""
    @torch.no_grad()
    def ref(ids, context_len, params):
        ctx = torch.tensor([ids[:context_len]])
        feats = capture_features(target, ctx, head.config.feature_layers)  # [1, L, F]
        kv = head.context_kv(head.context(feats[:, :-1]), torch.arange(context_len - 1)[None])
        block = torch.full((1, head.config.block_size), head.config.mask_token_id)
        block[0, 0] = ctx[0, -1]
        h = head(block, torch.arange(context_len - 1, context_len - 1 + head.config.block_size)[None], kv)
        return head.widen(probs(head.logits(h[0, len(ids) - context_len + 1]), params))  # over the target's ids
    return ref


def peagle_q_ref(target, head):
    """Row j of P-EAGLE's pass after the context ``ids[:context_len]`` (j = the node's depth): the head over the
    target's features of the context (one plain forward), then j slots, widened."""
    @torch.no_grad()
    def ref(ids, context_len, params):
        ctx = torch.tensor([ids[:context_len]])
        feats = capture_features(target, ctx, head.config.feature_layers)  # [1, L, F]
        h = head(ctx[:, 1:], head.input_hidden(feats[:, :-1]), torch.arange(context_len - 1)[None])[0, -1:]  # [1, H]
        depth = len(ids) - context_len
        if depth:
            cache = DraftCache()
            head(ctx[:, 1:], head.input_hidden(feats[:, :-1]), torch.arange(context_len - 1)[None], cache=cache)
            h = head.slots(torch.arange(context_len - 1, context_len - 1 + depth)[None], cache=cache)[0, -1:]
        q = probs(head.logits(h[0]), params)
        full = q.new_zeros(head.config.vocab_size)
        full[head.draft_token_ids] = q
        return full
    return ref


def layerskip_q_ref(target, head):
    """The exit head's processed distribution [V] after ``ids`` (a plain forward's layer-E state), widened."""
    @torch.no_grad()
    def ref(ids, context_len, params):
        state = target(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[head.config.exit_layer]
        q = probs(head(state[0, -1]), params)
        full = q.new_zeros(head.config.vocab_size)
        full[head.draft_token_ids] = q
        return full
    return ref


@pytest.fixture(scope="module")
def wiring_cases(models):
    return {name: make(models) for name, make in WIRING.items()}


@pytest.fixture(scope="module")
def setup(models, wiring_cases):
    joints = {name: exact_joint(context_logits(models.target, PROMPT), params) for name, params in SETTINGS.items()}
    drafters = {name: (case.drafter, case.tree) for name, case in wiring_cases.items()}
    return models.target, drafters, joints


# --- wiring: exact, node by node --------------------------------------------------------------

def run_and_check(target, case, params, monkeypatch, calls=3, max_new=12, seed=0, settings=None, processors=None):
    """A few generate calls on LONG_PROMPT with the recorder in place; check_wiring on each.
    ``settings``: generation-config settings passed to generate; ``processors``: the reference
    LogitsProcessorList they stand for, applied by check_wiring to each node's plain context."""
    recorder = VerifyRecorder(monkeypatch)
    gen = SpeculativeGenerator(target, case.drafter, tree=case.tree)
    g = torch.Generator().manual_seed(seed)
    rounds = 0
    for _ in range(calls):
        out = gen.generate(torch.tensor([LONG_PROMPT]), max_new_tokens=max_new, temperature=params.temperature,
                           top_k=params.top_k, top_p=params.top_p, generator=g, **(settings or {}))
        calls_made = recorder.take()
        check_wiring(target, case, gen.tree, LONG_PROMPT, params, max_new, calls_made, out, processors,
                     blind_first=bool(gen.drafter.feature_layers) or gen.drafter.shares_target_cache)
        rounds += len(calls_made)
    return rounds


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafter", list(WIRING))
def test_sampling_wiring(models, wiring_cases, drafter, setting, monkeypatch):
    rounds = run_and_check(models.target, wiring_cases[drafter], SETTINGS[setting], monkeypatch)
    assert rounds >= 3 * 3  # several rounds per call, so rounds after the first are checked too


# the rule as tensor ops on the device (the CUDA default), forced here on the CPU: one case per way a draft carries q
# (a [N, V] tensor or a dict; none: one-hot) and per drafter that drafts a block or chain in one pass
DEVICE_CASES = ["draft-tree", "medusa-tree", "lookup-chain", "eagle3-tree", "peagle-chain", "dflash-tree", "hybrid-medusa",
                "dflash-dynamic"]  # a tree whose shape is still on the device (its children table built there)


@pytest.mark.parametrize("drafter", DEVICE_CASES)
def test_sampling_wiring_on_the_device(models, wiring_cases, drafter, monkeypatch):
    monkeypatch.setattr(SpeculativeGenerator, "device_sampling", True)
    calls = []
    real = generator_mod.verify_sampling_tensors
    monkeypatch.setattr(generator_mod, "verify_sampling_tensors", lambda *a, **k: calls.append(1) or real(*a, **k))
    rounds = run_and_check(models.target, wiring_cases[drafter], SETTINGS["T0.7-p0.9"], monkeypatch)
    assert rounds >= 3 * 3 and len(calls) == rounds  # every round verified on the device


@pytest.mark.parametrize("drafter, setting", [pytest.param("draft-chain", "T1", marks=pytest.mark.slow),
                                              ("medusa-tree", "T0.7-p0.9")])
def test_sampling_on_the_device_matches_target_end_to_end(setup, drafter, setting, monkeypatch):
    monkeypatch.setattr(SpeculativeGenerator, "device_sampling", True)
    target, drafters, joints = setup
    samples = sample_first3(target, *drafters[drafter], SETTINGS[setting], n=1000, seed=1)
    assert chi2_pvalue(samples, joints[setting]) > 1e-3


@pytest.mark.parametrize("drafter", ["draft-tree", "lookup-tree", "medusa-tree", "eagle3-dynamic"])
def test_sampling_wiring_with_generation_config(models, wiring_cases, drafter, monkeypatch):
    """p at every node is the target's distribution after the generation config's processors run on
    that node's own context (repetition penalty over the context and the path, no-repeat bigrams)."""
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5), NoRepeatNGramLogitsProcessor(2)])
    rounds = run_and_check(models.target, wiring_cases[drafter], SETTINGS["T1"], monkeypatch,
                           settings=dict(repetition_penalty=1.5, no_repeat_ngram_size=2), processors=processors)
    assert rounds >= 3 * 3


def test_processors_on_the_wrong_context_are_caught(models, wiring_cases, monkeypatch):
    """Processing every node with the root's context (ignoring the draft path) must fail the check."""
    real = processors_mod.node_contexts
    monkeypatch.setattr(processors_mod, "node_contexts",
                        lambda prefix, tree, tokens, nodes: real(prefix, tree, tokens, [0] * len(nodes)))
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])
    with pytest.raises(AssertionError, match=r"p\[\d+\]"):
        run_and_check(models.target, wiring_cases["draft-tree"], SETTINGS["T1"], monkeypatch,
                      settings=dict(repetition_penalty=1.5), processors=processors)


def _shift_q(q):
    """q of the next node that has one (cyclically): the distribution of the wrong node."""
    if q is None:
        return None
    if isinstance(q, dict):
        nodes = sorted(q)
        return {n: q[nodes[(j + 1) % len(nodes)]] for j, n in enumerate(nodes)}
    return q.roll(1, dims=0)


BROKEN = [("q-of-wrong-node", "draft-tree", r"round 0: q\[0\]"), ("q-of-wrong-node", "draft-chain", r"round 0: q\[0\]"),
          ("p-of-wrong-node", "lookup-tree", r"round 0: p\[0\]"),
          ("features-off-by-one", "medusa-tree", r"round 1: node \d+ \(depth \d, rank \d\) holds token")]


@pytest.mark.parametrize("bug, drafter, message", [pytest.param(*b, id=f"{b[0]}-{b[1]}") for b in BROKEN])
def test_broken_wiring_is_caught(models, wiring_cases, bug, drafter, message, monkeypatch):
    """A generator that hands verification the wrong node's q or the wrong node's target logits, or
    hands the drafter target features one position off, fails the wiring check."""
    real = SpeculativeGenerator._accept
    if bug == "q-of-wrong-node":
        monkeypatch.setattr(SpeculativeGenerator, "_accept", lambda self, draft, *a: real(
            self, dataclasses.replace(draft, q=_shift_q(draft.q)), *a))
    elif bug == "p-of-wrong-node":
        monkeypatch.setattr(SpeculativeGenerator, "_accept",
                            lambda self, draft, logits, *a: real(self, draft, logits.roll(1, dims=0), *a))
    else:
        class OffByOne(generator_mod.FeatureCapture):
            def pop(self):
                return super().pop().roll(1, dims=1)  # every position gets the previous position's features

        monkeypatch.setattr(generator_mod, "FeatureCapture", OffByOne)
    with pytest.raises(AssertionError, match=message):
        run_and_check(models.target, wiring_cases[drafter], SETTINGS["T1"], monkeypatch)


# --- end to end: statistical ------------------------------------------------------------------

def sample_first3(target, drafter, tree, params, n, seed):
    gen = SpeculativeGenerator(target, drafter, tree=tree)
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([PROMPT])
    out = [gen.generate(ids, max_new_tokens=3, temperature=params.temperature, top_k=params.top_k,
                        top_p=params.top_p, generator=g).sequences[0, -3:] for _ in range(n)]
    return torch.stack(out)


# One end-to-end case per drafter kind (test_sampling_wiring checks every kind, chain and tree, node by node).
DEFAULT_CASES = [("medusa-tree", "T0.7-p0.9"), ("draft-chain", "T0.7-p0.9"), ("lookup-tree", "T0.7-p0.9"),
                 ("eagle3-tree", "T1"), ("suffix", "T0.7-p0.9"), ("hybrid-medusa", "T0.7-p0.9"),
                 ("layerskip-chain", "T1"), ("peagle-chain", "T0.7-p0.9"), ("dflash-tree", "T1")]
# One per drafter kind, both settings, (drafter, setting) pairs the default lane does not run (the draft
# model's chain runs there at T0.7-p0.9 and its tree here: no third pair for it).
SLOW_CASES = [("medusa-tree", "T1"), ("draft-tree", "T0.7-p0.9"), ("lookup-tree", "T1"),
              ("eagle3-tree", "T0.7-p0.9"), ("eagle3-dynamic", "T1"), ("layerskip-chain", "T0.7-p0.9"),
              ("peagle-chain", "T1"), ("dflash-tree", "T0.7-p0.9")]


@pytest.mark.parametrize("drafter, setting", DEFAULT_CASES)
def test_sampling_matches_target_end_to_end(setup, drafter, setting):
    target, drafters, joints = setup
    samples = sample_first3(target, *drafters[drafter], SETTINGS[setting], n=1000, seed=1)
    assert chi2_pvalue(samples, joints[setting]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("drafter, setting", SLOW_CASES)
def test_sampling_matches_target_end_to_end_long(setup, drafter, setting):
    target, drafters, joints = setup
    samples = sample_first3(target, *drafters[drafter], SETTINGS[setting], n=4_000, seed=2)
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


@pytest.mark.parametrize("bug", ["widen", "parent-state"])
def test_broken_eagle_wiring_is_caught(models, wiring_cases, bug, monkeypatch):
    """The wiring check rejects an EAGLE drafter that maps its reduced-vocabulary q onto the wrong target
    ids, or that feeds a node its own parent's input instead of the parent's output state."""
    from headway.inference import eagle as eagle_mod

    if bug == "widen":
        real = eagle_mod.EagleProposer._widen
        monkeypatch.setattr(eagle_mod.EagleProposer, "_widen", lambda self, q: real(self, q.roll(1)))
    else:
        real_fwd = type(models.eagle3).forward

        def stale(self, input_ids, hidden, position_ids, attention_mask=None, cache=None, ttt=None):
            if attention_mask is not None:  # tree nodes: read a zero state instead of the parent's output
                hidden = torch.zeros_like(hidden)
            return real_fwd(self, input_ids, hidden, position_ids, attention_mask, cache, ttt)

        monkeypatch.setattr(type(models.eagle3), "forward", stale)
    with pytest.raises(AssertionError, match="q\\["):
        run_and_check(models.target, wiring_cases["eagle3-tree"], SETTINGS["T1"], monkeypatch, calls=1)
