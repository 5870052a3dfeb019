"""Target features for drafter training, cached once to safetensors shards: the cache's format, the
fingerprint that ties it to a target, and the writer.

Medusa and EAGLE-1 read the target's last hidden state (after the final norm, so that
``lm_head(h) == logits``, layer id ``L``); EAGLE-3 reads several layers at once (e.g. the inputs of
layers 2, L//2 and L-3) plus, for its loss mask, the target's own next-token choice. Computing
them needs a full frozen forward of the target; caching them to disk lets a drafter train for
many epochs without running the target again. Layer ids follow ``headway.heads.target.features``.

Cache layout (``out_dir``): ``index.json`` (what was cached, from which target, tokenizer, layers
and data; see ``feature_fingerprint``) and ``shard-00000.safetensors`` ... each holding, for the
shard's sequences concatenated (N tokens, S sequences):

- ``features`` [N, len(layers) * H] in the storage dtype (bf16 by default), the layers side by side
  in the order of ``layers``;
- ``input_ids`` [N] int64, ``loss_mask`` [N] uint8, ``offsets`` [S + 1] int64;
- ``argmax`` [N] int32 (optional): the target's full-vocabulary argmax at each position.

Writing splits across launched processes (``cache_features(..., state=PartialState())``): rank r
computes shards r, r+N, ... (each shard's batches are the ones a single process forms, so the
tensors are bit-identical) and rank 0 writes index.json before and after; the folder is the one a
single process writes.

Reading the cache back: ``headway.train.feature_reader``. Padding examples into batches and the
online last hidden state: ``headway.train.batches``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from headway.heads.target.features import capture_features, check_feature_layers, num_layers
from headway.heads.files import atomic_write_text, save_safetensors
from headway.train.batches import pad_batch
from headway.train.launch import my_units, rank_and_world, wait_for_everyone

INDEX_NAME = "index.json"
# Bump when the shard layout or the index changes; older caches are refused with a clear message.
CACHE_FORMAT = 2
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_RECREATE = "recreate the cache with scripts/cache_features.py"
# Config fields that change with how a model was loaded or saved, not with what it computes.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "dtype", "torch_dtype", "architectures", "use_cache",
                         "output_hidden_states", "output_attentions", "return_dict", "attn_implementation"}
# Fingerprint fields, in the order they are checked, with what they describe in error messages.
_FINGERPRINT_FIELDS = {
    "num_layers": "target depth", "hidden_size": "target hidden size", "target_config": "target config",
    "embed_abs_sum": "target weights (embedding)", "lm_head_abs_sum": "target weights (lm_head)",
    "tokenizer_vocab": "tokenizer vocabulary",
}


# ---------------------------------------------------------------------------------------------
# Fingerprint: which target, tokenizer and layers a cache belongs to
# ---------------------------------------------------------------------------------------------


def _sha256(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _stable_config(d):
    if isinstance(d, dict):
        return {k: _stable_config(v) for k, v in d.items()
                if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(d, list):
        return [_stable_config(v) for v in d]
    return d


@torch.no_grad()
def _abs_sum(weight: torch.Tensor | None) -> str | None:
    """Sum of |w| in float64 over the bf16-rounded weight, to 6 significant digits.

    Rounding to bf16 first makes the value the same whether the target was loaded in float32 or
    bf16; |w| keeps it away from zero, where 6 digits would hang on the summation order."""
    if weight is None or weight.device.type == "meta":
        return None
    w = weight.detach().reshape(weight.shape[0], -1) if weight.dim() else weight.detach().reshape(1, 1)
    total = torch.zeros((), dtype=torch.float64, device=w.device)
    rows = max(1, (1 << 24) // max(1, w.shape[1]))  # about 16M values (128 MiB in float64) at a time
    for start in range(0, w.shape[0], rows):
        total += w[start:start + rows].to(torch.bfloat16).double().abs().sum()
    return f"{float(total):.6g}"


def feature_fingerprint(target, tokenizer, layers) -> dict:
    """What a feature cache depends on: the target (config hash, depth, hidden size, a weight
    checksum of the embedding and lm_head), the tokenizer vocabulary and the layer ids.

    ``tokenizer=None`` leaves the vocabulary out (``tokenizer_vocab: None``, never checked)."""
    config = target.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = check_feature_layers(layers, num_layers(target))
    out_emb = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    vocab = None
    if tokenizer is not None:
        vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    return {
        "num_layers": num_layers(target),
        "hidden_size": int(text.hidden_size),
        "target_config": _sha256(_stable_config(json.loads(config.to_json_string()))),
        "embed_abs_sum": _abs_sum(target.get_input_embeddings().weight),
        "lm_head_abs_sum": _abs_sum(getattr(out_emb, "weight", None)),
        "tokenizer_vocab": vocab,
        "layers": layers,
    }


def _fingerprint_diff(stored: dict, expected: dict) -> str | None:
    """What differs between two fingerprints (layers aside), as words; None when they agree.
    A field that either side did not record (None) is not compared."""
    for key, what in _FINGERPRINT_FIELDS.items():
        a, b = stored.get(key), expected.get(key)
        if a is not None and b is not None and a != b:
            shown = f"{a} vs {b}" if key in ("num_layers", "hidden_size") or key.endswith("_sum") else \
                f"{str(a)[:12]} vs {str(b)[:12]}"
            return f"the {what} differs ({shown})"
    return None


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _shard_name(s: int) -> str:
    return f"shard-{s:05d}.safetensors"


def _check_existing(index: dict, out_dir: Path, meta: dict, fingerprint: dict, settings: dict) -> None:
    """A cache folder may only be resumed by the same model, tokenizer, layers, data and settings."""
    if index.get("format") != CACHE_FORMAT:
        raise ValueError(f"{out_dir} holds a feature cache of another format (format {index.get('format')}, "
                         f"this headway writes {CACHE_FORMAT}); choose another folder or delete it")
    if index.get("meta") != meta:
        raise ValueError(f"{out_dir} already holds features of another model or data set; "
                         "choose another folder or delete it")
    diff = _fingerprint_diff(index.get("fingerprint") or {}, fingerprint)
    if diff is None and index.get("layers") != fingerprint["layers"]:
        diff = f"the feature layers differ ({index.get('layers')} vs {fingerprint['layers']})"
    if diff:
        raise ValueError(f"{out_dir} already holds features of another target, tokenizer or layer set: {diff}; "
                         "choose another folder or delete it")
    for key, value in settings.items():
        if index.get(key) != value:
            raise ValueError(f"{out_dir} was started with {key}={index.get(key)!r}, this run asks for {value!r}; "
                             f"keep {key}={index.get(key)!r} to resume it, or choose another folder or delete it")


def _shard_matches(path: Path, part: list[dict]) -> bool | None:
    """Whether an existing shard holds exactly ``part``'s token ids; None if it cannot be read."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            ids, offsets = f.get_tensor("input_ids"), f.get_tensor("offsets")
            mask = f.get_tensor("loss_mask")
    except (SafetensorError, OSError, KeyError, RuntimeError):
        return None
    lengths = [len(e["input_ids"]) for e in part]
    if offsets.tolist() != [0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()]:
        return False
    flat_ids = [t for e in part for t in e["input_ids"]]
    flat_mask = [int(bool(m)) for e in part for m in e["loss_mask"]]
    return ids.tolist() == flat_ids and mask.tolist() == flat_mask


