"""The DFlash head: its config's checks, the mask token's default, the context as every layer's keys, a strict round
trip in headway's format, its kind in the registry, and the target checks."""

import pytest
import torch

from headway.heads import load_drafter
from headway.heads.dflash import DFlashConfig, DFlashHead
from headway.heads.eagle import Eagle3Head, EagleHead
from headway.heads.peagle import default_mask_token
from headway.heads.registry import kind_of
from headway.heads.target.tiny import build_tiny_target


def test_config_checks():
    base = dict(num_target_layers=4, vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    cfg = DFlashConfig(**base)
    assert cfg.block_size == 8 and cfg.num_layers == 1 and cfg.feature_layers == [0, 2, 4]
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        DFlashConfig(**base, block_size=1)
    with pytest.raises(ValueError, match="num_layers must be an integer >= 1"):
        DFlashConfig(**base, num_layers=0)
    with pytest.raises(ValueError, match="version 3"):
        DFlashConfig(**base, version=1, feature_layers=[4])
    with pytest.raises(ValueError, match="drop normalize_features, store_embeddings and fc_bias"):
        DFlashConfig(**base, fc_bias=True)
    with pytest.raises(ValueError, match=r"mask_token_id must be a token id \(0 or more\)"):
        DFlashConfig(**base, mask_token_id=-1)
    assert DFlashConfig(**base, mask_token_id=100).mask_token_id == 100  # the target's vocabulary bounds it (bind, load)


def test_from_target_round_trip_and_kind(tmp_path):
    target, tok = build_tiny_target("llama")
    head = DFlashHead.from_target(target, block_size=4, num_layers=2)
    assert head.config.mask_token_id == default_mask_token(target) == tok.pad_token_id
    assert kind_of(head).name == "dflash" and len(head.layers) == 2
    assert torch.equal(head.norm.weight, target.model.norm.weight)  # starts as the target's final norm
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in head.state_dict())  # the target's, bound
    head.save_pretrained(tmp_path / "d")
    back = load_drafter(tmp_path / "d")
    assert isinstance(back, DFlashHead) and back.config == head.config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), head.state_dict().values()))
    with pytest.raises(RuntimeError, match="call head.bind_target"):
        back.logits(torch.zeros(64))
    with pytest.raises(ValueError, match="describes drafter_type 'dflash', expected 'eagle'"):
        Eagle3Head.from_pretrained(tmp_path / "d")  # a DFlash checkpoint is not an EAGLE-3 one
    EagleHead.from_target(target, version=3).save_pretrained(tmp_path / "e")
    with pytest.raises(ValueError, match="describes drafter_type 'eagle', expected 'dflash'"):
        DFlashHead.from_pretrained(tmp_path / "e")  # nor the reverse


def test_a_draft_vocabulary_scores_the_targets_rows(tmp_path):
    """draft_vocab_size: the logits are the target's lm_head rows of the draft tokens (frozen, not stored), d2t maps
    them back; a strict round trip keeps d2t."""
    target, _ = build_tiny_target("llama")
    ids = [5, 9, 17, 40, 41, 100, 150, 200]
    head = DFlashHead.from_target(target, block_size=4, draft_vocab_size=8, draft_tokens=ids[::-1])
    h = torch.randn(3, 64)
    full = torch.nn.functional.linear(head.norm(h), target.lm_head.weight)
    assert torch.allclose(head.logits(h), full[:, ids]) and head.to_target_ids(torch.arange(8)).tolist() == ids
    assert "d2t" in head.state_dict() and "lm_head.weight" not in head.state_dict()
    head.save_pretrained(tmp_path / "v")
    back = load_drafter(tmp_path / "v").bind_target(target)
    assert torch.equal(back.d2t, head.d2t) and torch.allclose(back.logits(h), head.logits(h))
    with pytest.raises(ValueError, match="draft_vocab_size=8 needs as many draft token ids"):
        DFlashHead.from_target(target, draft_vocab_size=8, draft_tokens=ids[:3])


def test_the_context_is_every_layers_keys():
    """Changing one context position's features changes the blocks (it is their keys and values), a context position
    after none of them does not exist, and the block is bidirectional: slot 1 reads slot 3's token."""
    target, _ = build_tiny_target("llama")
    torch.manual_seed(0)
    head = DFlashHead.from_target(target, block_size=4)
    feats = torch.randn(1, 5, head.config.feature_width)
    block = torch.tensor([[5, 1, 1, 1]])

    def run(f, ids=block):
        return head(ids, torch.arange(5, 9)[None], head.context_kv(head.context(f), torch.arange(5)[None]))

    with torch.no_grad():
        base = run(feats)
        other = feats.clone()
        other[0, 2] += 1.0
        assert not torch.allclose(run(other), base)
        changed = block.clone()
        changed[0, 3] = 7
        assert not torch.allclose(run(feats, changed)[0, 1], base[0, 1])  # bidirectional within the block


def test_the_target_is_checked_and_bf16_keeps_rope_exact():
    target, _ = build_tiny_target("llama")
    head = DFlashHead.from_target(target)
    wider, _ = build_tiny_target("llama", seed=1)
    wider.resize_token_embeddings(300, mean_resizing=False)
    with pytest.raises(ValueError, match="vocab"):
        head.bind_target(wider)
    deeper = build_tiny_target("llama", seed=1)[0]
    deeper.config.num_hidden_layers = 3
    deeper.model.layers.append(deeper.model.layers[-1])
    with pytest.raises(ValueError, match="built for a target with 2 layers"):
        head.bind_target(deeper)
    head.to(torch.bfloat16)
    assert head.rotary_emb.inv_freq.dtype == torch.float32 and head.fc.weight.dtype == torch.bfloat16
