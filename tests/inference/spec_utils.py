"""Shared helpers for the inference tests: tiny-vocabulary models, exact enumeration, chi-square,
self-distilled Medusa heads, noisy draft models, prompts, drafter contexts, prefilled caches, made-up cost curves."""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import torch

from headway.heads import MedusaConfig, MedusaHeads
from headway.inference.tree import Tree, node_depths, node_path
from headway.inference.verify import SamplingParams, probs

VOCAB = 8
PROMPT = [2, 5, 3, 7, 2, 5, 6, 4, 2, 5]  # "2 5" recurs with two continuations: prompt lookup builds a tree
SETTINGS = {"T1": SamplingParams(1.0), "T0.7-p0.9": SamplingParams(0.7, 0, 0.9)}


def tiny_vocab_model(seed: int, vocab: int = VOCAB, scale: float = 15.0, dtype=torch.float64):
    """A 2-layer Llama over ``vocab`` tokens whose next-token distributions are peaked and depend
    on the context (lm_head scaled up), so draft and target differ measurably."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.generation_config.eos_token_id = None  # the exact joints enumerate every token, EOS included
    return model.to(dtype)


@torch.no_grad()
def context_logits(model, prompt, vocab: int = VOCAB) -> dict[tuple, torch.Tensor]:
    """Raw next-token logits [V] after the prompt followed by every continuation of 0, 1 or 2 tokens."""
    prompt = torch.tensor(prompt)
    t = prompt.shape[0]
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V^2, 2]
    ids = torch.cat([prompt.expand(vocab * vocab, t), pairs], dim=1)  # [V^2, T + 2]
    logits = model(input_ids=ids).logits.double()  # [V^2, T + 2, V]
    table = {(): logits[0, t - 1]}
    for r, (a, b) in enumerate(pairs.tolist()):
        table[(a,)] = logits[r, t]
        table[(a, b)] = logits[r, t + 1]
    return table


def exact_joint(table: dict[tuple, torch.Tensor], params: SamplingParams, vocab: int = VOCAB) -> torch.Tensor:
    """P(x1, x2, x3) [V, V, V] by enumeration, under the processed (temperature/top-k/top-p) distribution."""
    p = {ctx: probs(lg, params).double() for ctx, lg in table.items()}
    joint = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for a in range(vocab):
        for b in range(vocab):
            joint[a, b] = p[()][a] * p[(a,)][b] * p[(a, b)]
    return joint


def chi2_pvalue(samples, joint: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``samples`` [S, 3] against ``joint``; cells expecting < 5 are merged."""
    samples = torch.as_tensor(samples, dtype=torch.long)
    v = joint.shape[0]
    flat = samples[:, 0] * v * v + samples[:, 1] * v + samples[:, 2]
    counts = torch.bincount(flat, minlength=v ** 3).double()
    expected = joint.flatten() * samples.shape[0]
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return 0.0  # an impossible outcome was produced
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def total_variation(samples, joint: torch.Tensor) -> float:
    samples = torch.as_tensor(samples, dtype=torch.long)
    v = joint.shape[0]
    flat = samples[:, 0] * v * v + samples[:, 1] * v + samples[:, 2]
    freq = torch.bincount(flat, minlength=v ** 3).double() / samples.shape[0]
    return float((freq - joint.flatten()).abs().sum() / 2)


