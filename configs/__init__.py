"""Shipped YAML configs (run configs, accelerate configs, tree definitions), installed as data."""

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent


def config_path(relative: str) -> Path:
    """Path of a shipped config file, e.g. ``config_path("medusa/tiny.yaml")``."""
    path = CONFIG_DIR / relative
    if not path.is_file():
        raise FileNotFoundError(f"no shipped config {relative!r} under {CONFIG_DIR}")
    return path
