"""Batch > 1: generate(input_ids [B, T], attention_mask [B, T]) with left padding, every drafter kind.

Every row's greedy output must be that prompt's own ``target.generate`` output (each stopping at its
own EOS, the rest padded as generate pads), with fixed trees and with tree="auto"; sampled rows must
follow the target's exact distribution (chi-square on an 8-token model, rows of one batch padded
differently); bad batches get one-line errors.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

import headway.inference.batch as batch_mod
from headway.heads.dflash import DFlashHead
from headway.heads.layerskip import LayerSkipHead
from headway.heads.peagle import PEagleHead
from headway.inference import (DraftModelProposer, LayerSkipProposer, Lookahead, PromptLookup, RetrievalChoice,
                               SpeculativeGenerator, SuffixDecoding)
from headway.inference.batch import BatchCost, check_batch
from headway.inference.cost_curve import OnlineCost
from headway.inference.kv_cache import compact_rows, new_cache, repack_rows
from tests.inference.eagle_utils import train_eagle
from tests.inference.spec_utils import (PROMPT, SETTINGS, chi2_pvalue, context_logits, exact_joint, left_pad,
                                        made_up_curve, reference_generate, tiny_vocab_model, train_medusa)

BATCH = 7  # the family's first prompts: 3-27 tokens (a prompt of one token: the EOS test), some repeating a segment


def assert_rows_equal_generate(target, out, prompts, ids, max_new, pad, **settings):
    t = ids.shape[1]
    assert out.sequences.shape[0] == len(prompts) and torch.equal(out.sequences[:, :t], ids)
    for r, prompt in enumerate(prompts):
        ref = reference_generate(target, prompt, max_new, **settings)[0, prompt.shape[-1]:]
        row = out.sequences[r, t:]
        assert torch.equal(row[:ref.shape[0]], ref), (r, row.tolist(), ref.tolist())
        assert (row[ref.shape[0]:] == pad).all(), r  # a row that stopped early is padded, as generate pads it
        assert out.rows[r].new_tokens == ref.shape[0]


def family_drafters(family, eagle):
    return {"medusa": family.heads, "eagle1": eagle[1], "eagle3": eagle[3], "draft-model": DraftModelProposer(family.draft),
            "layerskip": LayerSkipHead.from_target(family.target, exit_layer=1, num_draft=3),
            "lookup": PromptLookup(max_matches=2), "suffix": SuffixDecoding(), "lookahead": Lookahead(),
            "hybrid": [eagle[3], PromptLookup()],
            "hybrid-choice": [eagle[3], RetrievalChoice([SuffixDecoding(), PromptLookup()])]}


@pytest.mark.parametrize("kind", ["medusa", "eagle1", "eagle3", "draft-model", "layerskip", "lookup", "suffix",
                                  "lookahead", "hybrid", "hybrid-choice"])
@pytest.mark.parametrize("tree", [None, "auto"])
def test_every_row_equals_its_own_generate(family, eagle, kind, tree):
    """Rows of 1-30 tokens (some repeating a segment), their own EOS (the tiny targets' tokenizer EOS)."""
    target = family.target
    pad = target.generation_config.pad_token_id
    curve = made_up_curve(0.1) if tree == "auto" else None
    gen = SpeculativeGenerator(target, family_drafters(family, eagle)[kind], tree=tree, cost_curve=curve)
    prompts = family.prompts[:BATCH]
    ids, mask = left_pad(prompts, pad)
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=24)
    assert_rows_equal_generate(target, out, prompts, ids, 24, pad)
    assert out.stats.batch_passes >= max(s.target_forward_passes for s in out.rows)
    assert out.stats.new_tokens == sum(s.new_tokens for s in out.rows)


