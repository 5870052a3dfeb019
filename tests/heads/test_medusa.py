"""MedusaConfig / MedusaHeads (headway.heads.medusa): shapes and zero init, the shared lm_head, save/load,
the safetensors names, and a reduced draft vocabulary. Loading errors common to all drafters: test_base.py."""

import json

import pytest
import torch

from headway.heads import MedusaConfig, MedusaHeads, load_drafter


def test_shapes_and_zero_init(tiny_llama):
    target, _ = tiny_llama
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=3, num_layers=2))
    cfg = target.config
    assert (heads.config.hidden_size, heads.config.vocab_size) == (cfg.hidden_size, cfg.vocab_size)
    hidden = torch.randn(2, 5, cfg.hidden_size)
    logits = heads(hidden)
    assert logits.shape == (3, 2, 5, cfg.vocab_size)
    # every ResBlock has its own weights, all zero at init
    linears = [blk.linear for seq in heads.blocks for blk in seq]
    assert len(linears) == 6 and len({id(l.weight) for l in linears}) == 6
    assert all(torch.count_nonzero(l.weight) == 0 and torch.count_nonzero(l.bias) == 0 for l in linears)
    # zero W1 => blocks are the identity, so each head starts as the target's lm_head
    expected = target.lm_head(hidden)
    for k in range(3):
        torch.testing.assert_close(logits[k], expected)
        assert heads.lm_heads[k].weight.data_ptr() != target.lm_head.weight.data_ptr()


def test_shared_lm_head_is_not_saved(tiny_llama, tmp_path):
    target, _ = tiny_llama
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=2, share_lm_head=True))
    assert heads.lm_heads is None
    out = heads(torch.randn(1, 3, target.config.hidden_size))
    assert out.shape == (2, 1, 3, target.config.vocab_size)
    heads.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path)
    assert all("lm_head" not in k for k in loaded.state_dict())
    with pytest.raises(RuntimeError, match="bind_target"):
        loaded(torch.randn(1, 3, target.config.hidden_size))
    loaded.bind_target(target)
    torch.testing.assert_close(loaded(torch.ones(1, 2, target.config.hidden_size)),
                               heads(torch.ones(1, 2, target.config.hidden_size)))


def test_save_load_round_trip_bit_exact(tiny_llama, tmp_path):
    target, _ = tiny_llama
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=2, num_layers=2))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p))
    heads.save_pretrained(tmp_path, metrics={"head0/top1": 0.5})
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in tmp_path.iterdir()}
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["drafter_type"] == "medusa" and cfg["hidden_size"] == target.config.hidden_size
    assert "head0/top1" in (tmp_path / "README.md").read_text()
    loaded = MedusaHeads.from_pretrained(tmp_path)
    assert isinstance(load_drafter(tmp_path), MedusaHeads)
    a, b = heads.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_safetensors_readable_by_other_tools(tiny_llama, tmp_path):
    from safetensors import safe_open

    target, _ = tiny_llama
    MedusaHeads.from_target(target, MedusaConfig(num_heads=2)).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "blocks.0.0.linear.weight" in keys and "lm_heads.1.weight" in keys


@pytest.mark.parametrize("share", [False, True])
def test_reduced_draft_vocabulary(tiny_llama, tmp_path, share):
    target, _ = tiny_llama
    V, H = target.config.vocab_size, target.config.hidden_size
    draft = torch.tensor([40, 7, 12, 100, 3])
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=2, draft_vocab_size=5, share_lm_head=share),
                                    draft_tokens=draft)
    hidden = torch.randn(1, 4, H)
    logits = heads(hidden)
    assert logits.shape == (2, 1, 4, 5)
    ids = heads.draft_token_ids
    assert ids.tolist() == sorted(draft.tolist())
    # at init each head equals the target's logits restricted to the draft tokens
    torch.testing.assert_close(logits[0], target.lm_head(hidden)[..., ids])
    assert heads.to_target_ids(torch.tensor([0, 4])).tolist() == [3, 100]
    draft_index = heads.draft_index()
    assert draft_index.shape == (V,) and draft_index[100] == 4 and draft_index[0] == -1
    heads.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path).bind_target(target)
    assert torch.equal(loaded.draft_token_ids, ids)
    torch.testing.assert_close(loaded(hidden), logits)
    with pytest.raises(ValueError, match="draft token ids"):
        MedusaHeads.from_target(target, MedusaConfig(num_heads=2, draft_vocab_size=5))
