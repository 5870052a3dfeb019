"""What the EAGLE layouts share (headway.heads.formats.llama_layer): target layer ids in each engine's
numbering, the drafter's one-layer Llama config written and read back, fc's blocks sorted with their layers."""

import warnings
from pathlib import Path

import pytest
import torch

from headway.heads import EagleConfig
from headway.heads.formats.llama_layer import (EAGLE3_LAYER_KEYS, LAYER_KEYS, from_engine_layer_ids, layer_shapes,
                                               llama_fields, parse_llama_config, sorted_features, to_engine_layer_ids,
                                               warn_inexact_layers)


def test_engine_layer_id_conventions():
    # headway / transformers hidden_states ids [2, 16, 29] of a 32-layer target (inputs of those layers)
    assert to_engine_layer_ids([2, 16, 29], "vllm") == [2, 16, 29]
    assert to_engine_layer_ids([2, 16, 29], "sglang") == [1, 15, 28]
    for engine in ("vllm", "sglang"):
        assert from_engine_layer_ids(to_engine_layer_ids([0, 5, 32], engine), engine) == [0, 5, 32]
    with pytest.raises(ValueError, match="unknown engine"):
        to_engine_layer_ids([1], "trt")


def _config(**kw):
    return EagleConfig(hidden_size=64, vocab_size=100, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, num_target_layers=32, version=3, **kw)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope", [None, LLAMA3], ids=["default-rope", "llama3-rope"])
def test_the_llama_config_reads_back_what_it_writes(rope):
    cfg = _config(rope_scaling=rope, rope_theta=500000.0, rms_norm_eps=1e-6, max_position_embeddings=4096)
    data = llama_fields(cfg, torch.bfloat16)
    assert data["model_type"] == "llama" and data["num_hidden_layers"] == 1 and data["torch_dtype"] == "bfloat16"
    assert data["attention_bias"] is False and data["mlp_bias"] is False and data["rope_scaling"] == rope
    fields = parse_llama_config(Path("d/config.json"), data, "the drafter layer")
    assert fields == {k: getattr(cfg, k) for k in fields}
    assert set(fields) == {"hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                           "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
                           "max_position_embeddings"}


def test_rope_settings_in_either_spelling_and_the_defaults():
    base = llama_fields(_config(), torch.float32)
    legacy = {**base, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert parse_llama_config(Path("c"), legacy, "x")["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    newer = {k: v for k, v in base.items() if k not in ("rope_theta", "rope_scaling")}
    newer["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    fields = parse_llama_config(Path("c"), newer, "x")
    assert fields["rope_theta"] == 1e6 and fields["rope_scaling"] is None
    least = {k: base[k] for k in ("model_type", "hidden_size", "num_attention_heads", "intermediate_size",
                                  "vocab_size", "rms_norm_eps")}
    fields = parse_llama_config(Path("c"), least, "x")
    assert (fields["num_key_value_heads"], fields["head_dim"], fields["hidden_act"], fields["rope_theta"],
            fields["max_position_embeddings"]) == (4, 16, "silu", 10000.0, 8192)


@pytest.mark.parametrize("edit, match", [
    ({"model_type": "mistral"}, r"has model_type 'mistral'; headway imports Llama-layer EAGLE drafters"),
    ({"vocab_size": None}, r"lacks \['vocab_size'\]"),
    ({"num_hidden_layers": 2}, r"has num_hidden_layers 2; .* exactly one layer"),
    ({"attention_bias": True}, r"sets \['attention_bias'\]; headway's EAGLE layer has no attention or MLP biases"),
], ids=["mistral", "no-vocab", "two-layers", "biased"])
def test_layers_headway_cannot_hold_are_refused(edit, match):
    data = {**llama_fields(_config(), torch.float32), **edit}
    with pytest.raises(ValueError, match=match) as err:
        parse_llama_config(Path("d/config.json"), data, "the drafter layer")
    assert str(err.value).startswith("d/config.json: the drafter layer ")


def test_fc_blocks_are_sorted_with_their_layers():
    fc = torch.arange(12, dtype=torch.float32).view(2, 6)  # hidden 2: three input blocks of width 2
    layers, out = sorted_features([5, 1, 3], fc, 2)
    assert layers == [1, 3, 5]
    assert torch.equal(out, torch.cat([fc[:, 2:4], fc[:, 4:6], fc[:, 0:2]], dim=1))
    x = {i: torch.randn(2, generator=torch.Generator().manual_seed(i)) for i in (1, 3, 5)}
    torch.testing.assert_close(out @ torch.cat([x[1], x[3], x[5]]), fc @ torch.cat([x[5], x[1], x[3]]))
    same, kept = sorted_features([0, 1, 2], fc, 2)
    assert same == [0, 1, 2] and kept is fc


def test_ids_without_an_engine_counterpart_warn():
    with pytest.warns(UserWarning, match=r"feature layer\(s\) \[0, 32\] of this drafter .* the 'sglang' layout"):
        warn_inexact_layers([0, 16, 32], 32, "sglang")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_inexact_layers([2, 16, 29], 32, "sglang")


def test_layer_shapes_follow_the_config():
    fields = parse_llama_config(Path("c"), llama_fields(_config(head_dim=32), torch.float32), "x")
    shapes = layer_shapes(fields, 128)  # EAGLE-3: q/k/v read [emb; hidden], 2H wide
    assert set(shapes) == set(EAGLE3_LAYER_KEYS) and set(LAYER_KEYS) < set(EAGLE3_LAYER_KEYS)
    assert shapes["self_attn.q_proj.weight"] == (128, 128) and shapes["self_attn.k_proj.weight"] == (64, 128)
    assert shapes["self_attn.o_proj.weight"] == (64, 128) and shapes["mlp.gate_proj.weight"] == (128, 64)
    assert shapes["mlp.down_proj.weight"] == (64, 128) and shapes["hidden_norm.weight"] == (64,)
