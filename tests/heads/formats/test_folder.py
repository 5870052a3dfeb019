"""What every layout's reader and writer share (headway.heads.formats.folder): folders written whole and
moved into place, config.json and safetensors keys read with one-line errors, tensors checked strictly."""

import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.heads.formats.folder import (check_tensors, dtype_name, local_model_config, open_folder, pick_field,
                                          read_config, read_keys, text_config, write_folder)

TENSORS = {"fc.weight": torch.arange(6.0).view(2, 3), "norm.weight": torch.ones(2)}


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_a_folder_is_written_whole_readable_by_others(tmp_path, umask_022):
    out = write_folder(tmp_path / "out", {"model_type": "llama"}, TENSORS, overwrite=False)
    assert out == tmp_path / "out" and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text()) == {"model_type": "llama"}
    back = load_file(str(out / "model.safetensors"))
    assert back.keys() == TENSORS.keys() and all(torch.equal(back[k], TENSORS[k]) for k in TENSORS)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [out, *out.iterdir()]}
    assert modes == {"out": 0o755, "config.json": 0o644, "model.safetensors": 0o644}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left beside it


def test_a_non_empty_folder_is_replaced_only_with_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(ValueError, match=r"out is not empty; choose another folder or pass overwrite=True"):
        write_folder(out, {}, TENSORS, overwrite=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(ValueError, match=r"out holds files but no drafter \(keep.txt\); overwrite replaces"):
        write_folder(out, {}, TENSORS, overwrite=True)  # not a drafter's folder: never replaced
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    write_folder(out, {"a": 0}, TENSORS, overwrite=False)
    write_folder(out, {"a": 1}, TENSORS, overwrite=True)  # a drafter's folder: replaced
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text()) == {"a": 1}
    (out / "run_config.json").write_text("{}")  # a training run's folder: its drafter beside the run's state
    with pytest.raises(ValueError, match=r"out holds a training run \(run_config.json, checkpoints\)"):
        write_folder(out, {"a": 2}, TENSORS, overwrite=True)
    assert json.loads((out / "config.json").read_text()) == {"a": 1}
    (out / "run_config.json").unlink()
    (tmp_path / "empty").mkdir()
    write_folder(tmp_path / "empty", {}, TENSORS, overwrite=False)  # an empty folder is no one's data
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="file exists and is not a folder; choose another output folder"):
        write_folder(tmp_path / "file", {}, TENSORS, overwrite=True)
    with pytest.raises(ValueError, match="sub lies inside .*file, which is a file; choose another output folder"):
        write_folder(tmp_path / "file" / "sub", {}, TENSORS, overwrite=False)


def test_torch_weights_load_without_unpickling_code(tmp_path):
    view = torch.arange(8.0)[::2]  # not contiguous: written as its own tensor
    out = write_folder(tmp_path / "pt", {}, {"w": view}, overwrite=False, weights_name="weights.pt")
    back = torch.load(out / "weights.pt", weights_only=True)
    assert type(back) is dict and torch.equal(back["w"], torch.tensor([0.0, 2.0, 4.0, 6.0]))


def test_configs_and_keys_are_read_with_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="^no EAGLE drafter folder at .*nowhere$"):
        open_folder(tmp_path / "nowhere", "EAGLE drafter")
    assert open_folder(tmp_path, "EAGLE drafter") == tmp_path
    with pytest.raises(ValueError, match="has no config.json: not an EAGLE drafter folder"):
        read_config(tmp_path, "an EAGLE drafter")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json does not hold a JSON object$"):
        read_config(tmp_path, "an EAGLE drafter")
    (tmp_path / "config.json").write_text('{"hidden_size": 2}')
    assert read_config(tmp_path, "an EAGLE drafter") == {"hidden_size": 2}
    with pytest.raises(ValueError, match="has no model.safetensors; headway reads safetensors weights only"):
        read_keys(tmp_path)
    save_file(TENSORS, str(tmp_path / "model.safetensors"))
    assert read_keys(tmp_path) == {"fc.weight", "norm.weight"}
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(ValueError, match=r"model.safetensors is corrupt or truncated \(") as err:
        read_keys(tmp_path)
    assert "\n" not in str(err.value)


def test_what_the_folder_states_wins_over_a_keyword(tmp_path):
    path = tmp_path / "config.json"
    assert pick_field(path, "num_target_layers", 32, None) == 32
    assert pick_field(path, "num_target_layers", None, 32) == 32
    assert pick_field(path, "num_target_layers", 32, 32) == 32
    assert pick_field(path, "num_target_layers", None, None) is None
    with pytest.raises(ValueError, match=r"config.json says num_target_layers=32 but num_target_layers=30 was passed; "
                                         r"drop the keyword or fix the folder"):
        pick_field(path, "num_target_layers", 32, 30)


def test_tensors_are_checked_against_the_layout(tmp_path):
    expected = {"fc.weight": (2, 3), "norm.weight": (2,)}
    check_tensors(tmp_path, "sglang", TENSORS, expected)
    check_tensors(tmp_path, "sglang", {**TENSORS, "d2t": torch.zeros(2)}, expected, optional={"d2t"})
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) \['norm.weight'\] that the 'sglang' layout requires"):
        check_tensors(tmp_path, "sglang", {"fc.weight": TENSORS["fc.weight"]}, expected)
    with pytest.raises(ValueError, match=r"has tensor\(s\) \['extra'\] that the 'sglang' layout does not define; "
                                         r"headway will not drop weights silently"):
        check_tensors(tmp_path, "sglang", {**TENSORS, "extra": torch.zeros(1)}, expected)
    with pytest.raises(ValueError, match=r"model.safetensors: fc.weight has shape \(2, 3\), the config implies "
                                         r"\(3, 2\)"):
        check_tensors(tmp_path, "sglang", TENSORS, {**expected, "fc.weight": (3, 2)})


def test_local_model_configs_and_their_language_part(tmp_path):
    assert local_model_config(None) is None and local_model_config("someorg/model") is None
    assert local_model_config(str(tmp_path)) is None  # a folder without config.json
    (tmp_path / "config.json").write_text("{broken")
    assert local_model_config(str(tmp_path)) is None
    (tmp_path / "config.json").write_text("[1]")
    assert local_model_config(str(tmp_path)) is None
    (tmp_path / "config.json").write_text('{"architectures": ["LlavaForConditionalGeneration"], '
                                          '"text_config": {"vocab_size": 32064}}')
    config = local_model_config(str(tmp_path))
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert text_config(config) == {"vocab_size": 32064}
    assert text_config({"vocab_size": 218}) == {"vocab_size": 218} and text_config(None) == {}
    assert text_config({"text_config": "odd", "vocab_size": 5}) == {"text_config": "odd", "vocab_size": 5}
    assert (dtype_name(torch.bfloat16), dtype_name(torch.float32)) == ("bfloat16", "float32")
