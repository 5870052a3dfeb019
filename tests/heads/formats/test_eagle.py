"""The official EAGLE layouts (headway.heads.formats.eagle): ``eagle`` (EAGLE-1) and ``sglang`` (EAGLE-3) as
FORMATS.md lists them, the speculators layout's round trips beside them, layer ids, and one-line errors."""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.heads import EagleConfig, EagleHead, load_drafter
from headway.heads.formats.convert import convert, detect_format, export_any, load_any
from headway.heads.formats.eagle import detect_eagle_format, export_eagle, import_eagle
from tests.heads.formats.helpers import (DRAFT_IDS, LAYER, LAYER3, config_and_tensors, eagle_head, export_quietly,
                                         generate, noisy, one_line, quiet, saved, same_tensors, step_logits)

# --- layouts as FORMATS.md lists them ---------------------------------------------------------

def test_eagle_layout(tiny_llama, tmp_path):
    target, _ = tiny_llama
    head = eagle_head(target, 1)
    h, v = target.config.hidden_size, target.config.vocab_size
    config, tensors = config_and_tensors(export_quietly(head, tmp_path / "e", "eagle"))
    expected = {"fc.weight": (h, 2 * h), "fc.bias": (h,), **{f"layers.0.{k}": None for k in LAYER}}
    assert set(tensors) == set(expected)
    assert tensors["fc.weight"].shape == (h, 2 * h) and tensors["layers.0.self_attn.q_proj.weight"].shape == (h, h)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["bias"] is True and config["vocab_size"] == v
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["intermediate_size"]) == (h, 4, 2, 16, 128)
    assert config["headway"] == {"num_target_layers": 2, "base_model_name_or_path": None}
    assert not {"draft_vocab_size", "d2t", "t2d"} & set(config)


def test_eagle_layout_without_bias_with_embeddings(tiny_llama, tmp_path):
    target, _ = tiny_llama
    head = eagle_head(target, 1, fc_bias=False, store_embeddings=True)
    config, tensors = config_and_tensors(export_quietly(head, tmp_path / "e", "eagle"))
    assert config["bias"] is False and "fc.bias" not in tensors
    assert tensors["embed_tokens.weight"].shape == (target.config.vocab_size, target.config.hidden_size)


def test_sglang_layout(tiny_llama, tmp_path):
    target, _ = tiny_llama
    head = eagle_head(target, 3)
    h, v = target.config.hidden_size, target.config.vocab_size
    with pytest.warns(UserWarning, match=r"feature layer\(s\) \[0, 2\]"):
        out = export_eagle(head, tmp_path / "s", "sglang")
    config, tensors = config_and_tensors(out)
    assert set(tensors) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                            *[f"midlayer.{k}" for k in LAYER3]}
    assert tensors["fc.weight"].shape == (h, 3 * h)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (h, 2 * h)
    assert tensors["lm_head.weight"].shape == (v, h)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (v,) and not tensors["d2t"].any()
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (v,) and tensors["t2d"].all()
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == v
    assert "target_hidden_size" not in config  # its presence keeps the official EAGLE-3 runtime's embedding random
    assert config["tie_word_embeddings"] is False and config["norm_before_residual"] is False
    # headway [0, 1, 2] = inputs of layers 0, 1 and the final output: vLLM ids as is, SGLang ids one lower
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [-1, 0, 1]}
    assert "embed_tokens.weight" not in tensors and "bias" not in config


def _official_eagle3_embedding(folder, target):
    """The embedding SafeAILab/EAGLE's EAGLE-3 ``Model`` drafts with, by its loading rule (FORMATS.md):
    the target's when config.json has no ``target_hidden_size`` (load_emb), then the checkpoint's
    ``embed_tokens.weight`` if it has one (``load_state_dict(strict=False)``), else its random
    initialisation (None here)."""
    config, tensors = config_and_tensors(folder)
    embedding = None if "target_hidden_size" in config else target.get_input_embeddings().weight
    return tensors.get("embed_tokens.weight", embedding)


