"""DFlash drafters in speculators' ``dflash`` layout and z-lab's (headway.heads.formats.dflash), checked against the
real readers: speculators 0.9's ``DFlashDraftModel`` loads the "speculators" export and computes the block logits
headway computes, its ``DFlashConverter`` converts the "z-lab" export; both read back equal, through the converter
registry and the CLI; every refusal is one line."""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway import cli
from headway.heads import load_drafter
from headway.heads.dflash import DFlashHead
from headway.heads.formats.convert import FORMATS, convert, detect_format, export_any, load_any
from headway.heads.formats.dflash import export_dflash, import_dflash
from headway.heads.formats.eagle import import_eagle
from headway.heads.target.tiny import build_tiny_target
from tests.heads.formats.helpers import config_and_tensors, eagle_head, export_quietly, noisy, one_line, saved

pytest.importorskip("speculators")

C, B = 6, 4  # context positions before the anchor; the block (the anchor and B - 1 mask slots)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_target("llama")


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """(a 4-layer tiny Llama target, its saved folder): layers 1..3 are neither the embedding nor the last."""
    from transformers import AutoModelForCausalLM

    target, _ = build_tiny_target("llama")
    config = type(target.config).from_dict({**target.config.to_dict(), "num_hidden_layers": 4})
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).eval()
    folder = tmp_path_factory.mktemp("deep") / "target"
    model.save_pretrained(folder)
    return model, folder


def dflash_head(target, seed=0, **kw):
    return noisy(DFlashHead.from_target(target, **{"block_size": B, "num_layers": 2, **kw}), seed=seed)


def quietly(fn, *args, **kw):
    with warnings.catch_warnings():  # feature layers 0 and L have no exact speculators counterpart (warned)
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


