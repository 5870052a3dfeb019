"""Benchmark prompts from installed text: copy-heavy prompts of every kind in turn, the functions they
carry, and the typos of the spelling prompts."""

import ast
import re

from headway.bench import prompts as bench_prompts


def test_copy_prompts_mix_the_kinds_in_turn(monkeypatch):
    monkeypatch.setattr(bench_prompts, "passages", lambda: [f"passage number {i} about something" for i in range(10)])
    prompts = bench_prompts.copy_prompts(6)
    heads = ["Add type hints", "Rename the variable", "Correct the spelling", "Repeat the following", "Add type hints",
             "Rename the variable"]
    assert [p[:len(h)] for p, h in zip(prompts, heads)] == heads
    assert prompts[0] != prompts[4] and prompts[1] != prompts[5]  # different functions of the same kind
    assert "```python\ndef " in prompts[0] and "Hi Sam,\n\npassage number" in prompts[2]


def test_misspell_swaps_letters_of_every_nth_long_word():
    text = "seven longer words appear inside this sentence today"
    assert bench_prompts.misspell(text, every=3, seed=0) == "seven longer wodrs appear inside this sentnece today"


def test_the_functions_are_mid_sized_stdlib_functions_in_a_fixed_order():
    functions = bench_prompts.stdlib_functions()
    assert len(functions) >= 8 and [s for s, _ in functions] == [s for s, _ in bench_prompts.stdlib_functions()]
    for source, tree in functions:
        assert isinstance(tree, ast.FunctionDef) and source.startswith(f"def {tree.name}(")
        assert 8 <= source.count("\n") + 1 <= 29 and max(map(len, source.splitlines())) <= 100


def test_a_rename_prompt_names_the_most_used_parameter_of_the_function_it_carries(monkeypatch):
    monkeypatch.setattr(bench_prompts, "passages", lambda: [f"passage number {i} about something" for i in range(10)])
    prompts = bench_prompts.copy_prompts(12)
    sources = {source for source, _ in bench_prompts.stdlib_functions()}
    for prompt in prompts[1::4]:
        old, new = re.match(r"Rename the variable `(\w+)` to `(\w+)` in this Python function", prompt).groups()
        code = prompt.split("```python\n")[1].split("\n```")[0]
        assert code in sources and new == f"{old}_value"
        tree = ast.parse(code).body[0]
        args = [a.arg for a in tree.args.args + tree.args.kwonlyargs]
        used = [node.id for node in ast.walk(tree) if isinstance(node, ast.Name)]
        assert old in args and used.count(old) == max(used.count(a) for a in args if a not in ("self", "cls"))
    edited = {p.split("```python\n")[1] for p in prompts[0::4]}
    renamed = {p.split("```python\n")[1] for p in prompts[1::4]}
    assert len(edited) == len(renamed) == 3 and not edited & renamed  # other functions than the edits


def test_misspell_only_swaps_inner_letters_of_long_words():
    text = " ".join(["alpha", "be", "gamma", "delta", "epsilon", "x1234", "omega", "sigma", "lambda"] * 3)
    typo = bench_prompts.misspell(text, every=2, seed=4)
    assert typo == bench_prompts.misspell(text, every=2, seed=4) and typo != text
    words, typos = text.split(" "), typo.split(" ")
    assert len(words) == len(typos)
    long_words = [i for i, w in enumerate(words) if len(w) >= 5 and w.isalpha()]
    changed = [i for i, (w, t) in enumerate(zip(words, typos)) if w != t]
    assert changed == long_words[1::2]  # every second word of five letters or more
    for i in changed:
        w, t = words[i], typos[i]
        assert sorted(w) == sorted(t) and (w[0], w[-1]) == (t[0], t[-1])
        assert sum(a != b for a, b in zip(w, t)) == 2  # two neighbouring letters swapped
