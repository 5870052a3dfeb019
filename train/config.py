"""Run configs: nested dataclasses filled from YAML and ``key=value`` overrides.

The dataclasses are the single source of defaults. A YAML file or an override may only name
fields that exist (``train.lr=3e-4``, ``heads.num_heads=3``); anything else is an error that
names the key and lists the valid ones.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from headway.heads.values import ConfigError, parse_bool


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert YAML/CLI values to the annotated type (str -> int/float/bool where asked)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        errors = []
        for arg in args:
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1] or (Any,)
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        out = [_coerce(v, item, key) for v in value]
        return tuple(out) if origin is tuple else out
    if tp is Any:
        return value
    if tp is bool:
        return parse_bool(value, key)
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            number = float(value)  # PyYAML reads 1e-3 as a string
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}") from None
        if tp is int:
            if number != int(number):
                raise ConfigError(f"{key}: expected an integer, got {value!r}")
            return int(number)
        return number
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:  # (None: a YAML null, where a string is needed)
            raise ConfigError(f"{key}: expected a string, got {'null' if value is None else repr(value)}")
        return str(value)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    return value


def from_dict(cls, data: dict[str, Any] | None, prefix: str = ""):
    """Build dataclass ``cls`` from a (nested) mapping; unknown keys raise ConfigError."""
    data = dict(data or {})
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r}; valid keys here: {sorted(prefix + k for k in types_)}")
    kwargs = {}
    for name, tp in types_.items():
        if name not in data:
            continue
        key = prefix + name
        if _is_dataclass_type(tp):
            if not isinstance(data[name], dict):
                raise ConfigError(f"{key}: expected a section (mapping), got {data[name]!r}")
            kwargs[name] = from_dict(tp, data[name], prefix=key + ".")
        else:
            kwargs[name] = _coerce(data[name], tp, key)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(_with_key(str(exc), prefix, types_)) from None


def _with_key(message: str, prefix: str, fields) -> str:
    """A dataclass's own validation message with its section named: ``lr must be > 0`` from the
    ``train.`` section reads ``train.lr must be > 0``; a message naming no field gets ``train: ``."""
    if not prefix or message.startswith(prefix):
        return message
    first = re.match(r"[A-Za-z_]\w*", message)
    if prefix and first and first.group() in fields:
        return prefix + message
    return f"{prefix.rstrip('.') or 'config'}: {message}"


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Merge ``a.b=value`` strings into a nested dict (values parsed as YAML scalars)."""
    data = _deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (for example train.lr=3e-4)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return data


def _deepcopy(d):
    return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in d.items()}


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *anchor: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, collections.abc.Hashable):
                break  # the safe loader's own error follows
            if key in seen:
                raise ConfigError(f"{key!r} is set twice in one section (line {key_node.start_mark.line + 1} of "
                                  f"{key_node.start_mark.name}); keep one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
        loader = _UniqueKeys(text)
        loader.name = str(path)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}): pass a YAML file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if data is None:  # an empty file would silently train the defaults (the smollm2-135m run)
        raise ConfigError(f"config file {path} is empty: write its settings, or name a shipped config")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(data).__name__}")
    return data


def load_config(cls, path: str | Path | None = None, overrides: list[str] = ()):
    """YAML file (optional) + overrides -> dataclass ``cls``."""
    data = read_yaml(path) if path else {}
    return from_dict(cls, apply_overrides(data, list(overrides)))


def to_dict(config) -> dict[str, Any]:
    return dataclasses.asdict(config)
