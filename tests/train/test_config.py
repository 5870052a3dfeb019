from pathlib import Path

import pytest
import yaml

from headway.train.config import ConfigError, load_config
from headway.train.medusa import MedusaRunConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted((CONFIGS / "medusa").glob("*.yaml")), ids=lambda p: p.name)
def test_every_medusa_config_loads(path):
    cfg = load_config(MedusaRunConfig, path)
    assert cfg.heads.num_heads >= 1 and cfg.train.output_dir


@pytest.mark.parametrize("path", sorted((CONFIGS / "eagle").glob("*.yaml")), ids=lambda p: p.name)
def test_every_eagle_config_loads(path):
    from headway.heads.eagle import EagleConfig
    from headway.train.eagle import EagleRunConfig

    cfg = load_config(EagleRunConfig, path)
    assert cfg.eagle.version in (1, 3) and cfg.train.output_dir
    # the drafter config resolves for a target of the configured model's depth (30 for SmolLM2, 2 for tiny)
    depth = 30 if "smollm2" in path.name else 2
    resolved = EagleConfig(**{**vars(cfg.eagle), "num_target_layers": depth})
    assert resolved.feature_layers and resolved.feature_width == resolved.hidden_size * len(resolved.feature_layers)


@pytest.mark.parametrize("path", sorted((CONFIGS / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_every_accelerate_config_loads(path):
    from accelerate.commands.config.config_args import ClusterConfig

    known = set(ClusterConfig.__dataclass_fields__)
    data = yaml.safe_load(path.read_text())
    assert set(data) <= known, f"unknown accelerate keys {set(data) - known}"
    cfg = ClusterConfig.from_yaml_file(str(path))
    assert cfg.num_processes >= 1


def test_every_yaml_under_configs_is_covered():
    covered = {"medusa", "medusa2", "eagle", "accelerate", "trees"}
    for path in CONFIGS.rglob("*.yaml"):
        assert path.relative_to(CONFIGS).parts[0] in covered, f"{path} is not loaded by any test"


def test_overrides_and_types(tmp_path):
    cfg = load_config(MedusaRunConfig, CONFIGS / "medusa" / "tiny.yaml",
                      ["train.lr=1e-4", "heads.num_heads=2", "train.max_steps=7", "loss.weights=[1.0,0.5]",
                       "train.trackers=[]", "heads.share_lm_head=true"])
    assert cfg.train.lr == 1e-4 and cfg.heads.num_heads == 2 and cfg.train.max_steps == 7
    assert cfg.loss.weights == [1.0, 0.5] and cfg.train.trackers == [] and cfg.heads.share_lm_head is True
    assert isinstance(cfg.train.lr, float) and isinstance(cfg.train.max_steps, int)


def test_parse_bool_is_the_one_flag_parser():
    from headway.train.config import parse_bool

    for value, want in [(True, True), (0, False), (1, True), ("Yes", True), (" false ", False), ("0", False)]:
        assert parse_bool(value, "k") is want
    for value in ["maybe", 2, 0.5, None]:
        with pytest.raises(ConfigError, match="k: expected true/false"):
            parse_bool(value, "k")


@pytest.mark.parametrize("override, match", [
    ("train.lrr=1", "train.lrr"),
    ("bogus=1", "bogus"),
    ("train.batch_size=abc", "train.batch_size"),
    ("train.batch_size=1.5", "integer"),
    ("heads.share_lm_head=maybe", "true/false"),
    ("train.mixed_precision=fp8", "mixed_precision"),
    ("noequals", "key=value"),
])
def test_bad_keys_and_values_name_the_problem(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(MedusaRunConfig, CONFIGS / "medusa" / "tiny.yaml", [override])


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: x\ntrain:\n  learning_rate: 1\n")
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config(MedusaRunConfig, path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(MedusaRunConfig, tmp_path / "missing.yaml")


def test_model_and_data_flags():
    from headway.train.medusa import parse_args

    cfg = parse_args(["--config", str(CONFIGS / "medusa" / "tiny.yaml"), "--model", "org/model", "--data", "x.jsonl",
                      "train.lr=0.5"])
    assert (cfg.model, cfg.data.source, cfg.train.lr) == ("org/model", "x.jsonl", 0.5)
    # overrides wherever they stand (python -m headway.train.medusa, accelerate launch train/medusa.py)
    cfg = parse_args(["train.lr=0.5", "--config", str(CONFIGS / "medusa" / "tiny.yaml"), "--model", "org/model",
                      "features=feats", "--data", "x.jsonl", "train.lr=0.25"])
    assert (cfg.model, cfg.features, cfg.data.source, cfg.train.lr) == ("org/model", "feats", "x.jsonl", 0.25)


@pytest.mark.parametrize("override, message", [
    ("train.lr=-1e-3", "train.lr must be a positive number, got -0.001"),
    ("train.lr=0", "train.lr must be a positive number"),
    ("train.weight_decay=-0.1", "train.weight_decay must be >= 0"),
    ("train.betas=[0.9]", "train.betas must be two numbers in [0, 1)"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio must be in [0, 1]"),
    ("train.max_grad_norm=-1", "train.max_grad_norm must be >= 0"),
    ("train.save_every=-5", "train.save_every must be >= 0"),
    ("train.keep_checkpoints=-1", "train.keep_checkpoints must be >= 0"),
    ("train.batch_size=0", "train.batch_size must be >= 1"),
    ("train.output_dir=", "train.output_dir is empty"),
    ("train.trackers=[nope]", "train.trackers: unknown tracker 'nope'"),
    ("loss.chunk_size=-1", "loss.chunk_size must be >= 0"),
    ("loss.weights=[1,2]", "loss.weights has 2 entries for heads.num_heads=3"),
    ("data.source=", "data.source is empty"),
    ("data.max_length=4", "data.max_length=4 is too small"),
])
def test_values_are_refused_by_their_key(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(MedusaRunConfig, CONFIGS / "medusa" / "tiny.yaml", [override])
    assert str(info.value).startswith(message), str(info.value)


def test_interval_and_vocab_bounds():
    with pytest.raises(ConfigError, match="log_every"):
        load_config(MedusaRunConfig, CONFIGS / "medusa" / "tiny.yaml", ["train.log_every=0"])
    # a draft vocabulary larger than the placeholder vocab_size is fine in a run config ...
    cfg = load_config(MedusaRunConfig, CONFIGS / "medusa" / "tiny.yaml", ["heads.draft_vocab_size=64000"])
    assert cfg.heads.draft_vocab_size == 64000
    # ... and refused against the real target when the heads are built
    from headway.heads import MedusaConfig, MedusaHeads

    with pytest.raises(ValueError, match="exceeds the target's vocab_size 300"):
        MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=300, draft_vocab_size=301))


def test_deepspeed_config_is_filled_from_the_run_config_or_refused():
    import json

    from headway.configs import CONFIG_DIR
    from headway.train.loop import TrainConfig
    from headway.train.accelerator import fill_deepspeed_config

    cfg = TrainConfig(batch_size=4, grad_accum=2, max_grad_norm=0.5)
    ds = json.loads((CONFIG_DIR / "deepspeed" / "zero3.json").read_text())
    fill_deepspeed_config(ds, cfg, processes=2, mixed_precision="no")
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"],
            ds["gradient_clipping"]) == (4, 2, 16, 0.5)
    for key, value, name in [("train_micro_batch_size_per_gpu", 8, "train.batch_size"),
                             ("gradient_accumulation_steps", 4, "train.grad_accum"),
                             ("train_batch_size", 64, "processes")]:
        bad = {**json.loads((CONFIG_DIR / "deepspeed" / "zero2.json").read_text()), key: value}
        with pytest.raises(ValueError, match=f"sets {key}={value} .*{name}"):
            fill_deepspeed_config(bad, cfg, processes=2, mixed_precision="no")
    with pytest.raises(ValueError, match="enables bf16 .*train.mixed_precision=bf16"):
        fill_deepspeed_config({"bf16": {"enabled": True}}, cfg, processes=2, mixed_precision="no")