def test_sglang_exports_give_the_official_eagle3_runtime_the_targets_embedding(tiny_llama, tmp_path):
    target, _ = tiny_llama
    head = eagle_head(target, 3)
    emb = target.get_input_embeddings().weight.detach()
    plain = export_quietly(head, tmp_path / "plain", "sglang")
    assert torch.equal(_official_eagle3_embedding(plain, target), emb)
    # with the embedding stored the official runtime reads no file of the target (one it cannot read when the
    # target is saved unsharded): target_hidden_size stays and the stored copy is loaded
    stored = export_quietly(head, tmp_path / "stored", "sglang", embeddings=emb)
    assert config_and_tensors(stored)[0]["target_hidden_size"] == target.config.hidden_size
    assert torch.equal(_official_eagle3_embedding(stored, target), emb)
    assert torch.equal(step_logits(import_eagle(stored), target), step_logits(head, target))
    with pytest.raises(ValueError, match=r"embedding is \[5, 64\] but the head needs \[218, 64\].*this head's target"):
        export_eagle(head, tmp_path / "bad", "sglang", embeddings=torch.zeros(5, 64))
    with pytest.raises(ValueError, match="only into the 'sglang' layout, not 'speculators'"):
        export_eagle(head, tmp_path / "bad", "speculators", embeddings=emb)


def test_attention_the_official_eagle_config_cannot_hold_is_exported_with_a_warning(tiny_llama, tmp_path):
    target, _ = tiny_llama
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    for kw, match in (({"rope_scaling": llama3}, r"official EAGLE runtime refuses this head's rope_scaling"),
                      ({"head_dim": 32}, r"head size as hidden_size / num_attention_heads = 16, not .* head_dim 32")):
        head = eagle_head(target, 1, **kw)
        with pytest.warns(UserWarning, match=match):
            out = export_eagle(head, tmp_path / str(len(match)), "eagle")
        assert torch.equal(step_logits(import_eagle(out, num_target_layers=2), target), step_logits(head, target))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_eagle(eagle_head(target, 1, rope_scaling={"type": "linear", "factor": 2.0}), tmp_path / "linear",
                     "eagle")


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_reduced_vocabulary_tensors(tiny_llama, tmp_path, fmt):
    target, _ = tiny_llama
    head = eagle_head(target, 3, draft_vocab_size=40, draft_tokens=DRAFT_IDS)
    config, tensors = config_and_tensors(export_quietly(head, tmp_path / fmt, fmt))
    assert config["draft_vocab_size"] == 40
    assert tensors["lm_head.weight"].shape == (40, target.config.hidden_size)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (40,)
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 40
    assert (tensors["d2t"] + torch.arange(40)).tolist() == DRAFT_IDS


# --- round trips --------------------------------------------------------------------------------

EAGLE_CASES = {
    "eagle": ("eagle", 1, {}),
    "sglang-reduced": ("sglang", 3, {"draft_vocab_size": 40, "draft_tokens": DRAFT_IDS}),
    "speculators": ("speculators", 3, {}),
}


@pytest.mark.parametrize("case", list(EAGLE_CASES))
def test_eagle_round_trip_bit_exact(tiny_llama, tmp_path, case):
    target, _ = tiny_llama
    fmt, version, kw = EAGLE_CASES[case]
    head = eagle_head(target, version, **kw)
    mid = quiet(convert, saved(head, tmp_path / "src"), tmp_path / "mid", fmt)
    assert detect_format(mid) == fmt
    back = load_drafter(convert(mid, tmp_path / "back", "headway", target=target))
    assert back.config == head.config
    same_tensors(back, head)
    assert generate(target, load_any(mid)) == generate(target, head)


