"""Suffix decoding (Oliaro et al. 2024, SuffixDecoding, arXiv:2411.04975; Snowflake's ArcticInference):
retrieval drafting from a suffix structure over the prompt and the text generated so far, and
optionally over the earlier outputs of the same drafter (a cross-request cache for repeated and
agentic workloads). Needs no model.

The structure is a suffix trie cut at ``max_depth`` tokens: every substring of at most that many
tokens is a path from the root, each node counting how often its substring occurred. Appending a
token extends the nodes of the current suffixes by one (O(max_depth) per token), so the trie of a
sequence grows with it round by round. A round matches the longest suffix of the context (at most
``max_pattern`` tokens) that occurred before with a continuation, and grows a tree below it best
first: a candidate's score is the product of its empirical next-token frequencies along the path
(its estimated chance of being accepted), nodes under ``min_token_prob`` are dropped and at most
``max_spec_factor`` x the match length nodes are kept (a long match earns a wide tree; a one-token
match a small one), as SuffixDecoding does. headway's default factor is 2 where ArcticInference's is 1:
under ``tree="auto"``, which trims what does not pay, 2 raised tau on every task group (+0.01..+0.22)
and ran 1-7% faster on six, within noise on the other two (BENCHMARKS.md). The per-request trie and
the cross-request cache each propose a tree; the one with the larger expected accepted length (the sum
of its scores) is used.
Candidates are deterministic, so verification is exact greedy or exact rejection sampling.
"""

from __future__ import annotations

import copy
import heapq

import torch

from headway.inference.proposer import Draft, DraftContext, Proposer, root_only
from headway.inference.tree import shaped_tree


COUNT, NEXT = 0, 1  # a trie node is [count, {token: child node}]


class SuffixTrie:
    """Counts of every substring of at most ``max_depth`` tokens of the sequences appended to it."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root: list = [0, {}]
        self.active: list[list] = [self.root]  # active[k]: the node of the current length-k suffix
        self.tokens = 0  # tokens appended

    def start(self) -> None:
        """A new sequence: its substrings do not run on from the previous one's end."""
        self.active = [self.root]

    def append(self, tokens) -> None:
        for tok in tokens:
            nxt = [self.root]
            for node in self.active[:self.max_depth]:  # the suffixes one token longer, up to max_depth
                child = node[NEXT].get(tok)
                if child is None:
                    child = node[NEXT][tok] = [0, {}]
                child[COUNT] += 1
                nxt.append(child)
            self.active = nxt
        self.tokens += len(tokens)

    def find(self, pattern: list[int]) -> list | None:
        node = self.root
        for tok in pattern:
            node = node[NEXT].get(tok)
            if node is None:
                return None
        return node


def speculate(node: list, budget: int, depth: int, min_prob: float):
    """A best-first tree below ``node``: (parents [N] (-1: the root), tokens [N-1] of the other nodes,
    expected accepted length = the sum of the nodes' scores, scores [N] with the root's 1.0). A child's
    score is its parent's times count(child) / the counts of its siblings together."""
    parents, tokens, total, scores = [-1], [], 0.0, [1.0]
    heap: list = []  # (-score, tie, trie node, token, tree parent, depth)
    tie = 0

    def push(trie_node: list, tree_parent: int, score: float, level: int):
        nonlocal tie
        kids = trie_node[NEXT]
        denom = sum(k[COUNT] for k in kids.values())
        for tok, kid in kids.items():
            p = score * kid[COUNT] / denom
            if p >= min_prob:
                heapq.heappush(heap, (-p, tie, kid, tok, tree_parent, level))
                tie += 1

    push(node, 0, 1.0, 1)
    while heap and len(tokens) < budget:
        neg, _, kid, tok, parent, level = heapq.heappop(heap)
        parents.append(parent)
        tokens.append(tok)
        scores.append(-neg)
        total += -neg
        if level < depth:
            push(kid, len(parents) - 1, -neg, level + 1)
    return parents, tokens, total, scores


