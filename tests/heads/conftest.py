"""Fixtures of the drafter tests (tests/heads and its subfolders)."""

import pytest

from headway.heads.target.tiny import build_tiny_target

# the helper modules assert too: rewrite them as pytest does test modules, for readable failures
pytest.register_assert_rewrite("tests.heads.helpers", "tests.heads.formats.helpers", "tests.heads.hub.helpers")


@pytest.fixture(scope="module")
def target():
    """The tiny seeded Llama target in float64, for exact comparisons (test_eagle.py, test_eagle_layer.py)."""
    model, _ = build_tiny_target("llama", seed=0)
    return model.double()
