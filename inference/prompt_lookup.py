"""Prompt lookup (Saxena, 2023; transformers' ``prompt_lookup_num_tokens``): copy what followed
the last n-gram where it occurred earlier in the context. Free to compute, strong on copy-heavy
text. With ``max_matches > 1`` the continuations of several matches are merged into a trie, so
one verification pass tries them all (tree verification as in SpecInfer, arXiv:2305.09781).
"""

from __future__ import annotations

import torch

from headway.inference.drafter import Draft, DraftContext, Drafter, root_only
from headway.inference.tree import Tree


class PromptLookup(Drafter):
    """Deterministic n-gram copy drafter (needs no model).

    Args:
        max_ngram_size: longest suffix n-gram searched for (tried first).
        min_ngram_size: shortest suffix n-gram tried when longer ones do not occur.
        num_pred_tokens: tokens copied per match (the draft depth).
        max_matches: distinct continuations merged into a tree (1: a chain, as transformers does).
        max_nodes: cap on draft nodes (the verification width is max_nodes + 1).
    Matches are taken most recent first. A ``tree`` given to the generator caps the depth and,
    through its number of leaves, the number of matches.
    """

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 1, num_pred_tokens: int = 10,
                 max_matches: int = 1, max_nodes: int = 32):
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(f"need 1 <= min_ngram_size <= max_ngram_size, got {min_ngram_size}, {max_ngram_size}")
        if num_pred_tokens < 1 or max_matches < 1 or max_nodes < 1:
            raise ValueError("num_pred_tokens, max_matches and max_nodes must be >= 1")
        self.max_ngram_size, self.min_ngram_size = max_ngram_size, min_ngram_size
        self.num_pred_tokens, self.max_matches, self.max_nodes = num_pred_tokens, max_matches, max_nodes

    def propose(self, ctx: DraftContext) -> Draft:
        depth, matches = self.num_pred_tokens, self.max_matches
        if ctx.tree is not None:
            depth = min(depth, ctx.tree.depth)
            matches = min(matches, int((ctx.tree.retrieve[:, 0] >= 0).sum()))
        depth = min(depth, ctx.max_depth)
        if depth < 1:
            return root_only(ctx)
        conts = find_continuations(ctx.tokens, self.max_ngram_size, self.min_ngram_size, depth, matches)
        if not conts:
            return root_only(ctx)
        parents, node_tokens = build_trie(conts, self.max_nodes)
        tokens = torch.tensor([int(ctx.tokens[-1])] + node_tokens, dtype=torch.long, device=ctx.tokens.device)
        return Draft(Tree(parents, name="prompt-lookup"), tokens)


def find_continuations(tokens: torch.Tensor, max_n: int, min_n: int, depth: int, max_matches: int) -> list[list[int]]:
    """Up to ``max_matches`` distinct continuations (each <= depth tokens) of earlier occurrences
    of the context's suffix n-gram, longest n first, most recent occurrence first.  tokens: [L]."""
    length = tokens.shape[0]
    found: list[list[int]] = []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n:]  # [n]
        windows = tokens[:-1].unfold(0, n, 1)  # [L - n, n]: every earlier window, the suffix itself excluded
        starts = (windows == pattern).all(dim=1).nonzero().flatten().tolist()
        for s in reversed(starts):
            cont = tokens[s + n: s + n + depth].tolist()
            if cont and cont not in found:
                found.append(cont)
                if len(found) >= max_matches:
                    return found
    return found


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
