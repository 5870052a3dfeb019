"""Prompts and conversations from text that ships inside PyPI packages (the offline default data):
chitchat-dataset and chatterbot-corpus, mixed, deduplicated and filtered by length; the fixed
window of held-out prompts that training never draws."""

from __future__ import annotations

import functools
import glob
import importlib.util
import random
from pathlib import Path

# Prompt length filter for default_prompts: drops bare greetings and walls of text.
_PROMPT_MIN_WORDS = 3
_PROMPT_MAX_WORDS = 60


def _clean(text) -> str:
    return " ".join(str(text).split())


def _prompt_ok(text: str) -> bool:
    return _PROMPT_MIN_WORDS <= len(text.split()) <= _PROMPT_MAX_WORDS


@functools.lru_cache(maxsize=1)
def _chitchat_prompts() -> tuple[str, ...]:
    """Opening human turn of each chitchat conversation (its chat bubbles joined by newlines)."""
    try:
        import chitchat_dataset as ccc
    except ImportError as e:
        raise ImportError("default prompts need the package chitchat-dataset: pip install chitchat-dataset==0.9.0") from e
    prompts = []
    for _, convo in sorted(ccc.Dataset().items()):  # sorted by id: independent of dict order
        turns = convo.get("messages") or []
        if not turns or not turns[0]:
            continue
        text = "\n".join(_clean(m.get("text", "")) for m in turns[0] if _clean(m.get("text", "")))
        if _prompt_ok(text):
            prompts.append(text)
    return tuple(prompts)


@functools.lru_cache(maxsize=1)
def _chatterbot_conversations() -> tuple[tuple[str, ...], ...]:
    """Every chatterbot-corpus English conversation as its list of lines (question, answer, ...)."""
    import yaml

    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the packaged text needs chatterbot-corpus: pip install chatterbot-corpus==1.3.3")
    root = Path(spec.submodule_search_locations[0]) / "data" / "english"
    out = []
    for path in sorted(glob.glob(str(root / "*.yml"))):
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
        for convo in doc.get("conversations") or []:
            if isinstance(convo, list) and convo and all(line is not None for line in convo):
                out.append(tuple(_clean(line) for line in convo))
    return tuple(out)


def _chatterbot_prompts() -> tuple[str, ...]:
    """First line (the question) of each chatterbot-corpus English conversation."""
    return tuple(c[0] for c in _chatterbot_conversations() if _prompt_ok(c[0]))


def packaged_conversations() -> list[list[dict]]:
    """Real human-written conversations from the packaged text, as user/assistant turns.

    chatterbot-corpus question/answer pairs, and chitchat-dataset conversations whose speakers
    alternate (the opener as user). Not the target's own words: use them where any real chat
    text will do (the tiny config, tests); the default for real targets is self-distillation.
    """
    import chitchat_dataset as ccc

    out = []
    for lines in _chatterbot_conversations():
        if len(lines) >= 2 and all(lines):
            out.append([{"role": "user" if i % 2 == 0 else "assistant", "content": line}
                        for i, line in enumerate(lines)])
    for _, convo in sorted(ccc.Dataset().items()):
        turns = ["\n".join(_clean(m.get("text", "")) for m in turn if _clean(m.get("text", "")))
                 for turn in convo.get("messages") or [] if turn]
        turns = [t for t in turns if t]
        if len(turns) >= 2:
            out.append([{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)])
    return out


def _dedupe(items) -> list[str]:
    seen, out = set(), []
    for item in items:
        key = item.casefold()
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out


def default_prompts(limit: int | None = None, seed: int = 0) -> list[str]:
    """Real user prompts from the packaged chitchat and chatterbot corpora.

    Each source is deduplicated and shuffled with ``seed``; the two are interleaved so that any
    prefix (``limit``) mixes casual chat openers with short questions.
    """
    chitchat = _dedupe(_chitchat_prompts())
    chatterbot = _dedupe(_chatterbot_prompts())
    random.Random(seed).shuffle(chitchat)
    random.Random(seed + 1).shuffle(chatterbot)
    mixed = []
    for i in range(max(len(chitchat), len(chatterbot))):
        mixed.extend(source[i] for source in (chitchat, chatterbot) if i < len(source))
    mixed = _dedupe(mixed)  # the same question may appear in both corpora
    return mixed if limit is None else mixed[:limit]


# The benchmark's held-out chat prompts: a window of the seed-0 default prompts that no training
# set drawn with ``training_prompts`` contains, however many prompts it asks for or which seed.
HELD_OUT_START = 2000  # prompts before it are unchanged, so data sets of up to 2000 answers keep their bytes
HELD_OUT_SIZE = 200


def held_out_prompts(n: int = HELD_OUT_SIZE) -> list[str]:
    """The first ``n`` held-out prompts (never in ``training_prompts``)."""
    if not 0 <= n <= HELD_OUT_SIZE:
        raise ValueError(f"only {HELD_OUT_SIZE} packaged chat prompts are held out of training, not {n}; "
                         f"use a count from 0 up to at most {HELD_OUT_SIZE}")
    return default_prompts(seed=0)[HELD_OUT_START:HELD_OUT_START + n]


def training_prompts(limit: int | None = None, seed: int = 0) -> list[str]:
    """``default_prompts(seed=seed)`` without the held-out benchmark prompts (compared as ``_dedupe`` does)."""
    held = {p.casefold() for p in held_out_prompts()}
    kept = [p for p in default_prompts(seed=seed) if p.casefold() not in held]
    return kept if limit is None else kept[:limit]
