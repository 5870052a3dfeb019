"""A greedy round reads the device once (issue 22): the accepted leaf, the bonus token and the draft's
tokens, in one small tensor. Counted with the runtime probe's read counter (every ``.item()``,
``.tolist()``, ``int()``, ``float()``, ``bool()``, ``__index__``, ``.nonzero()``, ``.cpu()`` outside
the target's and the drafter's module forwards), on a tiny target, output checked against plain
greedy ``generate``."""

import random

import pytest
import torch

from headway.bench.runtime_probe import Meter, build_drafter, counted_reads, drafter_modules, metered
from headway.heads import MedusaHeads
from headway.heads.medusa import MedusaConfig
from headway.inference import PromptLookup, SpeculativeGenerator
from headway.inference.tree import Tree, node_path
from headway.inference.verify import verify_greedy, verify_greedy_logits, verify_greedy_tensors


def drafter_of(kind, target):
    torch.manual_seed(0)
    if kind == "medusa":
        return MedusaHeads.from_target(target, MedusaConfig(num_heads=3)).eval()
    return build_drafter(kind, target, 0)  # the runtime probe's random drafter of that kind


@pytest.mark.parametrize("kind,tree,reads", [("eagle3", "chain-3", 1), ("eagle3", "tree-7", 1), ("medusa", "tree-7", 1),
                                             ("medusa", None, 1), ("lookup", None, 1),
                                             ("eagle3", None, 1),  # a dynamic tree: its shape read with the verification
                                             ("peagle", None, 1), ("dflash", "chain-3", 1), ("dflash", "tree-7", 1),
                                             ("dflash", None, 1),  # its default, a dynamic tree, read the same way
                                             ("layerskip", None, 1), ("draft-model", "chain-3", 1),
                                             ("draft-model", "tree-7", 1), ("lookahead", None, 1), ("suffix", None, 1),
                                             ("eagle3+lookup", "tree-7", 2),
                                             ("eagle3+suffix", "tree-7", 2),  # merging the drafts reads them
                                             ("eagle3+suffix", None, 2)])  # a dynamic tree's shape read with the merge
def test_a_greedy_round_reads_the_device_once(tiny_llama, kind, tree, reads):
    target = tiny_llama[0]
    drafter = drafter_of(kind, target)
    gen = SpeculativeGenerator(target, drafter, tree=tree)
    if kind.startswith(("eagle3", "dflash")):  # the CUDA default (a CPU grows dynamic trees on the host, reading there)
        (gen.drafter.drafters[0] if "+" in kind else gen.drafter).tensor_rounds = True
    if kind == "layerskip":
        gen.drafter.early_stop = False  # the CUDA default (a CPU stops after an unlikely token: a read per token)
    prompt = torch.tensor([5, 9, 14, 5, 9, 14, 22, 5, 9])  # a repeat, so prompt lookup drafts
    modules = [target] + drafter_modules(drafter)
    counts = {}
    for budget in (8, 24):
        meter = Meter()
        with metered(meter, modules), counted_reads(meter):
            out = gen.generate(prompt, max_new_tokens=budget)
        ref = target.generate(prompt[None], attention_mask=torch.ones(1, prompt.shape[0], dtype=torch.long),
                              do_sample=False, max_new_tokens=budget, eos_token_id=None, pad_token_id=0)
        assert out.sequences.tolist() == ref.tolist()
        assert out.stats.plain_steps < out.stats.target_forward_passes  # it drafted
        counts[budget] = meter.reads, out.stats.target_forward_passes
    # the setup (input checks, generation-config handling, the prompt's host copy) reads a fixed number of times;
    # each further round reads once
    (reads8, passes8), (reads24, passes24) = counts[8], counts[24]
    assert passes24 > passes8 and reads24 - reads8 <= reads * (passes24 - passes8), counts


def random_tree(rng: random.Random, n: int) -> Tree:
    return Tree([-1] + [rng.randrange(i) for i in range(1, n)])


