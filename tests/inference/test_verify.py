"""Verification rules: greedy, lossless chain/tree rejection sampling (statistically, 20,000 samples
per case against the exact distribution by enumeration), and broken rules that must fail."""

import pytest
import torch

import headway.inference.verify as verify_mod
from headway.inference.proposer import sample_children
from headway.inference.tree import Tree, chain, node_path
from headway.inference.verify import (LazyProbs, SamplingParams, process_logits, probs, verify_chain_sampling,
                                      verify_greedy, verify_sampling_tensors, verify_sampling, verify_typical)
from tests.inference.spec_utils import PROMPT, SETTINGS, VOCAB, chi2_pvalue, context_logits, exact_joint, tiny_vocab_model

SAMPLES = 20_000
PASS_P, FAIL_P = 1e-3, 1e-8  # exact rules must pass at 1e-3; a broken rule must be rejected far beyond noise
TREE = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0]], name="test-tree")


# --- processing and greedy -------------------------------------------------------------------

@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.5, 20, 0.8)])
def test_process_logits_matches_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = process_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1))


def test_bad_sampling_args():
    for kwargs, match in [(dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
                          (dict(top_p=1.2), "top_p"), (dict(top_k=-1), "top_k")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**{"temperature": 1.0, **kwargs})


def test_greedy_longest_matching_path_then_bonus():
    tree = TREE  # root -> 1,2,3 ; 1 -> 4,5 ; 2 -> 6
    tokens = [9, 10, 11, 12, 13, 14, 15]
    argmax = [11, 0, 15, 0, 0, 0, 7]  # root wants 11 (node 2), node 2 wants 15 (node 6), node 6 wants 7
    assert verify_greedy(tree.children, tokens, argmax) == ([0, 2, 6], 7)
    assert verify_greedy(tree.children, tokens, [99] * 7) == ([0], 99)
    assert verify_greedy(chain(2).children, [1, 2, 3], [2, 3, 4]) == ([0, 1, 2], 4)


def test_sampling_stub_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert verify_chain_sampling([0, 1, 2], p, p.clone(), g) == (2, 0)  # q == p: always accepted
    never = torch.tensor([[0.0, 0.0, 1.0]] * 3)
    for _ in range(20):  # p(candidate) == 0: never accepted, the residual gives p's token
        assert verify_chain_sampling([0, 1, 1], never, p.clone(), g) == (0, 2)
        assert verify_chain_sampling([0, 1, 1], never, None, g) == (0, 2)


def test_gumbel_topk_is_sampling_without_replacement():
    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tok, dist = sample_children(q.log().expand(200_000, 4), 2, SamplingParams(1.0), torch.Generator().manual_seed(1))
    torch.testing.assert_close(dist[0].double(), q.double())
    first = torch.bincount(tok[:, 0], minlength=4).double() / tok.shape[0]
    second = torch.bincount(tok[:, 1], minlength=4).double() / tok.shape[0]
    expect2 = torch.stack([(q * q[y] / (1 - q)).sum() - q[y] * q[y] / (1 - q[y]) for y in range(4)]).double()
    torch.testing.assert_close(first, q.double(), atol=5e-3, rtol=0)
    torch.testing.assert_close(second, expect2, atol=5e-3, rtol=0)
    assert bool((tok[:, 0] != tok[:, 1]).all())


# --- statistical exactness -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tables():
    target, draft = tiny_vocab_model(0), tiny_vocab_model(1)
    return context_logits(target, PROMPT), context_logits(draft, PROMPT)


class CandidatePool:
    """Candidates per draft context drawn in bulk by the drafters' own ``sample_children``; each
    draw is used once, so every round's draft is independent of everything before it."""

    def __init__(self, draft_logits, k, params, sampled, generator, size):
        self.draft_logits, self.k, self.params, self.sampled = draft_logits, k, params, sampled
        self.generator, self.size, self.pool = generator, size, {}

    def take(self, ctx):
        if not self.sampled:
            if ctx not in self.pool:
                tok, _ = sample_children(self.draft_logits[ctx][None], self.k, None, None)
                self.pool[ctx] = (tok[0].tolist(), None)
            return self.pool[ctx]
        entry = self.pool.get(ctx)
        if entry is None or not entry[0]:
            logits = self.draft_logits[ctx].expand(self.size, VOCAB)  # one row per future use
            tok, q = sample_children(logits, self.k, self.params, self.generator)
            entry = self.pool[ctx] = (tok.tolist()[::-1], q[0])
        return entry[0].pop(), entry[1]


def simulate(tree, sampled, tables, params, n=SAMPLES, seed=0, rule="exact"):
    """Generate 3 tokens n times: rounds of (draft from the pool, verify against the target's
    processed distributions), until 3 tokens exist. Returns [n, 3]."""
    target_logits, draft_logits = tables
    p_table = {ctx: probs(lg, params) for ctx, lg in target_logits.items()}
    g = torch.Generator().manual_seed(seed)
    pool = CandidatePool(draft_logits, tree.top_k if not sampled else max(map(len, tree.children)), params,
                         sampled, g, size=n)
    out = []
    for _ in range(n):
        gen = ()
        while len(gen) < 3:
            t = tree.truncate(2 - len(gen))
            toks, ctx, q = [0] * t.size, [gen] + [None] * (t.size - 1), {} if sampled else None
            for parent, kids in enumerate(t.children):
                if kids:
                    cands, qrow = pool.take(ctx[parent])
                    for j, c in enumerate(kids):
                        toks[c] = cands[j if sampled else t.ranks[c]]
                        ctx[c] = ctx[parent] + (toks[c],)
                    if sampled:
                        q[parent] = qrow
            p = torch.stack([p_table[c] for c in ctx])  # [N, V]
            if rule == "typical":
                path, nxt = verify_typical(t.parents, t.retrieve, torch.tensor(toks), p, generator=g)
            elif rule == "tensors":  # the same rule as tensor ops (one read: the leaf and the next token)
                q_rows = None if q is None else torch.stack([q.get(i, p.new_zeros(VOCAB)) for i in range(t.size)])
                leaf, nxt = verify_sampling_tensors(*t.sampling_tensors(p.device), torch.tensor(toks), p, q_rows,
                                                    g).tolist()
                path = node_path(t.parents, leaf)
            else:
                path, nxt = verify_sampling(t.children, toks, p, q, g)
            gen += tuple(toks[i] for i in path[1:]) + (nxt,)
        out.append(gen[:3])
    return torch.tensor(out)


CASES = {  # name: (tree, candidates sampled from q (True) or deterministic top-k (False))
    "chain-sampled": (chain(2), True),  # the classic draft model
    "tree-sampled": (TREE, True),  # a draft model's tree, children drawn without replacement
    "tree-topk": (TREE, False),  # Medusa heads / a greedy draft tree / copied n-grams: one-hot drafts
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("case", list(CASES))
def test_sampling_is_exact(tables, case, setting):
    tree, sampled = CASES[case]
    params = SETTINGS[setting]
    samples = simulate(tree, sampled, tables, params)
    joint = exact_joint(tables[0], params)
    assert chi2_pvalue(samples, joint) > PASS_P


def test_sampling_on_the_device_is_exact(tables):
    """``verify_sampling_tensors``: the same rule with no read inside, every uniform drawn up front (a tree with
    sampled children here; the slow lane: a chain and one-hot drafts, more samples)."""
    params = SETTINGS["T1"]
    samples = simulate(*CASES["tree-sampled"], tables, params, n=10_000, rule="tensors")
    assert chi2_pvalue(samples, exact_joint(tables[0], params)) > PASS_P


@pytest.mark.slow
@pytest.mark.parametrize("case, setting", [("chain-sampled", "T0.7-p0.9"), ("tree-topk", "T0.7-p0.9"),
                                           ("tree-sampled", "T0.7-p0.9")])
def test_sampling_on_the_device_is_exact_long(tables, case, setting):
    params = SETTINGS[setting]
    samples = simulate(*CASES[case], tables, params, rule="tensors")
    assert chi2_pvalue(samples, exact_joint(tables[0], params)) > PASS_P


@pytest.mark.parametrize("bug", ["residual", pytest.param("removal", marks=pytest.mark.slow)])
def test_a_broken_device_rule_fails(tables, monkeypatch, bug):
    """The device rule resampling from p after a rejection, or trying the next sibling with the rejected candidate
    still in q: both are caught."""
    monkeypatch.setattr(verify_mod, "_residual" if bug == "residual" else "_without", lambda p, q: p)
    params = SETTINGS["T1"]
    samples = simulate(*CASES["tree-sampled"], tables, params, n=10_000, rule="tensors")
    assert chi2_pvalue(samples, exact_joint(tables[0], params)) < FAIL_P


def test_broken_residual_fails(tables, monkeypatch):
    """Resampling from p instead of norm(max(0, p - q)) after a rejection: the classic bug."""
    monkeypatch.setattr(verify_mod, "residual", lambda p, q: p)
    params = SETTINGS["T1"]
    samples = simulate(*CASES["tree-sampled"], tables, params)
    assert chi2_pvalue(samples, exact_joint(tables[0], params)) < FAIL_P


@pytest.mark.parametrize("case", ["tree-topk", "tree-sampled"])
def test_broken_candidate_removal_fails(tables, monkeypatch, case):
    """Trying the next sibling without removing the rejected candidate (from p for one-hot drafts,
    from q for drafts sampled without replacement)."""
    monkeypatch.setattr(verify_mod, "remove_candidate", lambda p, x: p)
    params = SETTINGS["T0.7-p0.9"]
    samples = simulate(*CASES[case], tables, params, n=10_000)
    assert chi2_pvalue(samples, exact_joint(tables[0], params)) < FAIL_P


def test_typical_acceptance_is_lossy(tables):
    """Medusa's typical acceptance is opt-in because it does not sample the target's distribution."""
    params = SETTINGS["T1"]
    samples = simulate(*CASES["tree-topk"], tables, params, n=5000, rule="typical")
    assert chi2_pvalue(samples, exact_joint(tables[0], params)) < FAIL_P


def test_lazy_probs_only_touches_visited_rows():
    logits = torch.randn(5, 8)
    lazy = LazyProbs(logits, SamplingParams(0.7, 3, 0.9))
    torch.testing.assert_close(lazy[2], probs(logits[2], SamplingParams(0.7, 3, 0.9)))
    assert list(lazy._rows) == [2]
