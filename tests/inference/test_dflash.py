"""DFlash's runtime: the root and B - 1 mask slots in one drafter pass over the context's features, verified as a
chain, a static tree or an EAGLE-2 dynamic tree over the block's rows; the output is the target's own (greedy on both
families, under tree="auto", with trees, in a batch; sampling: test_generator_sampling's wiring and chi-square
cases)."""

import pytest
import torch

from headway.heads.dflash import DFlashHead
from headway.inference import SpeculativeGenerator
from headway.inference.dflash import DFlashProposer
from headway.inference.expand import DynamicTree
from tests.inference.spec_utils import assert_batch_equals_rows, left_pad


@pytest.fixture(scope="module")
def heads():
    return {}


def dflash_for(family, heads, vocab=None):
    key = (family.name, vocab)
    if key not in heads:
        torch.manual_seed(0)
        head = DFlashHead.from_target(family.target, block_size=4, num_layers=2, draft_vocab_size=vocab,
                                      draft_tokens=None if vocab is None else list(range(0, 2 * vocab, 2)))
        with torch.no_grad():  # not a fresh init's near-uniform draft: slots that disagree with each other
            for p in head.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        heads[key] = head
    return heads[key]


DYNAMIC = {"depth": 3, "top_k": 2, "total_tokens": 5}


@pytest.mark.parametrize("tree, vocab", [(None, None), ("auto", None), ("chain-3", None), ("tree-7", None),
                                         (DYNAMIC, None), (None, 60), ("tree-7", 60), (DYNAMIC, 60)])
def test_greedy_equals_generate(family, heads, tree, vocab):
    gen = SpeculativeGenerator(family.target, dflash_for(family, heads, vocab), tree=tree)
    for i, (prompt, max_new, ref) in enumerate(list(zip(family.prompts, family.max_new, family.references))[:12]):
        out = gen.generate(prompt, max_new_tokens=max_new)
        assert torch.equal(out.sequences, ref), f"{family.name}: prompt {i} differs from generate"
        if tree == "chain-3" and i == 0:
            assert max(out.stats.draft_depth_per_step) == 3  # the whole block's B - 1 slots, from one pass


def test_one_block_per_round_and_the_context_only_stays(family, heads, monkeypatch):
    """One drafter forward a round, over the whole block; the caches keep the context's entries only, each layer's
    as many as the positions verified before the root."""
    head = dflash_for(family, heads)
    calls = []
    real = DFlashHead.forward
    monkeypatch.setattr(DFlashHead, "forward", lambda self, ids, positions, contexts, attention_mask=None:
                        calls.append(ids.shape[1]) or real(self, ids, positions, contexts, attention_mask))
    gen = SpeculativeGenerator(family.target, head, tree=None)
    assert gen.tree == DynamicTree(depth=3, top_k=4, total_tokens=7)  # the default: EAGLE-2's over the block's slots
    out = gen.generate(family.prompts[1], max_new_tokens=20)
    drafted = [d for d in out.stats.draft_depth_per_step if d > 0]
    assert calls and set(calls) == {4} and len(calls) == len(drafted)
    assert all(len(c) == gen.drafter._seen for c in gen.drafter._caches)
    assert gen.drafter._seen == out.sequences.shape[1] - 2  # the context: every position but the last two's root


@pytest.mark.parametrize("tree", [None, DYNAMIC, "chain-3"])
def test_a_batch_equals_its_rows_alone(family, heads, tree, monkeypatch):
    """Each row of a batch equals its own generate; the rows' blocks run as one pass (``BlockPass.run_together``)."""
    from headway.inference.dflash import BlockPass

    passes = []
    real = BlockPass.run_together.__func__
    monkeypatch.setattr(BlockPass, "run_together", classmethod(
        lambda cls, requests, state: passes.append(len(requests)) or real(cls, requests, state)))
    gen = SpeculativeGenerator(family.target, dflash_for(family, heads), tree=tree)
    assert_batch_equals_rows(gen, family)
    assert passes and max(passes) > 1, passes


def test_a_batchs_blocks_are_one_pass_giving_each_row_its_own(family, heads):
    """Rows with contexts of 3 and 6 positions: one pass over their stacked caches gives each row's block the h its
    own pass gives (fp32, to rounding), and leaves each row's caches holding its context."""
    from headway.inference.dflash import BlockPass, DFlashProposer
    from headway.inference.proposer import DraftContext

    head = dflash_for(family, heads)
    torch.manual_seed(3)
    rows, alone, requests = [], [], []
    for n in (3, 6):
        tokens = torch.randint(3, 100, (n + 1,))
        features = torch.randn(n, len(head.config.feature_layers) * family.target.config.hidden_size)
        ctx = DraftContext(tokens, features, None, 3, None, None)
        for group in (rows, alone):
            p = DFlashProposer(head)
            p.bind(family.target)
            p._catch_up(ctx)
            group.append(p)
        requests.append(BlockPass(rows[-1], tokens[-1:], n))
    out = BlockPass.run_together(requests, {})
    for p, q, r, h in zip(rows, alone, requests, out):
        torch.testing.assert_close(h, q._block(r.root, r.start), rtol=1e-5, atol=1e-6)
        assert all(len(c) == p._seen for c in p._caches)