@pytest.mark.parametrize("waste, hybrid", [(0.0, False), (1.0, False), (0.0, True)])
def test_a_draft_models_chains_share_one_cache_laid_out_as_the_targets(family, waste, hybrid, monkeypatch):
    """A draft model drafting chains keeps one cache for the whole batch (``ChainRows``), in step with the target's
    (its holes, the rows that leave at their EOS, repacks every round or never), alone or as a hybrid's model part.
    With the target's own weights as the draft every drafted token is the target's greedy one, so every round of
    every row accepts at least its whole chain (but where the budget or the EOS cuts it): the batched draft sees
    exactly each row's own context. Each step is one draft forward over the rows."""
    monkeypatch.setattr(batch_mod, "REPACK_WASTE", waste)
    drafter = DraftModelProposer(copy.deepcopy(family.target), gamma=3)
    out, steps = batch_with_shared_draft(family, [drafter, PromptLookup()] if hybrid else drafter, None, "step",
                                         monkeypatch)
    for r, st in enumerate(out.rows):
        assert all(n >= 4 for n in st.accepted_per_step[:-1]), (r, st.accepted_per_step)
    assert steps and max(steps) > 1  # the rows' chain steps ran together


def batch_with_shared_draft(family, drafter, tree, method: str, monkeypatch):
    """``family``'s first prompts as one batch through ``drafter`` (a draft model sharing one batch draft cache,
    ``ChainRows``), counting the rows of each ``ChainRows.<method>`` call; every row equals its own generate.
    Returns (the output, the calls' row counts)."""
    from headway.inference.draft_model import ChainRows

    calls = []
    real = getattr(ChainRows, method)
    monkeypatch.setattr(ChainRows, method, lambda self, parts: calls.append(len(parts)) or real(self, parts))
    target = family.target
    pad = target.generation_config.pad_token_id
    prompts = family.prompts[:BATCH]
    ids, mask = left_pad(prompts, pad)
    out = SpeculativeGenerator(target, drafter, tree=tree).generate(ids, attention_mask=mask, max_new_tokens=20)
    assert_rows_equal_generate(target, out, prompts, ids, 20, pad)
    return out, calls


def test_the_shared_draft_cache_gives_each_rows_own_logits():
    """``ChainRows`` against the draft model run on each row's own context alone (fp64): the roots' logits after the
    prompts (left-padded, of 5, 2 and 8 tokens), a chain step where one row does not step, a catch-up after a round
    where the rows kept 3, 1 and 2 tokens (holes between), a row leaving, a repack, and a step after them."""
    from headway.inference.draft_model import ChainRows

    model = tiny_vocab_model(3, vocab=50, scale=1.0)
    proposer = DraftModelProposer(model, gamma=3)
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(2, 50, (n,), generator=g).tolist() for n in (5, 2, 8)]
    ids, mask = left_pad([torch.tensor([c]) for c in contexts], 0)

    def alone(context):  # the draft model's logits after ``context``, run on it alone
        return model(torch.tensor([context])).logits[0, -1]

    def check(logits, rows):
        for r in rows:
            assert torch.allclose(logits[r], alone(contexts[r]), atol=1e-10), r

    with torch.no_grad():
        rows = ChainRows(proposer, ids, mask, capacity=64)
        check(rows.root_logits, range(3))
        steps = {0: torch.tensor([7]), 2: torch.tensor([9])}  # row 1 does not step (it steps on its root)
        logits = rows.step(steps)
        for r, t in steps.items():
            assert torch.allclose(logits[r], alone(contexts[r] + [int(t)]), atol=1e-10), r
        logits = rows.step({0: torch.tensor([8])})  # a second step, row 0's alone
        assert torch.allclose(logits[0], alone(contexts[0] + [7, 8]), atol=1e-10)
        rows.end_round()
        news = [[11, 12, 13], [14], [15, 16]]  # accepted tokens, then the new root
        for c, new in zip(contexts, news):
            c += new
        rows.catch_up(news, [len(c) for c in contexts])
        check(rows.root_logits, range(3))
        assert rows.valid.shape[1] == ids.shape[1] + 3  # the longest kept path (3) + the new root's column
        index = torch.tensor([0, 2])
        rows.select(index)
        contexts = [contexts[0], contexts[2]]
        rows.repack()
        assert rows.valid.sum(1).tolist() == [len(c) for c in contexts] and rows.valid[:, -1].all()
        assert rows.valid.shape[1] == max(map(len, contexts))  # the holes squeezed out
        check(rows.root_logits, range(2))
        logits = rows.step({0: torch.tensor([21]), 1: torch.tensor([22])})
        for r, t in enumerate((21, 22)):
            assert torch.allclose(logits[r], alone(contexts[r] + [t]), atol=1e-10), r


