"""``data.mix``: several data sources combined by weight (``[sharegpt:3, default:1]``).

Each source is shuffled with the data seed and the mix takes from each its share of the largest set
that holds the weights exactly without repeating a conversation; the shares are then interleaved
in a seeded random order, so a prefix (``data.max_examples``) keeps about the same proportions.
"""

from __future__ import annotations

import random


def parse_mix(entries: list[str]) -> list[tuple[str, float]]:
    """``["sharegpt:3", "data.jsonl:1"]`` -> ``[("sharegpt", 3.0), ("data.jsonl", 1.0)]``; a malformed entry,
    a weight that is not a positive number, or a source named twice is a one-line ValueError."""
    out = []
    for entry in entries:
        source, sep, weight = str(entry).rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            w = None
        if not sep or not source.strip() or w is None or not w > 0 or w == float("inf"):
            raise ValueError(f"mix entry {entry!r} is not SOURCE:WEIGHT with a positive weight "
                             "(e.g. data.mix=[sharegpt:3,default:1])")
        out.append((source.strip(), w))
    names = [s for s, _ in out]
    if len(set(names)) < len(names):
        raise ValueError(f"mix names a source twice: {names}; give each source once with its weight")
    return out


def mix_sizes(lengths: list[int], weights: list[float]) -> list[int]:
    """How many conversations each source gives: its weight's share of the largest total no source
    runs out of. lengths, weights: [n_sources] -> [n_sources]."""
    total_w = sum(weights)
    shares = [w / total_w for w in weights]
    total = min(n / s for n, s in zip(lengths, shares))
    return [min(n, int(round(total * s))) for n, s in zip(lengths, shares)]


def mix_conversations(sources: list[tuple[str, list, float]], seed: int = 0) -> list:
    """The mixed list of conversations from ``[(name, conversations, weight), ...]``."""
    for name, conversations, _ in sources:
        if not conversations:
            raise ValueError(f"data.mix: the source {name!r} holds no conversations; drop it or fix it")
    sizes = mix_sizes([len(c) for _, c, _ in sources], [w for _, _, w in sources])
    rng = random.Random(seed)
    picked, labels = [], []
    for i, ((_, conversations, _), n) in enumerate(zip(sources, sizes)):
        order = list(range(len(conversations)))
        rng.shuffle(order)
        picked.append([conversations[j] for j in order[:n]])
        labels += [i] * n
    rng.shuffle(labels)  # a seeded interleaving: source i's k-th conversation goes where its k-th label is
    cursors = [0] * len(picked)
    out = []
    for i in labels:
        out.append(picked[i][cursors[i]])
        cursors[i] += 1
    return out
