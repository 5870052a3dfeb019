"""Examples into training batches, and the target's last hidden state computed online."""

from __future__ import annotations

import torch


@torch.no_grad()
def last_hidden_state(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] token ids -> [B, T, H] final hidden states (after the final norm), no logits computed."""
    base = getattr(target, target.base_model_prefix, target)
    out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state


def pad_batch(examples, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad examples {input_ids, loss_mask[, features][, argmax][, hidden]} into batch tensors.

    ``features`` (and the older ``hidden``) are zero-padded in their own dtype, ``argmax`` with -1;
    ``attention_mask`` marks the real tokens."""
    examples = list(examples)  # one item object per example: lazy features are read once
    length = max(len(e["input_ids"]) for e in examples)
    batch = {
        "input_ids": torch.full((len(examples), length), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros((len(examples), length), dtype=torch.long),
        "attention_mask": torch.zeros((len(examples), length), dtype=torch.long),
    }
    if "features" in examples[0]:
        h = examples[0]["features"]
        batch["features"] = torch.zeros((len(examples), length, h.shape[-1]), dtype=h.dtype)
    if "argmax" in examples[0]:
        batch["argmax"] = torch.full((len(examples), length), -1, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        batch["input_ids"][i, :n] = torch.as_tensor(e["input_ids"])
        batch["loss_mask"][i, :n] = torch.as_tensor(e["loss_mask"])
        batch["attention_mask"][i, :n] = 1
        for key in ("features", "argmax"):
            if key in batch:
                batch[key][i, :n] = e[key]
    return batch
