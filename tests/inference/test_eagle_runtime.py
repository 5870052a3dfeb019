"""EAGLE drafters in the runtime: greedy output equals target.generate token for token (20 prompts) for EAGLE-1 and
EAGLE-3 over static and EAGLE-2 dynamic trees on two model families (with non-trivial acceptance),
the drafter's cache stays the context, dynamic trees are well formed, and bad trees are refused."""

import pytest
import torch

from headway.inference import DynamicTree, EagleProposer, SpeculativeGenerator, as_proposer
from headway.inference.expand import expand_dynamic

CASES = {  # name: (version, tree, floor on tau over the first 20 prompts)
    "eagle1-chain": (1, "chain-4", 1.2),
    "eagle1-dynamic": (1, {"depth": 4, "top_k": 3, "total_tokens": 10}, 1.35),
    "eagle3-chain": (3, "chain-4", 1.3),
    "eagle3-tree": (3, "tree-15", 1.5),
    "eagle3-dynamic": (3, None, 1.5),  # the default: EAGLE-2 dynamic settings for this device
}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_equals_generate(family, eagle, name):
    version, tree, floor = CASES[name]  # floors: tau over the 20 prompts
    gen = SpeculativeGenerator(family.target, eagle[version], tree=tree)
    new = passes = 0
    for i, (prompt, max_new, ref) in enumerate(list(zip(family.prompts, family.max_new, family.references))[:20]):
        out = gen.generate(prompt, max_new_tokens=max_new)
        assert torch.equal(out.sequences, ref), f"{family.name}/{name}: prompt {i} differs from generate"
        assert out.stats.new_tokens == ref.shape[1] - prompt.shape[1] == sum(out.stats.accepted_per_step)
        new, passes = new + out.stats.new_tokens, passes + out.stats.target_forward_passes
    tau = new / passes
    assert tau > floor, f"{family.name}/{name}: tau {tau:.2f} (floor {floor})"


def test_greedy_eager_attention_and_eos(family, eagle):
    family.target.set_attn_implementation("eager")
    try:
        gen = SpeculativeGenerator(family.target, eagle[3], tree={"depth": 4, "top_k": 3, "total_tokens": 8})
        for prompt, max_new, ref in list(zip(family.prompts, family.max_new, family.references))[:10]:
            assert torch.equal(gen.generate(prompt, max_new_tokens=max_new).sequences, ref)
    finally:
        family.target.set_attn_implementation("sdpa")
    prompt, ref = family.prompts[3], family.references[3]
    eos = int(ref[0, prompt.shape[1] + 4])
    first = (ref[0, prompt.shape[1]:] == eos).nonzero()[0, 0]
    out = SpeculativeGenerator(family.target, eagle[1]).generate(prompt, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(out.sequences[0], ref[0, :prompt.shape[1] + first + 1])


def test_draft_cache_holds_the_context_only(family, eagle):
    drafter = as_proposer(eagle[3])
    assert isinstance(drafter, EagleProposer) and drafter.feature_layers == eagle[3].config.feature_layers
    gen = SpeculativeGenerator(family.target, drafter, tree="tree-15")
    out = gen.generate(family.prompts[0], max_new_tokens=20)
    # after the last round the cache holds one entry per context position that had a feature
    assert len(drafter._cache) == drafter._seen == out.sequences.shape[1] - 1 - out.stats.accepted_per_step[-1]


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


@pytest.mark.parametrize("depth,top_k,total", [(5, 3, 7), (6, 4, 15), (3, 4, 7), (4, 2, 30)])
def test_dynamic_tree_pruning_keeps_eagle2_tree_and_feeds_fewer_rows(depth, top_k, total):
    """Skipping frontier nodes that already rank below total_tokens candidates changes nothing kept."""
    fed = {True: 0, False: 0}

    def drafter(prune):
        table = {}  # logits depend on the whole path (as a drafter's attention over its ancestors does)

        def feed(exp, nodes):
            fed[prune] += len(nodes)
            rows = []
            for n in nodes:
                path, m = [], n
                while m >= 0:
                    path.append(exp.tokens[m])
                    m = exp.parents[m]
                gen = torch.Generator().manual_seed(hash((seed, *path)) % 2**31)
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


def test_bad_trees(family, eagle):
    with pytest.raises(ValueError, match="unknown dynamic tree setting"):
        SpeculativeGenerator(family.target, eagle[3], tree={"depth": 4, "width": 3})
    with pytest.raises(ValueError, match="must be >= 1"):
        SpeculativeGenerator(family.target, eagle[3], tree={"depth": 0})
    with pytest.raises(ValueError, match="prune: expected true/false"):
        SpeculativeGenerator(family.target, eagle[3], tree={"depth": 3, "prune": "sometimes"})
    assert not DynamicTree.from_spec({"prune": "false"}).prune and DynamicTree.from_spec({"prune": "yes"}).prune
    with pytest.raises(ValueError, match="offers only top-150"):
        SpeculativeGenerator(family.target, eagle[3], tree=[[0], [200]])
    with pytest.raises(ValueError, match="grow their own tree"):
        SpeculativeGenerator(family.target, family.heads, tree={"depth": 3})  # Medusa: static trees only
