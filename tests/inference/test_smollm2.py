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
