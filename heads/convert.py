"""Kept so that the commands in model cards written by headway 0.1 still run: the converters live in
``headway.heads.formats.convert``."""

from headway.heads.formats.convert import FORMATS, convert, detect_format, export_any, load_any  # noqa: F401
