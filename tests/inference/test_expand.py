"""Growing draft trees level by level: static trees take each parent's rank-r candidate (or draws without
replacement, with q), EAGLE-2 dynamic trees keep the best total_tokens candidates closed under ancestors,
pruning feeds fewer rows for the same tree, and every fed node sees its context, ancestors and itself."""

import pytest
import torch

from headway.inference import DynamicTree
from headway.inference.expand import (Expansion, expand_dynamic, expand_dynamic_tensors, expand_static, feed_block,
                                     grow_shared_levels, grow_shared_levels_host,
                                      feed_mask, sees_all)
from headway.inference.tree import Tree
from headway.inference.verify import SamplingParams


def test_dynamic_tree_shape_and_scores():
    """EAGLE-2: expand the top_k best nodes per level, rerank all, keep total_tokens; closed under ancestors."""
    torch.manual_seed(0)
    table = {}  # a fixed random drafter: logits depend on the node's token and depth only

    def feed(exp, nodes):
        return torch.stack([table.setdefault((exp.tokens[n], exp.depths[n]), torch.randn(20) * 3) for n in nodes])

    settings = DynamicTree(depth=4, top_k=3, total_tokens=9)
    draft = expand_dynamic(settings, 10, 7, torch.randn(20) * 3, feed)
    tree = draft.tree
    assert tree.size == 10 and draft.q is None and tree.depth <= 4 and draft.tokens[0] == 7
    assert all(tree.parents[i] < i for i in range(1, tree.size))
    assert all(len(c) <= 3 for c in tree.children)
    truncated = expand_dynamic(settings, 2, 7, torch.randn(20), feed)
    assert truncated.tree.depth <= 2 and truncated.tree.size == 10  # 3 + 9 candidates, best 9 kept
    assert expand_dynamic(settings, 0, 7, torch.randn(20), feed).tree.size == 1


def path_tokens(exp, node: int) -> list[int]:
    """The tokens from ``node`` up to the root of a host expansion."""
    path = []
    while node >= 0:
        path.append(exp.tokens[node])
        node = exp.parents[node]
    return path


@pytest.mark.parametrize("depth,top_k,total", [(5, 3, 7), (6, 4, 15), (3, 4, 7), (4, 2, 30)])
def test_dynamic_tree_pruning_keeps_eagle2_tree_and_feeds_fewer_rows(depth, top_k, total):
    """Skipping frontier nodes that already rank below total_tokens candidates changes nothing kept."""
    fed = {True: 0, False: 0}

    def drafter(prune):
        def feed(exp, nodes):  # logits depend on the whole path (as a drafter's attention over its ancestors does)
            fed[prune] += len(nodes)
            rows = []
            for n in nodes:
                gen = torch.Generator().manual_seed(hash((seed, *path_tokens(exp, n))) % 2**31)
                rows.append(torch.randn(50, generator=gen) * 2)
            return torch.stack(rows)
        return feed

    settings = DynamicTree(depth=depth, top_k=top_k, total_tokens=total)
    unpruned = DynamicTree.from_spec({"depth": depth, "top_k": top_k, "total_tokens": total, "prune": 0})
    assert unpruned.name.endswith("-unpruned") and not unpruned.prune
    for seed in range(40):
        root = torch.randn(50, generator=torch.Generator().manual_seed(seed)) * 2
        a = expand_dynamic(settings, 10, 7, root, drafter(True))
        b = expand_dynamic(unpruned, 10, 7, root, drafter(False))
        assert a.tree.parents == b.tree.parents and torch.equal(a.tokens, b.tokens)
    assert fed[True] < fed[False] or total >= top_k ** 2 * depth


def test_expansion_adds_nodes_and_knows_their_ancestors():
    exp = Expansion([-1], [7], [0])
    a = exp.add(0, 3)
    b = exp.add(a, 4)
    c = exp.add(0, 5)
    assert (a, b, c) == (1, 2, 3) and exp.parents == [-1, 0, 1, 0] and exp.depths == [0, 1, 2, 1]
    assert exp.tokens == [7, 3, 4, 5] and exp.ancestors(b) == {1, 2} and exp.ancestors(0) == set()


