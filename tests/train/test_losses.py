import torch

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


def test_heads_without_positions_still_get_gradients():
    """Every head's parameters stay in the graph (DDP reduces all of them every step)."""
    heads = MedusaHeads(MedusaConfig(hidden_size=4, vocab_size=10, num_heads=3))
    hidden = torch.randn(1, 3, 4)
    loss, m = medusa_loss(heads, hidden, torch.tensor([[1, 2, 3]]), torch.tensor([[1, 1, 1]]), head_weights(3))
    loss.backward()
    assert int(m["head1/count"]) == 0 and int(m["head2/count"]) == 0
    assert all(p.grad is not None for p in heads.parameters())
    assert summarize({k: float(v) for k, v in m.items()})["head1/top1"] == 0.0