CASES = {
    "eagle": ("eagle", 1, {}),
    "eagle-nobias-emb": ("eagle", 1, {"fc_bias": False, "store_embeddings": True}),
    "sglang": ("sglang", 3, {}),
    "sglang-reduced": ("sglang", 3, {"draft_vocab_size": 40, "draft_tokens": DRAFT_IDS}),
    "speculators": ("speculators", 3, {}),
    "speculators-reduced": ("speculators", 3, {"draft_vocab_size": 40, "draft_tokens": DRAFT_IDS}),
    "speculators-3-layers": ("speculators", 3, {"num_layers": 3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_bit_exact(tiny_llama, tmp_path, case):
    target, _ = tiny_llama
    fmt, version, kw = CASES[case]
    head = eagle_head(target, version, **kw)
    out = export_quietly(head, tmp_path / case, fmt)
    assert detect_eagle_format(out) == fmt
    back = import_eagle(out)
    assert back.config == head.config
    a, b = head.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(step_logits(back, target), step_logits(head, target))
    assert import_eagle(out, fmt, version=version).config == head.config
    # generation with the imported drafter is the original's, round by round (static and dynamic trees)
    from headway.inference import SpeculativeGenerator

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6]])
    for tree in ("tree-7", {"depth": 3, "top_k": 2, "total_tokens": 6}):
        a = SpeculativeGenerator(target, head, tree=tree).generate(ids, max_new_tokens=12)
        b = SpeculativeGenerator(target, back, tree=tree).generate(ids, max_new_tokens=12)
        assert torch.equal(a.sequences, b.sequences) and a.stats.accepted_per_step == b.stats.accepted_per_step


def test_bfloat16_round_trip_keeps_dtype(tiny_llama, tmp_path):
    target, _ = tiny_llama
    head = eagle_head(target, 3)
    for p in head.parameters():  # parameters only, as import does: RoPE's inv_freq stays float32
        p.data = p.data.to(torch.bfloat16)
    out = export_quietly(head, tmp_path / "bf16", "sglang")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = import_eagle(out)
    assert back.fc.weight.dtype == torch.bfloat16 and back.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(step_logits(back, target), step_logits(head, target))


def test_eagle1_drops_reduced_vocabulary(tiny_llama, tmp_path):
    target, _ = tiny_llama
    head = eagle_head(target, 1, draft_vocab_size=40, draft_tokens=DRAFT_IDS)
    config, tensors = config_and_tensors(export_quietly(head, tmp_path / "e", "eagle"))
    assert not {"d2t", "t2d"} & set(tensors) and config["vocab_size"] == target.config.vocab_size
    back = import_eagle(tmp_path / "e")
    assert back.config.draft_vocab_size is None
    full, draft = step_logits(back, target), step_logits(head, target)  # [.., 218] vs [.., 40]: the same rows
    assert torch.equal(full[..., DRAFT_IDS], draft)


def test_eagle1_with_the_whole_vocabulary_as_draft_vocabulary_exports_without_widening(tiny_llama, tmp_path):
    """draft_vocab_size == vocab_size (the ids shuffled) is no reduction: the 'eagle' layout takes it without
    widen_vocab, and the exported drafter scores every token as the head did."""
    target, _ = tiny_llama
    v = target.config.vocab_size
    head = eagle_head(target, 1, draft_vocab_size=v, draft_tokens=list(range(v)))
    perm = torch.randperm(v, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        head.d2t.copy_(perm - torch.arange(v))
    out = quiet(export_any, head, tmp_path / "e", "eagle", target=target)
    back = import_eagle(out)
    assert back.config.draft_vocab_size is None
    full, draft = step_logits(back, target), step_logits(head, target)  # target order vs draft order
    assert torch.equal(full[..., perm], draft)


def test_unsorted_feature_layers_are_sorted_with_fc(tiny_llama, tmp_path):
    target, _ = tiny_llama
    head = eagle_head(target, 3, feature_layers=[2, 0, 1])
    out = export_quietly(head, tmp_path / "u", "sglang")
    back = import_eagle(out)
    assert back.config.feature_layers == [0, 1, 2]
    h = target.config.hidden_size
    head.bind_target(target), back.bind_target(target)
    ids, pos = torch.randint(0, 218, (1, 4)), torch.arange(4)[None]
    f = {i: torch.randn(1, 4, h) for i in (0, 1, 2)}
    with torch.no_grad():
        mine = head.logits(head(ids, head.input_hidden(torch.cat([f[2], f[0], f[1]], -1)), pos))
        theirs = back.logits(back(ids, back.input_hidden(torch.cat([f[0], f[1], f[2]], -1)), pos))
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)  # fc sums the blocks in another order


