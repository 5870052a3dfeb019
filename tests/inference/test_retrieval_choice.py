"""Choosing among retrieval drafters: the counterfactual judgment of each round's drafts, the switch to the
retriever that would have been accepted more, and exact output alone, in a hybrid and in a batch."""

import dataclasses

import pytest
import torch

from headway.inference import (Draft, DraftModelProposer, Lookahead, PromptLookup, Proposer, RetrievalChoice,
                               SpeculativeGenerator, SuffixDecoding, Tree)
from headway.inference.proposer import root_only
from headway.inference.retrieval_choice import matched_depth
from headway.inference.tree import chain
from tests.inference.spec_utils import (copy_prompt_tau, draft_context, made_up_curve, noisy_copy, reference_generate,
                                       tiny_vocab_model)


def test_matched_depth_walks_the_tree_along_the_text_that_followed():
    parents, tokens = [-1, 0, 1, 0, 3], [9, 4, 5, 6, 7]  # root 9: 4-5 and 6-7
    assert matched_depth(parents, tokens, [4, 5, 2]) == 2  # the whole 4-5 branch
    assert matched_depth(parents, tokens, [6, 3]) == 1  # 6, then 3 is not 7
    assert matched_depth(parents, tokens, [2]) == 0
    assert matched_depth(parents, tokens, [6]) is None  # 6 has a child: the next token decides
    assert matched_depth(parents, tokens, []) is None
    assert matched_depth(parents, tokens, [4, 5]) == 2  # a leaf reached: nothing deeper to know


class Scripted(Proposer):
    """A chain drafter that copies ``text`` from the context's end, each token shifted by ``shift`` (0: right)."""

    def __init__(self, text: list[int], shift: int, depth: int = 3, vocab: int = 8):
        self.text, self.shift, self.depth, self.vocab = text, shift, depth, vocab

    def propose(self, ctx):
        at = ctx.tokens.shape[0]
        nxt = [(t + self.shift) % self.vocab for t in self.text[at:at + min(self.depth, ctx.max_depth)]]
        return Draft(chain(len(nxt)), torch.tensor([int(ctx.tokens[-1])] + nxt))


class Silent(Proposer):
    def propose(self, ctx):
        return root_only(ctx)


def test_the_retriever_that_would_have_been_accepted_takes_over():
    model = tiny_vocab_model(seed=3)
    prompt = torch.tensor([[2, 5, 3, 7, 4]])
    ref = reference_generate(model, prompt, 30, eos_token_id=None)
    text = ref[0].tolist()
    choice = RetrievalChoice([Scripted(text, shift=1), Scripted(text, shift=0)])  # the first one is always wrong
    out = SpeculativeGenerator(model, choice, tree=None).generate(prompt, max_new_tokens=30)
    assert torch.equal(out.sequences, ref)
    # three wrong rounds (one token each) before the first right draft's three tokens are known, then the right one
    assert choice.current == 1 and choice.chosen == [3, 7], choice.chosen
    assert choice.accepted[0] == 0 and choice.accepted[1] >= 3 * 5, choice.accepted
    wrong = SpeculativeGenerator(model, Scripted(text, shift=1), tree=None).generate(prompt, max_new_tokens=30)
    assert out.stats.target_forward_passes < wrong.stats.target_forward_passes / 2
    # the next request starts again from no evidence, with the first one
    again = SpeculativeGenerator(model, choice, tree=None).generate(prompt, max_new_tokens=30)
    assert torch.equal(again.sequences, ref) and choice.chosen == [3, 7] and choice.accepted[0] == 0


def test_a_lead_under_the_margin_does_not_switch_and_a_silent_retriever_gives_way():
    model = tiny_vocab_model(seed=3)
    prompt = torch.tensor([[2, 5, 3, 7, 4]])
    text = reference_generate(model, prompt, 20, eos_token_id=None)[0].tolist()
    choice = RetrievalChoice([Scripted(text, shift=1), Scripted(text, shift=0, depth=1)], margin=100)
    SpeculativeGenerator(model, choice, tree=None).generate(prompt, max_new_tokens=20)
    assert choice.current == 0 and choice.accepted[1] > 0 and choice.chosen[1] == 0
    silent = RetrievalChoice([Silent(), Scripted(text, shift=0)], margin=100)
    out = SpeculativeGenerator(model, silent, tree=None).generate(prompt, max_new_tokens=20)
    assert silent.current == 0 and silent.chosen[0] == 0 and silent.chosen[1] > 0  # the drafting one drafts
    assert out.stats.mean_accepted_length > 3


class Watched(RetrievalChoice):
    """Records which retriever was drafting after each judgment."""

    seen: set

    def _judge(self, host):
        super()._judge(host)
        self.__dict__.setdefault("seen", set()).add(self.current)


def test_prompt_lookup_and_suffix_decoding_by_choice_are_exact_alone_and_in_a_hybrid():
    model = tiny_vocab_model(seed=3)
    g = torch.Generator().manual_seed(0)
    choice = Watched([SuffixDecoding(cross_request=False), PromptLookup()], margin=0)
    assert copy_prompt_tau(model, SpeculativeGenerator(model, choice), g, prompts=6) > 2.0
    assert choice.seen == {0, 1}  # prompt lookup took over from suffix decoding at times
    hybrid = [DraftModelProposer(noisy_copy(model, scale=2.0, seed=1), gamma=3),
              RetrievalChoice([SuffixDecoding(cross_request=False), PromptLookup()])]
    assert copy_prompt_tau(model, SpeculativeGenerator(model, hybrid), g) > 1.5
    # a batch's rows: tests/inference/test_batch.py ("hybrid-choice")


