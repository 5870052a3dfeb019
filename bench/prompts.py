"""Benchmark prompts built from text that ships in the installed packages (nothing downloaded).

Two groups: held-out chat prompts (never used for training) and copy-heavy prompts whose answer
mostly copies the prompt: edit a function, rename a variable, correct the spelling in an email,
repeat a paragraph. The kinds take turns, so any prefix of the list mixes them evenly.
"""

from __future__ import annotations

import ast
import inspect
import random
import textwrap

from headway.train.corpora import held_out_prompts, packaged_conversations

COPY_KINDS = ("edit function", "rename variable", "correct spelling", "repeat paragraph")
SOURCE_MODULES = ("textwrap", "shutil", "fnmatch", "posixpath", "glob", "string", "json.encoder", "csv")


def chat_prompts(n: int) -> list[str]:
    """n held-out chat prompts: packaged prompts that ``generate_data.py`` never answers for training."""
    return held_out_prompts(n)


def copy_prompts(n: int) -> list[str]:
    """n copy-heavy prompts, the kinds of ``COPY_KINDS`` in turn (item i of kind k is the i-th of its kind)."""
    makers = {"edit function": _edit_function, "rename variable": _rename_variable,
              "correct spelling": _correct_spelling, "repeat paragraph": _repeat_paragraph}
    per_kind = -(-n // len(COPY_KINDS))  # ceil
    made = {kind: make(per_kind) for kind, make in makers.items()}
    return [made[COPY_KINDS[i % len(COPY_KINDS)]][i // len(COPY_KINDS)] for i in range(n)]


def stdlib_functions() -> list[tuple[str, ast.FunctionDef]]:
    """(source, parsed) of mid-sized top-level functions of a few stdlib modules, in a fixed order."""
    import importlib

    out = []
    for name in SOURCE_MODULES:
        module = importlib.import_module(name)
        for fname, fn in sorted(inspect.getmembers(module, inspect.isfunction)):
            if fn.__module__ != module.__name__ or fname.startswith("__"):
                continue
            try:
                source = textwrap.dedent(inspect.getsource(fn))
            except (OSError, TypeError):
                continue
            if 8 <= source.count("\n") <= 28 and max(map(len, source.splitlines())) <= 100:
                out.append((source.rstrip(), ast.parse(source).body[0]))
    return out


def _spread(items: list, n: int) -> list:
    """n items spread evenly over the list (not its first n), so no one region decides the result."""
    step = max(1, len(items) // max(n, 1))
    return [items[(i * step) % len(items)] for i in range(n)]


def _edit_function(n: int) -> list[str]:
    return [f"Add type hints to the parameters of this Python function and return the whole function:\n\n```python\n{src}\n```"
            for src, _ in _spread(stdlib_functions(), n)]


def _rename_variable(n: int) -> list[str]:
    out = []
    fns = stdlib_functions()
    for src, tree in _spread(fns[1:] + fns[:1], n):  # other functions than the edits
        names = [node.id for node in ast.walk(tree) if isinstance(node, ast.Name)]
        args = [a.arg for a in tree.args.args + tree.args.kwonlyargs if a.arg not in ("self", "cls")]
        old = max(args or names, key=names.count)  # the most used parameter
        out.append(f"Rename the variable `{old}` to `{old}_value` in this Python function and return the whole "
                   f"function:\n\n```python\n{src}\n```")
    return out


def passages(lo: int = 45, hi: int = 90) -> list[str]:
    """Packaged conversation turns of lo..hi words (real human-written text)."""
    return [turn["content"] for conv in packaged_conversations() for turn in conv if lo <= len(turn["content"].split()) <= hi]


def misspell(text: str, every: int = 7, seed: int = 0) -> str:
    """Swap two inner letters of every ``every``-th word of five letters or more (a typo a reader fixes)."""
    rng = random.Random(seed)
    words = text.split(" ")
    count = 0
    for i, word in enumerate(words):
        if len(word) >= 5 and word.isalpha():
            count += 1
            if count % every == 0:
                j = rng.randrange(1, len(word) - 2)
                words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2:]
    return " ".join(words)


def _correct_spelling(n: int) -> list[str]:
    texts = _spread(passages(), 2 * n)[1::2]  # the other half of the spread: not the paragraphs to repeat
    return [f"Correct the spelling mistakes in this email and return the corrected email in full:\n\n"
            f"Hi Sam,\n\n{misspell(t, seed=i)}\n\nBest,\nAlex" for i, t in enumerate(texts)]


def _repeat_paragraph(n: int) -> list[str]:
    asks = ["Repeat the following text exactly, word for word:", "Copy this paragraph without changing anything:"]
    return [f"{asks[i % 2]}\n\n{t}" for i, t in enumerate(_spread(passages(), 2 * n)[0::2])]
