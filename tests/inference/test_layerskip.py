"""LayerSkip self-speculation: the target's own first layers draft into its cache, verification resumes
from their states, and the output is the target's own (greedy on both families, under tree="auto",
with a reduced draft vocabulary; sampling: test_generator_sampling's wiring case).
"""

import pytest
import torch

from headway.heads.layerskip import LayerSkipHead
from headway.inference import LayerSkipProposer, PromptLookup, SpeculativeGenerator
from headway.inference.kv_cache import new_cache
from headway.inference.target_forward import early_forward, prefill, resume_forward, tree_forward
from headway.inference.tree import chain
from tests.inference.spec_utils import left_pad, made_up_curve, reference_generate


def deep_target(family: str, layers: int = 4, seed: int = 5):
    """An fp64 tiny target of ``layers`` layers (the session's are 2 deep: one split only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions: drafts are often right, not always
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("family_name", ["llama", "qwen2"])
@pytest.mark.parametrize("exit_layer", [1, 3])
def test_resumed_verification_equals_a_full_pass(family_name, exit_layer):
    """Early layers run token by token into the cache, then the late layers over the saved states: the
    logits and every layer's keys/values equal one full pass over the same chain."""
    model = deep_target(family_name)
    prompt = torch.tensor([[5, 9, 3, 7, 11, 2, 8]])
    chain_tokens = torch.tensor([8, 40, 41, 42])  # root + 3 drafted tokens
    tree = chain(3)
    with torch.no_grad():
        full = new_cache(model)
        prefill(model, full, prompt[:, :-1])
        want, _ = tree_forward(model, full, tree, chain_tokens, prompt.shape[1] - 1)
        split = new_cache(model)
        prefill(model, split, prompt[:, :-1])
        p = prompt.shape[1] - 1
        states = torch.cat([early_forward(model, split, chain_tokens[i:i + 1], p + i, exit_layer) for i in range(4)])
        got, width = resume_forward(model, split, tree, states, p, exit_layer)
    assert width == 4 and torch.allclose(got, want, atol=1e-10)
    for i, (a, b) in enumerate(zip(full.layers, split.layers)):
        assert torch.allclose(a.keys, b.keys, atol=1e-10) and torch.allclose(a.values, b.values, atol=1e-10), i


@pytest.mark.parametrize("draft_vocab", [None, 150])
@pytest.mark.parametrize("tree", [None, "auto", "chain-2"])
def test_greedy_equals_generate(family, tree, draft_vocab):
    target = family.target
    tokens = None if draft_vocab is None else list(range(draft_vocab))
    head = LayerSkipHead.from_target(target, exit_layer=1, num_draft=3, draft_vocab_size=draft_vocab,
                                     draft_tokens=tokens)
    gen = SpeculativeGenerator(target, head, tree=tree)
    new = passes = 0
    for i, (prompt, max_new, ref) in enumerate(list(zip(family.prompts, family.max_new, family.references))[:12]):
        out = gen.generate(prompt, max_new_tokens=max_new)
        assert torch.equal(out.sequences, ref), f"{family.name}: prompt {i} differs from generate"
        new, passes = new + out.stats.new_tokens, passes + out.stats.target_forward_passes
    if tree is None:  # the untrained exit at layer 1 of 2 agrees with the target often enough to show
        assert new / passes > 1.2, f"{family.name}: tau {new / passes:.2f}"


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
def test_greedy_on_a_deeper_target_with_eos(exit_layer):
    model = deep_target("llama", layers=4, seed=6)
    head = LayerSkipHead.from_target(model, exit_layer=exit_layer, num_draft=4)
    gen = SpeculativeGenerator(model, head, tree=None)
    g = torch.Generator().manual_seed(exit_layer)
    for _ in range(4):
        prompt = torch.randint(2, 97, (1, 9), generator=g)
        eos = int(reference_generate(model, prompt, 6)[0, -1])  # a token the target does emit: stops early
        for settings in ({}, {"eos_token_id": eos}):
            ref = reference_generate(model, prompt, 24, **settings)
            out = gen.generate(prompt, max_new_tokens=24, **settings)
            assert torch.equal(out.sequences, ref), (exit_layer, settings)


