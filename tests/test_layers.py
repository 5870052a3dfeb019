"""The layering rule (ARCHITECTURE.md), on every import in every package module, those inside
functions and ``importlib.import_module("headway...")`` calls included:

    headway (cli)                      may import everything
    bench                              train, inference, heads, configs
    train        inference             heads, configs; never each other
    heads                              configs only (the ground floor)
    configs                            nothing of headway
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"headway": "headway", "bench": "bench", "train": "train", "inference": "inference", "heads": "heads",
           "configs": "configs"}  # folder -> subpackage name (pyproject's package-dir)
ALLOWED = {
    "headway": {"headway", "bench", "train", "inference", "heads", "configs"},
    "bench": {"bench", "train", "inference", "heads", "configs"},
    "train": {"train", "heads", "configs"},
    "inference": {"inference", "heads", "configs"},
    "heads": {"heads", "configs"},
    "configs": {"configs"},
}


def headway_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every absolute ``headway...`` import, anywhere in the module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"line {node.lineno}: relative import (entry points must run by path)"
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                                                     if node.module == "headway"]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found.append((node.lineno, node.args[0].value))
    return [(line, name) for line, name in found if name == "headway" or name.startswith("headway.")]


def layer_of(module: str) -> str | None:
    """The floor a ``headway.x.y`` name belongs to: a subpackage, ``headway`` for the command line
    (``headway.cli``, ``headway.__main__``), None for the root package itself (``headway.__version__``)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if parts[1] in FOLDERS.values():
        return parts[1]
    return "headway" if parts[1] in ("cli", "__main__") else None


def modules():
    return [(folder, path) for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))]


@pytest.mark.parametrize("folder", list(FOLDERS))
def test_no_module_imports_above_its_floor(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, name in headway_imports(ast.parse(path.read_text(), str(path))):
            layer = layer_of(name)
            if layer is not None and layer not in ALLOWED[FOLDERS[folder]]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name} ({FOLDERS[folder]} may import "
                           f"{sorted(ALLOWED[FOLDERS[folder]])})")
    assert not bad, "\n".join(bad)


def test_the_rule_catches_imports_inside_functions_and_import_module():
    source = ("def f():\n    from headway.inference.tree import Tree\n"
              "def g():\n    import importlib\n    return importlib.import_module('headway.train.data')\n")
    assert [name for _, name in headway_imports(ast.parse(source))] == ["headway.inference.tree", "headway.train.data"]
    assert layer_of("headway.cli") == "headway" and layer_of("headway.heads.eagle") == "heads"
    assert layer_of("headway.__version__") is None  # the root package: every floor imports it


def test_every_package_folder_is_checked():
    import tomllib

    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {folder for folder in mapping.values()} == set(FOLDERS)
    assert modules()


# Rooms of the ground floor (heads/): what each may import of headway.heads besides itself
HEADS_ROOMS = {
    "target": {"files", "values", "target"},  # target loading, tiny targets, feature hooks: nothing above
    "formats": {"base", "medusa", "eagle", "eagle_layer", "peagle", "dflash", "layerskip", "registry", "kinds", "files",
                "values", "target", "formats"},  # the drafters, never the Hub / card / info
    "drafters": {"base", "medusa", "eagle", "eagle_layer", "peagle", "dflash", "layerskip", "registry", "kinds", "files",
                 "values", "target", "hub"},  # the drafter modules and the registry: Hub I/O is theirs (save_pretrained, push_to_hub)
}


def room_of(path: Path) -> str:
    parts = path.relative_to(ROOT / "heads").parts
    return parts[0] if len(parts) > 1 else "drafters"


def test_the_ground_floor_rooms():
    bad = []
    for path in sorted((ROOT / "heads").rglob("*.py")):
        if path == ROOT / "heads" / "convert.py":  # the 0.1 path of the converters, kept for old model cards
            continue
        room = room_of(path)
        if room not in HEADS_ROOMS:
            continue
        for line, name in headway_imports(ast.parse(path.read_text(), str(path))):
            parts = name.split(".")
            if parts[:2] == ["headway", "heads"] and len(parts) > 2 and parts[2] not in HEADS_ROOMS[room]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name} (heads/{room} may import "
                           f"{sorted(HEADS_ROOMS[room])} of headway.heads)")
    assert not bad, "\n".join(bad)


def test_no_package_module_is_over_500_lines():
    long = [f"{path.relative_to(ROOT)}: {n} lines" for _, path in modules()
            if (n := len(path.read_text().splitlines())) > 500]
    assert not long, "split these by concern:\n" + "\n".join(long)


# Modules with no logic of their own to test (re-exports, declarations, thin entry points)
NO_OWN_TESTS = {"heads/convert.py", "headway/__main__.py", "heads/formats/__init__.py", "bench/__init__.py"}


def mirror_of(path: Path) -> Path:
    """Where a package module's tests live: tests/<its folder>/test_<name>.py (a package's __init__.py:
    test_<package>.py beside the package's own folder; the command line, headway/cli.py: tests/test_cli.py)."""
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "headway":
        return ROOT / "tests" / f"test_{rel.stem}.py"
    if rel.name == "__init__.py":
        return ROOT / "tests" / rel.parent.parent / f"test_{rel.parent.name}.py"
    return ROOT / "tests" / rel.parent / f"test_{rel.stem}.py"


def has_logic(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, (ast.FunctionDef, ast.ClassDef)) for node in tree.body) and \
        not (path.name == "__init__.py" and all(isinstance(n, (ast.Expr, ast.Import, ast.ImportFrom, ast.Assign,
                                                              ast.FunctionDef)) and not isinstance(n, ast.ClassDef)
                                               for n in tree.body) and len(path.read_text().splitlines()) < 60)


def test_tests_mirror_the_tree():
    missing = [f"{path.relative_to(ROOT)} -> {mirror_of(path).relative_to(ROOT)}" for folder, path in modules()
               if folder != "configs" and str(path.relative_to(ROOT)) not in NO_OWN_TESTS and has_logic(path)
               and not mirror_of(path).is_file()]
    assert not missing, "package modules without their test module:\n" + "\n".join(missing)
