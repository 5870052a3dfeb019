"""Run configs: overrides are typed, bad keys and values are refused by their key
(the command-line flags: test_common.py; DeepSpeed configs: test_accelerator.py; every shipped config
file: tests/test_configs.py)."""

from pathlib import Path

import pytest

from headway.train.config import ConfigError, load_config
from headway.train.medusa import MedusaRunConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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
    path.write_text("model: x\ntrain:\n  lr: 1.0e-3\n  epochs: 2\n  lr: 2.0e-3\n")  # YAML keeps the last: refused
    with pytest.raises(ConfigError, match=r"^'lr' is set twice in one section \(line 5 of .*bad.yaml\); keep one$"):
        load_config(MedusaRunConfig, path)
    path.write_text("model: x\ndata:\n  source: null\n")  # a null where a string goes (it became 'None')
    with pytest.raises(ConfigError, match="^data.source: expected a string, got null$"):
        load_config(MedusaRunConfig, path)


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
