"""``ranked_draft``: a tree whose depth-d candidates are one row's top-k (Medusa's heads, DFlash's block slots) as
one top-k and a gather: each node the rank-r token of its depth's row, scores the rows' probabilities multiplied
along the path, a chain the rows' argmax."""

import pytest
import torch

from headway.inference.ranked import ranked_draft
from headway.inference.tree import Tree, load_tree, node_path


@pytest.mark.parametrize("name", ["chain-3", "tree-7", "tree-15"])
@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.parametrize("mapped", [False, True])
def test_each_node_is_its_depths_rank_r_token_scored_along_its_path(name, scored, mapped):
    tree = load_tree(name)
    logits = torch.randn(tree.depth + 1, 50, generator=torch.Generator().manual_seed(3)) * 3  # a row more than needed
    to_target = (lambda x: x * 2 + 1) if mapped else (lambda x: x)
    draft = ranked_draft(tree, torch.tensor([7]), logits, to_target, scored)
    ranked = logits.topk(tree.top_k, -1).indices  # [D + 1, k]
    assert draft.tree is tree and draft.tokens[0] == 7 and draft.q is None
    for node in range(1, tree.size):
        assert int(draft.tokens[node]) == int(to_target(ranked[tree.depths[node] - 1, tree.ranks[node]]))
    if not scored:
        assert draft.scores is None
        return
    p = logits.softmax(-1)
    for node in range(tree.size):
        path = node_path(tree.parents, node)[1:]
        want = torch.tensor([float(p[tree.depths[n] - 1, ranked[tree.depths[n] - 1, tree.ranks[n]]]) for n in path]).prod()
        assert float(draft.scores[node]) == pytest.approx(float(want), rel=1e-5)


def test_a_chain_takes_each_rows_first_maximum():
    """Exact ties: an unscored chain takes each row's first maximal index, as a level-by-level argmax does."""
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 0.0, 3.0]])
    draft = ranked_draft(Tree([-1, 0, 1]), torch.tensor([9]), logits, lambda x: x, False)
    assert draft.tokens.tolist() == [9, 1, 0]