def test_device_greedy_verification_matches_the_host_walk():
    """Distinct sibling tokens: the same path and bonus token as ``verify_greedy``; duplicate siblings: a path
    at least as long, every token on it the target's argmax after its parent."""
    rng = random.Random(0)
    for trial in range(300):
        tree = random_tree(rng, rng.randrange(1, 14))
        vocab = 5 if trial % 2 else 50  # a small vocabulary makes duplicate siblings and long matches common
        tokens = [rng.randrange(vocab) for _ in range(tree.size)]
        argmax = [rng.randrange(vocab) for _ in range(tree.size)]
        for node in range(1, tree.size):  # make about half the children match their parent's argmax
            if rng.random() < 0.5:
                tokens[node] = argmax[tree.parents[node]]
        leaf, bonus = verify_greedy_tensors(*tree.greedy_tensors(torch.device("cpu")), torch.tensor(tokens),
                                            torch.tensor(argmax))
        path = node_path(tree.parents, int(leaf))
        want, want_bonus = verify_greedy(tree.children, tokens, argmax)
        distinct = all(len({tokens[c] for c in kids}) == len(kids) for kids in tree.children)
        if distinct:
            assert (path, int(bonus)) == (want, want_bonus)
        else:
            assert len(path) >= len(want) and int(bonus) == argmax[path[-1]]
        assert all(tokens[b] == argmax[a] for a, b in zip(path, path[1:]))


def test_greedy_verification_from_logits_takes_the_argmax_of_the_rows_it_reads_only():
    """``verify_greedy_logits`` (the runtime's: the argmax at the nodes with children, then at the leaf) gives
    the leaf and bonus token of ``verify_greedy_tensors`` over every row's argmax, on random trees (wide ones,
    where it reads fewer rows, and chains, where it reads them all) with ties in the logits; the rows it skips
    are never looked at (NaN there changes nothing)."""
    rng = random.Random(1)
    cpu = torch.device("cpu")
    for trial in range(300):
        tree = random_tree(rng, rng.randrange(1, 14)) if trial % 3 else Tree(list(range(-1, rng.randrange(1, 6))))
        vocab = 4 if trial % 2 else 40
        logits = torch.randint(0, 3, (tree.size, vocab)).float()  # small integers: ties among the maxima
        argmax = logits.argmax(-1)
        tokens = torch.tensor([rng.randrange(vocab) for _ in range(tree.size)])
        for node in range(1, tree.size):
            if rng.random() < 0.6:
                tokens[node] = argmax[tree.parents[node]]
        want = verify_greedy_tensors(*tree.greedy_tensors(cpu), tokens, argmax)
        inner = tree.inner_rows(cpu)
        if inner is not None:  # a row nobody reads (no children, not the leaf) may hold anything
            unread = [i for i in range(tree.size) if not tree.children[i] and i != int(want[0])]
            logits[unread] = float("nan")
        got = verify_greedy_logits(tree, tokens, logits)
        assert (int(got[0]), int(got[1])) == (int(want[0]), int(want[1]))
        if tree.is_chain:  # a chain's host form (SpeculativeGenerator.chain_result): the same path and tokens
            path, new = SpeculativeGenerator.chain_result(torch.cat([argmax, tokens]).tolist(), None, None)
            assert path == node_path(tree.parents, int(want[0]))
            assert new == [int(tokens[i]) for i in path[1:]] + [int(want[1])]
    wide = Tree([-1, 0, 0, 0, 0, 1, 1, 2])  # 3 nodes with children + the leaf: 4 rows of 8
    assert wide.inner_rows(cpu)[0].tolist() == [0, 1, 2]
    assert Tree([-1, 0, 1, 2]).inner_rows(cpu) is None  # a chain: all but its last + the leaf is every row


