"""EAGLE drafters in the runtime: greedy output equals target.generate token for token (20 prompts) for EAGLE-1 and
EAGLE-3 over static and EAGLE-2 dynamic trees on two model families (with non-trivial acceptance),
the drafter's cache stays the context, and bad trees are refused (the dynamic trees' expansion itself:
test_expand.py)."""

import pytest
import torch

from headway.inference import DynamicTree, EagleProposer, SpeculativeGenerator, as_proposer

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
    tau = greedy_tau(gen, family, 20, name)
    assert tau > floor, f"{family.name}/{name}: tau {tau:.2f} (floor {floor})"


def greedy_tau(gen, family, prompts: int, name: str) -> float:
    """``gen``'s output on the family's first ``prompts`` prompts, each checked equal to generate's (its token count
    the accepted tokens'); tau over them."""
    new = passes = 0
    for i, (prompt, max_new, ref) in enumerate(list(zip(family.prompts, family.max_new, family.references))[:prompts]):
        out = gen.generate(prompt, max_new_tokens=max_new)
        assert torch.equal(out.sequences, ref), f"{family.name}/{name}: prompt {i} differs from generate"
        assert out.stats.new_tokens == ref.shape[1] - prompt.shape[1] == sum(out.stats.accepted_per_step)
        new, passes = new + out.stats.new_tokens, passes + out.stats.target_forward_passes
    return new / passes


def test_eagle31_greedy_equals_generate(family):
    """EAGLE-3.1 (normalize_features), trained with the real loss: output identical to generate with
    non-trivial acceptance. (What its norms compute is checked against vLLM's speculators package:
    tests/heads/formats/test_speculators.py.)"""
    from tests.inference.eagle_utils import train_eagle

    head = train_eagle(family.target, 3, seed=FAMILY_SEEDS_31[family.name], steps=50, draft_vocab=150,
                       normalize_features=True)
    assert head.config.normalize_features and len(head.fc_norm) == 3
    tau = greedy_tau(SpeculativeGenerator(family.target, head, tree="tree-15"), family, 10, "eagle3.1")
    assert tau > 1.3, f"{family.name}/eagle3.1: tau {tau:.2f}"


FAMILY_SEEDS_31 = {"llama": 5, "qwen2": 6}


DEEP_DYNAMIC = {"depth": 4, "top_k": 3, "total_tokens": 10}


@pytest.mark.parametrize("tree,tensor_rounds", [("tree-15", None), (DEEP_DYNAMIC, False), (DEEP_DYNAMIC, True)])
def test_eagle3_of_several_layers_greedy_equals_generate(family, eagle_deep, tree, tensor_rounds):
    """An EAGLE-3 drafter of 3 decoder layers (midlayer, then plain pre-norm ones: speculators' num_hidden_layers),
    trained with the training-time test through every layer: output identical to generate, alone and in a batch,
    with non-trivial acceptance."""
    from tests.inference.spec_utils import assert_batch_equals_rows

    gen = SpeculativeGenerator(family.target, eagle_deep, tree=tree)
    gen.drafter.tensor_rounds = tensor_rounds
    tau = greedy_tau(gen, family, 10, "3 layers")
    assert tau > 1.3, f"{family.name}/3 layers: tau {tau:.2f}"
    assert [len(gen.drafter._cache.layer(i)) for i in range(3)] == [gen.drafter._seen] * 3
    assert_batch_equals_rows(gen, family)


@pytest.fixture(scope="module")
def eagle_deep(family):
    from tests.inference.eagle_utils import train_eagle

    head = train_eagle(family.target, 3, seed=FAMILY_SEEDS_31[family.name], steps=50, draft_vocab=150, num_layers=3)
    assert len(head.decoder_layers) == 3
    return head


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


DYNAMIC_HOST = {"depth": 4, "top_k": 3, "total_tokens": 10}