def reference_generate(model, ids, max_new, **settings):
    """``generate(do_sample=False)`` as a user calls it: the model's generation config (its EOS
    included) updated by ``settings`` (e.g. ``eos_token_id=None``, ``repetition_penalty=1.2``)."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                          pad_token_id=0, **settings)


def train_medusa(target, num_heads=3, steps=500, seed=0, low=4):
    """Medusa-1 on the frozen target's greedy continuations of random prompts (self-distillation)."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    prompts = torch.randint(low, vocab, (256, 6), generator=g)
    with torch.no_grad():
        seqs = reference_generate(target, prompts, 30, eos_token_id=None)  # [256, 36]
        hidden = target(seqs, output_hidden_states=True).hidden_states[-1].float()  # [256, 36, H]
    t = seqs.shape[1] - num_heads - 1
    x = hidden[:, :t].reshape(-1, hidden.shape[-1])  # [R, H]
    y = torch.stack([seqs[:, k + 2:t + k + 2] for k in range(num_heads)], -1).reshape(-1, num_heads)  # head k: t+k+2
    torch.manual_seed(seed)
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=num_heads)).float()
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (512,), generator=g)
        loss = sum(torch.nn.functional.cross_entropy(heads.head_logits(x[idx], k), y[idx, k]) for k in range(num_heads))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval().requires_grad_(False)


def noisy_copy(model, scale=0.25, seed=0):
    """A draft model that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * p.std() * scale)
    return draft


def copy_prompt_tau(model, gen, g: torch.Generator, prompts: int = 3, new_tokens: int = 24) -> float:
    """tau of ``gen`` on prompts that hold a passage and the start of its copy, each output asserted
    equal to the target's own greedy continuation."""
    new = passes = 0
    for i in range(prompts):
        segment = torch.randint(2, 8, (int(torch.randint(4, 12, (), generator=g)),), generator=g)
        prompt = torch.cat([segment, segment[: 3 + i % 3]])[None]
        out = gen.generate(prompt, max_new_tokens=new_tokens)
        assert torch.equal(out.sequences, reference_generate(model, prompt, new_tokens, eos_token_id=None)), \
            f"prompt {i}"
        new, passes = new + out.stats.new_tokens, passes + out.stats.target_forward_passes
    return new / passes