def test_a_dynamic_tree_stays_on_the_device_until_one_read_gives_its_shape(monkeypatch):
    """``grow_dynamic_tensors`` reads nothing: its tree is a ``DeviceTree`` whose masks, depths and greedy tensors
    come from the device and equal those of the host's tree for the same logits (``expand_dynamic``); its shape comes
    with one read, from tree="auto"'s cut (``host_scored``: scores and parents together) or from a use before it."""
    from headway.inference.auto import host_scored
    from headway.inference.expand import DynamicTree, expand_dynamic, expand_dynamic_tensors
    from headway.inference.tree import DeviceTree

    torch.manual_seed(3)
    settings = DynamicTree(depth=4, top_k=3, total_tokens=9)
    table = torch.randn(64, 40)  # a node's logits: a function of its token, the same for both growths

    def rows_feed(tokens, parent_rows, depth, allowed):
        return table[tokens]

    def host_feed(exp, nodes):
        return table[exp.tokens[torch.tensor(nodes)] if isinstance(exp.tokens, torch.Tensor) else
                     torch.tensor([exp.tokens[n] for n in nodes])]

    root = table[7]
    want = expand_dynamic(settings, 10, 7, root, host_feed)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    for use in ("scores", "parents"):
        draft = expand_dynamic_tensors(settings, 10, 7, root, rows_feed)
        tree = draft.tree
        assert isinstance(tree, DeviceTree) and not tree.settled and tree.size == want.tree.size and not reads
        dtype = torch.float32
        for mine, theirs in zip(tree.device_tensors(torch.device("cpu"), dtype),
                                want.tree.device_tensors(torch.device("cpu"), dtype)):
            assert torch.equal(mine, theirs)
        for mine, theirs in zip(tree.greedy_tensors(torch.device("cpu")), want.tree.greedy_tensors(torch.device("cpu"))):
            assert torch.equal(mine, theirs)
        kids, bound = tree.sampling_tensors(torch.device("cpu"))  # the sampling rule's children table, no read
        assert not reads and not tree.is_chain and bound == 4 and kids.shape == (tree.size, 3)
        assert [[c for c in row if c >= 0] for row in tolist(kids)] == want.tree.children
        if use == "scores":
            scored = host_scored(draft)
            assert len(reads) == 1 and tree.settled
            assert scored.scores == pytest.approx(want.scores, rel=1e-6)
        else:
            assert tree.parents == want.tree.parents and len(reads) == 1  # read on first use
        assert tree.parents == want.tree.parents and tree.depths == want.tree.depths
        assert tree.children == want.tree.children and draft.tokens.tolist() == want.tokens.tolist()
        reads.clear()
    for one in (DynamicTree(depth=4, top_k=1, total_tokens=3), DynamicTree(depth=4, top_k=3, total_tokens=1)):
        chained = expand_dynamic_tensors(one, 10, 7, root, rows_feed)  # a chain: known on the host, no read
        assert not isinstance(chained.tree, DeviceTree) and chained.tree.is_chain and not reads
        assert chained.tree.parents == expand_dynamic(one, 10, 7, root, host_feed).tree.parents
        reads.clear()  # (the host growth's)


def test_a_batchs_scores_and_device_shapes_are_read_once_for_the_cut(monkeypatch):
    """``host_scored_rows``: tree="auto"'s cut over a batch reads every row's device scores and device tree shape in
    one read (a sampled draft's scores never; host scores as they are), each row getting its own."""
    from headway.inference.auto import host_scored_rows
    from headway.inference.expand import DynamicTree, expand_dynamic, expand_dynamic_tensors
    from headway.inference.proposer import Draft
    from headway.inference.tree import DeviceTree, chain

    table = torch.randn(64, 40, generator=torch.Generator().manual_seed(5))

    def rows_feed(tokens, parent_rows, depth, allowed):
        return table[tokens]

    def host_feed(exp, nodes):
        return table[torch.tensor([int(exp.tokens[n]) for n in nodes])]

    settings = [DynamicTree(depth=3, top_k=2, total_tokens=5), DynamicTree(depth=4, top_k=3, total_tokens=8)]
    want = [expand_dynamic(s, 10, 7 + i, table[7 + i], host_feed) for i, s in enumerate(settings)]
    drafts = [expand_dynamic_tensors(s, 10, 7 + i, table[7 + i], rows_feed) for i, s in enumerate(settings)]
    static = Draft(chain(2), torch.tensor([3, 4, 5]), None, scores=torch.tensor([1.0, 0.5, 0.25]))
    host = Draft(chain(1), torch.tensor([3, 4]), None, scores=[1.0, 0.5])
    sampled = Draft(chain(1), torch.tensor([3, 4]), {0: torch.ones(40) / 40}, scores=torch.tensor([1.0, 0.5]))
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    out = host_scored_rows([drafts[0], static, host, sampled, drafts[1]])
    assert len(reads) == 1
    for got, ref in zip((out[0], out[4]), want):
        assert isinstance(got.tree, DeviceTree) and got.tree.settled and got.tree.parents == ref.tree.parents
        assert got.scores == pytest.approx(ref.scores, rel=1e-6)
    assert out[1].scores == [1.0, 0.5, 0.25] and out[2] is host and out[3].scores is sampled.scores
