"""EAGLE heads trained for the runtime tests: self-distilled on the target's own greedy continuations
of random prompts, with the real losses (EAGLE-1, and EAGLE-3's training-time test)."""

from __future__ import annotations

import torch

from headway.heads import EagleHead
from headway.heads.eagle import DraftCache
from headway.heads.target.features import capture_features
from headway.inference.verify import probs
from headway.train.eagle_losses import eagle1_loss, eagle3_loss


def train_eagle(target, version: int, seed: int = 0, steps: int = 150, low: int = 4, draft_vocab: int | None = None,
                **config):
    """A trained EAGLE-1 or EAGLE-3 head (fp32 training, returned in the target's dtype); ``config``:
    EagleConfig fields (e.g. ``normalize_features=True``: EAGLE-3.1)."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    prompts = torch.randint(low, vocab, (192, 6), generator=g)
    with torch.no_grad():
        seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=24,
                               eos_token_id=None, pad_token_id=0)  # [192, 30]
    torch.manual_seed(seed)
    extra = {}
    if draft_vocab:
        counts = torch.bincount(seqs[:, 6:].flatten(), minlength=vocab)
        extra = dict(draft_vocab_size=draft_vocab, draft_tokens=counts.topk(draft_vocab).indices)
    head = EagleHead.from_target(target, version=version, **extra, **config).float()
    depth = head.config.num_target_layers
    layers = head.config.feature_layers + ([depth] if depth not in head.config.feature_layers else [])
    feats = capture_features(target, seqs, layers).float()
    last = feats[..., -target.config.hidden_size:]
    head.bind_target(target)  # the bound embedding / lm_head rows are cast per use
    rows = head.draft_rows(target.get_output_embeddings().weight.detach()).float()
    draft_index = head.draft_index()
    mask = torch.zeros_like(seqs)
    mask[:, 6:] = 1
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3, betas=(0.9, 0.95))
    for _ in range(steps):
        idx = torch.randint(0, seqs.shape[0], (32,), generator=g)
        if version == 1:
            loss, _ = eagle1_loss(head, last[idx], seqs[idx], mask[idx], rows, draft_index, generator=g)
        else:
            loss, _ = eagle3_loss(head, feats[idx][..., :head.config.feature_width], last[idx], seqs[idx], mask[idx],
                                  rows, draft_index, steps=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dtype = next(target.parameters()).dtype
    return head.to(dtype).eval().requires_grad_(False).bind_target(target)


@torch.no_grad()
def eagle_q_ref(target, head):
    """q_ref for the sampling wiring test: the head's processed distribution [V] at the node whose
    root-to-node sequence is ``ids`` (context = ids[:context_len]), computed without tree masks: the
    target's features of the context by one plain forward, the head over them causally, then one
    cached step per path token on its own output states (positions L-2+d)."""
    def ref(ids, context_len, params):
        ctx = torch.tensor([ids[:context_len]])
        feats = capture_features(target, ctx, head.config.feature_layers)  # [1, L, F]
        cache = DraftCache()
        h = head(ctx[:, 1:], head.input_hidden(feats[:, :-1]), torch.arange(context_len - 1)[None], cache=cache)[:, -1:]
        for d, tok in enumerate(ids[context_len:], start=1):
            h = head(torch.tensor([[tok]]), h, torch.tensor([[context_len - 2 + d]]), cache=cache)
        q = probs(head.logits(h[0, 0]), params)  # [V']
        if head.d2t is None:
            return q
        full = q.new_zeros(head.config.vocab_size)
        full[head.draft_token_ids] = q
        return full
    return ref
