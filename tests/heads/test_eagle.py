"""EagleConfig / EagleHead (headway.heads.eagle): shapes, the two classes, RoPE precision, save/load, and
one-line errors for bad input. The layer's cache and training-time test: test_eagle_layer.py; the hooks
that read the target's features: target/test_features.py."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.heads import EagleConfig, EagleHead, load_drafter
from headway.heads.eagle import default_feature_layers
from headway.heads.target.features import capture_features
from headway.heads.target.tiny import build_tiny_target
from tests.heads.helpers import make_head


def test_default_feature_layers():
    assert default_feature_layers(3, 32) == [2, 16, 29]
    assert default_feature_layers(3, 30) == [2, 15, 27]
    assert default_feature_layers(1, 30) == [30]
    assert default_feature_layers(3, 2) == [0, 1, 2]  # too shallow for distinct low/mid/high


@pytest.mark.parametrize("version", [1, 3])
def test_shapes_and_state_dict_names(target, version):
    head = make_head(target, version)
    names = set(head.state_dict())
    if version == 1:
        assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight",
                "layers.0.post_attention_layernorm.weight"} <= names
        assert not any(n.startswith(("midlayer", "lm_head", "embed_tokens", "norm")) for n in names)
        assert head.fc.weight.shape == (64, 128)
    else:
        assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight",
                "midlayer.input_layernorm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
        assert head.fc.weight.shape == (64, 3 * 64) and head.fc.bias is None
        assert head.midlayer.self_attn.q_proj.weight.shape[1] == 128  # [emb; hidden] is 2H wide
        assert head.lm_head.weight.shape == (120, 64) and head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool
        assert torch.equal(head.to_target_ids(torch.arange(120)), torch.arange(5, 125))
    assert not any("embed" in n for n in names)  # the target's embedding is bound, not stored
    ids = torch.randint(4, 200, (2, 7))
    feats = capture_features(target, ids, head.config.feature_layers)
    h = head(ids[:, 1:], head.input_hidden(feats[:, :-1]), torch.arange(6)[None].expand(2, -1))
    assert h.shape == (2, 6, 64) and head.logits(h).shape == (2, 6, head.config.output_size)


def test_two_classes_over_one_layer_module(target, tmp_path):
    """EagleHead(config) is the class config.version names; each class refuses the other's config;
    copies keep the class; the layer module is shared (EAGLE-3's differs only in its attention input)."""
    import copy

    from headway.heads.eagle import Eagle1Head, Eagle3Head
    from headway.heads.eagle_layer import Eagle3Layer, EagleLayer

    h1, h3 = make_head(target, 1), make_head(target, 3)
    assert type(h1) is Eagle1Head and type(h3) is Eagle3Head and isinstance(h3, EagleHead)
    assert type(h1.layer) is EagleLayer and type(h3.layer) is Eagle3Layer and isinstance(h3.layer, EagleLayer)
    assert type(EagleHead(h1.config)) is Eagle1Head
    assert type(Eagle3Head.from_target(target)) is Eagle3Head and type(Eagle1Head.from_target(target)) is Eagle1Head
    with pytest.raises(ValueError, match="Eagle1Head is EAGLE-1 but the config says version=3"):
        Eagle1Head(h3.config)
    h1.save_pretrained(tmp_path / "e1")
    for cls in (EagleHead, Eagle1Head):
        assert type(cls.from_pretrained(tmp_path / "e1")) is Eagle1Head
    with pytest.raises(ValueError, match="holds an EAGLE-1 drafter but EAGLE-3 was asked for; load it with "
                                         "EagleHead.from_pretrained or load_drafter"):
        Eagle3Head.from_pretrained(tmp_path / "e1")
    with pytest.raises(ValueError, match="load it with version=1"):
        EagleHead.from_pretrained(tmp_path / "e1", version=3)
    twin = copy.deepcopy(h3)
    assert type(twin) is Eagle3Head and all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(),
                                                                               h3.state_dict().values()))


