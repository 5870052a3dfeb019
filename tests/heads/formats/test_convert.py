"""The converter registry (headway.heads.formats.convert): dispatch between headway's own format and the
layouts, what a layout cannot hold, folders that are not drafters, targets that do not fit, overwriting."""

import json

import pytest
from torch import nn

from headway.heads import load_drafter
from headway.heads.formats import convert as convert_module
from headway.heads.formats.convert import FORMATS, convert, detect_format, export_any, load_any
from tests.heads.formats.helpers import (DRAFT_IDS, eagle_head, file_names, medusa_heads, one_line, quiet, saved,
                                         same_tensors)


def test_headway_to_headway(tiny_llama, tmp_path):
    target, _ = tiny_llama
    heads = medusa_heads(target)
    out = convert(saved(heads, tmp_path / "src"), tmp_path / "copy", "headway")
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "src" / "config.json").read_text())
    same_tensors(load_drafter(out), heads)


# --- refusals and bad input -------------------------------------------------------------------------

def test_unknown_formats(tiny_llama, tmp_path):
    target, _ = tiny_llama
    src = saved(medusa_heads(target), tmp_path / "src")
    for call in (lambda: convert(src, tmp_path / "o", "medusa-v3"), lambda: load_any(src, "vllm"),
                 lambda: convert(src, tmp_path / "o", "headway", fmt_from="official")):
        with pytest.raises(ValueError, match=r"unknown .*format .*; choose one of \['headway', 'medusa-v0.1'") as err:
            call()
        one_line(err)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['speculative_token'\]"):
        convert(src, tmp_path / "o", "vllm-medusa", speculative_token=3)
    assert FORMATS == ("headway", "medusa-v0.1", "medusa-v2", "vllm-medusa", "z-lab", "eagle", "sglang",
                       "speculators")


def test_drafter_kind_the_format_cannot_hold(tiny_llama, tmp_path):
    target, _ = tiny_llama
    medusa = saved(medusa_heads(target), tmp_path / "m")
    for fmt in ("sglang", "eagle", "speculators"):
        with pytest.raises(ValueError, match=f"Medusa drafters cannot be written as '{fmt}'.*'vllm-medusa'") as err:
            convert(medusa, tmp_path / "o", fmt)
        one_line(err)
    eagle3 = saved(eagle_head(target, 3), tmp_path / "e")
    with pytest.raises(ValueError, match=r"EAGLE-3 drafters cannot be written as 'vllm-medusa' \(vLLM MedusaModel\)"):
        convert(eagle3, tmp_path / "o", "vllm-medusa")
    with pytest.raises(ValueError, match=r"EAGLE-3 drafters cannot be written as 'eagle' \(EAGLE-1\).*'sglang', 'speculators'\]"):
        convert(eagle3, tmp_path / "o", "eagle")
    eagle1 = saved(eagle_head(target, 1), tmp_path / "e1")
    with pytest.raises(ValueError, match=r"EAGLE-1/2 drafters cannot be written as 'sglang'.*\['headway', 'eagle'\]"):
        convert(eagle1, tmp_path / "o", "sglang")
    assert not (tmp_path / "o").exists()


def test_reduced_vocabulary_in_a_format_without_one(tiny_llama, tmp_path):
    target, _ = tiny_llama
    reduced = saved(medusa_heads(target, draft_vocab_size=40, draft_tokens=DRAFT_IDS), tmp_path / "m")
    for fmt in ("medusa-v0.1", "medusa-v2"):
        with pytest.raises(ValueError, match=f"the '{fmt}' layout has no reduced draft vocabulary .* 40 of 218") as err:
            convert(reduced, tmp_path / "o", fmt, target=target)
        one_line(err)
    eagle1 = saved(eagle_head(target, 1, draft_vocab_size=40, draft_tokens=DRAFT_IDS), tmp_path / "e")
    with pytest.raises(ValueError, match="'eagle' layout has no reduced draft vocabulary.*widen_vocab"):
        convert(eagle1, tmp_path / "o", "eagle")
    back = load_any(convert(eagle1, tmp_path / "o", "eagle", widen_vocab=True))
    assert back.config.draft_vocab_size is None


def test_folders_that_are_not_drafter_checkpoints(tiny_llama, tmp_path):
    target, _ = tiny_llama
    target.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"not a drafter checkpoint headway reads \(found config "
                                         r"\{'architectures': \['LlamaForCausalLM'\], 'model_type': 'llama'\}") as err:
        detect_format(tmp_path / "model")
    one_line(err)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"no config.json, so it is not a drafter checkpoint \(found \['notes.txt'\]"):
        convert(tmp_path / "empty", tmp_path / "o", "headway")
    with pytest.raises(ValueError, match=r"not a drafter checkpoint folder \(found nothing there\)"):
        load_any(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"not a drafter checkpoint folder \(found a file there\)"):
        detect_format(tmp_path / "empty" / "notes.txt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 1}))
    with pytest.raises(ValueError, match="neither medusa_lm_head.pt nor medusa_lm_head.safetensors"):
        detect_format(tmp_path / "full")
    sglang = quiet(convert, saved(eagle_head(target, 3), tmp_path / "e"), tmp_path / "sg", "sglang")
    weights = next(sglang.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:300])  # cut short: its layout cannot be told
    with pytest.raises(ValueError, match=rf"{weights.name} is corrupt or truncated \(.*\)") as err:
        detect_format(sglang)
    one_line(err)


