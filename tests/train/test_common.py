"""What every training method shares: the command line (--config by name, --model, --data, overrides
anywhere), the checks before anything loads, the one-line error exit, the reduced draft vocabulary."""

from pathlib import Path

import pytest

from headway.train import common
from headway.train.config import ConfigError
from headway.train.medusa import MedusaRunConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EXAMPLE = "configs/medusa/smollm2-135m.yaml"


def parse(argv):
    return common.parse_run_args(MedusaRunConfig, "Train Medusa-1 heads.", EXAMPLE, argv)


def test_model_and_data_flags():
    from headway.train.medusa import parse_args

    cfg = parse_args(["--config", str(CONFIGS / "medusa" / "tiny.yaml"), "--model", "org/model", "--data", "x.jsonl",
                      "train.lr=0.5"])
    assert (cfg.model, cfg.data.source, cfg.train.lr) == ("org/model", "x.jsonl", 0.5)
    # overrides wherever they stand (python -m headway.train.medusa, accelerate launch train/medusa.py)
    cfg = parse_args(["train.lr=0.5", "--config", str(CONFIGS / "medusa" / "tiny.yaml"), "--model", "org/model",
                      "features=feats", "--data", "x.jsonl", "train.lr=0.25"])
    assert (cfg.model, cfg.features, cfg.data.source, cfg.train.lr) == ("org/model", "feats", "x.jsonl", 0.25)


def test_a_shipped_config_is_found_by_its_name():
    by_name = parse(["--config", "tiny", "train.output_dir=x"])
    assert by_name == parse(["--config", "medusa/tiny.yaml", "train.output_dir=x"])
    assert by_name == parse(["--config", str(CONFIGS / "medusa" / "tiny.yaml"), "train.output_dir=x"])
    assert (by_name.model, by_name.heads.num_heads, by_name.train.output_dir) == ("tiny-random-llama", 3, "x")
    assert parse([]).model == MedusaRunConfig().model  # no --config: the dataclass defaults
    with pytest.raises(FileNotFoundError, match="shipped medusa configs: .*tiny"):
        parse(["--config", "no-such-config"])
    with pytest.raises(ConfigError, match="unknown config key 'heads.bogus'"):
        parse(["--config", "tiny", "heads.bogus=1"])


def test_run_main_turns_bad_input_into_one_line_and_status_2(tmp_path, capsys):
    def never(cfg):
        raise AssertionError("train ran on bad input")

    for argv in (["--config", "tiny", "train.bogus=1"], ["--config", "no-such-config"],
                 ["--config", "tiny", f"features={tmp_path / 'missing'}", f"train.output_dir={tmp_path / 'a'}"]):
        with pytest.raises(SystemExit) as exc:
            common.run_main(never, parse, argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), (argv, err)

    def fails(cfg):
        raise ValueError("the data ran out")

    with pytest.raises(SystemExit) as exc:
        common.run_main(fails, parse, ["--config", "tiny", f"train.output_dir={tmp_path / 'b'}"])
    assert exc.value.code == 2 and capsys.readouterr().err == "error: the data ran out\n"
    seen = []
    result = common.run_main(lambda cfg: seen.append(cfg) or {"head0/top1": 0.5}, parse,
                             ["--config", "tiny", f"train.output_dir={tmp_path / 'c'}"])
    assert result == {"head0/top1": 0.5} and seen[0].train.output_dir == str(tmp_path / "c")

    def interrupted(cfg):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exc:  # Ctrl-C: how to go on, in one line
        common.run_main(interrupted, parse, ["--config", "tiny", f"train.output_dir={tmp_path / 'd'}"])
    err = capsys.readouterr().err
    assert exc.value.code == 130 and err.startswith(f"interrupted: run the same command to resume {tmp_path / 'd'}")
    with pytest.raises(SystemExit):  # never the advice to rerun with train.overwrite=true: it would empty the folder
        common.run_main(interrupted, parse, ["--config", "tiny", f"train.output_dir={tmp_path / 'e'}",
                                             "train.overwrite=true"])
    assert "run the same command without train.overwrite=true to resume" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no checkpoints: nothing to resume
        common.run_main(interrupted, parse, ["--config", "tiny", f"train.output_dir={tmp_path / 'f'}",
                                             "train.save_every=0"])
    assert capsys.readouterr().err == "interrupted\n"


def test_check_run_refuses_before_anything_is_written(tmp_path):
    cfg = parse(["--config", "tiny", f"train.output_dir={tmp_path / 'run'}"])
    common.check_run(cfg)
    assert not (tmp_path / "run").exists()
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        common.check_run(parse(["--config", "tiny", f"train.output_dir={stray}"]))
    with pytest.raises(FileNotFoundError, match=r"features=.*missing: no such folder; pass features=online"):
        common.check_run(parse(["--config", "tiny", f"train.output_dir={tmp_path / 'run'}",
                                f"features={tmp_path / 'missing'}"]))
    (tmp_path / "feats" / "train").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="not a feature cache"):
        common.check_run(parse(["--config", "tiny", f"train.output_dir={tmp_path / 'run'}",
                                f"features={tmp_path / 'feats'}"]))
    with pytest.raises(FileNotFoundError, match="data.source: no data file at nope.jsonl"):
        common.check_run(parse(["--config", "tiny", f"train.output_dir={tmp_path / 'run'}", "--data", "nope.jsonl"]))
    assert not (tmp_path / "run").exists()


def test_draft_vocabulary_is_the_most_frequent_answer_tokens(tiny_llama):
    target, tokenizer = tiny_llama
    data = [{"input_ids": [5, 6, 6, 7, 7, 7, 9], "loss_mask": [0, 1, 1, 1, 1, 1, 0]}]
    setup = common.RunSetup(acc=None, target=target, tokenizer=tokenizer, train_data=data, eval_data=[], cached=False)
    assert common.draft_vocabulary(setup, None) is None and common.draft_vocabulary(setup, 0) is None
    assert common.draft_vocabulary(setup, 2) == [7, 6]  # 5 and 9 are not answer tokens
    assert common.draft_vocabulary(setup, 4) == [7, 6, 0, 1]


def test_max_length_past_the_targets_context_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    from headway.train.data import DataConfig
    from headway.train.loop import TrainConfig

    folder = tmp_path / "short-target"
    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=32, max_position_embeddings=64).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"\x00" * 10)  # corrupt: the weights must never be read

    def no_weights(*args, **kwargs):
        raise AssertionError("the target's weights loaded before the context check")

    monkeypatch.setattr(common, "load_target", no_weights)
    monkeypatch.setattr(common, "make_accelerator", no_weights)
    with pytest.raises(ValueError, match=r"data.max_length=128 exceeds the target's context \(64 positions"):
        common.setup_run(str(folder), "online", DataConfig(max_length=128), TrainConfig())


def test_an_unreadable_target_config_leaves_the_context_check_to_after_the_load(monkeypatch):
    monkeypatch.setattr(common, "resolve_model_path", lambda name: "/no/such/model/folder")
    assert common.target_config("anything") is None
