"""Shared helpers for the inference tests: tiny-vocabulary models, exact enumeration, chi-square,
self-distilled Medusa heads, noisy draft models, prompts."""

from __future__ import annotations

import copy

import torch

from headway.heads import MedusaConfig, MedusaHeads
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


def reference_generate(model, ids, max_new, eos=None):
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                          eos_token_id=eos, pad_token_id=0)


def train_medusa(target, num_heads=3, steps=500, seed=0, low=4):
    """Medusa-1 on the frozen target's greedy continuations of random prompts (self-distillation)."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    prompts = torch.randint(low, vocab, (256, 6), generator=g)
    with torch.no_grad():
        seqs = reference_generate(target, prompts, 30)  # [256, 36]
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
