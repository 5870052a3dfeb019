"""Drafts whose depth-d candidates are the top-k of one row of logits, whatever their parents: Medusa's heads
(head d-1 after the root) and DFlash's block (slot d). A node at depth d and rank r takes the rank-r token of row
d-1, so a whole tree is one top-k over the D rows and one gather, with no level-by-level expansion; a node's score
(what tree="auto" reads) is its rows' probabilities multiplied along its path."""

from __future__ import annotations

import torch

from headway.inference import vocab_reduce
from headway.inference.proposer import Draft
from headway.inference.tree import Tree, node_path


def ranked_draft(tree: Tree, root: torch.Tensor, logits: torch.Tensor, to_target, scored: bool) -> Draft:
    """The greedy draft of ``tree`` from ``logits`` [D >= tree.depth, V'] (row d-1: the candidates at depth d),
    ``root`` [1] its root token, ``to_target`` mapping indices of the logits to target ids. Scores only where
    ``scored`` (softmax keeps the logits' order: without it only which of two near-equal logits ranks first may
    differ, a draft's choice either way). A chain takes each row's argmax, as a static expansion does."""
    k = tree.top_k
    if tree.is_chain and not scored:
        return Draft(tree, torch.cat([root, to_target(vocab_reduce.argmax(logits[:tree.depth]))]))  # [N]
    # [D, k]: each row's k most likely tokens (and their probabilities where scored)
    best = vocab_reduce.topk(logits.float().softmax(-1) if scored else logits, k)
    top = to_target(best.indices.reshape(-1))  # [D * k] target ids
    index = flat_index(tree, k, top.device)  # [N - 1]
    tokens = torch.cat([root, top[index]])  # [N]
    if not scored:
        return Draft(tree, tokens)
    # a node's rows' probabilities multiplied along its path, on the device (tree="auto" reads them once)
    own = torch.cat([best.values.new_ones(1), best.values.reshape(-1)[index], best.values.new_ones(1)])  # [N + 1]
    return Draft(tree, tokens, scores=own[path_table(tree, top.device)].prod(-1))  # [N]


def flat_index(tree: Tree, k: int, device) -> torch.Tensor:
    """Index of each non-root node into the flattened [D, k] top-k table: (depth - 1) * k + rank.  [N - 1]"""
    return tree.cached(("ranked_index", k, device), lambda: torch.tensor(
        [(d - 1) * k + r for d, r in zip(tree.depths[1:], tree.ranks[1:])], dtype=torch.long, device=device))


def path_table(tree: Tree, device) -> torch.Tensor:
    """[N, D] the nodes on each node's root-to-node path, root first, padded with N (a factor of 1)."""
    def build() -> torch.Tensor:
        paths = [node_path(tree.parents, i)[1:] for i in range(tree.size)]
        return torch.tensor([p + [tree.size] * (tree.depth - len(p)) for p in paths], dtype=torch.long, device=device)

    return tree.cached(("ranked_paths", device), build)