def make_prompts(vocab, n, seed):
    """Random prompts of 1-20 tokens; every third one repeats a segment (copy-friendly)."""
    g = torch.Generator().manual_seed(seed)
    prompts, max_new = [], []
    for i in range(n):
        length = int(torch.randint(1, 21, (), generator=g))
        ids = torch.randint(4, vocab, (length,), generator=g)
        if i % 3 == 0 and length > 3:
            ids = torch.cat([ids, ids[: length // 2]])
        prompts.append(ids[None])
        max_new.append(int(torch.randint(1, 41, (), generator=g)) if i % 5 else 32)
    return prompts, max_new


# --- wiring: what the generator hands to verify_sampling, checked node by node ----------------

@dataclasses.dataclass
class VerifyCall:
    """One verify_sampling call as the generator made it."""

    children: list[list[int]]  # [N][*]
    tokens: list[int]  # [N], tokens[0] is the root
    p: torch.Tensor  # [N, V]: p[i] for every node (rows the verifier read are the very rows it got)
    p_read: list[int]  # nodes whose p row the verifier read, in order
    q: dict[int, torch.Tensor] | None  # node -> [V] for every node with children; None: deterministic draft
    path: list[int]  # what the real verify_sampling returned
    nxt: int


class VerifyRecorder:
    """Replaces ``verify_sampling`` where the generator looks it up with a wrapper that records
    (children, tokens, p, q) and calls the real function (same generator, so same random stream)."""

    def __init__(self, monkeypatch):
        import headway.inference.generator as generator_mod

        self.calls: list[VerifyCall] = []
        real = generator_mod.verify_sampling

        def wrapper(children, tokens, p, q, *args, **kwargs):
            read: dict[int, torch.Tensor] = {}

            class Reading:  # p as the verifier sees it, noting every row it reads
                def __getitem__(self, i):
                    row = p[i]
                    read.setdefault(int(i), row.detach().clone())
                    return row

            path, nxt = real(children, tokens, Reading(), q, *args, **kwargs)
            n = len(tokens)
            rows = torch.stack([read[i] if i in read else p[i].detach().clone() for i in range(n)])
            q_rows = None if q is None else {i: q[i].detach().clone() for i in range(n) if children[i]}
            self.calls.append(VerifyCall([list(c) for c in children], [int(t) for t in tokens], rows,
                                         list(read), q_rows, list(path), int(nxt)))
            return path, nxt

        monkeypatch.setattr(generator_mod, "verify_sampling", wrapper)
        real_tensors = generator_mod.verify_sampling_tensors

        def tensors_wrapper(children, depth, tokens, p, q, *args, **kwargs):  # the device rule reads every row
            out = real_tensors(children, depth, tokens, p, q, *args, **kwargs)
            leaf, nxt = out.tolist()
            kids = [[c for c in row if c >= 0] for row in children.tolist()]
            parents = [-1] * len(kids)
            for i, row in enumerate(kids):
                for c in row:
                    parents[c] = i
            q_rows = None if q is None else {i: q[i].detach().clone() for i in range(len(kids)) if kids[i]}
            self.calls.append(VerifyCall(kids, tokens.tolist(), p.detach().clone(), list(range(len(kids))), q_rows,
                                         node_path(parents, leaf), nxt))
            return out

        monkeypatch.setattr(generator_mod, "verify_sampling_tensors", tensors_wrapper)

    def take(self) -> list[VerifyCall]:
        calls, self.calls = self.calls, []
        return calls


@dataclasses.dataclass
class WiringCase:
    """A drafter under the wiring test.

    q_ref(ids, context_len, params) -> [V]: the drafter's own processed distribution at the node
    whose root-to-node sequence is ``ids`` [context_len + depth] (context = ids[:context_len], its
    last token the root), computed independently (e.g. a plain forward of the draft model); None
    for deterministic drafters, whose q must then be None.
    check_draft(context, parents, tokens, tree): extra checks of the candidates (lists of ints;
    ``tree``: the verified tree's expected shape with its ranks when the generator has a static
    Tree, else None).
    fixed_shape: with a static Tree, the verified tree must be it cut to the round's budget
    (False for drafters that build their own tree under the generator's tree as a cap).
    """

    drafter: object
    tree: object = None
    q_ref: Callable | None = None
    check_draft: Callable | None = None
    fixed_shape: bool = True


@torch.no_grad()
def last_logits(model, ids) -> torch.Tensor:
    """Next-token logits [V] after ``ids`` by one plain causal forward (no cache, no tree mask)."""
    return model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None]).logits[0, -1]


def lm_q_ref(model) -> Callable:
    """q_ref of a drafter that samples from a causal LM: probs of its logits on context + path."""
    return lambda ids, context_len, params: probs(last_logits(model, ids), params)


def medusa_check(target, heads) -> Callable:
    """check_draft for Medusa: node (depth d, rank r) holds the rank-r token of head d-1 on the
    target's final-norm hidden state that predicted the root (plain forward of the context)."""

    @torch.no_grad()
    def check(context, parents, tokens, tree):
        assert tree is not None, "Medusa verifies a fixed tree"
        hidden = target(input_ids=torch.tensor([context]), output_hidden_states=True).hidden_states[-1][0, -2]
        hidden = hidden.to(next(heads.parameters()).dtype)
        for i in range(1, tree.size):
            d, r = tree.depths[i], tree.ranks[i]
            order = heads.to_target_ids(heads.head_logits(hidden, d - 1).argsort(descending=True))
            assert tokens[i] == int(order[r]), (f"node {i} (depth {d}, rank {r}) holds token {tokens[i]}, "
                                                f"head {d - 1}'s rank-{r} token is {int(order[r])}")
    return check


def lookup_check(drafter) -> Callable:
    """check_draft for prompt lookup: every root-to-leaf path copies what followed an earlier
    occurrence of one of the context's suffix n-grams (n in the drafter's range)."""

    def check(context, parents, tokens, tree):
        leaves = [i for i in range(1, len(tokens)) if i not in parents]
        length = len(context)
        for leaf in leaves:
            cont = [tokens[j] for j in node_path(parents, leaf)[1:]]
            assert any(context[s:s + n] == context[length - n:] and context[s + n:s + n + len(cont)] == cont
                       for n in range(drafter.min_ngram_size, drafter.max_ngram_size + 1)
                       for s in range(0, length - n)), f"path {cont} follows no earlier suffix n-gram of {context}"
    return check


def _allclose(actual, expected, what):
    actual, expected = actual.double(), expected.double()
    err = float((actual - expected).abs().max())
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-7), f"{what}: max abs difference {err:.3g}"


