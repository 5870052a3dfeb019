"""Trees as data: structure functions, validation errors, loading by name / path / list."""

import pytest
import torch

from headway.inference.tree import (Tree, ancestor_mask, shaped_tree, available_trees, chain, load_tree, node_depths,
                                    normalize_paths, parent_indices, retrieve_indices)

PATHS = [[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def test_structure_functions():
    paths = normalize_paths(PATHS)
    assert paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    parents = parent_indices(paths)
    assert parents == [-1, 0, 0, 1, 1, 2, 3]
    assert node_depths(parents) == [0, 1, 1, 2, 2, 2, 3]
    mask = ancestor_mask(parents)
    assert mask.shape == (7, 7) and mask.dtype == torch.bool
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 3, 6]  # (0,0,0): root, (0), (0,0), itself
    assert mask[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert torch.equal(mask, mask.tril())  # parents come first
    assert retrieve_indices(parents).tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    tree = Tree.from_paths(PATHS)
    assert tree.size == 7 and tree.depth == 3 and tree.top_k == 2 and not tree.is_chain
    assert tree.paths == [tuple(p) for p in paths]
    assert tree.children[0] == [1, 2] and tree.children[1] == [3, 4]


def test_truncate_and_chain():
    tree = Tree.from_paths(PATHS)
    t2 = tree.truncate(2)
    assert t2.size == 6 and t2.depth == 2 and tree.truncate(2) is t2 and tree.truncate(5) is tree
    assert tree.truncate(0).size == 1
    c = chain(4)
    assert c.is_chain and c.depth == 4 and c.size == 5 and c.paths == [(0,) * d for d in range(1, 5)]
    # a drafter-built tree whose nodes are not sorted by depth still truncates correctly
    trie = Tree([-1, 0, 1, 2, 0, 4])
    assert trie.truncate(1).parents == [-1, 0, 0] and trie.truncate(2).parents == [-1, 0, 1, 0, 3]


def test_device_tensors_are_additive_float():
    tree = load_tree("chain-2")
    add, depth = tree.device_tensors(torch.device("cpu"), torch.float32)
    assert add.dtype == torch.float32 and depth.tolist() == [0, 1, 2]
    assert add[0, 1] == torch.finfo(torch.float32).min and add[2, 0] == 0 and add[2, 2] == 0


@pytest.mark.parametrize("paths, match", [
    ([[0], [1, 0]], "prefix \\[1\\] is missing"),
    ([[0], [0]], "more than once"),
    ([[0], [-1]], ">= 0"),
    ([[0], []], "non-empty"),
    ([[0], [0.5]], "integers"),
    (5, "list of paths"),
    ({"depth": 4, "top_k": 8, "total_tokens": 60}, "grow their own tree"),
    ([[0], "ab"], "non-empty list"),
])
def test_malformed_trees(paths, match):
    with pytest.raises(ValueError, match=match):
        load_tree(paths)


def test_validation_against_drafter():
    with pytest.raises(ValueError, match="rank 3 .* top-3"):
        load_tree([[0], [3]], top_k=3)
    with pytest.raises(ValueError, match="depth 3 .* at most 2"):
        load_tree("chain-3", max_depth=2)
    assert load_tree("chain-2", top_k=1, max_depth=2).depth == 2


def test_shipped_trees_load():
    names = available_trees()
    for d in range(1, 9):
        assert f"chain-{d}" in names
        t = load_tree(f"chain-{d}")
        assert t.is_chain and t.depth == d
    sizes = {name: load_tree(name).size - 1 for name in names if name.startswith("tree-")}
    assert sizes == {"tree-7": 7, "tree-15": 15, "tree-31": 31, "tree-63": 63}
    for name in names:
        load_tree(name)  # every shipped file validates


def test_load_from_file_and_errors(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("paths:\n  - [0]\n  - [0, 0]\n  - [1]\n")
    assert load_tree(good).size == 4 and load_tree(str(good)).name == "mine"
    bare = tmp_path / "bare.yaml"
    bare.write_text("- [0]\n- [1]\n")
    assert load_tree(bare).size == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("paths:\n  - [0]\n  - [2, 0]\n")
    with pytest.raises(ValueError, match="missing"):
        load_tree(bad)
    extra = tmp_path / "extra.yaml"
    extra.write_text("paths: [[0]]\nwidth: 3\n")
    with pytest.raises(ValueError, match="keys"):
        load_tree(extra)
    broken = tmp_path / "broken.yaml"
    broken.write_text("paths: [[0]\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_tree(broken)
    with pytest.raises(FileNotFoundError):
        load_tree(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="unknown tree 'nope'.*chain-1"):
        load_tree("nope")


def test_a_shape_drafted_again_is_the_same_tree(monkeypatch):
    """``shaped_tree``: one instance per shape and name (its device tensors built once), the same structure as a
    new ``Tree``; the cache is cleared when full, not grown without bound."""
    import headway.inference.tree as tree_mod

    a = shaped_tree([-1, 0, 1, 0], name="prompt-lookup")
    assert shaped_tree((-1, 0, 1, 0), name="prompt-lookup") is a
    assert shaped_tree([-1, 0, 1, 0], name="suffix") is not a and shaped_tree([-1, 0, 0, 1], "prompt-lookup") is not a
    fresh = Tree([-1, 0, 1, 0], name="prompt-lookup")
    assert (a.parents, a.depths, a.ranks, a.children) == (fresh.parents, fresh.depths, fresh.ranks, fresh.children)
    ranked = shaped_tree([-1, 0, 1, 0], name="prompt-lookup", ranks=[0, 1, 0, 0])  # a cut keeps its ranks: its own tree
    assert ranked is not a and ranked.ranks == [0, 1, 0, 0] and a.ranks == [0, 0, 0, 1]
    assert shaped_tree([-1, 0, 1, 0], name="prompt-lookup", ranks=(0, 1, 0, 0)) is ranked
    assert a.greedy_tensors(torch.device("cpu"))[0] is a.greedy_tensors(torch.device("cpu"))[0]
    monkeypatch.setattr(tree_mod, "_SHAPES", {})
    monkeypatch.setattr(tree_mod, "MAX_SHAPES", 3)
    for n in range(1, 8):
        shaped_tree(list(range(-1, n)))
        assert len(tree_mod._SHAPES) <= 3


def test_prompt_lookup_reuses_its_tree_shapes():
    """A repeated text drafts the same chain shape round after round: one Tree for all of them."""
    from headway.inference import PromptLookup
    from headway.inference.proposer import DraftContext

    seen = set()
    text = torch.tensor([5, 6, 7, 8, 9] * 6)
    lookup = PromptLookup(max_matches=1)
    for end in range(12, 30):
        ctx = DraftContext(tokens=text[:end], features=None, tree=None, max_depth=3, sampling=None, generator=None)
        draft = lookup.propose(ctx)
        if draft.tree.size == 4:
            seen.add(id(draft.tree))
    assert len(seen) == 1