def test_the_early_layers_never_run_twice(family, monkeypatch):
    """Layer 0 sees the prompt once, then one token per call (drafting); the late layer sees each verified
    chain once. Over a call, the tokens through layer 0 after the prompt equal those through layer 1."""
    target = family.target
    head = LayerSkipHead.from_target(target, exit_layer=1, num_draft=3)
    gen = SpeculativeGenerator(target, head, tree=None)
    rows = {0: [], 1: []}
    hooks = [target.model.layers[i].register_forward_hook(
        lambda mod, args, kwargs, out, i=i: rows[i].append(args[0].shape[1] if args else kwargs["hidden_states"].shape[1]),
        with_kwargs=True) for i in (0, 1)]
    try:
        prompt = family.prompts[0]
        out = gen.generate(prompt, max_new_tokens=20)
    finally:
        for h in hooks:
            h.remove()
    first = prompt.shape[1]  # the prompt's pass: the prompt and the root, through every layer
    assert rows[0][0] == rows[1][0] == first
    assert all(n == 1 for n in rows[0][1:]), "an early layer ran over several tokens after the prompt"
    assert sum(rows[0][1:]) == sum(rows[1][1:]) == sum(out.stats.verify_width_per_step[1:])
    assert out.stats.target_forward_passes == len(rows[1])


@pytest.mark.parametrize("exit_layer", [1, 3])
def test_a_batchs_resumed_verification_equals_a_full_batched_pass(exit_layer):
    """Three left-padded rows (prompts of 6, 2 and 9 tokens) in one cache with holes: their chains (3, 1 and 2 drafted
    tokens, padded to 4) stepped through the early layers together, one token a row a step, then the late layers
    over the saved states: logits and every layer's keys/values equal one full batched pass over the same trees."""
    import copy

    from headway.inference import Draft
    from headway.inference.batch import batch_inputs, prefill_rows
    from headway.inference.layerskip import EarlyRows

    model = deep_target("llama")
    g = torch.Generator().manual_seed(exit_layer)
    prompts = [torch.randint(2, 97, (1, n), generator=g) for n in (6, 2, 9)]
    ids, mask = left_pad(prompts)
    chains = [torch.tensor([int(prompts[0][0, -1]), 40, 41, 42]), torch.tensor([int(prompts[1][0, -1]), 50]),
              torch.tensor([int(prompts[2][0, -1]), 60, 61])]
    drafts = [Draft(chain(c.shape[0] - 1), c) for c in chains]
    lengths = [p.shape[1] for p in prompts]
    with torch.no_grad():
        full = new_cache(model)
        valid, _ = prefill_rows(model, full, ids, mask, None)
        split = copy.deepcopy(full)
        tokens, positions, attn, width = batch_inputs(drafts, lengths, valid, 1, model.dtype)
        want = model(input_ids=tokens, position_ids=positions, attention_mask=attn, cache=full, use_cache=True).logits
        rows = EarlyRows(model, split, exit_layer, valid, tokens[:, 0], torch.tensor(lengths) - 1)
        for d in range(width):  # a row past its chain steps on its last token
            rows.step({r: c[d:d + 1] for r, c in enumerate(chains) if d < c.shape[0]})
        rows.step({})  # a step past the widest chain: dropped before verification
        got = rows.resume(width, positions, attn)
    assert width == 4
    for r, c in enumerate(chains):  # each row's own nodes (padding columns see only themselves)
        assert torch.allclose(got[r, :c.shape[0]], want[r, :c.shape[0]], atol=1e-10), r
    for i, (a, b) in enumerate(zip(full.layers, split.layers)):
        assert a.keys.shape == b.keys.shape, i
        for r, c in enumerate(chains):  # the rows' own slots: the prompt's and the chain's
            n = valid.shape[1] + c.shape[0]
            slots = torch.cat([valid[r].nonzero().flatten(), torch.arange(valid.shape[1], n)])
            assert torch.allclose(a.keys[r, :, slots], b.keys[r, :, slots], atol=1e-10), (i, r)
            assert torch.allclose(a.values[r, :, slots], b.values[r, :, slots], atol=1e-10), (i, r)