def check_wiring(target, case: WiringCase, fixed_tree, prompt, params, max_new: int, calls: list[VerifyCall],
                 output, processors=None, blind_first: bool = False) -> None:
    """Assert that every verification of one generate call got exactly the right inputs.

    For each round (context = prompt + what earlier rounds produced): the root is the context's
    last token; the tree is well formed with distinct siblings and fits the budget; p[i] equals
    probs(target's logits after context + node i's path) by a plain forward; q[i] equals the
    drafter's own reference (or q is None for deterministic drafters); the accepted nodes are a
    root-to-node path whose tokens (plus the next token) are exactly what the sequence gained.
    ``blind_first``: the drafter reads the target's features (``Proposer.feature_layers``), so the
    first round, verified in the prompt's pass, has none of them yet. Raises AssertionError naming
    the round and node.
    """
    context = [int(t) for t in prompt]
    start = len(context)
    assert len(calls) == output.stats.target_forward_passes, \
        f"{len(calls)} verifications for {output.stats.target_forward_passes} target passes"
    for r, call in enumerate(calls):
        where = f"round {r}"
        n, children, tokens = len(call.tokens), call.children, call.tokens
        budget = max_new - (len(context) - start)
        parents = [-1] * n
        for i, kids in enumerate(children):
            for c in kids:
                assert i < c < n and parents[c] == -1, f"{where}: children lists are not a tree: {children}"
                parents[c] = i
            sib = [tokens[c] for c in kids]
            assert len(set(sib)) == len(sib), f"{where}: node {i} has repeated candidates {sib}"
        assert all(p >= 0 for p in parents[1:]), f"{where}: children lists are not a tree: {children}"
        depths = node_depths(parents)
        assert max(depths) <= budget - 1, f"{where}: tree depth {max(depths)} exceeds the budget {budget - 1}"
        expected_tree = None
        # the prompt's pass verifies the first round's tree; a drafter that reads the target's features has
        # none of them yet then, and proposes the root alone
        blind = r == 0 and start > 1 and blind_first
        if isinstance(fixed_tree, Tree):  # else None (the drafter's own trees) or dynamic settings
            expected_tree = Tree([-1]) if blind else fixed_tree.truncate(budget - 1)
            if case.fixed_shape:
                assert expected_tree.parents == parents, \
                    f"{where}: verified tree {parents} is not the generator's tree cut to depth {budget - 1}"
            else:
                expected_tree = None
        assert tokens[0] == context[-1], f"{where}: root token {tokens[0]} is not the last context token {context[-1]}"
        assert call.p.shape[0] == n
        for i in range(n):
            ids = context + [tokens[j] for j in node_path(parents, i)[1:]]
            logits = last_logits(target, ids)
            if processors is not None:  # the generation config's processors, applied to this path's context
                logits = processors(torch.tensor([ids]), logits.float()[None])[0]
            _allclose(call.p[i], probs(logits, params), f"{where}: p[{i}] (path {ids[start:]})")
            if case.q_ref is not None and children[i]:
                assert call.q is not None, f"{where}: q is None but the drafter samples its candidates"
                _allclose(call.q[i], case.q_ref(ids, len(context), params), f"{where}: q[{i}] (path {ids[start:]})")
        if case.q_ref is None:
            assert call.q is None, f"{where}: a deterministic drafter's q must be None"
        if case.check_draft is not None:
            try:
                case.check_draft(context, parents, tokens, expected_tree)
            except AssertionError as exc:
                raise AssertionError(f"{where}: {exc}") from None
        path = call.path
        assert path[0] == 0 and all(b in children[a] for a, b in zip(path, path[1:])), \
            f"{where}: accepted nodes {path} are not a root-to-node path"
        assert set(path) <= set(call.p_read), f"{where}: accepted nodes {path} but p was read only at {call.p_read}"
        for a, b in zip(path, path[1:]):
            assert float(call.p[a][tokens[b]]) > 0, f"{where}: accepted token {tokens[b]} has p = 0 at node {a}"
        assert float(call.p[path[-1]][call.nxt]) > 0, f"{where}: next token {call.nxt} has p = 0 at node {path[-1]}"
        context += [tokens[i] for i in path[1:]] + [call.nxt]
    produced = output.sequences[0].tolist()
    assert produced == context[:start + max_new], f"the output {produced[start:]} is not what the rounds accepted " \
                                                  f"{context[start:]}"
    assert len(context) - start >= max_new, f"generation stopped after {len(context) - start} of {max_new} tokens"