@pytest.mark.parametrize("tree,tensor_rounds", [("tree-15", None), (DYNAMIC_HOST, False), (DYNAMIC_HOST, True)])
def test_rows_drafted_together_equal_each_row_drafted_alone(family, eagle, tree, tensor_rounds, monkeypatch):
    """A batch's rows drafting side by side (each level of every row's tree in one head pass over the stacked
    draft caches, the root projections in one product, the second round's catch-ups in one pass) make each row
    the draft and the cache it makes alone: rows of different context lengths, in a first round and in a second
    one that catches each row up by its own number of positions."""
    from headway.heads.target.features import capture_features
    from headway.inference.eagle import StackedRows
    from headway.inference.proposer import DraftContext, run_rows

    gen = SpeculativeGenerator(family.target, eagle[3], tree=tree)
    layers = gen.drafter.feature_layers
    picked = [0, 3, 5, 8]
    alone, together = [gen.drafter.fork() for _ in picked], [gen.drafter.fork() for _ in picked]
    for p in alone + together:  # a dynamic tree grown on the host (a CPU's default) or with tensor ops (CUDA's)
        p.tensor_rounds = tensor_rounds
    feeds, catch_ups = [], []
    monkeypatch.setattr(StackedRows, "feed", lambda self, requests, feed=StackedRows.feed: feeds.append(
        len(requests)) or feed(self, requests))
    from headway.inference import eagle as eagle_module

    monkeypatch.setattr(eagle_module, "catch_up_rows", lambda requests, run=eagle_module.catch_up_rows:
                        catch_ups.append(len(requests)) or run(requests))
    seen = [0] * len(picked)
    for extra in ([0, 0, 0, 0], [1, 4, 2, 3]):  # the second round: each row accepted its own count
        contexts = []
        for r, (i, more) in enumerate(zip(picked, extra)):
            prompt, ref = family.prompts[i], family.references[i]
            tokens = ref[0, :prompt.shape[1] + more]
            with torch.no_grad():
                feats = capture_features(family.target, tokens[None], layers)[0, seen[r]:tokens.shape[0] - 1]
            seen[r] = tokens.shape[0] - 1
            contexts.append(DraftContext(tokens, feats, gen.tree, 8, None, None, host_tokens=tokens.tolist()))
        with torch.no_grad():
            mine = [p.propose(ctx) for p, ctx in zip(alone, contexts)]
            batched = run_rows([p.propose_steps(ctx) for p, ctx in zip(together, contexts)])
        assert len({c.tokens.shape[0] for c in contexts}) > 1  # the rows' contexts differ in length
        for a, b in zip(mine, batched):
            assert a.tree.parents == b.tree.parents and torch.equal(a.tokens, b.tokens)
            torch.testing.assert_close(torch.as_tensor(b.score_list()), torch.as_tensor(a.score_list()))
        for a, b in zip(alone, together):
            assert len(b._cache) == b._seen == a._seen  # a row's own cache holds its context only
            torch.testing.assert_close(b._cache.keys, a._cache.keys)
    assert feeds and all(n == len(picked) for n in feeds)  # the levels ran batched, every row in each
    assert catch_ups == [len(picked)]  # the second round's catch-ups (1-4 positions a row) in one pass, not the prompts


@pytest.mark.parametrize("tree", ["chain-4", "tree-15"])
def test_levels_that_see_the_whole_cache_run_unmasked_and_draft_the_same(family, eagle, tree, monkeypatch):
    """A chain's levels (one node seeing every fed node) run with no attention mask; every round's draft (tokens,
    scores) equals the one drafted with each level's mask built through the static tree's expansion (a greedy
    chain's own path, ``_grow_chain``, off), and a tree's levels keep theirs."""
    import headway.inference.eagle as runtime

    def drafts(masked: bool) -> tuple[list, int]:
        if masked:
            monkeypatch.setattr(runtime, "sees_all", lambda exp, nodes: False)
        built, run = [], runtime.Feed.run  # the levels run under a mask (built, or a static level's padded)
        monkeypatch.setattr(runtime.Feed, "run", lambda self: (built.append(1) if not self.open else None) or run(self))
        proposer, seen = EagleProposer(eagle[3]), []
        proposer.chain_path = not masked
        propose = proposer.propose

        def spy(ctx):
            draft = propose(ctx)
            seen.append((draft.tokens.tolist(), None if draft.scores is None else draft.scores.tolist()))
            return draft

        proposer.propose = spy
        gen = SpeculativeGenerator(family.target, proposer, tree=tree)
        for prompt, max_new in list(zip(family.prompts, family.max_new))[:4]:
            gen.generate(prompt, max_new_tokens=max_new)
        monkeypatch.undo()
        return seen, len(built)

    (open_drafts, open_masks), (masked_drafts, masked_masks) = drafts(False), drafts(True)
    assert [t for t, _ in open_drafts] == [t for t, _ in masked_drafts] and len(open_drafts) > 8
    for (_, a), (_, b) in zip(open_drafts, masked_drafts):
        assert (a is None) == (b is None) and (a is None or torch.allclose(torch.tensor(a), torch.tensor(b)))
    assert masked_masks >= len(open_drafts) - 4  # every level built its mask (a prompt's first round drafts none)
    assert open_masks == (0 if tree == "chain-4" else masked_masks)


def test_parent_outputs_are_the_stacked_rows_of_their_feeds():
    """``parent_outputs`` (a level's inputs) equals the row-by-row stack of its parents' outputs in every form it
    takes: one feed whole, a slice of it, a gather with repeats and out of order, and rows of two feeds."""
    from headway.inference.eagle import parent_outputs

    first, second = torch.randn(1, 8), torch.randn(4, 8)
    outputs = {0: (first, 0), **{n: (second, n - 1) for n in range(1, 5)}}
    for parents in ([0], [1, 2, 3, 4], [2, 3], [4], [1, 1, 3, 3], [3, 1], [0, 2], [2, 0, 4]):
        want = torch.stack([outputs[p][0][outputs[p][1]] for p in parents])
        assert torch.equal(parent_outputs(outputs, parents), want), parents
    assert parent_outputs(outputs, [1, 2, 3, 4]) is second  # a chain's level: the feed itself