def test_the_generators_tree_caps_every_retriever():
    choice = RetrievalChoice([SuffixDecoding(cross_request=False, min_token_prob=0.0), PromptLookup()])
    tree = choice.resolve_tree("chain-2")
    tokens = [2, 5, 3, 7, 4, 6, 2, 5, 3, 7, 4, 6, 2, 5]
    for i in range(2):
        choice.current = i
        draft = choice.propose(draft_context(tokens, tree=tree))
        assert 2 <= draft.tree.size <= 3 and max(draft.tree.depths) <= 2 and draft.sources == [i] * draft.tree.size


def test_forks_judge_apart_and_bad_lists_are_one_line():
    choice = RetrievalChoice([PromptLookup(), SuffixDecoding()])
    clone = choice.fork()
    assert clone.drafters[0] is not choice.drafters[0] and clone.accepted is not choice.accepted
    choice.propose(draft_context([2, 5, 3, 2, 5]))
    clone.propose(draft_context([4, 6, 4, 6, 4, 6]))
    assert len(choice._open) == len(clone._open) == 1 and choice._open[0][0] == 5 and clone._open[0][0] == 6
    with pytest.raises(ValueError, match="at least two"):
        RetrievalChoice([PromptLookup()])
    with pytest.raises(ValueError, match="reads the target"):
        RetrievalChoice([PromptLookup(), Lookahead()])
    with pytest.raises(ValueError, match="margin"):
        RetrievalChoice([PromptLookup(), SuffixDecoding()], margin=-1)


def test_each_retriever_is_calibrated_apart_alone_and_in_a_hybrid():
    from headway.inference.hybrid import merge_drafts

    model_draft = Draft(Tree([-1, 0]), torch.tensor([9, 4]))
    chosen = Draft(Tree([-1, 0, 1]), torch.tensor([9, 4, 5]), sources=[1, 1, 1])  # RetrievalChoice's part 1 drafted
    merged = merge_drafts([model_draft, chosen], 4, ids=[0, 1])
    assert merged.tokens.tolist() == [9, 4, 5] and merged.sources == [0, 0, (1, 1)]  # node 4 stays the model's
    model = tiny_vocab_model(seed=3)
    g = torch.Generator().manual_seed(0)
    prompt = torch.tensor([[2, 5, 3, 7, 4]])
    text = reference_generate(model, prompt, 30, eos_token_id=None)[0].tolist()
    alone = SpeculativeGenerator(model, RetrievalChoice([Scripted(text, shift=1), Scripted(text, shift=0)]),
                                 cost_curve=made_up_curve(0.1))
    alone.generate(prompt, max_new_tokens=30)
    assert {0, 1} <= {key[0] for key in alone._controller.cells} <= {0, 1}  # the wrong one's cells and the right one's
    hybrid = SpeculativeGenerator(model, [DraftModelProposer(noisy_copy(model, scale=2.0, seed=1), gamma=3),
                                          RetrievalChoice([SuffixDecoding(cross_request=False), PromptLookup()])])
    copy_prompt_tau(model, hybrid, g)
    sources = {key[0] for key in hybrid._controller.cells}
    assert 0 in sources and sources & {(1, 0), (1, 1)} and sources <= {0, (1, 0), (1, 1)}, sources


class Sampled(Proposer):
    """A drafter that drew nothing this round but says it samples (q set): the hybrid verifies another's tree."""

    def propose(self, ctx):
        return dataclasses.replace(root_only(ctx), q=torch.full((1, 8), 1 / 8))


def test_a_sampled_round_verifying_the_choice_alone_names_the_retriever():
    from headway.inference import HybridProposer, SamplingParams

    hybrid = HybridProposer([Sampled(), RetrievalChoice([SuffixDecoding(cross_request=False), PromptLookup()])])
    ctx = draft_context([2, 5, 3, 7, 2, 5, 3], sampling=SamplingParams(1.0))
    draft = hybrid.propose(ctx)
    assert draft.tree.size > 1 and draft.sources == [(1, 0)] * draft.tree.size  # suffix decoding's, as the hybrid's 1


def test_on_a_device_the_retrievers_draft_from_the_host_mirror():
    """A context on another device (meta: no data, so any read of it would fail): the retrievers draft from the host
    mirror and only the chosen draft's tokens go to the device, the same draft as on the CPU."""
    tokens = [2, 5, 3, 7, 4, 6, 2, 5, 3, 7, 4, 6, 2, 5]
    on_cpu = RetrievalChoice([SuffixDecoding(cross_request=False), PromptLookup()]).propose(draft_context(tokens))
    ctx = dataclasses.replace(draft_context(tokens), tokens=torch.empty(len(tokens), dtype=torch.long, device="meta"),
                              host_tokens=tokens)
    on_meta = RetrievalChoice([SuffixDecoding(cross_request=False), PromptLookup()]).propose(ctx)
    assert on_meta.tokens.device.type == "meta" and on_meta.tree.parents == on_cpu.tree.parents
    assert on_meta.sources == on_cpu.sources and on_meta.score_list() == on_cpu.score_list()
