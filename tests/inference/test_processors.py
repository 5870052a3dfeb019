"""The generation config's logits processors: built as ``generate`` builds them, applied to each tree node
with its own context (the sequence plus the draft path down to it); settings that cannot be honoured
exactly are refused by name."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, NoRepeatNGramLogitsProcessor
from transformers import RepetitionPenaltyLogitsProcessor
from transformers.generation import logits_process as lp

from headway.inference import PromptLookup, SpeculativeGenerator
from headway.inference.processors import apply_processors, node_contexts, prepare_generation
from headway.inference.tree import Tree

TREE = Tree([-1, 0, 0, 1, 3])  # root, two children, a grandchild under the first, its child
TOKENS = torch.tensor([9, 4, 5, 6, 7])  # node tokens, the root first


@pytest.mark.parametrize("setting, name", [
    (dict(num_beams=2), "num_beams"),
    (dict(guidance_scale=1.5), "guidance_scale"),
    (dict(stop_strings=["end"]), "stop_strings"),
    (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
    (dict(repetition_penaltyy=1.2), "repetition_penaltyy"),
])
def test_settings_that_cannot_be_honoured_are_refused(family, setting, name):
    gen = SpeculativeGenerator(family.target, PromptLookup())
    with pytest.raises(ValueError, match=name):
        gen.generate(family.prompts[0], max_new_tokens=4, **setting)


def test_sampling_warpers_beyond_top_k_top_p_are_refused(family):
    gen = SpeculativeGenerator(family.target, PromptLookup())
    with pytest.raises(ValueError, match="min_p"):
        gen.generate(family.prompts[0], max_new_tokens=4, temperature=1.0, min_p=0.1)
    gen.generate(family.prompts[0], max_new_tokens=4, min_p=0.1)  # greedy: generate(do_sample=False) ignores it too


def test_node_contexts_are_the_prefix_plus_the_path_below_the_root():
    prefix = torch.tensor([1, 2, 9])  # ends with the root token
    assert node_contexts(prefix, TREE, TOKENS, [0]).tolist() == [[1, 2, 9]]
    assert node_contexts(prefix, TREE, TOKENS, [1, 2]).tolist() == [[1, 2, 9, 4], [1, 2, 9, 5]]
    assert node_contexts(prefix, TREE, TOKENS, [3]).tolist() == [[1, 2, 9, 4, 6]]
    assert node_contexts(prefix, TREE, TOKENS, [4]).tolist() == [[1, 2, 9, 4, 6, 7]]


def test_each_node_is_processed_with_its_own_context():
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0), NoRepeatNGramLogitsProcessor(2)])
    prefix = torch.tensor([4, 6, 3, 9])
    logits = torch.randn(TREE.size, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = apply_processors(processors, prefix, TREE, TOKENS, logits)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    contexts = [[4, 6, 3, 9], [4, 6, 3, 9, 4], [4, 6, 3, 9, 5], [4, 6, 3, 9, 4, 6], [4, 6, 3, 9, 4, 6, 7]]
    for node, context in enumerate(contexts):
        expected = processors(torch.tensor([context]), logits[node].float()[None].clone())[0]
        assert torch.equal(out[node], expected), node
    # no repeated bigrams: node 1's context ends in 4 and "4 6" occurred, so 6 is banned there; node 2's ends in 5
    assert out[1, 6] == float("-inf") and out[2, 6] != float("-inf")
    assert torch.equal(apply_processors(LogitsProcessorList(), prefix, TREE, TOKENS, logits), logits.float())


def test_prepare_generation_builds_what_generate_builds(tiny_llama):
    model, _ = tiny_llama
    prompt = torch.tensor([5, 6, 7])
    setup = prepare_generation(model, prompt, 10, sampling=False, repetition_penalty=1.3, min_new_tokens=4,
                               eos_token_id=[3, 5])
    kinds = {type(p) for p in setup.processors}
    assert kinds >= {lp.RepetitionPenaltyLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor}
    assert setup.eos_token_ids == {3, 5}
    assert prepare_generation(model, prompt, 10, sampling=False, eos_token_id=4).eos_token_ids == {4}
    assert prepare_generation(model, prompt, 10, sampling=False, eos_token_id=None).eos_token_ids == set()
    assert len(prepare_generation(model, prompt, 10, sampling=True, eos_token_id=None).processors) == 0

    class Own(LogitsProcessor):  # a user's own processor: documented to be called per node, so accepted
        def __call__(self, input_ids, scores):
            return scores

    own = Own()
    built = prepare_generation(model, prompt, 10, sampling=False, logits_processor=LogitsProcessorList([own]),
                               eos_token_id=None)
    assert own in list(built.processors)


@pytest.mark.parametrize("sampling, kwargs, match", [
    (False, dict(no_such_setting=1), "unknown generation setting\\(s\\) \\['no_such_setting'\\]"),
    (False, dict(num_beams=3), "num_beams=3 cannot be honoured exactly"),
    (True, dict(typical_p=0.5), "sampling setting typical_p=0.5 is not supported"),
], ids=["unknown", "beams", "typical-p"])
def test_prepare_generation_refuses_by_name(tiny_llama, sampling, kwargs, match):
    with pytest.raises(ValueError, match=match):
        prepare_generation(tiny_llama[0], torch.tensor([5, 6, 7]), 10, sampling=sampling, **kwargs)
    if sampling:  # greedy decoding ignores sampling-only warpers, as generate(do_sample=False) does
        prepare_generation(tiny_llama[0], torch.tensor([5, 6, 7]), 10, sampling=False, **kwargs)
