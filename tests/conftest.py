"""Shared fixtures: isolated caches, one torch thread, tiny seeded targets built from configs."""

import os

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path_factory, monkeypatch):
    # Nothing may reach the Hub; caches live in a per-session temporary folder.
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("HF_HOME", str(base / "hf_home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HEADWAY_CACHE", str(base / "headway_cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama():
    from headway.heads.target.tiny import build_tiny_target

    return build_tiny_target("llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2():
    from headway.heads.target.tiny import build_tiny_target

    return build_tiny_target("qwen2", seed=1)


@pytest.fixture(scope="session")
def smollm2():
    """The real default target (converted from the packaged GGUF once per session cache)."""
    from headway.heads.target import load_target

    os.environ.setdefault("HEADWAY_CACHE", os.path.expanduser("~/.cache/headway"))
    return load_target("smollm2-135m", device="cpu")
