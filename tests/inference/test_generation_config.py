"""The target's generation config is honoured exactly, and the runtime fixes of issue 7.

Greedy output must equal ``target.generate(do_sample=False)`` with each logits processor that
``generate`` builds from the generation config (or from arguments), on two model families and
three drafters (draft-model tree, prompt-lookup tree, Medusa tree); settings that cannot be
honoured exactly are refused by name (test_processors.py, with the processors' own unit tests).
Sampling with processors is checked node by node in test_generator_sampling.py
(test_sampling_wiring_with_generation_config). Of issue 7's fixes, the draft model's padded
embeddings are checked in test_draft_model.py and the Medusa heads' cast at bind in test_medusa.py.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch
from transformers import GenerationConfig, TextStreamer

from headway.heads.target.tiny import build_tiny_target
from headway.inference import DraftModelProposer, PromptLookup, SpeculativeGenerator
from tests.inference.spec_utils import noisy_copy, reference_generate

DRAFTERS = {
    "draft-tree": (lambda f: DraftModelProposer(f.draft), "tree-7"),
    "lookup-tree": (lambda f: PromptLookup(max_matches=4), None),
    "medusa-tree": (lambda f: f.heads, "tree-15"),
}


def settings_for(ref_new: list[int]) -> dict[str, dict]:
    """Settings that change what generate produces on this prompt, built from its plain output."""
    first, common = ref_new[0], max(set(ref_new), key=ref_new.count)
    return {
        "repetition_penalty": dict(repetition_penalty=1.3),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "min_new_tokens": dict(eos_token_id=ref_new[3], min_new_tokens=12),  # EOS suppressed until 12 new tokens
        "suppress_tokens": dict(suppress_tokens=[common, ref_new[5]]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[first]),
        "bad_words_ids": dict(bad_words_ids=[[common], ref_new[6:8]]),
        "sequence_bias": dict(sequence_bias={(ref_new[2],): -4.0, (ref_new[4], ref_new[5]): 3.0}),
    }


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_equals_generate_with_every_processor(family, drafter):
    make, tree = DRAFTERS[drafter]
    gen = SpeculativeGenerator(family.target, make(family), tree=tree)
    changed = 0
    for prompt in family.prompts[:3]:
        plain = reference_generate(family.target, prompt, 24, eos_token_id=None)
        for name, setting in settings_for(plain[0, prompt.shape[1]:].tolist()).items():
            ref = reference_generate(family.target, prompt, 24, **setting)
            out = gen.generate(prompt, max_new_tokens=24, **setting)
            assert torch.equal(out.sequences, ref), f"{family.name}/{drafter}/{name}: differs from generate"
            changed += not torch.equal(ref[:, :plain.shape[1]], plain[:, :ref.shape[1]])
    assert changed >= 12  # the settings really change the output, so equality means something


def test_generation_config_of_the_model_is_read(family):
    """A model that ships repetition_penalty (Qwen2.5-Instruct: 1.05) and an EOS in its generation
    config: headway with no arguments equals generate with no arguments."""
    target = family.target
    saved = target.generation_config
    try:
        prompt = family.prompts[1]
        plain = reference_generate(target, prompt, 30, eos_token_id=None)[0, prompt.shape[1]:].tolist()
        target.generation_config = GenerationConfig(repetition_penalty=1.4, eos_token_id=plain[9], pad_token_id=0)
        ref = reference_generate(target, prompt, 30)
        assert ref.shape[1] <= prompt.shape[1] + 30 and not torch.equal(ref[0, prompt.shape[1]:], torch.tensor(plain))
        gen = SpeculativeGenerator(target, DraftModelProposer(family.draft), tree="tree-7")
        assert torch.equal(gen.generate(prompt, max_new_tokens=30).sequences, ref)
        assert torch.equal(gen.generate(prompt, max_new_tokens=30, generation_config=GenerationConfig()).sequences,
                           reference_generate(target, prompt, 30, generation_config=GenerationConfig()))
        no_eos = gen.generate(prompt, max_new_tokens=30, eos_token_id=None)
        assert no_eos.stats.new_tokens == 30  # eos_token_id=None: never stops, as in generate
    finally:
        target.generation_config = saved


def test_the_length_set_in_the_call_is_generates(family):
    """Without ``max_new_tokens``, the call's own generation_config or keyword sets the length as in generate
    (max_new_tokens before max_length, which counts the prompt); none set: 128. A max_length inside the prompt
    is a one-line error."""
    target, prompt = family.target, family.prompts[0]
    gen = SpeculativeGenerator(target, PromptLookup(max_matches=4), tree=None)
    t = prompt.shape[1]
    calls = [dict(generation_config=GenerationConfig(max_new_tokens=5)), dict(max_length=t + 7),
             dict(generation_config=GenerationConfig(max_length=t + 6)),
             dict(generation_config=GenerationConfig(max_new_tokens=4), max_length=t + 9)]
    for kwargs in calls:
        ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, pad_token_id=0,
                              eos_token_id=None, **kwargs)
        out = gen.generate(prompt, eos_token_id=None, **kwargs)
        assert torch.equal(out.sequences, ref) and ref.shape[1] < t + 10, kwargs
    assert gen.generate(prompt, max_new_tokens=3, max_length=t + 9, eos_token_id=None).stats.new_tokens == 3
    assert gen.generate(prompt, eos_token_id=None).stats.new_tokens == 128
    with pytest.raises(ValueError, match=rf"max_length={t} leaves no room after the prompt's {t} tokens"):
        gen.generate(prompt, max_length=t)
    with pytest.raises(ValueError, match=r"max_length must be an integer .*, got 40.0"):
        gen.generate(prompt, max_length=40.0)


class Recorder:
    """A streamer in transformers' protocol: put(tensor) per step, end() once."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ended += 1