# --- layer ids ------------------------------------------------------------------------------------

def _deep_head(**kw):
    cfg = EagleConfig(hidden_size=64, vocab_size=100, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, num_target_layers=32, version=3, **kw)
    return noisy(EagleHead(cfg))


def test_deep_target_layer_ids_round_trip(tmp_path):
    head = _deep_head()
    assert head.config.feature_layers == [2, 16, 29]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ids 0 or L: nothing to warn about
        out = export_eagle(head, tmp_path / "s", "sglang")
        spec = export_eagle(head, tmp_path / "p", "speculators")
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]
    assert json.loads((spec / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert import_eagle(out).config == import_eagle(spec).config == head.config


def _edit_config(folder, edit):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_layer_ids_from_either_key_or_the_engine_default(tmp_path):
    head = _deep_head()
    out = export_eagle(head, tmp_path / "s", "sglang")
    _edit_config(out, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))  # SGLang's key alone
    assert import_eagle(out).config.feature_layers == [2, 16, 29]
    _edit_config(out, lambda c: (c.pop("eagle_config"), c.update(eagle_aux_hidden_state_layer_ids=[2, 16, 29])))
    assert import_eagle(out).config.feature_layers == [2, 16, 29]  # vLLM's key alone
    _edit_config(out, lambda c: (c.pop("eagle_aux_hidden_state_layer_ids"), c.pop("headway")))
    with pytest.raises(ValueError, match="num_target_layers="):
        import_eagle(out)
    assert import_eagle(out, num_target_layers=32).config.feature_layers == [2, 16, 29]  # engines' default


def test_naively_copied_layer_ids_are_refused(tmp_path):
    out = export_eagle(_deep_head(), tmp_path / "s", "sglang")
    _edit_config(out, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 15, 28]))  # SGLang ids for vLLM
    with pytest.raises(ValueError, match=r"\[1, 15, 28\].*\[1, 15, 28\].*different target layers"):
        import_eagle(out)


# --- errors ---------------------------------------------------------------------------------------

@pytest.fixture
def sglang_folder(tiny_llama, tmp_path):
    target, _ = tiny_llama
    return export_quietly(eagle_head(target, 3, draft_vocab_size=40, draft_tokens=DRAFT_IDS), tmp_path / "s", "sglang")


def _edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor(sglang_folder):
    _edit_tensors(sglang_folder, lambda t: t.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) \['midlayer.hidden_norm.weight'\]") as err:
        import_eagle(sglang_folder)
    one_line(err)


def test_missing_d2t_of_a_reduced_vocabulary(sglang_folder):
    _edit_tensors(sglang_folder, lambda t: t.pop("d2t"))
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) \['d2t'\]"):
        import_eagle(sglang_folder)


def test_wrong_shape(sglang_folder):
    _edit_tensors(sglang_folder, lambda t: t.update({"norm.weight": torch.ones(63)}))
    with pytest.raises(ValueError, match=r"norm.weight has shape \(63,\), the config implies \(64,\)") as err:
        import_eagle(sglang_folder)
    one_line(err)