def test_the_shared_draft_cache_feeds_each_rows_tree_levels_as_its_own_context_would():
    """``ChainRows.feed`` against the draft model run alone on each row's context and the node's path (fp64): a
    first level of 2, 1 and 0 nodes (row 1 feeding none, its columns padding), a second level of row 0 below its
    second node, then the round cropped and a chain step as before."""
    from headway.inference.draft_model import ChainRows
    from headway.inference.expand import Expansion

    model = tiny_vocab_model(3, vocab=50, scale=1.0)
    proposer = DraftModelProposer(model, gamma=3)
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(2, 50, (n,), generator=g).tolist() for n in (4, 7, 2)]
    ids, mask = left_pad([torch.tensor([c]) for c in contexts], 0)

    def alone(context):
        return model(torch.tensor([context])).logits[0, -1]

    with torch.no_grad():
        rows = ChainRows(proposer, ids, mask, capacity=64)
        trees = {0: Expansion([-1, 0, 0, 2], [contexts[0][-1], 31, 32, 33], [0, 1, 1, 2]),
                 2: Expansion([-1, 0], [contexts[2][-1], 41], [0, 1])}
        out = rows.feed({0: (trees[0], [1, 2]), 2: (trees[2], [1])})
        for row, exp in trees.items():
            exp.fed += [1, 2] if row == 0 else [1]
        assert out[0].shape == (2, 50) and out[2].shape == (1, 50)
        assert torch.allclose(out[0][0], alone(contexts[0] + [31]), atol=1e-10)
        assert torch.allclose(out[0][1], alone(contexts[0] + [32]), atol=1e-10)  # not seeing its sibling
        assert torch.allclose(out[2][0], alone(contexts[2] + [41]), atol=1e-10)
        deeper = rows.feed({0: (trees[0], [3])})  # below node 2: sees 2, not 1, nor row 2's column
        assert torch.allclose(deeper[0][0], alone(contexts[0] + [32, 33]), atol=1e-10)
        rows.end_round()
        assert rows.cache.get_seq_length() == ids.shape[1]
        logits = rows.step({1: torch.tensor([9])})
        assert torch.allclose(logits[1], alone(contexts[1] + [9]), atol=1e-10)


@pytest.mark.parametrize("tree", ["tree-7", {"depth": 3, "top_k": 2, "total_tokens": 6}])
def test_a_draft_models_trees_share_one_cache_level_by_level(family, tree, monkeypatch):
    """A draft model's static or dynamic tree in a batch: each level of every drafting row is one forward over the
    shared cache (``ChainRows.feed``). With the target's weights as the draft, every round accepts a full path
    (but where the budget or the EOS cuts it), and every row equals its own generate."""
    out, levels = batch_with_shared_draft(family, DraftModelProposer(copy.deepcopy(family.target)), tree, "feed",
                                          monkeypatch)
    for r, st in enumerate(out.rows):
        assert all(n >= 3 for n in st.accepted_per_step[:-1]), (r, st.accepted_per_step)
    assert levels and max(levels) > 1  # the rows' levels ran together


