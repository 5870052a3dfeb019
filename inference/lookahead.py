"""Lookahead decoding (Fu et al., 2024, arXiv:2402.02057): the target drafts for itself by Jacobi iteration.

No drafter model. Each round one verification pass carries two branches below the root:

- the **lookahead window**: a chain of ``window`` guesses for the next positions. The pass gives the
  target's own next token after every prefix of it, o_j = argmax p(. | context, y_1..y_j): one Jacobi
  step, whose outputs become the next round's guesses (shifted by what was accepted). The newest
  ``ngram - 1`` levels of guesses are kept by absolute position, and every trajectory along them,
  ``level_{N-2}[p], ..., level_0[p + N - 3], o[p + N - 2]`` (each token the target's guess after the one
  before it), is an n-gram for the pool;
- the **verification branch**: up to ``guesses`` n-grams from the pool that start with the root token
  (the last accepted one), each a chain of ``ngram - 1`` tokens, merged into a trie with the window.

Every proposal is deterministic (q None), so greedy acceptance is exact and sampling verifies them
with the one-hot rule, exact as for prompt lookup; the window's chain is a candidate too (plain
Jacobi decoding's acceptance comes free). The pool is also fed the n-grams of the prompt and of the
accepted text.

headway's window is one chain, each guess reading the current level's guesses before it (plain
Jacobi), so the pass is an ordinary tree pass; the paper lays ``ngram - 1`` levels side by side
under a staircase mask instead, which draws each new guess from several levels at once.
The generator hands the target's greedy choices at the verified nodes back through
``observe_outputs`` (read with the round's accepted path: one host read a round, greedy).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from headway.inference.prompt_lookup import build_trie, trie_scores
from headway.inference.proposer import Draft, DraftContext, Proposer, root_only
from headway.inference.tree import shaped_tree


class NgramPool:
    """n-grams by first token: ``key -> continuations`` (each ``n - 1`` tokens), newest first, at most
    ``per_key`` kept per key (the oldest dropped)."""

    def __init__(self, n: int, per_key: int):
        self.n, self.per_key = n, per_key
        self._pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram) -> None:
        """Add one n-gram (a sequence of ``n`` tokens); a known one becomes the newest."""
        key, cont = int(ngram[0]), tuple(int(t) for t in ngram[1:])
        found = self._pool.setdefault(key, OrderedDict())
        found.pop(cont, None)
        found[cont] = None
        while len(found) > self.per_key:
            found.popitem(last=False)

    def add_text(self, tokens: list[int], start: int = 0) -> None:
        """Every n-gram of ``tokens`` that ends at index >= start + n - 1 (the text from ``start`` on)."""
        for i in range(max(0, start - self.n + 1), len(tokens) - self.n + 1):
            self.add(tokens[i:i + self.n])

    def lookup(self, key: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` continuations of ``key``, newest first."""
        found = self._pool.get(int(key))
        return [list(c) for c in reversed(found)][:limit] if found else []

    def __len__(self) -> int:
        return sum(len(v) for v in self._pool.values())


