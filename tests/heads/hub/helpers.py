"""What the Hub, card and info tests share: a seeded tiny Medusa drafter and its target's Hub id."""

import torch

from headway.heads import MedusaConfig, MedusaHeads


TARGET = "someorg/tiny-target"


def tiny_heads(seed: int, base: str | None = TARGET) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=32, num_heads=2, base_model_name_or_path=base))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p))
    return heads
