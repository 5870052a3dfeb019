"""Prompt lookup (Saxena, 2023; transformers' ``prompt_lookup_num_tokens``): copy what followed
the last n-gram where it occurred earlier in the context. Free to compute, strong on copy-heavy
text. With ``max_matches > 1`` the continuations of several matches are merged into a trie, so
one verification pass tries them all (tree verification as in SpecInfer, arXiv:2305.09781).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from headway.inference.proposer import Draft, DraftContext, Proposer, root_only
from headway.inference.tree import shaped_tree


class PromptLookup(Proposer):
    """Deterministic n-gram copy drafter (needs no model).

    Args:
        max_ngram_size: longest suffix n-gram searched for (tried first).
        min_ngram_size: shortest suffix n-gram tried when longer ones do not occur.
        num_pred_tokens: tokens copied per match (the draft depth).
        max_matches: distinct continuations merged into a tree (1: a chain, as transformers does).
        max_nodes: cap on draft nodes (the verification width is max_nodes + 1).

    Ranking: the longest n-gram that occurs wins; among its occurrences, each continuation is
    scored by the accepted length it would reach if the next text behaved like the n-gram's past
    occurrences: sum over k of the share of occurrences (those with k tokens left before the end
    of the context) whose first k tokens agree with it (``expected_accepted``). So a continuation
    cut short by the end of the context loses to a full one that agrees with it, and one that
    several occurrences share beats a one-off; equal scores go to the most recent occurrence.
    transformers instead takes the earliest occurrence, headway before took the most recent.
    A ``tree`` given to the generator caps the depth and, through its number of leaves, the
    number of matches.
    """

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 1, num_pred_tokens: int = 10,
                 max_matches: int = 1, max_nodes: int = 32):
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(f"need 1 <= min_ngram_size <= max_ngram_size, got {min_ngram_size}, {max_ngram_size}")
        if num_pred_tokens < 1 or max_matches < 1 or max_nodes < 1:
            raise ValueError("num_pred_tokens, max_matches and max_nodes must be >= 1")
        self.max_ngram_size, self.min_ngram_size = max_ngram_size, min_ngram_size
        self.num_pred_tokens, self.max_matches, self.max_nodes = num_pred_tokens, max_matches, max_nodes
        self._index = NgramIndex(min_ngram_size, max_ngram_size)

    def reset(self) -> None:
        self._index = NgramIndex(self.min_ngram_size, self.max_ngram_size)

    def propose(self, ctx: DraftContext) -> Draft:
        depth, matches = self.num_pred_tokens, self.max_matches
        if ctx.tree is not None:
            depth = min(depth, ctx.tree.depth)
            matches = min(matches, int((ctx.tree.retrieve[:, 0] >= 0).sum()))
        depth = min(depth, ctx.max_depth)
        if depth < 1:
            return root_only(ctx)
        starts = None
        if ctx.host_tokens is not None:  # the context's n-grams indexed as it grows: no scan of the whole context
            self._index.extend(ctx.host_tokens)
            starts = self._index.starts
        found = find_matches(ctx.host_context(), self.max_ngram_size, self.min_ngram_size, depth, matches, starts,
                             ctx.host_tokens)
        if not found:
            return root_only(ctx)
        conts = [cont for cont, _ in found]
        parents, node_tokens = build_trie(conts, self.max_nodes)
        tokens = torch.tensor([ctx.root_token] + node_tokens, dtype=torch.long, device=ctx.tokens.device)
        # a raw confidence for tree="auto" (which calibrates it against acceptance): the matched n-gram's
        # length over the longest searched, shared by the continuation's nodes, halved per lower rank
        weights = [n / self.max_ngram_size / (rank + 1) for rank, (_, n) in enumerate(found)]
        return Draft(shaped_tree(parents, name="prompt-lookup"), tokens,
                     scores=trie_scores(conts, weights, parents, node_tokens))


def find_continuations(tokens: torch.Tensor, max_n: int, min_n: int, depth: int, max_matches: int) -> list[list[int]]:
    """Up to ``max_matches`` distinct continuations (each <= depth tokens) of earlier occurrences
    of the context's suffix n-gram: longest n first, then best ranked (see ``PromptLookup``).  tokens: [L]."""
    return [cont for cont, _ in find_matches(tokens, max_n, min_n, depth, max_matches)]