def test_rows_stop_at_their_own_eos_and_honour_the_generation_config():
    target = tiny_vocab_model(seed=3)
    prompts = [torch.tensor([PROMPT]), torch.tensor([[3, 3, 3, 3]]), torch.tensor([PROMPT[:3]]), torch.tensor([[5]])]
    ids, mask = left_pad(prompts, pad=0)
    gen = SpeculativeGenerator(target, PromptLookup(max_matches=2), tree=None)
    for settings in ({"eos_token_id": 6}, {"eos_token_id": 6, "repetition_penalty": 1.3},
                     {"eos_token_id": None, "no_repeat_ngram_size": 2, "min_new_tokens": 4}):
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=20, **settings)
        assert_rows_equal_generate(target, out, prompts, ids, 20, 0, **settings)
    ones = [torch.tensor([[5]]), torch.tensor([[2]])]  # every row a single token: nothing to prefill
    out = gen.generate(torch.cat(ones), max_new_tokens=12, eos_token_id=None)
    assert_rows_equal_generate(target, out, ones, torch.cat(ones), 12, 0, eos_token_id=None)
    stopped = gen.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=6)
    assert min(s.new_tokens for s in stopped.rows) < 20  # the EOS case really stops a row early


@pytest.mark.parametrize("waste", [0.0, 1.0])
def test_repacking_the_cache_every_round_or_never_gives_the_same_rows(family, eagle, waste, monkeypatch):
    monkeypatch.setattr(batch_mod, "REPACK_WASTE", waste)
    target = family.target
    pad = target.generation_config.pad_token_id
    prompts = family.prompts[:BATCH]
    ids, mask = left_pad(prompts, pad)
    out = SpeculativeGenerator(target, eagle[3], tree=None).generate(ids, attention_mask=mask, max_new_tokens=24)
    assert_rows_equal_generate(target, out, prompts, ids, 24, pad)


def test_a_batch_of_one_row_and_a_mask_of_ones_equal_the_single_row_call(family):
    target = family.target
    gen = SpeculativeGenerator(target, PromptLookup(), tree=None)
    prompt = family.prompts[0]
    single = gen.generate(prompt, max_new_tokens=16)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)], 1)
    out = gen.generate(padded, attention_mask=mask, max_new_tokens=16).sequences  # the padding kept, as generate does
    assert torch.equal(out, torch.cat([padded[:, :3], single.sequences], 1))
    assert torch.equal(gen.generate(padded[0], attention_mask=mask[0], max_new_tokens=16).sequences, out)  # [T] too
    same = gen.generate(prompt.expand(3, -1), max_new_tokens=16)  # no mask: no row is padded
    assert all(torch.equal(row, single.sequences[0]) for row in same.sequences)


def test_the_cache_helpers_keep_what_each_row_needs(family_model):
    """compact_rows and repack_rows: the next forward over the compacted cache equals one over each row's kept
    tokens. Four tree nodes (parents -1, 0, 0, 2) follow a 5-token prefix; row 0 keeps the path 0-1, row 1 0-2-3."""
    model = family_model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=g)
    parents, depths = [-1, 0, 0, 2], torch.tensor([0, 1, 1, 2])
    seen = torch.eye(4, dtype=torch.bool)
    for i in range(1, 4):
        seen[i] |= seen[parents[i]]
    min_ = torch.finfo(model.dtype).min
    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=ids[:, :5], cache=cache, use_cache=True)
        tree_mask = torch.cat([torch.ones(4, 5, dtype=torch.bool), seen], 1)  # [4, 9]
        attn = torch.zeros(2, 1, 4, 9, dtype=model.dtype).masked_fill_(~tree_mask, min_)
        model(input_ids=ids[:, 5:], position_ids=(depths + 5).expand(2, -1), attention_mask=attn, cache=cache,
              use_cache=True)
        kept = compact_rows(cache, 5, [[0, 1], [0, 2, 3]], 4)
        assert kept == 3 and cache.get_seq_length() == 8
        nxt = torch.tensor([[4], [5]])

        def step(cache, valid, positions):  # one more token per row over the cache, seeing the slots ``valid`` marks
            blocked = ~torch.cat([valid, torch.ones(2, 1, dtype=torch.bool)], 1)
            attn = torch.zeros(blocked.shape, dtype=model.dtype).masked_fill_(blocked, min_)[:, None, None]
            return model(input_ids=nxt, position_ids=torch.tensor(positions)[:, None], attention_mask=attn,
                         cache=copy.deepcopy(cache), use_cache=True).logits[:, -1]

        valid = torch.tensor([[True] * 7 + [False], [True] * 8])
        got = step(cache, valid, [7, 8])
        for r, keep in enumerate([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 7, 8]]):
            want = model(input_ids=torch.cat([ids[r, keep], nxt[r]])[None]).logits[0, -1]
            assert torch.allclose(got[r], want, atol=1e-9), r
        assert repack_rows(cache, valid) is valid  # nothing to drop: the longest row fills the cache
        valid[0, 2] = valid[1, 3] = False  # a hole in each row: repacking drops a slot and keeps what each row sees
        before = step(cache, valid, [7, 8])
        packed = repack_rows(cache, valid)
        assert packed.shape == (2, 7) and cache.get_seq_length() == 7 and packed.sum(1).tolist() == [6, 7]
        assert torch.allclose(step(cache, packed, [7, 8]), before, atol=1e-9)


