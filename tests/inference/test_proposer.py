"""The one drafter interface: what ``as_proposer`` makes of what the user passes, the base class's defaults,
the empty draft, and children drawn greedily or without replacement."""

import pytest
import torch

from headway.heads import MedusaConfig, MedusaHeads
from headway.inference import DraftModelProposer, MedusaProposer, PromptLookup, SpeculativeGenerator
from headway.inference.hybrid import HybridProposer
from headway.inference.proposer import Proposer, as_proposer, root_draft, root_only, sample_children
from headway.inference.verify import SamplingParams, probs
from tests.inference.spec_utils import draft_context


def test_unknown_drafter_rejected(tiny_llama):
    with pytest.raises(ValueError, match="unsupported drafter"):
        SpeculativeGenerator(tiny_llama[0], object())


def test_pre_rename_names_still_import_with_a_warning():
    import headway.inference as inf

    for old, new in [("Drafter", "Proposer"), ("MedusaDrafter", "MedusaProposer"), ("as_drafter", "as_proposer")]:
        with pytest.warns(DeprecationWarning, match=new):
            assert getattr(inf, old) is getattr(inf, new)
    with pytest.raises(AttributeError):
        inf.NoSuchName


def test_as_proposer_wraps_each_kind_of_drafter(tiny_llama):
    target, _ = tiny_llama
    lookup = PromptLookup()
    assert as_proposer(lookup) is lookup  # a Proposer stays itself
    assert isinstance(as_proposer(MedusaHeads.from_target(target, MedusaConfig(num_heads=2))), MedusaProposer)
    draft = as_proposer(target)  # a causal LM: a draft model
    assert isinstance(draft, DraftModelProposer) and draft.model is target
    hybrid = as_proposer([lookup, target])
    assert isinstance(hybrid, HybridProposer)
    assert isinstance(as_proposer((lookup,)), HybridProposer)
    with pytest.raises(ValueError, match="unsupported drafter str"):
        as_proposer("medusa")
    with pytest.raises(ValueError, match="unsupported drafter"):
        as_proposer(target.model)  # a transformers model without an output embedding is no causal LM


def test_the_base_class_defaults():
    proposer = Proposer()
    assert proposer.feature_layers is None and proposer.default_tree() is None and proposer.resolve_tree(None) is None
    assert proposer.resolve_tree("chain-2").parents == [-1, 0, 1]
    assert proposer.resolve_tree([[0], [1], [0, 0]]).size == 4  # paths of ranks
    assert proposer.bind(None) is None and proposer.reset() is None and proposer.check_tree(None) is None
    with pytest.raises(NotImplementedError):
        proposer.propose(draft_context([1, 2]))


def test_the_empty_draft_is_the_root_alone():
    tokens = torch.tensor([5, 6, 7])
    draft = root_draft(tokens)
    assert draft.tree.parents == [-1] and draft.tokens.tolist() == [7] and draft.q is None and draft.scores is None
    draft.tokens[0] = 9
    assert tokens[-1] == 7  # a copy, not a view of the context
    assert root_only(draft_context([3, 4])).tokens.tolist() == [4]


def test_greedy_children_are_the_top_k():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 0.0, 1.0, 4.0]])
    tokens, q = sample_children(logits, 2, None, None)
    assert q is None and tokens.tolist() == [[1, 2], [0, 3]]


def test_sampled_children_are_distinct_draws_from_q():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0)) * 2
    params = SamplingParams(0.8)
    tokens, q = sample_children(logits, 4, params, torch.Generator().manual_seed(1))
    assert tokens.shape == (3, 4) and torch.allclose(q, probs(logits, params))
    assert all(len(set(row)) == 4 for row in tokens.tolist())  # without replacement
    again, _ = sample_children(logits, 4, params, torch.Generator().manual_seed(1))
    assert torch.equal(tokens, again)  # the generator is the only randomness
    # top-k 2: only two tokens have q > 0, so two draws are exactly them
    top2, q2 = sample_children(logits, 2, SamplingParams(1.0, 2), torch.Generator().manual_seed(2))
    assert [set(row) for row in top2.tolist()] == [set(row) for row in logits.topk(2).indices.tolist()]
    assert ((q2 > 0).sum(-1) == 2).all()
    # the first draw follows q: over many draws its frequency matches q (a peaked row, 2,000 draws)
    row = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(3)
    first = torch.stack([sample_children(row, 2, SamplingParams(1.0), g)[0][0, 0] for _ in range(2000)])
    freq = torch.bincount(first, minlength=4).double() / 2000
    assert torch.allclose(freq, row.softmax(-1)[0].double(), atol=0.04)


def test_rows_run_side_by_side_with_one_pass_per_kind_and_key():
    """run_rows steps every row's generator; each time, the waiting requests of one kind and key run in one
    run_together call (rows that finish early drop out), and each row gets its own result; run_alone runs
    the same generator one request at a time and gets the same Draft."""
    from headway.inference.proposer import Draft, DraftRequest, run_alone, run_rows
    from headway.inference.tree import chain

    calls = []

    class Double(DraftRequest):
        def __init__(self, key, x):
            self.key, self.x = key, x

        def run(self):
            return 2 * self.x

        @classmethod
        def run_together(cls, requests, state):
            calls.append((requests[0].key, [r.x for r in requests]))
            return [2 * r.x for r in requests]

    def steps(key, start, levels):
        x = start
        for _ in range(levels):
            x = yield Double(key, x)
        return Draft(chain(0), torch.tensor([x]))

    rows = [("a", 1, 3), ("a", 5, 1), ("b", 7, 2), ("a", 2, 0)]
    drafts = run_rows([steps(*row) for row in rows])
    assert [int(d.tokens[0]) for d in drafts] == [8, 10, 28, 2]
    assert [int(run_alone(steps(*row)).tokens[0]) for row in rows] == [8, 10, 28, 2]
    assert calls == [("a", [1, 5]), ("b", [7]), ("a", [2]), ("b", [14]), ("a", [4])]
