"""EAGLE-3 in the layout of vLLM's speculators package (headway.heads.formats.speculators): the files, the
verifier it names, the package itself loading the export, and the config read back."""

import json
import warnings
from pathlib import Path

import pytest
import torch

from headway.heads import EagleConfig
from headway.heads.formats.convert import convert
from headway.heads.formats.speculators import (SPECULATORS_VERSION, check_model_type, is_speculators,
                                               read_speculators_config, speculators_config)
from tests.heads.formats.helpers import (DRAFT_IDS, LAYER3, config_and_tensors, eagle_head, export_quietly, quiet,
                                         saved)


def test_speculators_layout(tiny_llama, tmp_path):
    target, _ = tiny_llama
    head = eagle_head(target, 3)
    h, v = target.config.hidden_size, target.config.vocab_size
    config, tensors = config_and_tensors(export_quietly(head, tmp_path / "p", "speculators",
                                                        target_name_or_path="org/target", speculative_tokens=5))
    assert set(tensors) == {"fc.weight", "norm.weight", "lm_head.weight", *[f"layers.0.{k}" for k in LAYER3]}
    assert tensors["layers.0.self_attn.k_proj.weight"].shape == (32, 2 * h)
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3DraftModel"]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == v
    assert config["draft_vocab_size"] == v and config["target_hidden_size"] == h
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and config["norm_before_residual"] is False
    assert config["speculators_config"] == {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": "org/target", "architectures": []}}


def test_speculators_keeps_its_verifier(tiny_llama, tmp_path):
    target, tokenizer = tiny_llama
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = quiet(convert, saved(eagle_head(target, 3), tmp_path / "src"), tmp_path / "p", "speculators",
                target=str(folder), speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    verifier = config["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(folder), "architectures": ["LlamaForCausalLM"]}
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4


def test_the_config_reads_back_what_it_writes(tmp_path):
    cfg = EagleConfig(hidden_size=64, vocab_size=100, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, num_target_layers=32, version=3, draft_vocab_size=40)
    verifier = tmp_path / "target"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    config = speculators_config(cfg, torch.bfloat16, [2, 16, 29], str(verifier), 4, {"num_target_layers": 32})
    assert is_speculators(config) and not is_speculators({"model_type": "llama"})
    assert config["speculators_version"] == SPECULATORS_VERSION and config["torch_dtype"] == "bfloat16"
    assert config["draft_vocab_size"] == 40 and config["target_hidden_size"] == 64
    assert config["headway"] == {"num_target_layers": 32}
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(verifier),
                                                        "architectures": ["LlamaForCausalLM"]}
    fields, ids, name = read_speculators_config(Path("p"), config)
    assert ids == [2, 16, 29] and name == str(verifier)
    assert fields == {k: getattr(cfg, k) for k in fields}
    check_model_type(Path("p"), config)
    with pytest.raises(ValueError, match=r"p sets \['fc_norm'\]; headway's EAGLE-3 layer has none of these norms"):
        read_speculators_config(Path("p"), {**config, "fc_norm": True})
    with pytest.raises(ValueError, match="p lacks a transformer_layer_config object"):
        read_speculators_config(Path("p"), {k: v for k, v in config.items() if k != "transformer_layer_config"})
    unnamed = speculators_config(cfg, torch.float32, [2, 16, 29], None, 3, {})
    assert unnamed["speculators_config"]["verifier"] == {"name_or_path": None, "architectures": []}


# --- a real reader --------------------------------------------------------------------------------

@pytest.mark.parametrize("reduced", [False, True])
def test_speculators_package_loads_the_export(tiny_llama, tmp_path, reduced):
    pytest.importorskip("speculators")
    from speculators import SpeculatorModel

    target, _ = tiny_llama
    verifier = tmp_path / "target"
    target.save_pretrained(verifier)
    kw = {"draft_vocab_size": 40, "draft_tokens": DRAFT_IDS} if reduced else {}
    head = eagle_head(target, 3, **kw)
    out = export_quietly(head, tmp_path / "p", "speculators", target_name_or_path=str(verifier))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SpeculatorModel.from_pretrained(str(out))
    assert type(model).__name__ == "Eagle3DraftModel"
    assert model.config.eagle_aux_hidden_state_layer_ids == [0, 1, 2]
    assert model.config.speculators_config.verifier.architectures == ["LlamaForCausalLM"]
    theirs = model.state_dict()
    for key, value in head.state_dict().items():
        assert torch.equal(theirs[key.replace("midlayer.", "layers.0.")], value), key
    # Their layer on their modules gives our logits. The embedding is the target's (speculators 0.9.0
    # refills it from the verifier only when it sees NaN, which transformers 5.24 does not leave there).
    model.config.transformer_layer_config._attn_implementation = "sdpa"
    ids, pos = torch.randint(0, 218, (1, 6)), torch.arange(6)[None]
    feats = torch.randn(1, 6, head.config.feature_width)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        x = torch.cat([model.embed_tokens(ids), model.fc(feats)], dim=-1)
        out_h = model.layers[0](x, attention_mask=None, position_ids=pos,
                                position_embeddings=model.rotary_emb(x, pos))
        out_h = out_h[0] if isinstance(out_h, tuple) else out_h
        theirs_logits = model.lm_head(model.norm(out_h))
        head.bind_target(target)
        mine = head.logits(head(ids, head.input_hidden(feats), pos))
    torch.testing.assert_close(theirs_logits, mine)
