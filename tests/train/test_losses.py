"""Medusa's loss: labels, gradients of every head, the simulated acceptance length, chunked = plain."""

import pytest
import torch
from tests.train.loss_utils import assert_same, loss_and_grads

from headway.heads import MedusaConfig, MedusaHeads
from headway.train.losses import head_weights, medusa_loss, summarize


def test_labels_are_token_t_plus_k_plus_2_on_assistant_positions():
    heads = MedusaHeads(MedusaConfig(hidden_size=4, vocab_size=10, num_heads=2))
    torch.manual_seed(0)
    for p in heads.parameters():
        torch.nn.init.normal_(p)
    hidden = torch.randn(1, 6, 4)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 0]])  # assistant tokens: 4 and 5
    loss, m = medusa_loss(heads, hidden, ids, mask, [1.0, 0.0])
    # head 0 at t predicts ids[t+2]: labelled positions are t=1 (token 4) and t=2 (token 5)
    logits = heads.head_logits(hidden[0, [1, 2]], 0)
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor([4, 5]))
    torch.testing.assert_close(loss, expected)
    assert int(m["head0/count"]) == 2 and int(m["head1/count"]) == 2  # head 1: t=0 -> 4, t=1 -> 5


@pytest.mark.parametrize("kind", ["kl", "lk_alpha"])
def test_soft_kinds_train_head_k_on_the_targets_distribution_at_t_plus_k_plus_1(kind):
    """loss.kind other than ce: head k at t learns the target's own distribution for token t+k+2,
    softmax(lm_head @ hidden[t+k+1]); the accuracy stays against the data's tokens."""
    heads = MedusaHeads(MedusaConfig(hidden_size=4, vocab_size=10, num_heads=2))
    torch.manual_seed(0)
    for p in heads.parameters():
        torch.nn.init.normal_(p)
    rows = torch.randn(10, 4)  # the target's lm_head
    hidden = torch.randn(1, 6, 4)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 0]])
    loss, m = medusa_loss(heads, hidden, ids, mask, [1.0, 0.5], kind=kind, target_rows=rows)
    expected = 0.0
    for k, weight in enumerate([1.0, 0.5]):
        t = torch.tensor([1, 2]) - k  # head k at t predicts ids[t+k+2] = 4, 5
        q = heads.head_logits(hidden[0, t], k).log_softmax(-1)
        p = (hidden[0, t + k + 1] @ rows.T).log_softmax(-1)
        rowwise = (p.exp() * (p - q)).sum(-1) if kind == "kl" else -torch.minimum(p.exp(), q.exp()).sum(-1).log()
        expected = expected + weight * rowwise.mean()
        hits = (heads.head_logits(hidden[0, t], k).argmax(-1) == torch.tensor([4, 5])).sum()
        assert int(m[f"head{k}/top1"]) == int(hits)
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match="needs the target's distribution"):
        medusa_loss(heads, hidden, ids, mask, [1.0, 0.5], kind=kind)


def test_heads_without_positions_still_get_gradients():
    """Every head's parameters stay in the graph (DDP reduces all of them every step)."""
    heads = MedusaHeads(MedusaConfig(hidden_size=4, vocab_size=10, num_heads=3))
    hidden = torch.randn(1, 3, 4)
    loss, m = medusa_loss(heads, hidden, torch.tensor([[1, 2, 3]]), torch.tensor([[1, 1, 1]]), head_weights(3))
    loss.backward()
    assert int(m["head1/count"]) == 0 and int(m["head2/count"]) == 0
    assert all(p.grad is not None for p in heads.parameters())
    assert summarize({k: float(v) for k, v in m.items()})["head1/top1"] == 0.0


def test_simulated_acceptance_length_is_logged_beside_the_per_step_accuracy():
    counts = {}
    for k, (top1, n) in enumerate([(8, 10), (3, 6), (1, 4)]):  # per-step top-1 0.8, 0.5, 0.25
        counts.update({f"step{k}/count": n, f"step{k}/loss_sum": 1.0, f"step{k}/top1": top1, f"step{k}/top5": n})
    out = summarize(counts)
    expected = 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.25  # sum_k prod_{i<=k} acc_i
    assert abs(out["simulated_acc_len"] - expected) < 1e-12 and abs(out["simulated_tau"] - 1 - expected) < 1e-12
    # perfect steps: every draft token accepted, tau = steps + the bonus token
    perfect = summarize({f"head{k}/{m}": 5.0 for k in range(4) for m in ("count", "loss_sum", "top1", "top5")})
    assert perfect["simulated_acc_len"] == 4.0 and perfect["simulated_tau"] == 5.0
    assert "simulated_acc_len" not in summarize({"kl_sum": 1.0})


@pytest.mark.parametrize("variant", ["full", "draft_vocab", "shared"])
def test_medusa_loss_chunked_equals_plain(tiny_llama, variant):
    target = tiny_llama[0]
    vocab = target.config.vocab_size
    cfg = MedusaConfig(num_heads=3, num_layers=1, share_lm_head=variant == "shared",
                       draft_vocab_size=40 if variant == "draft_vocab" else None)
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(target, cfg, draft_tokens=torch.arange(3, 43))
    with torch.no_grad():
        for p in heads.parameters():  # non-zero blocks so every weight matters
            p.add_(torch.randn_like(p) * 0.1)
    hidden = torch.randn(2, 9, 64)
    ids = torch.randint(0, vocab, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    draft_index = heads.draft_index()

    def run(chunk):
        return medusa_loss(heads, hidden, ids, mask, [1.0, 0.8, 0.64], draft_index, chunk_size=chunk)

    plain, fused = loss_and_grads(heads, run, 0), loss_and_grads(heads, run, 3)
    assert_same(plain, fused)
    if variant == "draft_vocab":
        assert any(int(c) >= 0 for c in draft_index[ids.flatten()]) and bool((draft_index[ids.flatten()] < 0).any())
    assert ("lm_heads.0.weight" in fused[2]) == (variant != "shared")
