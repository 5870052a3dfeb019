"""Values a user types (headway.heads.values): flags parsed the same way on every floor."""

import re

import pytest

from headway.heads.values import ConfigError, first_line, parse_bool


@pytest.mark.parametrize("value, expected", [
    (True, True), (False, False), (1, True), (0, False),
    ("true", True), ("TRUE", True), (" Yes ", True), ("1", True),
    ("false", False), ("No", False), ("0", False), ("  FaLsE\n", False),
], ids=["True", "False", "int-1", "int-0", "true", "TRUE", "padded-Yes", "str-1", "false", "No", "str-0",
        "padded-FaLsE"])
def test_flags_in_any_spelling(value, expected):
    assert parse_bool(value, "train.flag") is expected


@pytest.mark.parametrize("value", [2, -1, 1.0, 0.0, "maybe", "on", "off", "", "t", None, [], [True]],
                         ids=["2", "-1", "1.0", "0.0", "maybe", "on", "off", "empty", "t", "None", "[]", "[True]"])
def test_anything_else_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=rf"^train\.flag: expected true/false, got {re.escape(repr(value))}$"):
        parse_bool(value, "train.flag")
    assert issubclass(ConfigError, ValueError)


def test_first_line_of_an_exception_never_fails():
    """One line for a one-line error: the first line of the message, cut; the type where the message is empty."""
    assert first_line(ValueError("bad thing\nmore detail")) == "bad thing"
    assert first_line(EOFError()) == "EOFError" and first_line(RuntimeError("  \n")) == "RuntimeError"
    assert first_line(OSError("x" * 500), limit=10) == "x" * 10
