"""Shipped YAML configs (run configs, accelerate configs, tree definitions), installed as data."""

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent


def config_path(relative: str) -> Path:
    """Path of a shipped config file, e.g. ``config_path("medusa/tiny.yaml")``."""
    path = CONFIG_DIR / relative
    if not path.is_file():
        raise FileNotFoundError(f"no shipped config {relative!r} under {CONFIG_DIR}")
    return path


def shipped_configs(method: str) -> list[str]:
    """Names of the shipped run configs of ``method`` (``medusa/tiny``, ...)."""
    return sorted(f"{method}/{p.stem}" for p in (CONFIG_DIR / method).glob("*.yaml"))


def resolve_config(name: str, method: str) -> Path:
    """A YAML path as given, else a shipped run config: ``medusa/tiny``, or ``tiny`` for ``method``,
    with or without ``.yaml``."""
    path = Path(name)
    if path.is_file():
        return path
    stem = name[:-5] if name.endswith(".yaml") else name
    for candidate in (CONFIG_DIR / f"{stem}.yaml", CONFIG_DIR / method / f"{stem}.yaml"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"config {name!r} is neither a file nor a shipped config; shipped {method} configs: "
                            f"{', '.join(shipped_configs(method))}")
