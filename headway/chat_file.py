"""``headway generate --chat-file``: a prompt file read into chat messages, or a one-line error naming the file.

A file holds one conversation: a JSON list of {role, content} messages (or one such message on its own, a record,
``{"messages": [...]}``, or ShareGPT's ``{"conversations": [...]}``), or any other text, which is one user message.
A ``*.json`` file must be JSON, and every message needs content.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_JSON = "a JSON list of {role, content} messages"  # what a chat file holds, besides plain text


def read_chat_file(path: str | Path) -> list[dict]:
    """The messages of the chat file at ``path`` ([{"role", "content"}, ...]), or a ValueError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"chat file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"chat file {path} is not UTF-8 text (byte {exc.start}): pass a text file or "
                         f"{CHAT_JSON}") from None
    data = parse(path, text)
    records = {"messages", "conversations"}
    if isinstance(data, dict) and not records & data.keys() and {"role", "content"} <= data.keys():
        data = [data]  # one message, unlisted
    if isinstance(data, dict) and not records & data.keys():
        raise ValueError(f"chat file {path} holds an object, not a list: expected {CHAT_JSON} (one too: [{{...}}])")
    from headway.train.records import normalize_record

    try:
        messages = normalize_record(data if isinstance(data, dict) else {"messages": data})
    except ValueError as exc:
        raise ValueError(f"chat file {path}: {exc}") from None
    # (an empty system message is common, and harmless)
    empty = next((i for i, m in enumerate(messages, 1) if m["role"] != "system" and not m["content"].strip()), 0)
    if empty or not messages:
        what = "is empty" if not text.strip() else f"holds message {empty} without content" if empty else \
            "holds no messages"
        raise ValueError(f"chat file {path} {what}: write the prompt in it, as text or as {CHAT_JSON} with non-empty "
                         "content")
    return messages


def parse(path: Path, text: str) -> list | dict:
    """The file's JSON list or record; text that is not JSON (or a JSON string or number) as one user message.
    A ``*.json`` file that is not JSON is a one-line error."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if text.strip() and path.suffix.lower() == ".json":
            raise ValueError(f"chat file {path} is not valid JSON: {exc.msg} (line {exc.lineno}, column "
                             f"{exc.colno})") from None
        data = None
    return data if isinstance(data, (list, dict)) else [{"role": "user", "content": text}]