def test_target_that_does_not_fit(tiny_llama, tiny_qwen2, tmp_path):
    target, _ = tiny_llama
    shared = saved(medusa_heads(target, share_lm_head=True), tmp_path / "shared")
    other, _ = tiny_qwen2
    wide = type(other)(type(other.config)(**{**other.config.to_dict(), "vocab_size": 300}))
    with pytest.raises(ValueError, match="vocab_size 218 does not match the target's vocab_size 300"):
        convert(shared, tmp_path / "o", "medusa-v0.1", target=wide)
    with pytest.raises(ValueError, match=r"cannot load the target '.*nowhere' \(") as err:
        convert(shared, tmp_path / "o", "medusa-v0.1", target=str(tmp_path / "nowhere"))
    one_line(err)
    with pytest.raises(ValueError, match="num_target_layers=2 but num_target_layers=5 was passed"):
        quiet(load_any, quiet(convert, saved(eagle_head(target, 3), tmp_path / "e"), tmp_path / "s", "sglang"),
              num_target_layers=5)


def test_refuses_to_overwrite(tiny_llama, tmp_path):
    target, _ = tiny_llama
    src = saved(medusa_heads(target), tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("user data")
    with pytest.raises(ValueError, match="not empty; .* overwrite=True"):
        convert(src, tmp_path / "out", "medusa-v0.1")
    assert file_names(tmp_path / "out") == ["keep.txt"]
    with pytest.raises(ValueError, match="holds files but no drafter"):  # overwrite replaces a drafter's folder only
        convert(src, tmp_path / "out", "medusa-v0.1", overwrite=True)
    (tmp_path / "out" / "keep.txt").unlink()
    convert(src, tmp_path / "out", "headway")
    convert(src, tmp_path / "out", "medusa-v0.1", overwrite=True)
    assert file_names(tmp_path / "out") == ["config.json", "medusa_lm_head.pt"]
    with pytest.raises(ValueError, match="is the source folder"):
        convert(src, src, "headway", overwrite=True)
    with pytest.raises(ValueError, match="holds the source folder"):  # replacing it would delete the source
        convert(src, tmp_path, "headway", overwrite=True)
    assert file_names(src)
    with pytest.raises(ValueError, match="cannot convert a Linear"):
        export_any(nn.Linear(2, 2), tmp_path / "x", "headway")


def test_the_output_folder_is_refused_before_the_drafter_and_target_load(tmp_path, monkeypatch):
    """A folder convert would refuse to write is named before the (possibly huge) target and the source load."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("user data")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run_config.json").write_text("{}")
    (tmp_path / "run" / "config.json").write_text("{}")
    (tmp_path / "a-file").write_text("mine")

    def never(*args, **kwargs):
        raise AssertionError("loaded before the output folder was checked")

    monkeypatch.setattr(convert_module, "load_any", never)
    cases = [("out", False, "is not empty; .* overwrite=True"), ("out", True, "holds files but no drafter"),
             ("run", True, "holds a training run"), ("a-file", False, "exists and is not a folder"),
             ("a-file/sub", False, "lies inside .*a-file, which is a file")]
    for name, overwrite, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            convert(tmp_path / "missing-src", tmp_path / name, "headway", overwrite=overwrite,
                    target=str(tmp_path / "no-such-target"))
        one_line(err)
    assert file_names(tmp_path / "out") == ["keep.txt"]


# --- the registry itself ----------------------------------------------------------------------------

def test_the_0_1_import_path_still_works():
    """Commands in model cards written by headway 0.1 import the converters from headway.heads.convert."""
    from headway.heads import convert as old

    for name in ("FORMATS", "convert", "detect_format", "export_any", "load_any"):
        assert getattr(old, name) is getattr(convert_module, name), name


def test_formats_follow_the_registered_converters(monkeypatch):
    monkeypatch.setattr(convert_module, "_CONVERTERS", convert_module.converters())  # restored after the test
    assert convert_module.formats() == FORMATS
    assert [c.name for c in convert_module.converters()] == ["headway", "medusa", "dflash", "eagle"]
    toy = convert_module.Converter("toy", {"toy-v1": "a toy layout"}, lambda folder, config: None, None, None)
    assert convert_module.register_converter(toy) is toy
    assert convert_module.formats() == (*FORMATS, "toy-v1")
    with pytest.raises(ValueError, match=r"layout\(s\) \['eagle'\] already belong to another converter"):
        convert_module.register_converter(convert_module.Converter("other", {"eagle": "EAGLE-1"}, None, None, None))
    convert_module.register_converter(convert_module.Converter("toy", {"toy-v2": "renamed"}, toy.detect, None, None))
    assert convert_module.formats() == (*FORMATS, "toy-v2")  # replaced by name, not added
    with pytest.raises(ValueError, match=r"unknown format 'toy-v1'; choose one of \['headway', .*'toy-v2'\]"):
        load_any(".", "toy-v1")
