"""The real default target (SmolLM2-135M, fp32): greedy speculative output equals generate."""

import pytest
import torch

from headway.heads import MedusaConfig, MedusaHeads
from headway.inference import PromptLookup, SpeculativeGenerator

PROMPTS = [
    "Here is a list of fruits: apple, banana, cherry, date, fig. Repeat it: apple, banana,",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
]


@pytest.mark.slow
def test_smollm2_greedy_equals_generate(smollm2):
    model, tokenizer = smollm2
    # Untrained heads (every head starts as the target's own lm_head): acceptance is low, exactness is the point here.
    heads = MedusaHeads.from_target(model, MedusaConfig(num_heads=3, share_lm_head=True))
    gens = [SpeculativeGenerator(model, PromptLookup(max_matches=3, max_nodes=15)),
            SpeculativeGenerator(model, heads, tree="tree-7")]
    copied = 0
    for text in PROMPTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                             eos_token_id=None)
        for gen in gens:
            out = gen.generate(ids, max_new_tokens=24)
            assert torch.equal(out.sequences, ref), text
        copied = max(copied, gens[0].generate(ids, max_new_tokens=24).stats.mean_accepted_length)
    assert copied > 2  # the list prompt is copy-heavy


@pytest.mark.slow
def test_smollm2_packed_greedy_equals_unpacked_generate(smollm2):
    """The default as `headway bench` and `headway generate` run it: linears prepacked for the verification
    passes, output still exactly plain greedy on the model as loaded. (Fixed trees: tree="auto" on the real
    model runs in the test above; here it would only measure the packed model's cost curve, about a minute.)"""
    from headway.inference import pack_linears, unpack_linears

    model, tokenizer = smollm2
    heads = MedusaHeads.from_target(model, MedusaConfig(num_heads=3, share_lm_head=True))
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in PROMPTS]
    refs = [model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                           eos_token_id=None) for ids in prompts]
    try:
        assert pack_linears(model) > 0
        for gen in (SpeculativeGenerator(model, PromptLookup(max_matches=3, max_nodes=15), tree=None),
                    SpeculativeGenerator(model, heads, tree="tree-7")):
            for ids, ref in zip(prompts, refs):
                assert torch.equal(gen.generate(ids, max_new_tokens=24).sequences, ref)
    finally:
        unpack_linears(model)


@pytest.mark.slow
def test_smollm2_trained_heads_greedy_equals_generate(smollm2, tmp_path):
    """Heads trained briefly on the real default (shipped config: shared lm_head, 8k draft vocabulary)
    accept drafts, and the output stays exactly the target's on chat prompts."""
    from pathlib import Path

    from headway.heads import load_drafter
    from headway.train.config import load_config
    from headway.train.medusa import MedusaRunConfig, train

    config = Path(__file__).resolve().parents[2] / "configs" / "medusa" / "smollm2-135m.yaml"
    train(load_config(MedusaRunConfig, config, [
        "data.source=packaged", "data.max_examples=300", "data.max_length=64", "train.batch_size=8",
        "train.max_steps=25", "train.lr=3e-3", "train.trackers=[]", f"train.output_dir={tmp_path}"]))
    model, tokenizer = smollm2
    gen = SpeculativeGenerator(model, load_drafter(tmp_path), tree="tree-7")
    accepted = 0
    for text in ["What is your favorite color?", "Tell me a joke about computers.", "How are you today?"]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        out = gen.generate(ids, max_new_tokens=32, eos_token_id=tokenizer.eos_token_id)
        assert torch.equal(out.sequences, ref), text
        accepted += sum(a > 1 for a in out.stats.accepted_per_step)
    assert accepted >= 3, "the trained heads never got a draft token accepted"


@pytest.mark.slow
def test_smollm2_eagle3_greedy_equals_generate(smollm2, tmp_path):
    """An EAGLE-3 drafter trained briefly on the real default (shipped config: layers 2, 15, 27, 8k draft
    vocabulary, online features through hooks) drafts over chains, static and dynamic trees, and the
    output stays exactly the target's; a sampled run stays inside the target's support."""
    from pathlib import Path

    from headway.heads import load_drafter
    from headway.train.config import load_config
    from headway.train.eagle import EagleRunConfig, train

    config = Path(__file__).resolve().parents[2] / "configs" / "eagle" / "eagle3-smollm2-135m.yaml"
    train(load_config(EagleRunConfig, config, [
        "data.source=packaged", "data.max_examples=200", "data.max_length=64", "train.batch_size=8",
        "train.max_steps=20", "train.lr=3e-3", "loss.ttt_steps=3", "train.trackers=[]",
        f"train.output_dir={tmp_path}"]))
    model, tokenizer = smollm2
    head = load_drafter(tmp_path)
    assert head.config.feature_layers == [2, 15, 27] and head.config.draft_vocab_size == 8192
    accepted = 0
    for tree in ("chain-4", "tree-7", {"depth": 4, "top_k": 4, "total_tokens": 10}):
        gen = SpeculativeGenerator(model, head, tree=tree)
        for text in ["What is your favorite color?", "Tell me a joke about computers."]:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
            out = gen.generate(ids, max_new_tokens=32, eos_token_id=tokenizer.eos_token_id)
            assert torch.equal(out.sequences, ref), (text, tree)
            accepted += sum(a > 1 for a in out.stats.accepted_per_step)
    assert accepted >= 3, "the trained EAGLE-3 drafter never got a draft token accepted"
    sampled = SpeculativeGenerator(model, head, tree="tree-7").generate(
        ids, max_new_tokens=16, temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert sampled.stats.new_tokens == 16 or int(sampled.sequences[0, -1]) == tokenizer.eos_token_id