def test_a_batchs_dynamic_trees_are_read_with_its_verification(family, heads, monkeypatch):
    """Each row's dynamic tree stays on the device until the batch's one verification read carries its shape: one
    read a round for the whole batch (the runtime probe's counter), where each row read its own tree before (the
    tensor growth, CUDA's default: a CPU grows the tree on the host)."""
    from headway.bench.runtime_probe import Meter, counted_reads, metered

    monkeypatch.setattr(DFlashProposer, "tensor_rounds", True)  # every row's fork
    head = dflash_for(family, heads)
    gen = SpeculativeGenerator(family.target, head, tree=DYNAMIC)
    pad = family.target.generation_config.pad_token_id
    ids, mask = left_pad(family.prompts[:3], pad)
    counts = {}
    for budget in (4, 12):
        meter = Meter()
        with metered(meter, [family.target, head]), counted_reads(meter):
            out = gen.generate(ids, attention_mask=mask, max_new_tokens=budget)
        counts[budget] = meter.reads, out.stats.target_forward_passes
    (reads4, passes4), (reads12, passes12) = counts[4], counts[12]
    assert passes12 > passes4 and reads12 - reads4 <= passes12 - passes4, counts


def test_a_dynamic_tree_is_eagle2s_rule_over_the_blocks_rows(family, heads):
    """The dynamic tree is EAGLE-2's (the host growth, ``expand_dynamic``) with every depth-d node's children
    scored by slot d + 1's row (block_logits' row d), from the one block pass; every kept node is among its
    depth's top-k."""
    from headway.inference.expand import DynamicTree, expand_dynamic
    from headway.inference.proposer import DraftContext

    head = dflash_for(family, heads, 60)
    settings = DynamicTree(**DYNAMIC)
    gen = SpeculativeGenerator(family.target, head, tree=DYNAMIC)
    out = gen.generate(family.prompts[1], max_new_tokens=12)  # the drafter's caches hold the context so far
    tokens = out.sequences[0]
    features = gen.drafter._seen  # positions the drafter has taken in
    prompt = tokens[:features + 1]  # the context it has, and its root
    ctx = DraftContext(prompt, None, settings, 3, None, None)
    logits = gen.drafter.block_logits(ctx, 3)  # [3, V'] (the block's entries are cropped off again)
    draft = gen.drafter.propose(DraftContext(prompt, tokens.new_zeros(0, 1), settings, 3, None, None))
    want = expand_dynamic(settings, 3, int(prompt[-1]), logits[0],
                          lambda exp, nodes: logits[exp.depths[nodes[0]]].expand(len(nodes), -1), head.to_target_ids)
    assert draft.tree.parents == want.tree.parents and torch.equal(draft.tokens, want.tokens)
    assert draft.tree.size == 1 + DYNAMIC["total_tokens"] and draft.q is None  # deterministic: verified one-hot
    top = head.to_target_ids(logits.topk(2, -1).indices)  # [3, 2]
    assert all(int(draft.tokens[n]) in top[draft.tree.depths[n] - 1].tolist() for n in range(1, draft.tree.size))


@pytest.mark.parametrize("tree_name", ["chain-3", "tree-7"])
@pytest.mark.parametrize("scored", [False, True])
def test_a_greedy_static_tree_is_its_expansion_over_the_blocks_rows(family, heads, tree_name, scored):
    """A greedy static tree is drafted as one top-k over the block's rows and a gather (``ranked_draft``): the tokens
    (and, where scored, the scores) of the level-by-level expansion over the same rows, ``expand_static``."""
    from headway.inference.expand import expand_static
    from headway.inference.proposer import DraftContext
    from headway.inference.tree import load_tree

    head = dflash_for(family, heads, 60)
    tree = load_tree(tree_name)
    gen = SpeculativeGenerator(family.target, head, tree=tree)
    tokens = gen.generate(family.prompts[2], max_new_tokens=12).sequences[0]
    prompt = tokens[:gen.drafter._seen + 1]  # the context the drafter has taken in, and its root
    logits = gen.drafter.block_logits(DraftContext(prompt, None, tree, 3, None, None), 3)  # [3, V']
    ctx = DraftContext(prompt, tokens.new_zeros(0, 1), tree, 3, None, None, scored=scored)
    draft = gen.drafter.propose(ctx)
    want = expand_static(tree, int(prompt[-1]), logits[0], lambda exp, nodes: logits[exp.depths[nodes[0]]].expand(
        len(nodes), -1), None, None, head.to_target_ids, head.widen, scored)
    assert draft.tree is tree and draft.tokens.tolist() == want.tokens.tolist() and draft.q is None
    assert (draft.scores is None) == (not scored)
    if scored:
        assert draft.scores.tolist() == pytest.approx(want.scores.tolist(), rel=1e-5)