def test_feed_mask_shows_the_context_the_fed_ancestors_and_the_node_itself():
    exp = Expansion([-1, 0, 0, 1, 2], [7, 3, 4, 5, 6], [0, 1, 1, 2, 2])
    exp.fed = [1, 2]  # depth 1 was fed; now depth 2 is
    mask = feed_mask(exp, [3, 4], 5, torch.float32, "cpu")
    assert mask.shape == (1, 1, 2, 5 + 2 + 2)
    seen = (mask[0, 0] == 0).int().tolist()
    # columns: 5 context entries, then nodes 1, 2 (fed), then nodes 3, 4 (fed now)
    assert seen == [[1, 1, 1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 0, 1, 0, 1]]
    assert (mask[mask != 0] == torch.finfo(torch.float32).min).all()


def test_a_node_that_sees_every_fed_node_needs_no_mask():
    """``sees_all``: one node whose fed nodes are all its ancestors (a chain's level) sees the whole cache, so its
    step runs unmasked; a second row, or a fed node off its path, needs the mask. It agrees with the mask itself
    (nothing blocked) on every level of a static tree, memoised there."""
    exp = Expansion([-1, 0, 0, 1, 2], [7, 3, 4, 5, 6], [0, 1, 1, 2, 2])
    assert sees_all(exp, [1])  # nothing fed yet
    assert not sees_all(exp, [1, 2])  # siblings do not see each other
    exp.fed = [1]
    assert sees_all(exp, [3]) and not sees_all(exp, [4])  # node 1 is 3's parent, not 4's
    for tree in (Tree([-1, 0, 1, 2]), Tree([-1, 0, 0, 1, 3, 4]), Tree([-1, 0, 0, 1, 2, 3])):
        exp = Expansion(list(tree.parents), list(range(tree.size)), list(tree.depths), tree=tree)
        frontier = [0]
        while frontier:
            nodes = [c for n in frontier for c in tree.children[n] if tree.children[c]] or None
            if nodes is None:
                break
            assert sees_all(exp, nodes) == (not feed_block(exp, nodes, "cpu").any())
            assert tree.cached(("sees_all", len(exp.fed), tuple(nodes)), lambda: None) is not None
            exp.fed += nodes
            frontier = nodes


