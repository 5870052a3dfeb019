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


def test_mismatched_target_names_both_values(tiny_llama, tiny_qwen2):
    target, _ = tiny_llama
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=target.config.vocab_size))
    with pytest.raises(ValueError, match=r"hidden_size 32 .* hidden_size 64"):
        heads.bind_target(target)
    heads = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=1000))
    with pytest.raises(ValueError, match=r"vocab_size 1000 .* vocab_size \d+"):
        heads.bind_target(target)


def test_corrupt_or_truncated_weights(tiny_llama, tmp_path):
    target, _ = tiny_llama
    MedusaHeads.from_target(target, MedusaConfig(num_heads=2)).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_drafter(tmp_path)
    weights.write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_drafter(tmp_path)


def test_foreign_or_mismatched_checkpoint(tiny_llama, tmp_path):
    target, _ = tiny_llama
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 1}))
    with pytest.raises(ValueError, match="official Medusa"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_drafter(tmp_path)
    MedusaHeads.from_target(target, MedusaConfig(num_heads=2)).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_heads"] = 3  # config and weights disagree
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        load_drafter(tmp_path)
    cfg["num_heads"] = 2
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lacks .*hidden_size"):
        load_drafter(tmp_path)
    cfg["hidden_size"], cfg["bogus"] = target.config.hidden_size, 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bogus"):
        load_drafter(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "nope")


def test_load_from_hub_cache_offline(tiny_llama, tmp_path, monkeypatch):
    """A Hub repo id resolves through the local HF cache (HF_HUB_OFFLINE=1), no network."""
    from huggingface_hub import constants

    target, _ = tiny_llama
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=2))
    cache = tmp_path / "hub"
    snap = cache / "models--someone--tiny-medusa" / "snapshots" / ("a" * 40)
    heads.save_pretrained(snap)
    (cache / "models--someone--tiny-medusa" / "refs").mkdir(parents=True)
    (cache / "models--someone--tiny-medusa" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = load_drafter("someone/tiny-medusa", cache_dir=str(cache))
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), loaded.state_dict().values()))


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


def test_bf16_checkpoint_loads_in_bf16(tiny_llama, tmp_path):
    target, _ = tiny_llama
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=2)).to(torch.bfloat16)
    heads.save_pretrained(tmp_path / "h")
    loaded = load_drafter(tmp_path / "h")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), loaded.state_dict().values()))