FEW_OCCURRENCES = 16  # up to this many, the occurrences are ranked in Python (``rank_few``), else with tensor ops


def find_matches(tokens: torch.Tensor, max_n: int, min_n: int, depth: int, max_matches: int,
                 index: "Callable[[int], list[int]] | None" = None,
                 host: list[int] | None = None) -> list[tuple[list[int], int]]:
    """``find_continuations`` with the length of the n-gram each continuation follows. ``index``: n -> the starts
    of the suffix n-gram's earlier occurrences, ascending (``NgramIndex.starts``); None: a scan of ``tokens``.
    ``host``: ``tokens`` as a list, when the caller has one."""
    length = tokens.shape[0]
    found: list[tuple[list[int], int]] = []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        if index is not None:
            starts = index(n)
        else:
            windows = tokens[:-1].unfold(0, n, 1)  # [L - n, n]: every earlier window, the suffix itself excluded
            starts = (windows == tokens[length - n:]).all(dim=1).nonzero().flatten().tolist()  # [M]
        if not starts:
            continue
        if len(starts) <= FEW_OCCURRENCES:  # a few: a handful of list operations beat two dozen tensor ops
            host = tokens.tolist() if host is None else host
            conts = [host[s + n:s + n + depth] for s in starts]
            ranked = [conts[i] for i in rank_few(conts)[:max_matches]]
        else:
            padded, lengths = continuations_at(tokens, torch.tensor(starts) + n, depth)
            best = rank_continuations(padded, lengths)[:max_matches].tolist()
            ranked = [padded[i, :lengths[i]].tolist() for i in best]
        for cont in ranked:
            if all(cont != f for f, _ in found):
                found.append((cont, n))
                if len(found) >= max_matches:
                    return found
    return found


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a growing context starts, added as the context grows: a round
    looks its suffix n-gram up instead of scanning the context (whose scan grows with its length)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._tokens: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        """Index ``tokens``, the context so far: the one indexed until now plus new tokens (a context that is not
        is indexed afresh)."""
        old = len(self._tokens)
        if len(tokens) < old or (old and tokens[old - 1] != self._tokens[-1]) or tokens[:1] != self._tokens[:1]:
            self._tokens, self._starts, old = [], {}, 0
        self._tokens.extend(tokens[old:])
        for end in range(old + 1, len(tokens) + 1):  # every n-gram ending at a new token
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._starts.setdefault(tuple(tokens[end - n:end]), []).append(end - n)

    def starts(self, n: int) -> list[int]:
        """The starts of the context's suffix n-gram's earlier occurrences (the suffix itself excluded), ascending."""
        length = len(self._tokens)
        found = self._starts.get(tuple(self._tokens[length - n:]), [])
        return found[:-1] if found and found[-1] == length - n else list(found)