def test_unknown_tensor(sglang_folder):
    _edit_tensors(sglang_folder, lambda t: t.update({"midlayer.extra.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match="does not define"):
        import_eagle(sglang_folder)


def test_version_and_format_mismatch(tiny_llama, tmp_path, sglang_folder):
    target, _ = tiny_llama
    with pytest.raises(ValueError, match=r"EAGLE-3 drafter .* EAGLE-1 was asked for \(version=1\)") as err:
        import_eagle(sglang_folder, version=1)
    one_line(err)
    with pytest.raises(ValueError, match=r"'sglang' layout \(EAGLE-3\) but fmt='eagle' \(EAGLE-1\)"):
        import_eagle(sglang_folder, "eagle")
    e1 = export_quietly(eagle_head(target, 1), tmp_path / "e", "eagle")
    with pytest.raises(ValueError, match=r"EAGLE-1 drafter .* EAGLE-3 was asked for"):
        import_eagle(e1, version=3)
    with pytest.raises(ValueError, match="EAGLE-3 drafters but this head is EAGLE-1; export it as 'eagle'"):
        export_eagle(eagle_head(target, 1), tmp_path / "x", "sglang")
    with pytest.raises(ValueError, match="EAGLE-1 drafters but this head is EAGLE-3; export it as 'sglang' or"):
        export_eagle(eagle_head(target, 3), tmp_path / "x", "eagle")


def test_foreign_configs(tiny_llama, tmp_path):
    target, _ = tiny_llama
    native = tmp_path / "native"
    eagle_head(target, 3).save_pretrained(native)
    with pytest.raises(ValueError, match="headway's own format"):
        import_eagle(native)
    plain = tmp_path / "plain"
    target.save_pretrained(plain)
    with pytest.raises(ValueError, match="not an EAGLE drafter") as err:
        import_eagle(plain)
    one_line(err)
    spec = export_quietly(eagle_head(target, 3), tmp_path / "p", "speculators")
    _edit_config(spec, lambda c: c.pop("norm_before_residual"))
    with pytest.raises(ValueError, match="lacks norm_before_residual"):
        import_eagle(spec)
    _edit_config(spec, lambda c: c.update(speculators_model_type="mtp"))
    with pytest.raises(ValueError, match="'mtp' model"):
        import_eagle(spec)
    with pytest.raises(ValueError, match="unknown EAGLE format"):
        import_eagle(spec, "medusa")


def test_keywords_that_contradict_the_folder(sglang_folder):
    with pytest.raises(ValueError, match=r"num_target_layers=2 but num_target_layers=30 was passed"):
        import_eagle(sglang_folder, num_target_layers=30)
    with pytest.raises(ValueError, match=r"feature layers \[0, 1, 2\].*feature_layers=\[0, 1\]"):
        import_eagle(sglang_folder, feature_layers=[0, 1])
    assert import_eagle(sglang_folder, num_target_layers=2, base_model_name_or_path="org/t") \
        .config.base_model_name_or_path == "org/t"


def test_export_refusals_and_atomic_replace(tiny_llama, tmp_path):
    target, _ = tiny_llama
    with pytest.raises(ValueError, match="no fc bias"):
        export_eagle(eagle_head(target, 3, fc_bias=True), tmp_path / "b", "sglang")
    with pytest.raises(ValueError, match="unknown EAGLE export format"):
        export_eagle(eagle_head(target, 3), tmp_path / "b", "medusa")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    head = eagle_head(target, 1)
    with pytest.raises(ValueError, match="not empty; .* overwrite=True"):
        export_eagle(head, out, "eagle")
    assert (out / "keep.txt").exists()
    with pytest.raises(ValueError, match="holds files but no drafter"):  # overwrite replaces a drafter's folder only
        export_eagle(head, out, "eagle", overwrite=True)
    (out / "keep.txt").unlink()
    export_eagle(head, out, "eagle")
    export_eagle(head, out, "eagle", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folders left beside it
    export_eagle(head, tmp_path / "empty", "eagle")  # a missing folder is created