def token_drafter(vocab: int = 12, seed: int = 0, offset: int = 0):
    """A drafter whose logits after a node depend on its token only (token ids ``offset`` + its own
    index), and the feed calls it saw."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, vocab, generator=g, dtype=torch.float64) * 2
    calls = []

    def feed(exp, nodes):
        calls.append(list(nodes))
        return table[exp.token_ids(nodes, "cpu") - offset]
    return table, feed, calls


def test_static_greedy_takes_each_parents_rank_r_candidate():
    tree = Tree([-1, 0, 0, 1, 1, 2], ranks=[0, 0, 1, 0, 1, 0])
    table, feed, calls = token_drafter()
    root = table[7]
    draft = expand_static(tree, 7, root, feed, None, None)
    assert isinstance(draft.scores, torch.Tensor)  # left on the device: tree="auto" reads them once
    scores = draft.score_list()
    assert draft.q is None and draft.tokens[0] == 7 and draft.tree is tree
    assert calls == [[1, 2]]  # the nodes with children, one level per call (the root's logits are given)
    for node in range(1, tree.size):
        parent = tree.parents[node]
        logits = root if parent == 0 else table[int(draft.tokens[parent])]
        assert draft.tokens[node] == logits.topk(2).indices[tree.ranks[node]]
        p = logits.float().softmax(-1)[draft.tokens[node]]
        assert scores[node] == pytest.approx(scores[parent] * float(p), rel=1e-6)
    assert scores[0] == 1.0


def test_static_sampling_draws_distinct_children_and_reports_q():
    tree = Tree([-1, 0, 0, 0, 1])
    table, feed, _ = token_drafter(offset=100)
    params = SamplingParams(1.0)
    draft = expand_static(tree, 7, table[7], feed, params, torch.Generator().manual_seed(0),
                          to_target=lambda ids: ids + 100, widen=lambda q: torch.cat([q.new_zeros(100), q]))
    assert set(draft.q) == {0, 1}  # the nodes with children
    kids = draft.tokens[tree.children[0]]
    assert len(set(kids.tolist())) == 3 and bool((kids >= 100).all())  # drawn without replacement, as target ids
    for node, q in draft.q.items():
        assert q.shape == (112,) and float(q.sum()) == pytest.approx(1.0) and float(q[:100].sum()) == 0
        assert bool((q[draft.tokens[tree.children[node]]] > 0).all())
    again = expand_static(tree, 7, table[7], feed, params, torch.Generator().manual_seed(0),
                          to_target=lambda ids: ids + 100, widen=lambda q: torch.cat([q.new_zeros(100), q]))
    assert torch.equal(draft.tokens, again.tokens)  # the generator is the only randomness


def test_dynamic_tree_settings():
    assert DynamicTree().name == "dynamic-d5-k4-n10"
    # strings are read as numbers; "total_token" is EAGLE's own spelling
    assert DynamicTree.from_spec({"depth": "3", "total_token": 6}) == DynamicTree(depth=3, total_tokens=6)
    with pytest.raises(ValueError, match="must be >= 1"):
        DynamicTree(top_k=0)
    with pytest.raises(ValueError, match="unknown dynamic tree setting\\(s\\) \\['width'\\]"):
        DynamicTree.from_spec({"width": 3})
    with pytest.raises(ValueError, match="bad dynamic tree settings"):
        DynamicTree.from_spec({"depth": "deep"})


@pytest.mark.parametrize("depth,top_k,total", [(3, 4, 7), (5, 3, 7), (7, 4, 7), (6, 4, 15), (4, 2, 30), (2, 5, 3),
                                               (4, 1, 4), (3, 4, 1)])
@pytest.mark.parametrize("rows", [2, 3, 7])
def test_shared_levels_grow_the_generic_growths_tree(depth, top_k, total, rows):
    """A drafter whose logits depend on a node's depth only (DFlash's slots), fed row d for every node of depth d:
    ``grow_shared_levels`` keeps the tree, tokens and scores ``expand_dynamic_tensors`` keeps, and
    ``grow_shared_levels_host`` (one read, the tree grown on the host; one Tree a shape) those ``expand_dynamic``
    keeps, also where the logits hold fewer rows than the tree's depth (the depth is cut to them) and with exact
    ties among the candidates (integer logits: ties broken by node id in all four). Without ties the host and
    tensor trees agree too (with ties, float32 sums may break a near-tie the other way)."""
    vocab = 24
    settings = DynamicTree(depth=depth, top_k=top_k, total_tokens=total, prune=False)
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(rows, vocab, generator=g) * 2
        if seed % 3 == 0:
            logits = logits.round()  # many exact ties
        to_target = (lambda x: x + 100) if seed % 2 else (lambda x: x)
        want = expand_dynamic_tensors(settings, rows, 7, logits[0], lambda t, p, level, a: logits[level][None],
                                      to_target)
        got = grow_shared_levels(settings, 7, logits, to_target)
        assert got.tree.parents == want.tree.parents and got.tokens.tolist() == want.tokens.tolist(), seed
        assert torch.equal(got.scores, want.scores) and got.tree.name == want.tree.name and got.q is None
        host = expand_dynamic(settings, rows, 7, logits[0], lambda exp, nodes: logits[exp.depths[nodes[0]]].expand(
            len(nodes), -1), to_target)
        on_host = grow_shared_levels_host(settings, 7, logits, to_target)
        assert on_host.tree.parents == host.tree.parents and on_host.tokens.tolist() == host.tokens.tolist(), seed
        assert on_host.scores == host.scores and on_host.tree.name == host.tree.name and on_host.q is None
        assert grow_shared_levels_host(settings, 7, logits, to_target).tree is on_host.tree
        if seed % 3:
            assert on_host.tree.parents == got.tree.parents and on_host.tokens.tolist() == got.tokens.tolist(), seed
            assert on_host.scores == pytest.approx(got.scores.tolist(), rel=1e-5)


@pytest.mark.parametrize("depth,top_k,total", [(3, 4, 7), (5, 3, 7), (6, 4, 15), (4, 2, 30), (2, 5, 3)])
@pytest.mark.parametrize("prune", [True, False])
def test_dynamic_tree_as_tensor_ops_keeps_the_host_versions_tree(depth, top_k, total, prune):
    """Fixed shapes, no read (the kept shape is read on its first host use): the same kept tree, tokens and scores
    as ``expand_dynamic``; each fed row sees exactly its fed ancestors and itself."""
    vocab = 40

    def logits_of(path, seed):  # a drafter whose logits depend on the whole path
        return torch.randn(vocab, generator=torch.Generator().manual_seed(hash((seed, *path)) % 2**31)) * 2

    settings = DynamicTree(depth=depth, top_k=top_k, total_tokens=total, prune=prune)
    for seed in range(20):
        def host_feed(exp, nodes):
            return torch.stack([logits_of(path_tokens(exp, n), seed) for n in nodes])

        fed = []  # per feed: each row's path (tokens from the node up to the root)

        def rows_feed(tokens, parent_rows, level_depth, allowed):
            prev = fed[-1] if fed else None
            paths = [[t] + (prev[r] if r >= 0 else [7]) for t, r in zip(tokens.tolist(), parent_rows.tolist())]
            width = sum(len(p) for p in fed)  # nodes fed before these rows
            assert allowed.shape == (len(paths), width + len(paths))
            assert allowed[:, width:].equal(torch.eye(len(paths), dtype=torch.bool))
            assert (allowed.sum(1) == level_depth).all()  # its ancestors below the root, and itself
            for r, p in enumerate(parent_rows.tolist()):  # the parent's row: its fed ancestors and itself
                if p >= 0:
                    assert allowed[r, :width].equal(fed_allowed[-1][p])
            fed.append(paths)
            fed_allowed.append(allowed)
            return torch.stack([logits_of(p, seed) for p in paths])

        fed_allowed = []
        root = logits_of([7], seed)
        a = expand_dynamic(settings, 10, 7, root, host_feed)
        b = expand_dynamic_tensors(settings, 10, 7, root, rows_feed)
        assert a.tree.parents == b.tree.parents and a.tokens.tolist() == b.tokens.tolist()
        assert b.scores.tolist() == pytest.approx(a.scores, rel=1e-6) and b.q is None and b.tree.name == a.tree.name
    assert expand_dynamic_tensors(settings, 0, 7, root, rows_feed).tree.size == 1  # no budget: the root alone
    fed.clear()
    shallow = expand_dynamic_tensors(settings, 1, 7, root, rows_feed)
    assert shallow.tree.depth == 1 and shallow.tree.size == 1 + min(top_k, total) and not fed


def test_expansion_positions_are_depths_plus_an_offset():
    """``Expansion.positions``: a static tree's (its depths built once per level) and a dynamic one's (from the host)."""
    tree = Tree([-1, 0, 0, 1, 2])
    static = Expansion(list(tree.parents), torch.zeros(5, dtype=torch.long), list(tree.depths), tree=tree)
    dynamic = Expansion(list(tree.parents), [0] * 5, list(tree.depths))
    for exp in (static, dynamic):
        assert exp.positions([3, 4], 10, "cpu").tolist() == [12, 12]
        assert exp.positions([1, 2, 0], 5, "cpu").tolist() == [6, 6, 5]


def test_a_static_levels_mask_padded_by_its_context_is_the_mask_built_for_it():
    """``static_feed_mask`` (built once per level of a static tree) padded by a context of any length equals the mask
    built from the level's ``feed_block`` after that context; it is the same tensor every round; a dynamic tree has
    none."""
    import torch.nn.functional as F

    from headway.inference.expand import additive_mask, static_feed_mask

    tree = Tree([-1, 0, 0, 1, 1, 2, 3])
    exp = Expansion(list(tree.parents), torch.zeros(7, dtype=torch.long), list(tree.depths), tree=tree)
    for nodes in ([1, 2], [3, 4, 5], [6]):
        block = static_feed_mask(exp, nodes, "cpu", torch.float32)
        assert block is static_feed_mask(exp, nodes, "cpu", torch.float32)
        for seen in (0, 5):
            assert torch.equal(F.pad(block, (seen, 0)), additive_mask(feed_block(exp, nodes, "cpu"), seen, torch.float32))
        exp.fed += nodes
    assert static_feed_mask(Expansion([-1], [7], [0]), [0], "cpu", torch.float32) is None
