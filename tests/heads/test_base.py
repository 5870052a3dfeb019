"""What every drafter shares (headway.heads.base): its config's round trip through config.json, the strict
loader's one-line errors (foreign, corrupt, mismatched files), loading by Hub id from the cache, the
checkpoint's precision, and the check against a target's shape."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from headway import __version__
from headway.heads import MedusaConfig, MedusaHeads, load_drafter
from headway.heads.base import (CONFIG_NAME, Drafter, DrafterConfig, check_target_compatible, load_state_strict,
                                read_json, register_drafter, resolve_folder)
from headway.heads.registry import kind_of, kinds, unregister_kind


def test_mismatched_target_names_both_values(tiny_llama, tiny_qwen2):
    target, _ = tiny_llama
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=target.config.vocab_size))
    with pytest.raises(ValueError, match=r"hidden_size 32 .* hidden_size 64"):
        heads.bind_target(target)
    heads = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=1000))
    with pytest.raises(ValueError, match=r"vocab_size 1000 .* vocab_size \d+"):
        heads.bind_target(target)


@pytest.mark.parametrize("given, warned", [
    ("HuggingFaceTB/SmolLM2-135M", False),  # the same model as a Hub id, a local folder, a Hub cache snapshot
    ("/models/smollm2-135m/", False),
    ("/cache/hub/models--HuggingFaceTB--SmolLM2-135M/snapshots/0123abcd", False),
    ("", False),  # a target built from a config names nothing: nothing to compare
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True),  # another model of the same shape
    ("/cache/hub/models--Org--Other-135M/snapshots/0123abcd", True),
])
def test_a_drafter_for_another_target_of_the_same_shape_warns(given, warned, recwarn):
    cfg = DrafterConfig(hidden_size=64, vocab_size=218, base_model_name_or_path="HuggingFaceTB/SmolLM2-135M")
    check_target_compatible(cfg, SimpleNamespace(hidden_size=64, vocab_size=218, _name_or_path=given))
    messages = [str(w.message) for w in recwarn.list if w.category is UserWarning]
    if not warned:
        assert messages == []
        return
    assert messages == [f"this drafter was trained on 'HuggingFaceTB/SmolLM2-135M', not on the target {given!r}; the "
                        "output is still the target's, but expect little speed-up: use a drafter trained for this "
                        "target"]
    with pytest.raises(ValueError, match="hidden_size"):  # a shape mismatch is an error first, not a warning
        check_target_compatible(cfg, SimpleNamespace(hidden_size=32, vocab_size=218, _name_or_path=given))


def test_a_loaded_drafter_warns_when_bound_to_another_model(tiny_llama, tmp_path):
    target, _ = tiny_llama
    before = target.config._name_or_path  # a session fixture: put back
    try:
        target.config._name_or_path = "org/tiny-target"
        MedusaHeads.from_target(target, num_heads=2).save_pretrained(tmp_path)
        loaded = load_drafter(tmp_path)
        assert loaded.config.base_model_name_or_path == "org/tiny-target"
        target.config._name_or_path = "org/other-target"
        with pytest.warns(UserWarning, match=r"trained on 'org/tiny-target', not on the target 'org/other-target'"):
            loaded.check_target(target)
    finally:
        target.config._name_or_path = before


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


def test_bf16_checkpoint_loads_in_bf16(tiny_llama, tmp_path):
    target, _ = tiny_llama
    heads = MedusaHeads.from_target(target, MedusaConfig(num_heads=2)).to(torch.bfloat16)
    heads.save_pretrained(tmp_path / "h")
    loaded = load_drafter(tmp_path / "h")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), loaded.state_dict().values()))


def test_a_config_reads_back_what_it_writes():
    cfg = DrafterConfig(hidden_size=8, vocab_size=10, base_model_name_or_path="org/target")
    data = cfg.to_dict()
    assert data == {"drafter_type": "base", "headway_version": __version__, "hidden_size": 8, "vocab_size": 10,
                    "base_model_name_or_path": "org/target"}
    assert DrafterConfig.from_dict(json.loads(json.dumps(data))) == cfg
    without_target = {k: v for k, v in data.items() if k != "base_model_name_or_path"}  # the one optional key
    assert DrafterConfig.from_dict(without_target) == DrafterConfig(hidden_size=8, vocab_size=10)
    with pytest.raises(ValueError, match=r"^cfg.json describes drafter_type 'medusa', expected 'base'$"):
        DrafterConfig.from_dict({**data, "drafter_type": "medusa"}, source="cfg.json")
    with pytest.raises(ValueError, match=r"^cfg.json: unknown DrafterConfig key\(s\) \['depth'\]; known keys: "
                                         r"\['base_model_name_or_path', 'hidden_size', 'vocab_size'\]$"):
        DrafterConfig.from_dict({**data, "depth": 3}, source="cfg.json")
    with pytest.raises(ValueError, match=r"^cfg.json lacks DrafterConfig key\(s\) \['hidden_size'\]; re-export"):
        DrafterConfig.from_dict({k: v for k, v in data.items() if k != "hidden_size"}, source="cfg.json")
    with pytest.raises(ValueError, match="hidden_size and vocab_size must be positive, got 0, 10"):
        DrafterConfig(hidden_size=0, vocab_size=10)


def test_the_target_check_names_both_sizes():
    cfg = DrafterConfig(hidden_size=64, vocab_size=218)
    check_target_compatible(cfg, SimpleNamespace(hidden_size=64, vocab_size=218))
    check_target_compatible(cfg, SimpleNamespace())  # a config that states neither size: nothing to compare
    with pytest.raises(ValueError, match=r"^drafter hidden_size 64 does not match the target's hidden_size 576; "
                                         r"train or load heads made for this target$"):
        check_target_compatible(cfg, SimpleNamespace(hidden_size=576, vocab_size=218))
    with pytest.raises(ValueError, match=r"^drafter vocab_size 218 does not match the target's vocab_size 49152; "):
        check_target_compatible(cfg, SimpleNamespace(hidden_size=64, vocab_size=49152))
    multimodal = SimpleNamespace(hidden_size=1024, get_text_config=lambda: SimpleNamespace(hidden_size=64,
                                                                                          vocab_size=218))
    check_target_compatible(cfg, multimodal)  # the language part's sizes are the ones compared


def test_folders_without_a_config_or_with_a_broken_one(tmp_path):
    with pytest.raises(ValueError, match=r"has no config.json: not a headway drafter folder$"):
        read_json(tmp_path, "a headway drafter")
    (tmp_path / CONFIG_NAME).write_text('{"hidden_size": 8,\n "vocab_size": }')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON \(Expecting value at line 2\); fix it$"):
        read_json(tmp_path, "a headway drafter", "; fix it")
    (tmp_path / CONFIG_NAME).write_text('{"hidden_size": 8}')
    assert read_json(tmp_path, "a headway drafter") == {"hidden_size": 8}
    assert resolve_folder(tmp_path) == tmp_path
    with pytest.raises(ValueError, match=r"revision='v1' applies to Hub repo ids, but .* is a local folder"):
        resolve_folder(tmp_path, revision="v1")
    for missing in ("./nowhere", str(tmp_path / CONFIG_NAME)):  # a path, not a Hub id; a file, not a folder
        with pytest.raises(FileNotFoundError, match="^no drafter folder at "):
            resolve_folder(missing)


def test_strict_loading_names_the_wrong_tensor():
    module = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"^w.safetensors: weight has shape \(2, 2\), config expects \(2, 3\)$"):
        load_state_strict(module, {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, "w.safetensors")
    with pytest.raises(ValueError, match=r"^w does not match the config: missing \['bias'\], unexpected \['scale'\]$"):
        load_state_strict(module, {"weight": torch.zeros(2, 3), "scale": torch.zeros(1)}, "w")
    load_state_strict(module, {"weight": torch.ones(2, 3), "bias": torch.full((2,), 2.0)}, "w")
    assert torch.equal(module.weight, torch.ones(2, 3)) and torch.equal(module.bias, torch.full((2,), 2.0))


@dataclasses.dataclass
class ScaleConfig(DrafterConfig):
    drafter_type_name = "test-scale"


class Scale(Drafter):
    """A drafter of one vector, defined here: registered with register_drafter alone."""

    config_class = ScaleConfig

    def __init__(self, config: ScaleConfig):
        super().__init__(config)
        self.scale = torch.nn.Parameter(torch.arange(float(config.hidden_size)))


def test_register_drafter_makes_a_class_loadable(tmp_path):
    try:
        assert register_drafter(Scale) is Scale
        register_drafter(Scale)  # a second call adds nothing
        assert [k.name for k in kinds()].count("test-scale") == 1
        Scale(ScaleConfig(hidden_size=4, vocab_size=8)).save_pretrained(tmp_path)
        assert json.loads((tmp_path / CONFIG_NAME).read_text())["drafter_type"] == "test-scale"
        loaded = load_drafter(tmp_path)
        assert type(loaded) is Scale and loaded.config == ScaleConfig(hidden_size=4, vocab_size=8)
        assert torch.equal(loaded.scale, torch.arange(4.0)) and kind_of(loaded).title == "Scale"
    finally:
        unregister_kind("test-scale")


@pytest.mark.parametrize("change", [{"rope_scaling": {"rope_type": "bogus"}}, {"hidden_act": "gelu_bogus"},
                                    {"vocab_size": None}, {"hidden_size": "64"}])
def test_config_values_that_cannot_build_the_drafter(tiny_llama, tmp_path, change):
    """load_drafter on a config.json whose values build no drafter: one ValueError line naming the file and the fix."""
    import logging

    from headway.heads import EagleHead

    target, _ = tiny_llama
    EagleHead.from_target(target, version=3).save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**config, **change}))
    logger = logging.getLogger("transformers.modeling_rope_utils")  # it warns of the bogus type first
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with pytest.raises(ValueError, match=r"config.json: a setting cannot build the drafter \(\w+: .*re-export") as err:
            load_drafter(tmp_path)
    finally:
        logger.setLevel(level)
    assert "\n" not in str(err.value)


def test_check_saved_refuses_what_load_drafter_refuses_without_reading_weights(tiny_llama, tmp_path, monkeypatch):
    """check_saved (headway info) builds every kind on the meta device and compares the safetensors header."""
    import warnings

    from headway.heads import base

    target, _ = tiny_llama
    for kind in kinds():
        folder = tmp_path / kind.name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # EAGLE-3's layers of the 2-layer tiny target warn
            kind.head.from_target(target).save_pretrained(folder)
        base.check_saved(folder)
    folder = tmp_path / "medusa"
    cfg = json.loads((folder / CONFIG_NAME).read_text())
    (folder / CONFIG_NAME).write_text(json.dumps({**cfg, "num_heads": cfg["num_heads"] + 1}))
    monkeypatch.setattr(base, "load_file", lambda *a, **k: pytest.fail("check_saved read the weights"))
    with pytest.raises(ValueError, match=r"model.safetensors does not match the config: missing \['blocks"):
        base.check_saved(folder)