def same_head(a: DFlashHead, b: DFlashHead, **differ):
    assert b.config == type(a.config)(**{**vars(a.config), **differ})
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def speculators_model(folder):
    """speculators' own DFlashDraftModel from the folder (verifier weights from its verifier folder), eager."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"  # its float mask, not flex attention
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DFlashDraftModel.from_pretrained(str(folder), config=config).eval()


def per_layer_features(layers, seed=3):
    """{layer id: [1, T, H] random features}: T covers the context, the anchor and positions the block must not see."""
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randn(1, C + B + 2, 64, generator=g) for i in layers}


def speculators_block_logits(model, feats: dict, ids):
    """The block logits speculators computes: its training forward (``_backbone_forward``: its anchor mask, mask-token
    fill, positions, fc / hidden_norm / layers / norm / lm_head) with one anchor at position C."""
    layers = model.config.aux_hidden_state_layer_ids
    hidden = torch.cat([feats[i] for i in layers], -1)
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, C] = 1  # the only anchor it may draw
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(hidden, ids, loss_mask, torch.zeros(1, ids.shape[1], 64),
                                                torch.zeros_like(ids), max_anchors=1)
    return logits


def headway_block_logits(head, feats: dict, ids):
    features = torch.cat([feats[i][:, :C] for i in head.config.feature_layers], -1)
    block = torch.full((1, B), head.config.mask_token_id)
    block[0, 0] = ids[0, C]
    with torch.no_grad():
        kv = head.context_kv(head.context(features), torch.arange(C)[None])
        return head.logits(head(block, torch.arange(C, C + B)[None], kv))


def assert_speculators_computes_it(head, folder, target):
    model = speculators_model(folder)
    own = set(model.state_dict()) - {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                     "verifier_norm.weight", "t2d"}
    assert own == set(head.state_dict())  # the body (and d2t): every tensor loaded, none left out
    assert torch.equal(model.embed_tokens.weight, target.get_input_embeddings().weight)  # from the verifier
    rows = head.draft_rows(target.get_output_embeddings().weight)
    assert torch.equal(model.lm_head.weight, rows)  # the verifier's, or the draft rows the folder carries
    feats = per_layer_features(head.config.feature_layers)
    ids = torch.randint(0, 218, (1, C + B + 2), generator=torch.Generator().manual_seed(4))
    theirs, ours = speculators_block_logits(model, feats, ids), headway_block_logits(head, feats, ids)
    assert theirs.shape == ours.shape == (1, B, head.config.output_size)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


# --- the "speculators" layout -------------------------------------------------------------------------

def test_speculators_layout_is_what_speculators_computes(tiny, tmp_path):
    target, _ = tiny
    verifier = tmp_path / "target"
    target.save_pretrained(verifier)
    head = dflash_head(target, feature_layers=[2, 0, 1])  # unsorted: fc's blocks are permuted on export
    out = quietly(export_dflash, head, tmp_path / "s", "speculators", target_name_or_path=str(verifier))
    config, tensors = config_and_tensors(out)
    assert set(tensors) == set(head.state_dict()) and tensors["fc.weight"].shape == (64, 3 * 64)
    assert config["architectures"] == ["DFlashSpeculator"] and config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [0, 1, 2] and config["block_size"] == B
    assert config["draft_vocab_size"] == 218 and config["mask_token_id"] == head.config.mask_token_id
    assert config["sample_from_anchor"] is False and config["sliding_window_non_causal"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and not layer["attention_bias"]
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": head.config.rope_theta}
    assert config["speculators_config"]["algorithm"] == "dflash"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == B - 1
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(verifier),
                                                        "architectures": ["LlamaForCausalLM"]}
    assert config["headway"] == {"num_target_layers": 2, "base_model_name_or_path": None}
    assert_speculators_computes_it(head, out, target)


def test_a_draft_vocabulary_is_what_speculators_computes(tiny, tmp_path):
    """draft_vocab_size: d2t, t2d and the target's rows of the draft tokens, as speculators writes a reduced
    vocabulary; its model scores those rows and reads the same logits; read back equal; z-lab's layout refuses it."""
    target, _ = tiny
    verifier = tmp_path / "target"
    target.save_pretrained(verifier)
    ids = list(range(3, 200, 3))
    head = dflash_head(target, feature_layers=[0, 1, 2], draft_vocab_size=len(ids), draft_tokens=ids)
    out = quietly(export_any, head, tmp_path / "s", "speculators", target=target, target_name_or_path=str(verifier))
    config, tensors = config_and_tensors(out)
    assert config["draft_vocab_size"] == len(ids) and set(tensors) == {*head.state_dict(), "t2d", "lm_head.weight"}
    assert tensors["t2d"].sum() == len(ids) and torch.equal(tensors["lm_head.weight"], target.lm_head.weight[ids])
    assert_speculators_computes_it(head, out, target)
    same_head(head, import_dflash(out))
    refused(lambda: export_dflash(head, tmp_path / "z", "z-lab"), "which z-lab's layout cannot hold")
    unbound = import_dflash(out)
    refused(lambda: export_dflash(unbound, tmp_path / "u", "speculators"), "pass target=")


def test_speculators_round_trip(tiny, tmp_path):
    target, _ = tiny
    head = dflash_head(target, seed=1, feature_layers=[0, 1, 2])
    out = quietly(export_any, head, tmp_path / "s", "speculators")
    assert detect_format(out) == "speculators"
    same_head(head, import_dflash(out))
    back = load_any(out, target=target)  # the registry: the EAGLE family's "speculators" sends it here
    same_head(head, back)
    assert torch.equal(headway_block_logits(back, per_layer_features([0, 1, 2]), torch.arange(C + B + 2)[None]),
                       headway_block_logits(head, per_layer_features([0, 1, 2]), torch.arange(C + B + 2)[None]))
    half = quietly(export_any, head.to(torch.bfloat16), tmp_path / "h", "speculators")
    assert config_and_tensors(half)[0]["torch_dtype"] == "bfloat16"
    assert import_dflash(half).fc.weight.dtype == torch.bfloat16  # the checkpoint's dtype is kept


def test_speculators_export_warns_on_inexact_layers(tiny, tmp_path):
    with pytest.warns(UserWarning, match=r"feature layer\(s\) \[0, 2\] .* 'speculators' layout"):
        export_dflash(dflash_head(tiny[0], feature_layers=[0, 1, 2]), tmp_path / "s", "speculators")


# --- the "z-lab" layout -----------------------------------------------------------------------------