def test_a_block_larger_than_trained_is_refused(family, heads):
    head = dflash_for(family, heads)
    with pytest.raises(ValueError, match="trained on blocks of 4 tokens, so it drafts at most 3 per pass"):
        SpeculativeGenerator(family.target, head, tree="chain-4")
    with pytest.raises(ValueError, match="trained on blocks of 4 tokens"):
        SpeculativeGenerator(family.target, head, tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="the dynamic tree has depth 4: pass depth <= 3"):
        SpeculativeGenerator(family.target, head, tree={"depth": 4, "top_k": 2, "total_tokens": 5})


def _probe_case(family, heads):
    """(a bound DFlash proposer, tokens [L] the target made, the target's features [L, F] at its layers)."""
    from headway.heads.target.features import capture_features
    from headway.inference.dflash import DFlashProposer

    head = dflash_for(family, heads)
    proposer = DFlashProposer(head)
    proposer.bind(family.target)
    tokens = family.references[2][0]  # [L]
    with torch.no_grad():
        feats = capture_features(family.target, tokens[None], proposer.feature_layers)[0]  # [L, F]
    return proposer, tokens, feats


def test_a_probe_is_each_blocks_first_guess_seeing_the_context_before_it(family, heads):
    """DFlashProposer.probe: for each of the last m verified tokens x[j], slot 1 of a whole block rooted there over
    the context before j only (its own pass, no cache here), its probability and whether it is x[j+1]; the caches
    keep the context (positions .. L-3) and nothing of the probe's blocks."""
    from headway.inference.proposer import DraftContext

    proposer, tokens, feats = _probe_case(family, heads)
    head, length, m = proposer.head, tokens.shape[0], 5
    found = proposer.probe(DraftContext(tokens, feats[:length - 1], None, 8, None, None), m)
    rows = []
    with torch.no_grad():
        for j in range(length - 1 - m, length - 1):
            ids = torch.full((1, head.config.block_size), head.config.mask_token_id)
            ids[0, 0] = tokens[j]
            context = head.context(feats[None, :j])  # [1, j, H]
            kv = head.context_kv(context, torch.arange(j)[None])
            h = head(ids, torch.arange(j, j + head.config.block_size)[None], kv)[0]  # [B, H]
            rows.append(head.logits(h[1]))
    conf, top = torch.stack(rows).float().softmax(-1).max(-1)
    assert found.hits == (head.to_target_ids(top) == tokens[length - m:]).tolist()
    torch.testing.assert_close(torch.tensor(found.confidence, dtype=conf.dtype), conf, rtol=1e-5, atol=1e-6)
    assert proposer._seen == length - 2 and all(len(c) == length - 2 for c in proposer._caches)


def test_after_a_probe_the_dflash_drafter_drafts_what_it_would_have_drafted(family, heads):
    """The next round, handed the root's feature again, drafts the tree a drafter that never probed drafts."""
    from headway.inference.proposer import DraftContext

    probed, tokens, feats = _probe_case(family, heads)
    plain = probed.fork()
    length = tokens.shape[0]
    assert probed.probe(DraftContext(tokens, feats[:length - 1], None, 8, None, None), 4) is not None
    tree = probed.resolve_tree(DYNAMIC)
    with torch.no_grad():
        a = probed.propose(DraftContext(tokens, feats[length - 2:length - 1], tree, 8, None, None))
        b = plain.propose(DraftContext(tokens, feats[:length - 1], tree, 8, None, None))
    assert a.tree.parents == b.tree.parents and torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(torch.tensor(a.score_list()), torch.tensor(b.score_list()))


def test_auto_probes_a_dflash_drafter_that_lost_and_stays_the_targets(family, heads, monkeypatch):
    """tree="auto" tests DFlash before trying it again (forced on every retry here, the verdicts alternating): the
    probes run and every output is the target's own."""
    from headway.inference.auto import AutoTree

    verdicts = []

    def probed(self, probe, prefix_len, real=AutoTree.probed, **kwargs):
        real(self, probe, prefix_len, **kwargs)
        verdicts.append(len(verdicts) % 2 == 0)
        return verdicts[-1]

    monkeypatch.setattr(AutoTree, "wants_probe", lambda self: True)
    monkeypatch.setattr(AutoTree, "probed", probed)
    gen = SpeculativeGenerator(family.target, dflash_for(family, heads), tree="auto")
    probes = 0
    for prompt, max_new, ref in list(zip(family.prompts, family.max_new, family.references))[:6]:
        out = gen.generate(prompt, max_new_tokens=max_new)
        assert torch.equal(out.sequences, ref)
        probes += out.stats.probes
    assert probes >= 5 and True in verdicts and False in verdicts, (probes, verdicts)
