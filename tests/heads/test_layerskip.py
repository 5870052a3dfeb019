"""The LayerSkip exit head: its config's checks, its start from the target (the final norm, the lm_head
rows), its logits, and a strict save/load round trip."""

import json

import pytest
import torch

from headway.heads import load_drafter
from headway.heads.layerskip import LayerSkipConfig, LayerSkipHead, default_exit_layer
from headway.heads.target.tiny import build_tiny_target


def test_config_defaults_and_checks():
    assert LayerSkipConfig(num_target_layers=30).exit_layer == 27 == default_exit_layer(30)
    assert LayerSkipConfig(num_target_layers=2).exit_layer == 1
    with pytest.raises(ValueError, match="exit_layer must be in 1..29"):
        LayerSkipConfig(num_target_layers=30, exit_layer=30)
    with pytest.raises(ValueError, match="at least 2 layers"):
        LayerSkipConfig(num_target_layers=1)
    with pytest.raises(ValueError, match="draft_vocab_size must be in 1..10"):
        LayerSkipConfig(vocab_size=10, num_target_layers=4, draft_vocab_size=11)


def test_it_starts_as_the_targets_own_exit_and_round_trips(tmp_path):
    target, _ = build_tiny_target("qwen2")
    head = LayerSkipHead.from_target(target, exit_layer=1, draft_vocab_size=20, draft_tokens=list(range(40, 60)))
    assert torch.equal(head.norm.weight, target.model.norm.weight)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[40:60])
    h = torch.randn(3, target.config.hidden_size)
    assert torch.allclose(head(h), target.lm_head(target.model.norm(h))[:, 40:60], atol=1e-6)
    assert head.to_target_ids(torch.tensor([0, 19])).tolist() == [40, 59]
    head.save_pretrained(tmp_path / "ls")
    back = load_drafter(tmp_path / "ls")
    assert isinstance(back, LayerSkipHead) and back.config == head.config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), head.state_dict().values()))


def test_a_corrupt_vocabulary_map_or_config_is_a_one_line_error(tmp_path):
    from safetensors.torch import load_file, save_file

    target, _ = build_tiny_target("llama")
    LayerSkipHead.from_target(target, exit_layer=1, draft_vocab_size=4, draft_tokens=[1, 2, 3, 4]).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["d2t"] = torch.zeros(4, dtype=torch.long)  # draft id i -> target id i
    state["d2t"][1] = -1  # draft ids 0 and 1 both map to target id 0
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="re-export the drafter"):
        load_drafter(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["exit_layer"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"lacks LayerSkipConfig key\(s\) \['exit_layer'\]"):
        load_drafter(tmp_path)
