"""Session fixtures for the runtime tests: fp64 tiny targets (so argmax ties cannot flip between
a tree pass and generate's one-token steps), Medusa heads trained on each target's own greedy
continuations (non-trivial acceptance), a noisy copy of the target as draft model, prompts and
transformers' own greedy outputs to compare against; per-module fp64 tiny targets of three families
for the forward and cache tests."""

import dataclasses

import pytest
import torch

from headway.heads import MedusaHeads
from headway.heads.target.tiny import build_tiny_target
from tests.inference.spec_utils import make_prompts, noisy_copy, reference_generate, train_medusa

FAMILY_SEEDS = {"llama": 0, "qwen2": 1}
NUM_PROMPTS = 50


@dataclasses.dataclass
class Family:
    name: str
    target: torch.nn.Module
    heads: MedusaHeads
    draft: torch.nn.Module
    prompts: list  # [1, T] long tensors
    max_new: list  # tokens to generate per prompt
    references: list  # target.generate(do_sample=False) outputs [1, T + max_new]


@pytest.fixture(scope="session", params=list(FAMILY_SEEDS))
def family(request):
    name, seed = request.param, FAMILY_SEEDS[request.param]
    target, _ = build_tiny_target(name, seed=seed)
    target = target.to(torch.float64)
    prompts, max_new = make_prompts(target.config.vocab_size, NUM_PROMPTS, seed + 10)
    with torch.no_grad():
        refs = [reference_generate(target, p, m) for p, m in zip(prompts, max_new)]
    return Family(name, target, train_medusa(target, seed=seed), noisy_copy(target, seed=seed), prompts, max_new, refs)


@pytest.fixture(scope="session")
def eagle(family):
    """EAGLE-1 (full vocabulary) and EAGLE-3 (reduced draft vocabulary) heads trained on the family's target."""
    from tests.inference.eagle_utils import train_eagle

    seed = FAMILY_SEEDS[family.name]
    return {1: train_eagle(family.target, 1, seed=seed), 3: train_eagle(family.target, 3, seed=seed, draft_vocab=150)}


FORWARD_FAMILIES = ["llama", "qwen2", "gpt2"]


@pytest.fixture(scope="module", params=FORWARD_FAMILIES)
def family_model(request):
    """An fp64 tiny target per family (rotary and absolute positions) for the target-forward and cache tests."""
    model, _ = build_tiny_target(request.param, seed=3)
    return model.to(torch.float64)