def _pad_case(setting: str):
    """(kwargs for both generates, the target's generation config changed in place) for each way a pad id is
    given or left out."""
    eos = 218
    return {"keyword": dict(eos_token_id=eos, pad_token_id=7),
            "generation_config": dict(generation_config=GenerationConfig(eos_token_id=eos, pad_token_id=7)),
            "eos list, no pad": dict(eos_token_id=[eos, 3]),  # generate pads with the first EOS id, 218
            "model config's pad only": dict(eos_token_id=eos)}[setting]


@pytest.mark.parametrize("setting", ["keyword", "generation_config", "eos list, no pad", "model config's pad only"])
def test_rows_that_stop_early_are_padded_as_generate_pads_them(setting):
    """The fill after a row's EOS is ``generate``'s: the merged pad_token_id (a keyword, a GenerationConfig
    argument), else the first EOS id (the model config's pad_token_id is not read). Row 0 emits 218 (its 3rd new
    token), row 1 does not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=256, tie_word_embeddings=False, attn_implementation="sdpa")
    target = LlamaForCausalLM(cfg).eval().to(torch.float64)
    with torch.no_grad():
        target.lm_head.weight.mul_(20)
    target.generation_config.pad_token_id = None
    if setting == "model config's pad only":
        target.config.pad_token_id = 9
    ids = torch.tensor([[0, 0, 0, 11, 12, 13], [21, 22, 23, 24, 25, 26]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kwargs = _pad_case(setting)
    with torch.no_grad():
        want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, **kwargs)
    assert want[0, 8] == 218 and (want[0, 9:] != 218).any() == (setting in ("keyword", "generation_config"))
    out = SpeculativeGenerator(target, PromptLookup(), tree=None).generate(ids, attention_mask=mask,
                                                                             max_new_tokens=8, **kwargs)
    assert torch.equal(out.sequences, want), (out.sequences.tolist(), want.tolist())


def test_bad_batches_get_one_line_errors(family):
    target = family.target
    gen = SpeculativeGenerator(target, PromptLookup(), tree=None)
    pad = target.generation_config.pad_token_id
    ids, mask = left_pad(family.prompts[:3], pad)
    with pytest.raises(ValueError, match="no attention_mask was given"):
        gen.generate(ids, max_new_tokens=4)
    other = torch.where(ids == pad, 5, ids)  # padded with another id, named as the call's own pad_token_id
    with pytest.raises(ValueError, match=r"pad token \(5\) but no attention_mask"):
        gen.generate(other, max_new_tokens=4, pad_token_id=5)
    with pytest.raises(ValueError, match=rf"pad token \({pad}\) but no attention_mask"):  # the model's, merged in
        gen.generate(ids, max_new_tokens=4, generation_config=GenerationConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="right padding.*padding_side = 'left'"):
        gen.generate(ids, attention_mask=mask.flip(1), max_new_tokens=4)
    holed = torch.ones_like(mask)
    holed[1, 2] = 0
    with pytest.raises(ValueError, match=r"attention_mask row\(s\) \[1\] have a hole"):
        gen.generate(ids, attention_mask=holed, max_new_tokens=4)
    with pytest.raises(ValueError, match="a streamer takes one sequence"):
        gen.generate(ids, attention_mask=mask, max_new_tokens=4, streamer=SimpleNamespace(put=print, end=print))
    with pytest.raises(ValueError, match=r"longest row \(\d+ tokens\) \+ max_new_tokens"):
        gen.generate(ids, attention_mask=mask, max_new_tokens=target.config.max_position_embeddings)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        gen.generate(ids, attention_mask=mask[:, 1:], max_new_tokens=4)
    empty = mask.clone()
    empty[1] = 0
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] of the batch hold no token"):
        gen.generate(ids, attention_mask=empty, max_new_tokens=4)
    assert check_batch(ids, mask, pad)[1].dtype == torch.long


def test_trees_narrow_as_the_batch_grows():
    """BatchCost: a row's k-node tree costs t(B k)/t(B) of a batched plain step, so the same drafter's
    trees shrink as B grows, down to plain steps where widening the batch costs as much as it yields."""
    from transformers.cache_utils import DynamicCache  # noqa: F401  (the curve below is made up)

    from headway.inference.cost_curve import CostCurve

    ks = [1, 2, 4, 8, 16, 32, 64]
    rel = [1.0, 1.0, 1.05, 1.3, 2.2, 4.2, 8.4]  # flat while the GEMMs are thin, then linear in tokens
    online = OnlineCost(CostCurve(ks, [0], [1.0], [rel], [rel], {}))
    cost = BatchCost(online)
    assert cost.rel(4, 0) == pytest.approx(1.05)
    cost.rows = 8
    assert cost.rel(4, 0) == pytest.approx(4.2 / 1.3)  # t(32) / t(8)
    assert cost.rel(1, 0) == 1.0 and cost.plain_passes() == float("inf")


def test_one_width_is_chosen_for_the_whole_pass():
    """fit_widths: a row with a long confident chain and a row with nothing to verify. When widening the pass is
    cheap the chain is verified whole; when it costs about a step per token, the pass is a plain batched step,
    and in between the chain is cut to its best nodes (a prefix of the chain)."""
    from types import SimpleNamespace

    from headway.inference import Draft, chain
    from headway.inference.batch import fit_widths
    from headway.inference.tree import Tree

    long = Draft(chain(6), torch.arange(7))
    alone = Draft(Tree([-1]), torch.tensor([3]))
    gains = [1.0 + 0.9 * (1 - 0.9 ** j) / 0.1 for j in range(7)]  # E(k): each node 0.9 times as likely as its parent
    rows = [SimpleNamespace(ranked=(long, list(range(7)), gains)), SimpleNamespace(ranked=None)]
    widths = {}
    for step in (0.01, 0.15, 1.0):
        cost = BatchCost(OnlineCost(made_up_curve(step)), rows=2)
        widths[step] = [d.tree.size for d in fit_widths(rows, [long, alone], cost, pad_to=1, prefix_len=0)[0]]
    assert widths[0.01] == [7, 1] and widths[1.0] == [1, 1] and 1 < widths[0.15][0] < 7, widths
    cut = fit_widths(rows, [long, alone], BatchCost(OnlineCost(made_up_curve(0.15)), rows=2), 1, 0)[0][0]
    assert cut.tree.is_chain and cut.tokens.tolist() == list(range(cut.tree.size))


def test_a_batchs_pass_runs_at_the_cheapest_width_at_least_as_wide(family):
    """A curve on which 4-8 tokens cost less than 2 (a CPU's prepacked linears can): two rows' plain batched step (2
    tokens) runs padded to a width of 2 (4 tokens), a wider choice is priced at its padded width, and on a curve
    that only rises nothing is padded. End to end the padding is dropped from the cache: each row is its own
    generate."""
    from types import SimpleNamespace

    from headway.inference import Draft
    from headway.inference.batch import fit_widths
    from headway.inference.tree import Tree
    from tests.inference.test_auto import dip_curve

    alone = [Draft(Tree([-1]), torch.tensor([3])), Draft(Tree([-1]), torch.tensor([4]))]
    rows = [SimpleNamespace(ranked=None)] * 2
    dip = BatchCost(OnlineCost(dip_curve(0.8)), rows=2)
    assert fit_widths(rows, alone, dip, pad_to=1, prefix_len=0)[1] == 2
    assert fit_widths(rows, alone, BatchCost(OnlineCost(made_up_curve(0.1)), rows=2), 1, 0)[1] == 1
    assert fit_widths(rows * 2, alone * 2, BatchCost(OnlineCost(dip_curve(0.8)), rows=4), 1, 0)[1] == 1  # 4 tokens
    target = family.target
    pad = target.generation_config.pad_token_id
    prompts = family.prompts[:2]
    ids, mask = left_pad(prompts, pad)
    gen = SpeculativeGenerator(target, DraftModelProposer(family.draft), tree="auto", cost_curve=dip_curve(0.8))
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=16)
    assert_rows_equal_generate(target, out, prompts, ids, 16, pad)
    both = min(len(row.verify_width_per_step) for row in out.rows)  # the passes both rows were in
    widths = out.rows[0].verify_width_per_step[:both]
    assert min(widths) >= 2, widths  # two rows: never a pass of 2 tokens, which costs more than 4


def test_typical_acceptance_runs_per_row_and_is_labelled_lossy(family):
    target = family.target
    pad = target.generation_config.pad_token_id
    prompts = family.prompts[:3]
    ids, mask = left_pad(prompts, pad)
    gen = SpeculativeGenerator(target, family.heads, tree=None, acceptance="typical")
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=12, temperature=0.7,
                       generator=torch.Generator().manual_seed(0))
    assert out.stats.lossy and all(row.lossy for row in out.rows) and out.sequences.shape[0] == 3
    greedy = gen.generate(ids, attention_mask=mask, max_new_tokens=12)  # greedy: typical plays no part, exact
    assert not greedy.stats.lossy
    assert_rows_equal_generate(target, greedy, prompts, ids, 12, pad)


# --- sampling: exact per row ----------------------------------------------------------------------

# the enumerated prompt in four rows, left-padded by 2 beside two longer prompts (padded by 1 and by 0)
SAMPLING_PROMPTS = [PROMPT] * 4 + [[5] + PROMPT, [2, 5] + PROMPT]


@pytest.fixture(scope="module")
def sampling_setup():
    target = tiny_vocab_model(0)
    heads = train_medusa(target, num_heads=2, steps=200, seed=2, low=0).double()
    eagle3 = train_eagle(target, 3, seed=2, steps=60, low=0, draft_vocab=6)
    joints = {name: exact_joint(context_logits(target, PROMPT), params) for name, params in SETTINGS.items()}
    drafters = {"draft-tree": (DraftModelProposer(tiny_vocab_model(1)), [[0], [1], [0, 0], [1, 0]]),
                "draft-chain": (DraftModelProposer(tiny_vocab_model(1), gamma=2), None),  # one cache for all rows
                "medusa-tree": (heads, [[0], [1], [0, 0]]), "eagle3-tree": (eagle3, [[0], [1], [0, 0], [0, 1]]),
                "lookup-chain": (PromptLookup(), None),
                # the target's own first layer and an exit head started from the target's own (min_prob 0: every row
                # drafts its whole chain through the batched early steps)
                "layerskip-chain": (LayerSkipProposer(LayerSkipHead.from_target(target, exit_layer=1), min_prob=0.0),
                                    "chain-3"),
                "hybrid-medusa": ([heads, PromptLookup(max_matches=2, max_ngram_size=2)], [[0], [1], [0, 0]]),
                "suffix": (SuffixDecoding(cross_request=False), None),
                "lookahead": (Lookahead(window=3, ngram=3), None)}
    vocab = dict(draft_vocab_size=6, draft_tokens=[0, 1, 2, 4, 5, 7])
    torch.manual_seed(4)
    peagle = PEagleHead.from_target(target, parallel_depths=3, **vocab)
    dflash = DFlashHead.from_target(target, block_size=4, num_layers=2, **vocab)
    with torch.no_grad():  # untrained heads with spread-out drafts: some accepted, some not
        peagle.mask_hidden.normal_()
        for p in dflash.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    drafters["peagle-chain"] = (peagle, "chain-3")
    drafters["dflash-tree"] = (dflash, [[0], [1], [0, 0]])
    return target, drafters, joints


@pytest.mark.parametrize("drafter, setting", [pytest.param("draft-tree", "T1", marks=pytest.mark.slow),
                                              ("draft-chain", "T0.7-p0.9"), ("medusa-tree", "T0.7-p0.9"),
                                              ("eagle3-tree", "T1"),
                                              ("lookup-chain", "T0.7-p0.9"), ("layerskip-chain", "T0.7-p0.9"),
                                              ("peagle-chain", "T1"), ("dflash-tree", "T0.7-p0.9"),
                                              ("hybrid-medusa", "T1"), ("suffix", "T0.7-p0.9"), ("lookahead", "T1")])
def test_sampled_rows_follow_the_target_distribution(sampling_setup, drafter, setting):
    target, drafters, joints = sampling_setup
    params = SETTINGS[setting]
    gen = SpeculativeGenerator(target, *drafters[drafter])
    ids, mask = left_pad([torch.tensor([p]) for p in SAMPLING_PROMPTS])
    g = torch.Generator().manual_seed(4)
    samples = []
    for _ in range(250):
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=3, temperature=params.temperature,
                           top_k=params.top_k, top_p=params.top_p, generator=g)
        samples.append(out.sequences[:4, -3:])  # the rows whose prompt is PROMPT: the enumerated joint
    assert chi2_pvalue(torch.cat(samples), joints[setting]) > 1e-3


@pytest.mark.parametrize("auto", [False, True])
def test_the_rows_dynamic_trees_grown_with_tensor_ops_are_read_with_the_verification(family, eagle, auto):
    """A batch's rows growing EAGLE-2 dynamic trees with tensor ops (the CUDA default) keep their kept trees on the
    device until the batch's one verification read, which carries every row's shape: one read a round (the probe's
    read counter: ``.tolist()``, ``.item()``, ``int()`` ... outside the module forwards); under tree="auto" one more
    in a round that drafts, every row's scores and shape together for the cut; every row equals its own generate."""
    from headway.bench.runtime_probe import Meter, counted_reads, drafter_modules, metered

    target, pad = family.target, family.target.generation_config.pad_token_id
    dynamic = {"depth": 3, "top_k": 3, "total_tokens": 8}
    gen = SpeculativeGenerator(target, eagle[3], tree="auto" if auto else dynamic,
                               cost_curve=made_up_curve(0.02) if auto else None)
    gen.drafter.tensor_rounds = True
    prompts = family.prompts[:3]
    ids, mask = left_pad(prompts, pad)
    counts = {}
    for budget in (6, 16):
        meter = Meter()
        with metered(meter, [target] + drafter_modules(eagle[3])), counted_reads(meter):
            out = gen.generate(ids, attention_mask=mask, max_new_tokens=budget)
        assert_rows_equal_generate(target, out, prompts, ids, budget, pad)
        counts[budget] = meter.reads, out.stats.target_forward_passes
    (reads6, passes6), (reads16, passes16) = counts[6], counts[16]
    assert passes16 > passes6 and reads16 - reads6 <= (1 + auto) * (passes16 - passes6), counts