def test_zlab_layout_and_speculators_converter(deep, tmp_path):
    from speculators.convert.dflash import DFlashConverter

    target, verifier = deep
    head = dflash_head(target, feature_layers=[1, 2, 3])
    out = export_any(head, tmp_path / "z", "z-lab")
    config, tensors = config_and_tensors(out)
    assert set(tensors) == set(head.state_dict())
    assert all(torch.equal(tensors[k], v) for k, v in head.state_dict().items())
    assert config["architectures"] == ["DFlashDraftModel"] and "auto_map" not in config
    assert config["model_type"] == "qwen3" and config["num_hidden_layers"] == 2 and config["block_size"] == B
    assert config["dflash_config"] == {"mask_token_id": head.config.mask_token_id, "target_layer_ids": [0, 1, 2]}
    assert config["num_target_layers"] == 4 and detect_format(out) == "z-lab"
    same_head(head, import_dflash(out))
    same_head(head, load_any(out))

    conv = tmp_path / "converted"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DFlashConverter().convert(str(out), str(conv), base_model=str(verifier), validate=True)
    converted, weights = config_and_tensors(conv)
    assert converted["speculators_model_type"] == "dflash"
    assert converted["aux_hidden_state_layer_ids"] == head.config.feature_layers  # it maps z-lab's ids + 1
    assert converted["block_size"] == B and converted["mask_token_id"] == head.config.mask_token_id
    assert set(weights) == set(head.state_dict()) and all(torch.equal(weights[k], v)
                                                          for k, v in head.state_dict().items())
    assert_speculators_computes_it(head, conv, target)
    assert detect_format(conv) == "speculators"  # its architectures say DFlashDraftModel; speculators_model_type wins
    same_head(head, load_any(conv), base_model_name_or_path=str(verifier))  # depth from the verifier folder


def test_zlab_takes_the_whole_vocabulary_as_draft_vocabulary(deep, tmp_path):
    """draft_vocab_size == vocab_size (the ids shuffled) is no reduction: z-lab's layout takes it, unreduced, and
    the re-imported drafter scores every token as the head did."""
    target, _ = deep
    v = target.config.vocab_size
    head = dflash_head(target, feature_layers=[1, 2, 3], draft_vocab_size=v, draft_tokens=list(range(v)))
    perm = torch.randperm(v, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        head.d2t.copy_(perm - torch.arange(v))
    out = export_any(head, tmp_path / "z", "z-lab", target=target)
    config, tensors = config_and_tensors(out)
    assert "d2t" not in tensors and not config.get("draft_vocab_size")
    back = load_any(out)
    assert back.config.draft_vocab_size is None
    feats = per_layer_features(head.config.feature_layers)
    ids = torch.randint(0, v, (1, C + B + 2), generator=torch.Generator().manual_seed(4))
    mine = headway_block_logits(head.bind_target(target), feats, ids)
    theirs = headway_block_logits(back.bind_target(target), feats, ids)
    assert torch.equal(theirs[..., perm], mine)


def test_zlab_with_the_last_layer_warns(deep, tmp_path):
    """z-lab's code reads hidden_states[L] exactly, but speculators' DFlashConverter drops id L - 1 (it takes the last
    layer for the verifier's own output) and then cannot load fc: the export says so."""
    from speculators.convert.dflash import DFlashConverter

    target, verifier = deep
    head = dflash_head(target, num_layers=1, feature_layers=[1, 4])
    with pytest.warns(UserWarning, match="DFlashConverter drops that id"):
        out = export_dflash(head, tmp_path / "z", "z-lab")
    same_head(head, import_dflash(out))
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="size mismatch for fc.weight"):
        warnings.simplefilter("ignore")
        DFlashConverter().convert(str(out), str(tmp_path / "c"), base_model=str(verifier), validate=False)


# --- the registry and the CLI ------------------------------------------------------------------------