# --- drafter contexts, prefilled target caches, made-up cost curves -----------------------------

def draft_context(tokens, hidden=None, tree=None, max_depth=10, sampling=None, generator=None):
    """The DraftContext the generator hands a drafter: ``tokens`` so far (the last one the root) and
    ``hidden`` [H], the target's state that predicted the root (None: no features yet)."""
    from headway.inference.proposer import DraftContext

    features = None if hidden is None else hidden[None]  # [1, H]: the state that predicted the root
    return DraftContext(torch.tensor(tokens), features, tree, max_depth, sampling, generator)


def prefilled(model, tree, prompt_len: int, seed: int):
    """Random prompt and tree tokens (node 0 = the prompt's last token); a cache prefilled with
    the prompt minus its last token."""
    from headway.inference.kv_cache import new_cache
    from headway.inference.target_forward import prefill

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, 200, (prompt_len,), generator=g)
    nodes = torch.randint(4, 200, (tree.size,), generator=g)
    nodes[0] = prompt[-1]
    cache = new_cache(model)
    with torch.no_grad():
        prefill(model, cache, prompt[None, :-1])
    return prompt, nodes, cache


def causal_logits(model, ids):
    """Logits [T, V] of one plain causal forward over ``ids`` [T] (no cache)."""
    with torch.no_grad():
        return model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None]).logits[0]


def made_up_curve(step: float, t1: float = 1.0):
    """A made-up cost curve: a pass over k tokens costs 1 + step * (k - 1) one-token steps of ``t1``
    seconds (the default makes drafting free next to a step; 1e-3 makes it cost several steps)."""
    from headway.inference.cost_curve import CostCurve

    ks = [1, 2, 4, 8, 16, 32, 64]
    rel = [1 + step * (k - 1) for k in ks]
    return CostCurve(ks, [0], [t1], [rel], [rel], {})


def assert_batch_equals_rows(gen, family, max_new_tokens: int = 10) -> None:
    """Two of ``family``'s prompts of different lengths, left-padded into one batch: each row's output (its padding
    dropped) equals that prompt generated alone."""
    prompts = [family.prompts[2][0], family.prompts[3][0][:5]]
    width = max(p.shape[0] for p in prompts)
    pad = family.target.generation_config.pad_token_id or 0
    ids = torch.stack([torch.cat([torch.full((width - p.shape[0],), pad), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - p.shape[0]), torch.ones(p.shape[0])]) for p in prompts]).long()
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=None)
    for r, p in enumerate(prompts):
        alone = gen.generate(p[None], max_new_tokens=max_new_tokens, eos_token_id=None).sequences[0]
        assert torch.equal(out.sequences[r, width - p.shape[0]:][:alone.shape[0]], alone)  # left padding dropped


def left_pad(prompts, pad: int = 0):
    """[1, T_r] prompts -> (input_ids [B, T], attention_mask [B, T]), left-padded as a tokenizer pads."""
    t = max(p.shape[-1] for p in prompts)
    ids = torch.full((len(prompts), t), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), t, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, t - p.shape[-1]:] = p.reshape(-1)
        mask[r, t - p.shape[-1]:] = 1
    return ids, mask