@pytest.mark.parametrize("version", [1, 3])
def test_rope_stays_fp32_when_bound_to_a_half_precision_target(version):
    from headway.inference import EagleProposer

    model, _ = build_tiny_target("llama", seed=0)
    head = EagleHead.from_target(model, version=version, **({"draft_vocab_size": 50, "draft_tokens": torch.arange(50)}
                                                             if version == 3 else {}))
    EagleProposer(head).bind(model.to(torch.bfloat16))
    assert head.fc.weight.dtype == torch.bfloat16 and head.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("version", [1, 3])
def test_a_bf16_checkpoint_keeps_exact_rope_frequencies(target, version, tmp_path):
    """Loading a bf16 drafter casts the module to bf16; RoPE's inverse frequencies stay the float32
    ones (rounded to bf16 and back they would move every position's angle)."""
    exact = make_head(target, version).rotary_emb.inv_freq.clone()
    make_head(target, version).to(torch.bfloat16).save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path)
    assert loaded.fc.weight.dtype == torch.bfloat16
    for head in (loaded, loaded.float(), loaded.half()):
        assert head.rotary_emb.inv_freq.dtype == torch.float32 and torch.equal(head.rotary_emb.inv_freq, exact)
        assert torch.equal(head.rotary_emb.original_inv_freq, exact)


@pytest.mark.parametrize("version", [1, 3])
def test_save_load_roundtrip(target, version, tmp_path):
    head = make_head(target, version).float()  # a drafter is built (and loaded) in fp32
    head.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["drafter_type"] == "eagle" and config["version"] == version
    assert config["num_target_layers"] == 2 and config["feature_layers"] == head.config.feature_layers
    loaded = load_drafter(tmp_path).bind_target(target)
    assert isinstance(loaded, EagleHead) and loaded.config == head.config
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert EagleHead.from_pretrained(tmp_path, version=version).config.version == version
    with pytest.raises(ValueError, match=f"EAGLE-{version} drafter but EAGLE-{4 - version} was asked"):
        EagleHead.from_pretrained(tmp_path, version=4 - version)


def test_bad_input(target, tmp_path):
    with pytest.raises(ValueError, match=r"\[0, 5, 1\] has ids \[5\] outside the target's depth: valid ids are 0..2"):
        EagleHead.from_target(target, version=3, feature_layers=[0, 5, 1])
    with pytest.raises(ValueError, match="EAGLE-1 reads one feature layer"):
        EagleConfig(version=1, num_target_layers=4, feature_layers=[1, 2])
    with pytest.raises(ValueError, match="final-norm feature \\(layer 4\\)"):
        EagleConfig(version=1, num_target_layers=4, feature_layers=[2])
    with pytest.raises(ValueError, match="version must be 1"):
        EagleConfig(version=2)
    with pytest.raises(ValueError, match="draft_vocab_size 100000 exceeds the target's vocab_size 218"):
        EagleHead.from_target(target, version=3, draft_vocab_size=100000)
    with pytest.raises(ValueError, match="needs as many draft token ids"):
        EagleHead.from_target(target, version=3, draft_vocab_size=10, draft_tokens=torch.arange(9))
    with pytest.raises(ValueError, match="distinct ids"):
        EagleHead.from_target(target, version=3, draft_vocab_size=3, draft_tokens=[4, 4, 5])
    # a d2t map inconsistent with the vocabularies, found at load time
    head = make_head(target, 3)
    head.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["d2t"][3] = state["d2t"][2] - 1  # draft ids 2 and 3 now map to the same target id
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t/t2d are inconsistent"):
        load_drafter(tmp_path)
    # another target: hidden size, vocabulary or depth
    other, _ = build_tiny_target("qwen2", seed=1)
    other.config.hidden_size = 32
    with pytest.raises(ValueError, match="hidden_size 64 does not match the target's hidden_size 32"):
        make_head(target, 1).bind_target(other)
    deeper, _ = build_tiny_target("llama", seed=2)
    deeper.config.num_hidden_layers = 4
    with pytest.raises(ValueError, match="target with 2 layers, but the target has 4"):
        make_head(target, 3).bind_target(deeper)
    with pytest.raises(ValueError, match="features have width 64, this drafter reads 192"):
        make_head(target, 3).input_hidden(torch.zeros(1, 64, dtype=torch.float64))
