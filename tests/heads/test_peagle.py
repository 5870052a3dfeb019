"""The P-EAGLE head: its config's checks, the mask token's default, the slots' input, a strict round trip in
headway's format, and its kind in the registry."""

import pytest
import torch

from headway.heads import load_drafter
from headway.heads.eagle import EagleConfig
from headway.heads.peagle import PEagleConfig, PEagleHead, default_mask_token
from headway.heads.registry import kind_of
from headway.heads.target.tiny import build_tiny_target


def test_config_checks():
    base = dict(num_target_layers=4, vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert PEagleConfig(**base).parallel_depths == 4
    with pytest.raises(ValueError, match="parallel_depths must be >= 2"):
        PEagleConfig(**base, parallel_depths=1)
    with pytest.raises(ValueError, match="extends EAGLE-3"):
        PEagleConfig(**base, version=1, feature_layers=[4])
    with pytest.raises(ValueError, match="ignores fc_norm for peagle"):
        PEagleConfig(**base, normalize_features=True)
    with pytest.raises(ValueError, match=r"mask_token_id must be a token id \(0 or more\)"):
        PEagleConfig(**base, mask_token_id=-1)
    assert PEagleConfig(**base, mask_token_id=100).mask_token_id == 100  # the target's vocabulary bounds it (bind, load)
    assert PEagleConfig(**base, num_layers=4).num_layers == 4
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="num_layers must be an integer >= 1"):
            PEagleConfig(**base, num_layers=bad)
    with pytest.raises(ValueError, match="EAGLE-1 has one decoder layer"):
        EagleConfig(**base, version=1, feature_layers=[4], num_layers=2)


def test_from_target_round_trip_and_kind(tmp_path):
    target, tok = build_tiny_target("llama")
    head = PEagleHead.from_target(target, parallel_depths=3)
    assert head.config.mask_token_id == default_mask_token(target) == tok.pad_token_id
    assert head.mask_hidden.shape == (head.config.feature_width,) and kind_of(head).name == "peagle"
    assert torch.allclose(head.slot_hidden(), head.fc(head.mask_hidden))
    head.save_pretrained(tmp_path / "p")
    back = load_drafter(tmp_path / "p")
    assert isinstance(back, PEagleHead) and back.config == head.config
    assert torch.equal(back.mask_hidden, head.mask_hidden)


def test_several_layers_are_saved_as_midlayer_then_layers_i(tmp_path):
    """num_layers=3: midlayer (2H-wide attention, hidden_norm), then layers.1 and layers.2 (H wide, pre-norm); headway's
    folder reads back strictly, and a folder written before num_layers existed reads as one layer."""
    import json

    target, _ = build_tiny_target("llama")
    head = PEagleHead.from_target(target, parallel_depths=3, num_layers=3)
    names = set(head.state_dict())
    assert {"midlayer.hidden_norm.weight", "layers.1.input_layernorm.weight", "layers.2.mlp.down_proj.weight"} <= names
    assert not any(n.startswith(("layers.0.", "layers.1.hidden_norm")) for n in names)
    assert head.layers["1"].self_attn.q_proj.weight.shape[1] == head.config.hidden_size
    head.save_pretrained(tmp_path / "p")
    back = load_drafter(tmp_path / "p")
    assert back.config.num_layers == 3 and all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())
    one = PEagleHead.from_target(target, parallel_depths=3)
    one.save_pretrained(tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    config.pop("num_layers")
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    assert load_drafter(tmp_path / "old").config.num_layers == 1


def test_the_slots_input_is_computed_once_per_version_of_its_weights():
    """Without gradients fc(mask_hidden) is kept between rounds and recomputed after an in-place change of fc or
    mask_hidden (an optimizer step, load_state_dict) or a cast; with gradients it is always fresh (training)."""
    target, _ = build_tiny_target("llama")
    head = PEagleHead.from_target(target, parallel_depths=3)
    with torch.no_grad():
        first = head.slot_inputs(2, torch.device("cpu"))[1]
        assert head.slot_inputs(2, torch.device("cpu"))[1].data_ptr() == first.data_ptr()  # kept
        head.mask_hidden.add_(1.0)
        moved = head.slot_inputs(2, torch.device("cpu"))[1]
        torch.testing.assert_close(moved, head.slot_hidden().expand(2, -1))
        assert not torch.allclose(moved, first)
        head.load_state_dict({**head.state_dict(), "fc.weight": torch.zeros_like(head.fc.weight)})
        assert not head.slot_inputs(1, torch.device("cpu"))[1].any()
        head.double()
        assert head.slot_inputs(1, torch.device("cpu"))[1].dtype == torch.float64
    with torch.inference_mode():
        made = PEagleHead.from_target(target, parallel_depths=3)  # weights without a version counter
        torch.testing.assert_close(made.slot_inputs(1, torch.device("cpu"))[1], made.slot_hidden()[None])
    hidden = head.slot_inputs(2, torch.device("cpu"))[1]
    assert hidden.requires_grad and hidden.grad_fn is not None  # training: through fc and mask_hidden


@pytest.mark.parametrize("kind", ["peagle", "dflash"])
def test_the_mask_token_is_checked_against_the_targets_vocabulary(tmp_path, kind):
    """A run config's sizes are placeholders until the target loads, so a mask token past the default vocabulary
    (SmolLM2's 49,152; Llama 3's reserved ids are 128,002 and up) parses; it is refused in one line where the drafter
    meets a target without that token, and where a saved config holds one outside its own vocabulary."""
    import json

    from headway.heads.dflash import DFlashHead
    from headway.train.dflash import parse_args as dflash_args
    from headway.train.peagle import parse_args as peagle_args

    parse, cls = {"peagle": (peagle_args, PEagleHead), "dflash": (dflash_args, DFlashHead)}[kind]
    assert getattr(parse(["--config", f"{kind}/tiny", f"{kind}.mask_token_id=128002"]), kind).mask_token_id == 128002
    with pytest.raises(ValueError, match=r"mask_token_id must be a token id \(0 or more\), got -1"):
        parse(["--config", f"{kind}/tiny", f"{kind}.mask_token_id=-1"])
    target, _ = build_tiny_target("llama")
    v = target.config.vocab_size
    with pytest.raises(ValueError, match=f"mask_token_id must be a token id in 0..{v - 1}, got {v}"):
        cls.from_target(target, mask_token_id=v)
    cls.from_target(target, mask_token_id=v - 1).save_pretrained(tmp_path / kind)
    config = json.loads((tmp_path / kind / "config.json").read_text())
    (tmp_path / kind / "config.json").write_text(json.dumps({**config, "mask_token_id": v}))
    with pytest.raises(ValueError, match=f"mask_token_id must be a token id in 0..{v - 1}, got {v}"):
        load_drafter(tmp_path / kind)
