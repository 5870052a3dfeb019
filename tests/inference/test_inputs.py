"""What every generation path checks first: the settings, and the prompt against the target's config."""

import pytest
import torch
from transformers import LlamaConfig

from headway.inference.inputs import check_generation, check_prompt, check_settings, context_length


@pytest.fixture(scope="module")
def config():
    return LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       max_position_embeddings=12)


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=1),
    dict(max_new_tokens=64, temperature=0.7, top_k=5, top_p=0.9),
    dict(max_new_tokens=3, temperature=1, top_p=1),
], ids=["greedy", "sampling", "ints"])
def test_good_settings_pass(kwargs):
    assert check_settings(**kwargs) is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=True), "max_new_tokens"),  # a bool is not a count
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(max_new_tokens=2, temperature=-0.1), "temperature must be >= 0"),
    (dict(max_new_tokens=2, temperature=float("nan")), "temperature"),
    (dict(max_new_tokens=2, top_k=1.5), "top_k"),
    (dict(max_new_tokens=2, top_p=0.0), "top_p must be in \\(0, 1\\]"),
], ids=["zero-new", "bool-new", "float-new", "negative-temperature", "nan-temperature", "float-top-k", "zero-top-p"])
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_settings(**kwargs)


def test_context_length_reads_max_position_embeddings(config):
    assert context_length(config) == 12

    class NoPositions:  # a config naming no context (e.g. a state-space model)
        def get_text_config(self):
            return self

    assert context_length(NoPositions()) is None


def test_prompt_becomes_flat_long_ids(config):
    for given in (torch.tensor([[3, 4, 5]]), torch.tensor([3, 4, 5]), torch.tensor([3, 4, 5], dtype=torch.int32),
                  [3, 4, 5]):
        ids = check_prompt(given, config)
        assert ids.dtype == torch.long and ids.tolist() == [3, 4, 5]
    assert check_prompt(torch.arange(11), config).shape == (11,)  # one position left for the first new token
    assert check_prompt(torch.tensor([0, 49]), config).tolist() == [0, 49]  # both ends of the vocabulary


@pytest.mark.parametrize("ids, match", [
    (torch.tensor([[1, 2], [3, 4]]), "batch size 1; got input_ids of shape \\(2, 2\\)"),
    (torch.tensor([], dtype=torch.long), "non-empty integer tensor"),
    (torch.tensor([1.0, 2.0]), "non-empty integer tensor"),
    (torch.zeros(1, 1, 3, dtype=torch.long), "non-empty integer tensor"),
    (torch.arange(12), "the prompt has 12 tokens but the model's context is 12"),
    (torch.tensor([3, 50]), "outside the target's vocabulary \\[0, 50\\)"),
    (torch.tensor([-1, 3]), "outside the target's vocabulary"),
], ids=["batch", "empty", "float", "3d", "fills-context", "past-vocab", "negative-id"])
def test_bad_prompts_are_named(config, ids, match):
    with pytest.raises(ValueError, match=match):
        check_prompt(ids, config)


def test_check_generation_checks_the_settings_before_the_prompt(config):
    assert check_generation(config, torch.tensor([[7, 8]]), 4, temperature=1.0, top_p=0.5).tolist() == [7, 8]
    with pytest.raises(ValueError, match="max_new_tokens"):  # a bad setting is reported even with a bad prompt
        check_generation(config, torch.tensor([[1, 2], [3, 4]]), 0)
    with pytest.raises(ValueError, match="batch size 1"):
        check_generation(config, torch.tensor([[1, 2], [3, 4]]), 4)


@pytest.fixture(scope="module")
def lookup_gen():
    from transformers import LlamaForCausalLM

    from headway.inference import PromptLookup, SpeculativeGenerator

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, eos_token_id=None)).eval()
    return SpeculativeGenerator(target, PromptLookup(), tree="chain-3")


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=None), "input_ids must be token ids"),
    (dict(input_ids="hello"), "tokenize the text first"),
    (dict(generator=1234), "generator must be a torch.Generator"),
    (dict(streamer=object()), r"streamer must have put\(\) and end\(\)"),
    (dict(logits_processor=lambda ids, scores: scores), "logits_processor must be a list of callables"),
    (dict(logits_processor=[5]), "logits_processor must be a list of callables"),
    (dict(generation_config={"repetition_penalty": 1.1}), "generation_config must be a transformers GenerationConfig"),
    (dict(eos_token_id=[]), "eos_token_id must be a token id or a non-empty list"),
    (dict(eos_token_id=3.0), "eos_token_id must be"),
    (dict(eos_token_id=[[37]]), "eos_token_id must be"),
    (dict(top_k=True), "top_k must be an integer"),
    (dict(do_sample=True), "do_sample=True asks for sampling.*temperature"),
], ids=lambda v: str(v)[:40] if not isinstance(v, dict) else next(iter(v)))
def test_generate_arguments_of_the_wrong_kind_are_one_line(lookup_gen, kwargs, match):
    """Arguments a user may mistype reach generate as one ValueError naming the argument, not a traceback from
    inside transformers or torch; do_sample=True without a temperature is refused, not silently greedy."""
    from transformers import GenerationConfig

    kwargs = {"input_ids": torch.tensor([[5, 6, 7, 5, 6]]), "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        lookup_gen.generate(**kwargs)
    if "do_sample" in kwargs:
        with pytest.raises(ValueError, match="do_sample=True asks for sampling"):
            lookup_gen.generate(kwargs["input_ids"], max_new_tokens=4, generation_config=GenerationConfig(do_sample=True))
        assert lookup_gen.generate(kwargs["input_ids"], max_new_tokens=4, temperature=0.8, do_sample=True,
                                   generator=torch.Generator().manual_seed(0)).sequences.shape[1] == 9


@pytest.mark.parametrize("fill", [float("nan"), float("-inf")])
def test_a_processor_that_leaves_no_distribution_to_sample_is_one_line(lookup_gen, fill):
    """A logits processor returning NaN scores, or masking every token, while sampling: one ValueError naming the
    processor, not torch's message from inside multinomial (alone and in a batch)."""
    ids = torch.tensor([[5, 6, 7, 5, 6], [9, 5, 6, 7, 5]])
    for batch in (ids[:1], ids):
        with pytest.raises(ValueError, match="a logits_processor .* returned NaN scores or masked every token"):
            lookup_gen.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=4, temperature=0.8,
                                logits_processor=[lambda i, scores: torch.full_like(scores, fill)],
                                generator=torch.Generator().manual_seed(0))


def test_a_target_that_samples_by_default_is_decoded_greedily_with_a_warning(lookup_gen):
    """A checkpoint whose generation_config says do_sample=True: headway's generate stays greedy (its documented
    default: temperature=0) and says so once."""
    config = lookup_gen.target.generation_config
    config.do_sample, config.temperature = True, 0.7
    try:
        with pytest.warns(UserWarning, match="decodes greedily unless generate is given temperature > 0"):
            out = lookup_gen.generate(torch.tensor([[5, 6, 7, 5, 6]]), max_new_tokens=4)
    finally:
        config.do_sample, config.temperature = False, 1.0
    want = lookup_gen.target.generate(torch.tensor([[5, 6, 7, 5, 6]]), max_new_tokens=4, do_sample=False)
    assert torch.equal(out.sequences, want)