@pytest.mark.parametrize("tree", [None, "auto"])
def test_a_batch_equals_its_rows_and_runs_the_early_layers_once(tree):
    """Four prompts of 2-11 tokens, left-padded, on a 4-layer target exiting at layer 2: every row equals its own
    generate, with and without an EOS that stops some rows early; the rows draft (tau > 1), and with a fixed chain
    (every row drafts every round), after each prompt's own prefill the first layer sees one token a row per call
    (the batched drafting steps: verification resumes from their states and never runs it) while the last sees
    each pass's width."""
    model = deep_target("llama", layers=4, seed=6)
    head = LayerSkipHead.from_target(model, exit_layer=2, num_draft=3)
    gen = SpeculativeGenerator(model, LayerSkipProposer(head, min_prob=0.0), tree=tree,
                               cost_curve=made_up_curve(0.05) if tree == "auto" else None)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 97, (1, n), generator=g) for n in (7, 2, 11, 5)]
    ids, mask = left_pad(prompts)
    eos = int(reference_generate(model, prompts[0], 5)[0, -1])  # a token the target emits: a row stops early
    for settings in ({}, {"eos_token_id": eos}):
        calls = {0: [], 3: []}
        hooks = [model.model.layers[i].register_forward_hook(
            lambda mod, args, kwargs, out, i=i: calls[i].append(tuple((args[0] if args else kwargs["hidden_states"]
                                                                        ).shape[:2])), with_kwargs=True) for i in calls]
        try:
            out = gen.generate(ids, attention_mask=mask, max_new_tokens=16, **settings)
        finally:
            for h in hooks:
                h.remove()
        for r, prompt in enumerate(prompts):
            ref = reference_generate(model, prompt, 16, **settings)[0, prompt.shape[1]:]
            row = out.sequences[r, ids.shape[1]:]
            assert torch.equal(row[:ref.shape[0]], ref) and (row[ref.shape[0]:] == 0).all(), (settings, r)
        assert out.stats.new_tokens > 1.3 * out.stats.batch_passes, "the rows did not draft"
        if tree is None:
            prefills = sum(p.shape[1] > 1 for p in prompts)  # each prompt but its root, alone
            assert all(n == 1 for _, n in calls[0][prefills:]), calls[0]
            assert len(calls[3]) - prefills == out.stats.batch_passes  # one late pass a round, over its width
            assert sum(b * n for b, n in calls[3][prefills:]) <= sum(b * n for b, n in calls[0][prefills:])
        if "eos_token_id" in settings:
            assert min(s.new_tokens for s in out.rows) < 16  # the EOS really stops a row early


def test_bad_input_is_refused(family):
    target = family.target
    head = LayerSkipHead.from_target(target, exit_layer=1)
    with pytest.raises(ValueError, match="LayerSkipProposer cannot join a hybrid list"):
        SpeculativeGenerator(target, [head, PromptLookup()])
    with pytest.raises(ValueError, match="LayerSkip drafts a chain"):
        SpeculativeGenerator(target, head, tree="tree-7")
    with pytest.raises(ValueError, match="exits at layer 3 of a target with 4 layers, but the target has 2"):
        SpeculativeGenerator(deep_target("llama", layers=2), LayerSkipHead.from_target(deep_target("llama"), exit_layer=3))
    with pytest.raises(ValueError, match="exit_layer must be in 1..1"):
        LayerSkipHead.from_target(target, exit_layer=2)
    with pytest.raises(ValueError, match="num_draft must be >= 1"):
        LayerSkipProposer(head, num_draft=-1)


def test_a_gpt2_target_is_refused_in_one_line():
    from headway.heads.target.tiny import build_tiny_target

    gpt2, _ = build_tiny_target("gpt2")
    with pytest.raises(ValueError, match="supports Llama-style decoders"):
        LayerSkipHead.from_target(gpt2, exit_layer=1)


def test_drafting_stops_after_an_unlikely_token(family):
    """min_prob: no token after one the exit head gave less than it; 0 drafts the whole chain, and so does
    ``early_stop=False`` (a GPU's default: no read per drafted token). Output unchanged."""
    target = family.target
    head = LayerSkipHead.from_target(target, exit_layer=1, num_draft=4)
    depths = {}
    for min_prob, early_stop, cpu in ((0.0, None, True), (0.999, None, True), (0.999, False, True),
                                      (0.999, None, False)):
        gen = SpeculativeGenerator(target, LayerSkipProposer(head, min_prob=min_prob, early_stop=early_stop), tree=None)
        gen.drafter._on_cpu = cpu  # False: as bound on a GPU, whose default drafts the whole chain without a read
        out = gen.generate(family.prompts[4], max_new_tokens=40)
        assert torch.equal(out.sequences, reference_generate(target, family.prompts[4], 40))
        depths[min_prob, early_stop, cpu] = out.stats.draft_depth_per_step[1:]  # the prompt's pass aside
    # min_prob 0 or no early stop (forced, or a GPU's default): the whole chain (but where the budget cuts it);
    # nearly 1 on a CPU: one token a round
    for whole in (depths[0.0, None, True], depths[0.999, False, True], depths[0.999, None, False]):
        assert whole.count(4) >= len(whole) - 2, whole
    assert 1 in depths[0.999, None, True] and set(depths[0.999, None, True]) <= {0, 1}
    with pytest.raises(ValueError, match=r"min_prob must be in \[0, 1\)"):
        LayerSkipProposer(head, min_prob=1.0)