def test_streamer_sees_tokens_as_they_are_accepted(family):
    gen = SpeculativeGenerator(family.target, DraftModelProposer(family.draft), tree="tree-7")
    prompt = family.prompts[2]
    rec = Recorder()
    out = gen.generate(prompt, max_new_tokens=20, eos_token_id=None, streamer=rec)
    assert rec.ended == 1 and rec.puts[0] == prompt[0].tolist()
    assert sum(rec.puts[1:], []) == out.sequences[0, prompt.shape[1]:].tolist()
    assert len(rec.puts) - 1 == out.stats.target_forward_passes and max(map(len, rec.puts[1:])) > 1


def test_text_streamer_prints_the_generated_text():
    target, tokenizer = build_tiny_target("llama", seed=3)
    prompt = tokenizer("the cat sat on the mat and the dog", return_tensors="pt")["input_ids"]
    gen = SpeculativeGenerator(target, PromptLookup(max_matches=2))
    buf = io.StringIO()
    with redirect_stdout(buf):
        out = gen.generate(prompt, max_new_tokens=16, streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert buf.getvalue().strip() == tokenizer.decode(out.sequences[0, prompt.shape[1]:]).strip() != ""


def test_absolute_positions_stay_inside_the_context():
    """GPT-2 (learned absolute positions, 40 of them): generating up to the last position with a
    padded chain must neither index past the table nor change the output."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=40, eos_token_id=None)
    torch.manual_seed(0)
    target = GPT2LMHeadModel(cfg).eval()
    target.generation_config.eos_token_id = None
    draft = noisy_copy(target, seed=1)
    prompt = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    ref = reference_generate(target, prompt, 20)
    for drafter, tree in [(DraftModelProposer(draft, gamma=2), None), (PromptLookup(num_pred_tokens=1), None)]:
        out = SpeculativeGenerator(target, drafter, tree=tree, pad_to=4).generate(prompt, max_new_tokens=20)
        assert torch.equal(out.sequences, ref)
