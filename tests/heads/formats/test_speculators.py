"""EAGLE-3 in the layout of vLLM's speculators package (headway.heads.formats.speculators): the files, the
verifier it names, the package itself loading the export, and the config read back."""

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from headway.heads import EagleConfig
from headway.heads.eagle_layer import DraftCache
from headway.heads.formats.convert import convert
from headway.heads.formats.eagle import import_eagle
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
    fields, ids, name, normalized = read_speculators_config(Path("p"), config)
    assert ids == [2, 16, 29] and name == str(verifier) and not normalized
    assert fields == {k: getattr(cfg, k) for k in fields}
    check_model_type(Path("p"), config)
    eagle31 = speculators_config(cfg, torch.float32, [2, 16, 29], None, 3, {}, normalize_features=True)
    assert eagle31["fc_norm"] is eagle31["norm_output"] is True and eagle31["norm_before_fc"] is False
    assert read_speculators_config(Path("p"), eagle31)[3]
    for odd, named in [({"fc_norm": True}, "['fc_norm']"), ({"norm_output": True}, "['norm_output']"),
                       ({"fc_norm": True, "norm_output": True, "norm_before_fc": True}, "['norm_before_fc']")]:
        with pytest.raises(ValueError, match=rf"p sets {re.escape(named)}; headway reads EAGLE-3 .* and EAGLE-3.1 "
                                             r"\(fc_norm and norm_output together\)"):
            read_speculators_config(Path("p"), {**config, **odd})
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