def continuations_at(tokens: torch.Tensor, begins: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The up to ``depth`` tokens from each of ``begins`` [M]: (conts [M, depth], -1 past the end of
    the context; lengths [M])."""
    idx = begins[:, None] + torch.arange(depth)  # [M, depth]
    inside = idx < tokens.shape[0]
    return torch.where(inside, tokens[idx.clamp(max=tokens.shape[0] - 1)], -1), inside.sum(dim=1)


def rank_continuations(conts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Indices of the distinct continuations, best first: by ``expected_accepted`` (descending),
    ties to the later occurrence; of identical continuations only the best ranked one is kept.
    conts [M, D] (-1 past lengths [M], rows in context order) -> [G] long."""
    if conts.shape[0] == 1:
        return torch.zeros(1, dtype=torch.long)
    score, same = expected_accepted(conts, lengths)  # [M], [M] group of identical rows
    recent_first = torch.arange(conts.shape[0] - 1, -1, -1)
    order = recent_first[torch.argsort(score[recent_first], descending=True, stable=True)]  # [M]
    first = torch.zeros(conts.shape[0], dtype=torch.bool)
    rank_in_group = torch.full((conts.shape[0],), conts.shape[0]).scatter_reduce(
        0, same[order], torch.arange(conts.shape[0]), "amin")  # group -> best rank position
    first[rank_in_group[same[order]] == torch.arange(conts.shape[0])] = True
    return order[first]


def rank_few(conts: list[list[int]]) -> list[int]:
    """``rank_continuations`` of a few continuations given as lists (each as long as the context allows, >= 1
    token), in exact arithmetic: each score scaled by the least common multiple of the valid counts. Scores that
    tie exactly go to the later occurrence, as ``PromptLookup`` promises; the tensor ranking's float32 sums may
    instead order such a tie by rounding (the draft differs, never the output)."""
    if len(conts) == 1:
        return [0]
    valid = [sum(len(c) > k for c in conts) for k in range(max(map(len, conts)))]  # occurrences with k + 1 tokens
    scale = math.lcm(*valid)
    trie: dict = {}  # token -> [occurrences sharing this prefix, the next level]
    for cont in conts:
        level = trie
        for token in cont:
            node = level.setdefault(token, [0, {}])
            node[0] += 1
            level = node[1]
    score = []
    for cont in conts:
        level, total = trie, 0
        for k, token in enumerate(cont):
            support, level = level[token]
            total += support * (scale // valid[k])
        score.append(total)
    seen, ranked = set(), []
    for i in sorted(range(len(conts)), key=lambda i: (-score[i], -i)):  # best first, ties to the later occurrence
        if tuple(conts[i]) not in seen:
            seen.add(tuple(conts[i]))
            ranked.append(i)
    return ranked


def expected_accepted(conts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per occurrence, the accepted length its continuation would reach if the text went on like a
    random one of these occurrences: sum over k < length of support_k / valid_k, support_k the
    occurrences whose first k+1 tokens equal its own, valid_k those with k+1 tokens before the end.
    conts [M, D] (-1 past lengths [M]) -> (score [M] float, group [M] long: equal ids = identical rows)."""
    m, d = conts.shape
    order = torch.arange(m)
    for col in range(d - 1, -1, -1):  # lexicographic sort (stable, last column first): equal prefixes become runs
        order = order[torch.argsort(conts[order, col], stable=True)]
    rows = conts[order]  # [M, D]
    starts = torch.ones(m, d, dtype=torch.long)  # starts[r, k]: sorted row r opens a new run of (k+1)-prefixes
    starts[1:] = (rows[1:] != rows[:-1]).long().cummax(dim=1).values
    run = starts.cumsum(dim=0) - 1 + torch.arange(d) * m  # [M, D] run id, distinct per column
    support = torch.bincount(run.flatten(), minlength=m * d)[run]  # [M, D] size of each row's run
    valid = lengths[order, None] > torch.arange(d)  # [M, D]
    share = support * valid / valid.sum(dim=0).clamp(min=1)  # pads (-1) never share a run with a token
    score, group = torch.empty(m), torch.empty(m, dtype=torch.long)
    score[order], group[order] = share.sum(dim=1).float(), starts[:, -1].cumsum(dim=0) - 1
    return score, group


def build_trie(continuations: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """Merge continuations into a trie below the root: (parents [N] with -1 for the root,
    tokens of the N-1 non-root nodes). Earlier continuations get the lower sibling ranks."""
    parents, tokens = [-1], []
    child_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for cont in continuations:
        node = 0
        for tok in cont:
            nxt = child_of.get((node, tok))
            if nxt is None:
                if len(tokens) >= max_nodes:
                    break
                nxt = len(parents)
                parents.append(node)
                tokens.append(tok)
                child_of[(node, tok)] = nxt
            node = nxt
    return parents, tokens


def trie_scores(continuations: list[list[int]], weights: list[float], parents: list[int],
                tokens: list[int]) -> list[float]:
    """Per node of ``build_trie``'s trie (parents [N], tokens [N-1]), the largest weight of the
    continuations through it (the root's 1.0)."""
    node_of = {(parents[i], tokens[i - 1]): i for i in range(1, len(parents))}
    scores = [1.0] + [0.0] * (len(parents) - 1)
    for cont, weight in zip(continuations, weights):
        node = 0
        for tok in cont:
            node = node_of.get((node, tok))
            if node is None:
                break
            scores[node] = max(scores[node], weight)
    return scores