def cache_features(target, examples, out_dir: str | Path, *, layers: list[int] | None = None, meta: dict,
                   batch_size: int = 8, shard_size: int = 256, dtype: torch.dtype = torch.bfloat16, device=None,
                   with_argmax: bool = True, fingerprint: dict | None = None, state=None) -> Path:
    """Run the frozen target once over ``examples`` and write feature shards; resumes per shard.

    ``layers``: target hidden-state ids to store side by side (None: ``[L]``, the final-norm output
    that Medusa and EAGLE-1 read). ``dtype``: storage dtype (bfloat16, float16 or float32).
    ``with_argmax``: also store the target's full-vocabulary argmax per position (needs the
    logits). ``meta`` (model name, data config, ...) and ``fingerprint`` (``feature_fingerprint``
    of the target, tokenizer and layers; computed without the tokenizer when None) are stored in
    index.json and must match on resume. Existing shards are checked against ``examples`` and
    kept; missing ones are (re)written.

    ``state``: accelerate's ``PartialState`` when launched on several processes (every rank calls
    this with the same examples): rank r computes and writes shards r, r+N, ... only, rank 0 writes
    index.json, and every rank returns once the cache is complete. None: one process does all.
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"feature dtype {dtype} is not supported; use one of {sorted(_DTYPES)}")
    if batch_size < 1 or shard_size < 1:
        raise ValueError(f"batch_size and shard_size must be >= 1, got {batch_size} and {shard_size}")
    depth = num_layers(target)
    layers = check_feature_layers([depth] if layers is None else layers, depth, "layers")
    own = feature_fingerprint(target, None, layers)
    if fingerprint is None:
        fingerprint = own
    else:
        if list(fingerprint.get("layers", [])) != layers:
            raise ValueError(f"the fingerprint was made for layers {fingerprint.get('layers')}, "
                             f"but layers={layers} are cached; compute it with feature_fingerprint(target, tokenizer, layers)")
        diff = _fingerprint_diff(own, {k: v for k, v in fingerprint.items() if k != "tokenizer_vocab"})
        if diff:
            raise ValueError(f"the fingerprint was made for another target than the one given: {diff}")
        fingerprint = {**own, "tokenizer_vocab": fingerprint.get("tokenizer_vocab")}
    hidden_size = fingerprint["hidden_size"]
    settings = {"dtype": _DTYPE_NAMES[dtype], "with_argmax": bool(with_argmax), "shard_size": shard_size}

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = device or next(target.parameters()).device
    index_path = out_dir / INDEX_NAME
    shards = [_shard_name(s) for s in range((len(examples) + shard_size - 1) // shard_size)]
    head = {"format": CACHE_FORMAT, "meta": meta, "fingerprint": fingerprint, "layers": layers,
            "hidden_size": hidden_size, **settings}
    if index_path.is_file():  # every rank checks, so all of them refuse a foreign folder alike
        old = json.loads(index_path.read_text())
        _check_existing(old, out_dir, meta, fingerprint, settings)
        if old.get("complete") and old.get("num_sequences") != len(examples):
            raise ValueError(f"{out_dir} holds {old.get('num_sequences')} sequences, this data has {len(examples)}; "
                             "choose another folder or delete it")
    rank, _ = rank_and_world(state)
    wait_for_everyone(state)
    if rank == 0:
        _write_index(index_path, {**head, "shards": shards, "complete": False})

    token_count = sum(len(e["input_ids"]) for e in examples)
    for s in tqdm(my_units(len(shards), state), desc="caching features", unit="shard", disable=rank != 0):
        path = out_dir / shards[s]
        part = [examples[i] for i in range(s * shard_size, min(len(examples), (s + 1) * shard_size))]
        if path.is_file():
            ok = _shard_matches(path, part)
            if ok:
                continue
            if ok is False:
                raise ValueError(f"{path} holds other sequences than this data (the data changed since the cache "
                                 "was started); choose another folder or delete it")
            # unreadable (e.g. cut short outside headway): write it again
        # sort by length inside the shard so padding stays small, then restore order
        order = sorted(range(len(part)), key=lambda i: len(part[i]["input_ids"]))
        feats: dict[int, torch.Tensor] = {}
        tops: dict[int, torch.Tensor] = {}
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            batch = pad_batch([{"input_ids": part[i]["input_ids"], "loss_mask": part[i]["loss_mask"]} for i in idx])
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            if with_argmax:
                f, logits = capture_features(target, ids, layers, mask, with_logits=True)
                top = logits.argmax(-1)
                del logits
            else:
                f = capture_features(target, ids, layers, mask)
            for row, i in enumerate(idx):
                n = len(part[i]["input_ids"])
                feats[i] = f[row, :n].to("cpu", dtype)
                if with_argmax:
                    tops[i] = top[row, :n].to("cpu", torch.int32)
        lengths = torch.tensor([len(e["input_ids"]) for e in part], dtype=torch.long)
        tensors = {
            "features": torch.cat([feats[i] for i in range(len(part))]),
            "input_ids": torch.cat([torch.as_tensor(e["input_ids"], dtype=torch.long) for e in part]),
            "loss_mask": torch.cat([torch.as_tensor(e["loss_mask"], dtype=torch.long).ne(0).to(torch.uint8)
                                    for e in part]),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        }
        if with_argmax:
            tensors["argmax"] = torch.cat([tops[i] for i in range(len(part))])
        save_safetensors(tensors, path, metadata={"format": str(CACHE_FORMAT), "layers": ",".join(map(str, layers)),
                                              "dtype": settings["dtype"]})
    bytes_per_token = len(layers) * hidden_size * torch.empty((), dtype=dtype).element_size()
    wait_for_everyone(state)  # every shard is written
    if rank == 0:
        _write_index(index_path, {**head, "shards": shards, "complete": True, "num_sequences": len(examples),
                                  "num_tokens": token_count, "bytes_per_token": bytes_per_token})
    wait_for_everyone(state)  # no rank returns (and reads the cache) before the index says complete
    return out_dir


def _write_index(path: Path, index: dict) -> None:
    atomic_write_text(path, json.dumps(index, indent=2))