def test_convert_cli_writes_both_layouts(deep, tmp_path):
    target, verifier = deep
    head = dflash_head(target, feature_layers=[1, 3])
    src = saved(head, tmp_path / "src")
    assert "z-lab" in FORMATS and FORMATS.index("z-lab") < FORMATS.index("eagle")
    assert cli.main(["convert", "--to", "z-lab", str(src), str(tmp_path / "z")]) == 0
    assert cli.main(["convert", "--to", "speculators", "--target", str(verifier), str(src), str(tmp_path / "s")]) == 0
    same_head(head, load_any(tmp_path / "z"))
    same_head(head, load_any(tmp_path / "s", target=target))
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(verifier)
    back = convert(tmp_path / "z", tmp_path / "again", "headway")  # z-lab -> headway's own
    same_head(head, load_drafter(back))


# --- refusals: one line each ---------------------------------------------------------------------------

def refused(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    one_line(err)


def rewrite(folder, **changes):
    """Change config.json keys (a value None removes the key; a dict merges into the key's object)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        elif isinstance(value, dict):
            config[key] = {k: v for k, v in {**config[key], **value}.items() if v is not None}
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return folder


def retensor(folder, **tensors):
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    for key, value in tensors.items():
        if value is None:
            weights.pop(key)
        else:
            weights[key] = value
    save_file(weights, str(path))
    return folder


def test_export_refusals(tiny, tmp_path):
    target, _ = tiny
    refused(lambda: export_dflash(dflash_head(target, feature_layers=[0, 1]), tmp_path / "z", "z-lab"),
            r"reads target layer 0 \(the embedding output.*export it as 'speculators'")
    refused(lambda: export_any(eagle_head(target, 3), tmp_path / "e", "z-lab"),
            r"EAGLE-3 drafters cannot be written as 'z-lab' \(DFlash \(z-lab\)\)")
    refused(lambda: export_dflash(eagle_head(target, 3), tmp_path / "e", "speculators"),
            "export_dflash needs a DFlashHead, got Eagle3Head")
    assert not (tmp_path / "z").exists() and not (tmp_path / "e").exists()


@pytest.fixture
def exports(deep, tmp_path):
    """A fresh copy of each layout: {"speculators": folder, "z-lab": folder}."""
    target, verifier = deep
    head = dflash_head(target, feature_layers=[1, 2, 3])
    return {fmt: export_dflash(head, tmp_path / fmt, fmt, target_name_or_path=str(verifier))
            for fmt in ("speculators", "z-lab")}


def test_what_dflash_cannot_compute_is_refused(exports):
    spec, zlab = exports["speculators"], exports["z-lab"]
    refused(lambda: import_dflash(rewrite(spec, sample_from_anchor=True)), "sets sample_from_anchor")
    refused(lambda: import_dflash(rewrite(zlab, dflash_config={"causal": True})), r"dflash_config sets \['causal'\]")
    refused(lambda: import_dflash(rewrite(zlab, dflash_config={"causal": None}, attention_bias=True)),
            "sets attention_bias; headway's DFlash attention has no biases")
    sliding = ["sliding_attention", "full_attention"]
    refused(lambda: import_dflash(rewrite(zlab, attention_bias=None, layer_types=sliding)),
            r"has sliding-window layers \[0\]")


def test_a_bad_draft_vocabulary_is_refused(exports):
    spec, zlab = exports["speculators"], exports["z-lab"]
    refused(lambda: import_dflash(rewrite(spec, draft_vocab_size=100)), "needs d2t of 100 offsets, got None")
    retensor(spec, d2t=torch.zeros(100, dtype=torch.long), t2d=torch.zeros(218, dtype=torch.bool))
    refused(lambda: import_dflash(spec), "d2t/t2d do not map 100 draft tokens to distinct ids")
    retensor(spec, d2t=None, t2d=None)
    refused(lambda: import_dflash(rewrite(spec, draft_vocab_size=500)), "draft_vocab_size 500 is not in 1..218")
    refused(lambda: import_dflash(rewrite(zlab, draft_vocab_size=100)), "reduced draft vocabulary")
    rewrite(spec, draft_vocab_size=218)
    refused(lambda: import_dflash(retensor(spec, **{"lm_head.weight": torch.zeros(100, 64)})),
            r"reduced draft vocabulary \(lm_head rows 100 of 218")
    retensor(spec, **{"lm_head.weight": torch.zeros(218, 64), "d2t": torch.ones(218, dtype=torch.long),
                      "t2d": torch.ones(218, dtype=torch.bool)})
    refused(lambda: import_dflash(spec), "d2t/t2d that are not the identity")
    retensor(spec, d2t=torch.zeros(218, dtype=torch.long))  # full-vocabulary copies speculators refills: not kept
    assert "lm_head.weight" not in import_dflash(spec).state_dict()


def test_missing_config_and_tensors_are_refused(exports):
    spec, zlab = exports["speculators"], exports["z-lab"]
    refused(lambda: import_dflash(rewrite(zlab, dflash_config={"mask_token_id": None})), "has no mask_token_id")
    refused(lambda: import_dflash(rewrite(spec, mask_token_id=None)), "has no mask_token_id")
    rewrite(spec, mask_token_id=1)
    refused(lambda: import_dflash(retensor(spec, **{"norm.weight": None})), r"lacks tensor\(s\) \['norm.weight'\]")
    refused(lambda: import_dflash(retensor(spec, **{"norm.weight": torch.ones(64), "extra": torch.ones(2)})),
            r"has tensor\(s\) \['extra'\] that the 'speculators' layout does not define")
    refused(lambda: import_dflash(retensor(spec, extra=None, **{"layers.1.self_attn.q_norm.weight": torch.ones(8)})),
            r"layers.1.self_attn.q_norm.weight has shape \(8,\), the config implies \(16,\)")
    refused(lambda: import_dflash(retensor(spec, **{"fc.weight": torch.ones(64, 128)})),
            r"fc.weight has shape \(64, 128\), but 3 feature layer\(s\)")
    (spec / "model.safetensors").write_bytes(b"\x10\x00")
    refused(lambda: import_dflash(spec), "is corrupt or truncated")


def test_depth_and_layers_come_from_the_folder_or_keywords(exports):
    zlab = exports["z-lab"]
    refused(lambda: import_dflash(zlab, num_target_layers=5), "says num_target_layers=4 but num_target_layers=5")
    refused(lambda: import_dflash(zlab, feature_layers=[1, 2]), r"names feature layers \[1, 2, 3\] .* feature_layers")
    rewrite(zlab, num_target_layers=None, headway=None)
    refused(lambda: import_dflash(zlab), "pass num_target_layers=")
    assert import_dflash(zlab, num_target_layers=4).config.num_target_layers == 4
    rewrite(zlab, num_target_layers=2)
    refused(lambda: import_dflash(zlab), r"feature layers \[1, 2, 3\] has ids \[3\] outside the target's depth")


def test_eagle_and_dflash_folders_are_not_each_other(tiny, exports, tmp_path):
    spec, zlab = exports["speculators"], exports["z-lab"]
    refused(lambda: import_eagle(spec, version=3), r"speculators 'dflash' model; headway's EAGLE importer .* load_any")
    refused(lambda: load_any(spec, "sglang"), "speculators 'dflash' model")
    refused(lambda: load_any(zlab, "eagle"), r"architectures \['DFlashDraftModel'\] are not an EAGLE-1")
    refused(lambda: import_dflash(zlab, "speculators"), "holds the 'z-lab' DFlash layout but fmt='speculators'")
    target, _ = tiny
    eagle3 = export_quietly(eagle_head(target, 3), tmp_path / "e3", "speculators")
    refused(lambda: import_dflash(eagle3), "is a speculators 'eagle3' model, not a DFlash drafter")
    refused(lambda: load_any(eagle3, "z-lab"), "is a speculators 'eagle3' model, not a DFlash drafter")
    from headway.heads.peagle import PEagleHead

    peagle = export_quietly(PEagleHead.from_target(target, parallel_depths=3), tmp_path / "p", "speculators")
    refused(lambda: import_dflash(peagle), "is a speculators 'peagle' model, not a DFlash drafter")
    assert detect_format(eagle3) == detect_format(peagle) == "speculators"  # still the EAGLE family's
    refused(lambda: import_dflash(saved(dflash_head(target), tmp_path / "own")), "is headway's own format")