class Lookahead(Proposer):
    """Lookahead decoding: a Jacobi window and an n-gram pool, verified in one pass (needs no model).

    Args:
        window: W, guesses in the lookahead window (positions looked ahead per round).
        ngram: N, the n-gram size: the pool's candidates are N - 1 tokens long, and N - 1 levels of
            guesses are kept to form them.
        guesses: G, pool candidates verified per round (and kept per first token).
        pool_from_prompt: seed the pool with the prompt's n-grams (and keep adding the accepted text's).
    """

    reads_outputs = True  # the generator calls observe_outputs after each verification

    def __init__(self, window: int = 5, ngram: int = 4, guesses: int = 3, pool_from_prompt: bool = True):
        if window < 1 or ngram < 2 or guesses < 0:
            raise ValueError(f"lookahead needs window >= 1, ngram >= 2 and guesses >= 0, got window={window}, "
                             f"ngram={ngram}, guesses={guesses}")
        self.window, self.ngram, self.guesses, self.pool_from_prompt = window, ngram, guesses, pool_from_prompt
        self.reset()

    @property
    def max_nodes(self) -> int:
        """The widest draft below the root: the window and G candidates of N - 1 tokens."""
        return self.window + self.guesses * (self.ngram - 1)

    def bind(self, target_model) -> None:
        config = target_model.config.get_text_config()
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if positions is not None and self.max_nodes + 2 > positions:
            raise ValueError(f"lookahead window={self.window}, ngram={self.ngram}, guesses={self.guesses} verifies up "
                             f"to {self.max_nodes + 1} tokens a pass, more than the target's {positions} positions; "
                             "lower them")

    def reset(self) -> None:
        self.pool = NgramPool(self.ngram, max(self.guesses, 1))
        self.latest: dict[int, int] = {}  # the last Jacobi step's outputs: absolute position -> the target's token
        self.trail: list[dict[int, int]] = []  # the windows verified, newest first (N - 1 kept)
        self.seen = 0  # tokens of the context already added to the pool
        self._window: tuple[int, list[int]] | None = None  # (position of the first guess, the guesses) last proposed

    def propose(self, ctx: DraftContext) -> Draft:
        host = ctx.host_tokens if ctx.host_tokens is not None else ctx.host_context().tolist()
        length = len(host)
        if self.pool_from_prompt or self.seen:  # the prompt (first round) and the text accepted since
            self.pool.add_text(host, self.seen)
        self.seen = length
        cap = min(ctx.max_depth, ctx.tree.depth if ctx.tree is not None else ctx.max_depth)
        depth, width = min(self.ngram - 1, cap), min(self.window, cap)
        self._window = None
        if cap < 1:
            return root_only(ctx)
        guesses = self._guesses(host, length, width)  # width >= 1: the window is never empty
        conts = [c[:depth] for c in self.pool.lookup(host[-1], self.guesses)]
        self._window = (length, guesses)
        branches = conts + [guesses]  # pool candidates first (the lower sibling ranks), then the window
        parents, node_tokens = build_trie(branches, self.max_nodes)
        tokens = torch.tensor([host[-1]] + node_tokens, dtype=torch.long, device=ctx.tokens.device)
        # a raw confidence per node for tree="auto" (which calibrates it against acceptance): a pool candidate's
        # nodes 0.5 / (rank + 1), the window's 0.1 (a Jacobi guess is rarely right), the root 1
        weights = [0.5 / (rank + 1) for rank in range(len(conts))] + [0.1]
        return Draft(shaped_tree(parents, name="lookahead"), tokens,
                     scores=trie_scores(branches, weights, parents, node_tokens))

    def _guesses(self, host: list[int], length: int, width: int) -> list[int]:
        """The window for positions length .. length + width - 1: the last Jacobi step's outputs where it has
        them, else an earlier window's guesses, else tokens of the context (the paper starts from the prompt's)."""
        out = []
        for j in range(width):
            p = length + j
            tok = next((level[p] for level in [self.latest, *self.trail] if p in level), None)
            out.append(tok if tok is not None else host[(p * 7919) % length])  # a fixed spread over the context
        return out

    def observe_outputs(self, draft: Draft, outputs: list[int], tokens: list[int] | None = None) -> None:
        """The target's greedy choice after each node of the verified ``draft`` (outputs [N]): the Jacobi
        step over the window's nodes (as far as the verified tree kept them), and the pool's new n-grams."""
        if self._window is None:
            return
        start, guesses = self._window
        self._window = None
        tokens = draft.tokens.tolist() if tokens is None else tokens
        child = {(p, t): i for i, (p, t) in enumerate(zip(draft.tree.parents, tokens)) if p >= 0}
        node, level = 0, {start: outputs[0]}  # o_0: the token after the root, at the first guess's position
        for j, tok in enumerate(guesses, start=1):
            node = child.get((node, tok))
            if node is None:
                break
            level[start + j] = outputs[node]  # o_j: the target's next token after guesses 1..j
        if len(level) < 2:
            return  # the window was not verified (tree="auto" cut it): no Jacobi step this round
        verified = {start + j: tok for j, tok in enumerate(guesses[:len(level) - 1])}  # this round's guesses, by position
        self.trail = [verified] + self.trail[:self.ngram - 2]  # the N - 1 levels below the new one, newest first
        for p, tok in level.items():  # o at p, the guess at p - 1 it followed, the one that guess followed, ...
            gram = [tok]
            for back, lvl in enumerate(self.trail, start=1):
                if p - back not in lvl:
                    break
                gram.append(lvl[p - back])
            if len(gram) == self.ngram:
                self.pool.add(gram[::-1])
        self.latest = level

