"""Target features for drafter training: computed online, or cached once to safetensors shards.

Medusa and EAGLE-1 read the target's last hidden state (after the final norm, so that
``lm_head(h) == logits``). Computing it needs a full frozen forward of the target; caching it
to disk lets the heads train for many epochs without running the target again.

Cache layout (``out_dir``): ``index.json`` (what was cached, from which model and data) and
``shard-00000.safetensors`` ... each holding ``hidden`` [N, H] (all tokens of the shard's
sequences, concatenated), ``input_ids`` [N], ``loss_mask`` [N] and ``offsets`` [S+1].
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from headway.train.checkpoint import atomic_write_text

INDEX_NAME = "index.json"


@torch.no_grad()
def last_hidden_state(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] token ids -> [B, T, H] final hidden states (after the final norm), no logits computed."""
    base = getattr(target, target.base_model_prefix, target)
    out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state


def pad_batch(examples: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of {input_ids, loss_mask[, hidden]} examples into batch tensors."""
    length = max(len(e["input_ids"]) for e in examples)
    batch = {
        "input_ids": torch.full((len(examples), length), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros((len(examples), length), dtype=torch.long),
        "attention_mask": torch.zeros((len(examples), length), dtype=torch.long),
    }
    if "hidden" in examples[0]:
        h = examples[0]["hidden"]
        batch["hidden"] = torch.zeros((len(examples), length, h.shape[-1]), dtype=h.dtype)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        batch["input_ids"][i, :n] = torch.as_tensor(e["input_ids"])
        batch["loss_mask"][i, :n] = torch.as_tensor(e["loss_mask"])
        batch["attention_mask"][i, :n] = 1
        if "hidden" in e:
            batch["hidden"][i, :n] = e["hidden"]
    return batch


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def cache_features(target, examples: list[dict], out_dir: str | Path, *, meta: dict, batch_size: int = 8,
                   shard_size: int = 256, dtype: torch.dtype = torch.float32, device=None) -> Path:
    """Run the frozen target once over ``examples`` and write feature shards; resumes per shard.

    ``meta`` (model name, data fingerprint, ...) is stored in index.json and must match on resume.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = device or next(target.parameters()).device
    index_path = out_dir / INDEX_NAME
    if index_path.is_file():
        old = json.loads(index_path.read_text())
        if old.get("meta") != meta:
            raise ValueError(f"{out_dir} already holds features of another model or data set; "
                             "choose another folder or delete it")
        if old.get("complete"):
            return out_dir
    _write_index(index_path, meta, [], complete=False)
    shards = []
    starts = range(0, len(examples), shard_size)
    for s, start in enumerate(tqdm(starts, desc="caching features", unit="shard")):
        path = out_dir / f"shard-{s:05d}.safetensors"
        shards.append(path.name)
        if path.is_file():
            continue
        part = examples[start:start + shard_size]
        # sort by length inside the shard so padding stays small, then restore order
        order = sorted(range(len(part)), key=lambda i: len(part[i]["input_ids"]))
        per_example: dict[int, torch.Tensor] = {}
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            batch = pad_batch([part[i] for i in idx])
            h = last_hidden_state(target, batch["input_ids"].to(device), batch["attention_mask"].to(device))
            for row, i in enumerate(idx):
                per_example[i] = h[row, :len(part[i]["input_ids"])].to("cpu", dtype)
        hidden = [per_example[i] for i in range(len(part))]
        lengths = torch.tensor([len(e["input_ids"]) for e in part])
        _atomic_save({
            "hidden": torch.cat(hidden),
            "input_ids": torch.cat([torch.as_tensor(e["input_ids"], dtype=torch.long) for e in part]),
            "loss_mask": torch.cat([torch.as_tensor(e["loss_mask"], dtype=torch.uint8) for e in part]),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        }, path)
    _write_index(index_path, meta, shards, complete=True, num_sequences=len(examples),
                 num_tokens=sum(len(e["input_ids"]) for e in examples))
    return out_dir


def _write_index(path: Path, meta: dict, shards: list[str], complete: bool, **extra) -> None:
    atomic_write_text(path, json.dumps({"meta": meta, "shards": shards, "complete": complete, **extra}, indent=2))


def load_cached_features(out_dir: str | Path, expect_meta: dict | None = None) -> list[dict]:
    """Read a complete feature cache back as examples {input_ids, loss_mask, hidden}."""
    out_dir = Path(out_dir)
    index_path = out_dir / INDEX_NAME
    if not index_path.is_file():
        raise FileNotFoundError(f"{out_dir} is not a feature cache (no {INDEX_NAME}); "
                                "create it with scripts/cache_features.py")
    index = json.loads(index_path.read_text())
    if not index.get("complete"):
        raise ValueError(f"feature cache {out_dir} is incomplete; rerun scripts/cache_features.py to finish it")
    if expect_meta is not None:
        for key, value in expect_meta.items():
            if index["meta"].get(key) != value:
                raise ValueError(f"feature cache {out_dir} was made with {key}={index['meta'].get(key)!r}, "
                                 f"this run needs {value!r}; recreate the cache")
    examples = []
    for name in index["shards"]:
        try:
            shard = load_file(str(out_dir / name))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"feature shard {out_dir / name} is corrupt ({exc}); delete it and rerun "
                             "scripts/cache_features.py") from None
        offsets = shard["offsets"].tolist()
        for a, b in zip(offsets[:-1], offsets[1:]):
            examples.append({"input_ids": shard["input_ids"][a:b].tolist(),
                             "loss_mask": shard["loss_mask"][a:b].long().tolist(),
                             "hidden": shard["hidden"][a:b]})
    return examples