class SuffixDecoding(Proposer):
    """Suffix-tree retrieval drafter over the context and, with ``cross_request``, earlier outputs.

    Args:
        max_pattern: longest context suffix matched (tried first; shorter ones when it did not occur).
        max_depth: deepest draft node below the root.
        max_spec_factor: at most this many draft nodes per matched token (SuffixDecoding's factor).
        max_nodes: a cap on draft nodes whatever the match (the verification width is max_nodes + 1).
        min_token_prob: candidates whose estimated acceptance falls below this are not drafted.
        cross_request: also keep the outputs of this drafter's earlier requests in a shared trie and draft
            from it (the newest ``cache_tokens`` tokens of them: an older output is dropped whole).
    """

    def __init__(self, max_pattern: int = 12, max_depth: int = 12, max_spec_factor: float = 2.0,
                 max_nodes: int = 32, min_token_prob: float = 0.1, cross_request: bool = True,
                 cache_tokens: int = 16_384):
        if max_pattern < 1 or max_depth < 1 or max_nodes < 1 or not max_spec_factor > 0:
            raise ValueError("max_pattern, max_depth and max_nodes must be >= 1 and max_spec_factor > 0")
        if not 0 <= min_token_prob <= 1:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        self.max_pattern, self.max_depth, self.max_spec_factor = max_pattern, max_depth, max_spec_factor
        self.max_nodes, self.min_token_prob, self.cross_request = max_nodes, min_token_prob, cross_request
        self.cache_tokens = cache_tokens
        self.outputs: list[list[int]] = []  # earlier requests' outputs, oldest first
        self.cache = SuffixTrie(max_pattern + max_depth)  # their substrings
        self._seen: list[int] = []
        self._prompt_len: int | None = None
        self.reset()

    def reset(self) -> None:
        """A new request: the last one's output joins the cross-request cache; the context trie starts empty."""
        if self.cross_request and self._prompt_len is not None and len(self._seen) > self._prompt_len:
            self.remember(self._seen[self._prompt_len:])
        self.trie = SuffixTrie(self.max_pattern + self.max_depth)
        self._seen: list[int] = []  # every context token appended to self.trie, in order
        self._prompt_len: int | None = None

    def fork(self) -> "SuffixDecoding":
        """A batch row's proposer: its own context trie; the cross-request cache is shared (read-only here:
        a fork's output is not remembered)."""
        clone = copy.copy(self)
        clone._prompt_len = None  # so its reset remembers nothing of this proposer's last request
        clone.reset()
        return clone

    def remember(self, output: list[int]) -> None:
        """Add one finished output to the cross-request cache (rebuilt without the oldest outputs when it
        would hold more than ``cache_tokens`` tokens)."""
        self.outputs.append(list(output))
        if self.cache.tokens + len(output) > self.cache_tokens:
            while len(self.outputs) > 1 and sum(map(len, self.outputs)) > self.cache_tokens:
                self.outputs.pop(0)
            self.cache = SuffixTrie(self.max_pattern + self.max_depth)
            for out in self.outputs:
                self.cache.start()
                self.cache.append(out)
            return
        self.cache.start()
        self.cache.append(output)

    def _update(self, ctx: DraftContext) -> None:
        tokens = ctx.tokens
        if self._prompt_len is None:
            self._prompt_len = tokens.shape[0]
        # the tokens made since the last round, from the generator's host mirror where it gives one (no device read)
        new = ctx.host_tokens[len(self._seen):] if ctx.host_tokens is not None else tokens[len(self._seen):].tolist()
        self._seen += new
        self.trie.append(new)

    def _best(self, trie: SuffixTrie, depth: int, own: bool):
        """(parents, tokens, expected accepted, match length) of the longest matched suffix, or None. In
        the context's own trie the current suffix is there already: only earlier occurrences count."""
        seq = self._seen
        for m in range(min(self.max_pattern, len(seq) - (1 if own else 0)), 0, -1):
            node = trie.active[m] if own else trie.find(seq[-m:])  # own: the current suffixes' nodes
            if node is None or not node[NEXT]:
                continue
            budget = min(self.max_nodes, max(1, int(self.max_spec_factor * m)))
            parents, tokens, score, scores = speculate(node, budget, depth, self.min_token_prob)
            if tokens:
                return parents, tokens, score, m, scores
        return None

    def propose(self, ctx: DraftContext) -> Draft:
        self._update(ctx)
        depth = min(self.max_depth, ctx.max_depth)
        if ctx.tree is not None:
            depth = min(depth, ctx.tree.depth)
        if depth < 1:
            return root_only(ctx)
        found = [f for f in (self._best(self.trie, depth, own=True),
                             self._best(self.cache, depth, own=False) if self.cross_request else None) if f]
        if not found:
            return root_only(ctx)
        parents, tokens, _, _, scores = max(found, key=lambda f: f[2])
        out = torch.tensor([ctx.root_token] + tokens, dtype=torch.long, device=ctx.tokens.device)
        return Draft(shaped_tree(parents, name="suffix"), out, scores=scores)
