"""Values a user types into a config file, an override or a tree spec, parsed the same way on every
floor (the run configs in ``train.config``, the dynamic tree specs in ``inference.expand``)."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config file or override that does not fit the dataclass."""


TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


def parse_bool(value: Any, key: str) -> bool:
    """A YAML/CLI/JSON flag: a bool, 0 or 1, or true/false/1/0/yes/no in any case; else a ConfigError naming ``key``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
        return value.strip().lower() in TRUE
    raise ConfigError(f"{key}: expected true/false, got {value!r}")


def check_token_id(name: str, value: int | None, vocab_size: int | None) -> None:
    """A one-line ValueError unless ``value`` (None: unset) is a token id of a ``vocab_size``-token vocabulary (None:
    not known yet, any id >= 0)."""
    if value is None:
        return
    if vocab_size is None and value < 0:
        raise ValueError(f"{name} must be a token id (0 or more), got {value}")
    if vocab_size is not None and not 0 <= value < vocab_size:
        raise ValueError(f"{name} must be a token id in 0..{vocab_size - 1}, got {value}")


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message for a one-line error: its first line (at most ``limit`` characters), or its type's
    name where the message is empty (torch's EOFError on an empty file has none)."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__