def test_speculators_package_computes_what_the_eagle31_export_computes(tiny_llama, tmp_path):
    """EAGLE-3.1 (eagle.normalize_features): vLLM's speculators package reads fc_norm + norm_output and
    the fc_norm.{i} tensors; its modules, in the order its own forward runs them (per-layer norms,
    fc, the layer, norm fed back and scored), give our two draft steps' logits and states."""
    pytest.importorskip("speculators")
    from speculators import SpeculatorModel

    target, _ = tiny_llama
    head = eagle_head(target, 3, config=EagleConfig(normalize_features=True, feature_layers=[1, 0, 2]))
    with torch.no_grad():
        for norm in head.fc_norm:
            norm.weight.uniform_(0.5, 1.5)  # distinct norms: a swapped order would show
    verifier = tmp_path / "target"
    target.save_pretrained(verifier)
    out = export_quietly(head, tmp_path / "p", "speculators", target_name_or_path=str(verifier))
    config, tensors = config_and_tensors(out)
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # sorted, fc's blocks and norms with them
    assert torch.equal(tensors["fc_norm.0.weight"], head.fc_norm[1].weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SpeculatorModel.from_pretrained(str(out))
    assert model.config.fc_norm and model.config.norm_output and len(model.fc_norm) == 3
    model.config.transformer_layer_config._attn_implementation = "sdpa"
    ids, pos = torch.randint(0, 218, (1, 6)), torch.arange(6)[None]
    ids2 = torch.randint(0, 218, (1, 6))
    feats = torch.randn(1, 6, head.config.feature_width)  # in headway's feature order [1, 0, 2]
    sorted_feats = torch.cat([feats[..., 64:128], feats[..., :64], feats[..., 128:]], -1)  # the engines' [0, 1, 2]

    def their_step(tokens, hidden, positions):
        x = torch.cat([model.embed_tokens(tokens), hidden], dim=-1)
        h = model.layers[0](x, attention_mask=None, position_ids=positions,
                            position_embeddings=model.rotary_emb(x, positions))
        h = model.norm(h[0] if isinstance(h, tuple) else h)  # norm_output: the normed state goes on
        return h, model.lm_head(h)

    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        chunks = sorted_feats.chunk(3, dim=-1)
        fused = model.fc(torch.cat([n(c) for n, c in zip(model.fc_norm, chunks)], dim=-1))
        t1, l1 = their_step(ids, fused, pos)
        t2, l2 = their_step(ids2, t1, pos + 1)
        head.bind_target(target)
        h1 = head(ids, head.input_hidden(feats), pos)
        h2 = head(ids2, h1, pos + 1)
    torch.testing.assert_close(h1, t1)
    torch.testing.assert_close(head.logits(h1), l1)
    torch.testing.assert_close(head.logits(h2), l2)
    back = quiet(import_eagle, out)
    assert back.config.normalize_features and back.config.feature_layers == [0, 1, 2]
    back.bind_target(target)
    with torch.no_grad():
        torch.testing.assert_close(back.logits(back(ids, back.input_hidden(sorted_feats), pos)), head.logits(h1))


def test_eagle31_goes_to_the_speculators_layout_only(tiny_llama, tmp_path):
    target, _ = tiny_llama
    head = eagle_head(target, 3, config=EagleConfig(normalize_features=True))
    with pytest.raises(ValueError, match="this head is EAGLE-3.1 .* export it as 'speculators'"):
        export_quietly(head, tmp_path / "s", "sglang")
    assert not (tmp_path / "s").exists()


def test_speculators_package_computes_what_the_peagle_export_computes(tiny_llama, tmp_path):
    """P-EAGLE: the export is speculators' peagle model (mask_token_id, the depths as speculative_tokens,
    mask_hidden in the engines' layer order); the package loads it, and its modules over the context and
    two mask slots in one causal pass give our root and slot logits; it reads back the same."""
    pytest.importorskip("speculators")
    from speculators import SpeculatorModel

    from headway.heads.formats.eagle import export_eagle
    from headway.heads.peagle import PEagleHead

    target, _ = tiny_llama
    head = PEagleHead.from_target(target, feature_layers=[1, 0, 2], parallel_depths=3, mask_token_id=7)
    with torch.no_grad():
        head.mask_hidden.normal_()  # distinct blocks: a mask_hidden left in headway's order would show
    verifier = tmp_path / "target"
    target.save_pretrained(verifier)
    out = export_quietly(head, tmp_path / "p", "speculators", target_name_or_path=str(verifier))
    config, tensors = config_and_tensors(out)
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == 7
    assert config["speculators_config"]["algorithm"] == "peagle"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    mh = head.mask_hidden.detach()
    assert torch.equal(tensors["mask_hidden"].flatten(), torch.cat([mh[64:128], mh[:64], mh[128:]]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SpeculatorModel.from_pretrained(str(out))
    assert type(model).__name__ == "PEagleDraftModel" and model.mask_token_id == 7
    model.config.transformer_layer_config._attn_implementation = "sdpa"
    ids = torch.randint(0, 218, (1, 5))
    feats = torch.randn(1, 5, head.config.feature_width)  # headway's order [1, 0, 2]
    sorted_feats = torch.cat([feats[..., 64:128], feats[..., :64], feats[..., 128:]], -1)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        tokens = torch.cat([ids, torch.full((1, 2), 7)], 1)  # the context, then two slots
        hidden = torch.cat([sorted_feats, model.mask_hidden.expand(1, 2, -1)], 1)
        x = torch.cat([model.embed_tokens(tokens), model.fc(hidden)], dim=-1)
        pos = torch.arange(7)[None]
        h = model.layers[0](x, attention_mask=None, position_ids=pos, position_embeddings=model.rotary_emb(x, pos))
        theirs = model.lm_head(model.norm(h[0] if isinstance(h, tuple) else h))[0, 4:]  # root, slot 1, slot 2
        head.bind_target(target)
        cache = DraftCache()  # the runtime's way: the context into the cache, then the slots after it
        root = head(ids, head.input_hidden(feats), torch.arange(5)[None], cache=cache)[0, -1:]
        slots = head.slots(torch.arange(5, 7)[None], cache=cache)[0]
        mine = head.logits(torch.cat([root, slots]))
    torch.testing.assert_close(mine, theirs)
    back = quiet(import_eagle, out)
    assert type(back).__name__ == "PEagleHead" and back.config.parallel_depths == 3 and back.config.mask_token_id == 7
    back.bind_target(target)
    with torch.no_grad():
        torch.testing.assert_close(back.logits(back.slots(torch.arange(5, 7)[None], cache=_context(back, ids, sorted_feats))[0]),
                                   mine[1:])
    with pytest.raises(ValueError, match="this head is P-EAGLE .* export it as 'speculators'"):
        export_eagle(head, tmp_path / "s", "sglang")


def _context(head, ids, feats):
    cache = DraftCache()
    head(ids, head.input_hidden(feats), torch.arange(ids.shape[1])[None], cache=cache)
    return cache


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_speculators_package_computes_what_a_deep_export_computes(tiny_llama, tmp_path, kind):
    """A drafter of 3 decoder layers (speculators' num_hidden_layers; P-EAGLE's published drafters have 4): the export
    names its later layers layers.1, layers.2 (no hidden_norm, H-wide attention), the package builds 3 layers and
    loads every tensor, and its modules (layer 0 over [emb; fc(f)], then its plain decoder layers, norm, lm_head)
    give our logits over the context and, for P-EAGLE, two mask slots in the same causal pass; it reads back."""
    pytest.importorskip("speculators")
    from speculators import SpeculatorModel

    from headway.heads.formats.eagle import export_eagle
    from headway.heads.peagle import PEagleHead
    from tests.heads.formats.helpers import noisy

    target, _ = tiny_llama
    verifier = tmp_path / "target"
    target.save_pretrained(verifier)
    if kind == "peagle":
        head = noisy(PEagleHead.from_target(target, parallel_depths=3, mask_token_id=7, num_layers=3))
    else:
        head = eagle_head(target, 3, num_layers=3, draft_vocab_size=40, draft_tokens=DRAFT_IDS)
    out = export_quietly(head, tmp_path / "p", "speculators", target_name_or_path=str(verifier))
    config, tensors = config_and_tensors(out)
    assert config["transformer_layer_config"]["num_hidden_layers"] == 3
    assert tensors["layers.1.self_attn.q_proj.weight"].shape[1] == 64 and "layers.2.input_layernorm.weight" in tensors
    assert not any(k.startswith(("layers.1.hidden_norm", "layers.2.hidden_norm", "midlayer.")) for k in tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SpeculatorModel.from_pretrained(str(out))
    assert len(model.layers) == 3
    theirs = model.state_dict()
    for key, value in head.state_dict().items():
        if key.startswith(("midlayer.", "layers.")):
            assert torch.equal(theirs[key.replace("midlayer.", "layers.0.")], value), key
    model.config.transformer_layer_config._attn_implementation = "sdpa"
    ids, feats = torch.randint(0, 218, (1, 5)), torch.randn(1, 5, head.config.feature_width)
    slots = 2 if kind == "peagle" else 0
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        tokens, hidden = ids, feats
        if slots:
            tokens = torch.cat([ids, torch.full((1, slots), 7)], 1)
            hidden = torch.cat([feats, model.mask_hidden.expand(1, slots, -1)], 1)
        x = torch.cat([model.embed_tokens(tokens), model.fc(hidden)], dim=-1)
        pos = torch.arange(5 + slots)[None]
        h = x
        for layer in model.layers:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=model.rotary_emb(x, pos))
            h = h[0] if isinstance(h, tuple) else h
        theirs_logits = model.lm_head(model.norm(h))[0]
        head.bind_target(target)
        cache = DraftCache()
        mine = head(ids, head.input_hidden(feats), torch.arange(5)[None], cache=cache)[0]
        if slots:
            mine = torch.cat([mine, head.slots(torch.arange(5, 5 + slots)[None], cache=cache)[0]])
        mine = head.logits(mine)
    torch.testing.assert_close(mine, theirs_logits)
    back = quiet(import_eagle, out)
    assert type(back) is type(head) and back.config == head.config
    assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())
    with pytest.raises(ValueError, match="SGLang's EAGLE-3 (model has one|layout cannot carry it)"):
        export_eagle(head, tmp_path / "s", "sglang")


def test_a_deep_drafter_with_its_first_layer_as_midlayer_reads_the_same(tiny_llama, tmp_path):
    """vLLM maps midlayer.* to layers.0.*; a speculators folder (and a flat Llama config with num_hidden_layers 3) whose
    first layer is midlayer.* and the others layers.{i}.* (the published P-EAGLE drafters' names) imports the same."""
    target, _ = tiny_llama
    head = eagle_head(target, 3, num_layers=3)
    out = export_quietly(head, tmp_path / "p", "speculators")
    config, tensors = config_and_tensors(out)
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    save_file(renamed, str(out / "model.safetensors"))
    back = quiet(import_eagle, out)
    assert back.config == head.config
    assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())
    save_file({**renamed, "layers.0.norm.weight": torch.ones(64)}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="both midlayer.* and layers.0.* tensors"):
        quiet(import_eagle, out)
    flat = {**config["transformer_layer_config"], "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": config["draft_vocab_size"], "headway": config["headway"],
            "eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"]}
    (out / "config.json").write_text(json.dumps(flat))
    save_file(renamed, str(out / "model.safetensors"))
    back = quiet(import_eagle, out)
    assert back.config.num_layers == 3 and back.config.feature_layers == head.config.feature_layers
    assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())
