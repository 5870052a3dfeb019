"""End-to-end Medusa-1 training on the tiny config: learning, export, resume, bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.train.train_utils import kill_and_resume, two_process_cpu_run

from headway.heads import MedusaHeads, load_drafter
from headway.train.config import load_config
from headway.train.medusa import MedusaRunConfig, train

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "medusa" / "tiny.yaml"


def tiny_cfg(out, *overrides):
    return load_config(MedusaRunConfig, TINY, [f"train.output_dir={out}", *overrides])


def _metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_tiny_training_learns_and_exports(tmp_path):
    out = tmp_path / "run"
    final = train(tiny_cfg(out))
    evals = [m for m in _metrics(out) if "eval/head0/loss" in m]
    before, after = evals[0], evals[-1]
    assert before["step"] == 0 and after["step"] > 0
    for k in range(3):  # held-out loss falls clearly for every head
        assert after[f"eval/head{k}/loss"] < 0.6 * before[f"eval/head{k}/loss"], (before, after)
        assert after[f"eval/head{k}/top1"] > before[f"eval/head{k}/top1"] + 0.1
        assert final[f"head{k}/top5"] >= final[f"head{k}/top1"]
    # the export is a loadable drafter with a model card and the metrics
    heads = load_drafter(out)
    assert isinstance(heads, MedusaHeads) and heads.config.num_heads == 3
    assert heads.config.base_model_name_or_path == "tiny-random-llama"
    assert "head0/top1" in (out / "README.md").read_text()
    assert json.loads((out / "eval_metrics.json").read_text()) == final
    assert list((out / "headway").rglob("events.out.tfevents*")), "TensorBoard events were not written"
    assert any(m.get("tokens_per_s", 0) > 0 for m in _metrics(out))


def _launch(out, *overrides, module=True):
    cmd = [sys.executable, "-m", "headway.train.medusa"] if module else [sys.executable, str(ROOT / "train" / "medusa.py")]
    cmd += ["--config", str(TINY), f"train.output_dir={out}", "train.trackers=[]", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # kill-and-resume in every distributed mode: tests/train/test_distributed.py (slow too)
def test_kill_and_resume_equals_uninterrupted(tmp_path):
    """SIGKILL mid-run, rerun the same command: final weights equal an uninterrupted run's."""
    ref, out = kill_and_resume(_launch, tmp_path, ["train.epochs=6", "train.save_every=10"], "step-0000030")
    a, b = load_file(str(ref / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # metrics were not duplicated by the rerun
    steps_logged = [m["step"] for m in _metrics(out) if "loss" in m]
    assert steps_logged == sorted(set(steps_logged))


@pytest.mark.slow  # launches two training processes
@pytest.mark.multiprocess
def test_two_process_cpu_ddp_stays_in_sync(tmp_path):
    _, info = two_process_cpu_run(ROOT / "train" / "medusa.py", TINY, tmp_path / "ddp", "train.max_steps=12",
                                  "train.batch_size=8")
    rank0 = info["fingerprints"][0]
    # and the parameters actually moved from their initialisation
    assert any(abs(v) > 0 for v in rank0)


def test_a_stop_inside_a_log_window_resumes_its_metrics_and_the_folder_spelled_otherwise(tmp_path, monkeypatch):
    """A run stopped after a checkpoint taken inside a log window (save_every 4, log_every 5): the rerun's first log
    line averages the same steps as an uninterrupted run's (the window's counts go with the checkpoint), and it
    resumes with the folder named by an absolute path where the first run had a relative one."""
    import headway.train.loop as loop

    args = ["train.max_steps=6", "train.save_every=4", "train.log_every=5", "train.trackers=[]"]
    train(tiny_cfg(tmp_path / "ref", *args))
    real = loop._save

    def save_then_stop(*a, **kw):
        real(*a, **kw)
        raise RuntimeError("stopped after the checkpoint")

    monkeypatch.setattr(loop, "_save", save_then_stop)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="stopped"):
        train(tiny_cfg(Path("run"), *args))
    monkeypatch.setattr(loop, "_save", real)
    train(tiny_cfg(tmp_path / "run", *args))  # the same folder, spelled absolute
    logged = [{k: v for k, v in m.items() if k.startswith("train/")} for m in _metrics(tmp_path / "run") if "loss" in m]
    want = [{k: v for k, v in m.items() if k.startswith("train/")} for m in _metrics(tmp_path / "ref") if "loss" in m]
    assert logged == want and len(want) == 2 and want[0]


def test_a_kill_while_writing_the_first_run_config_or_the_finished_mark(tmp_path):
    """A rerun after a kill mid-way through writing run_config.json (its atomic write's temporary file left) starts
    the run; a finished run's eval_metrics.json cut by a kill (an older, non-atomic write) makes the rerun export
    again from the newest checkpoint, not fail on the JSON."""
    out = tmp_path / "run"
    out.mkdir()
    (out / ".run_config.json.k3x9").write_text('{"mod')
    args = ["train.max_steps=4", "train.save_every=2", "train.trackers=[]"]
    done = train(tiny_cfg(out, *args))
    (out / "eval_metrics.json").write_text(json.dumps(done)[:20])
    again = train(tiny_cfg(out, *args))
    assert again == done and json.loads((out / "eval_metrics.json").read_text()) == done


def test_output_dir_with_another_run_is_refused(tmp_path):
    out = tmp_path / "run"
    train(tiny_cfg(out, "train.max_steps=3", "train.trackers=[]"))
    with pytest.raises(ValueError, match="different run.*overwrite=true"):
        train(tiny_cfg(out, "train.max_steps=3", "train.trackers=[]", "train.lr=1e-2"))
    train(tiny_cfg(out, "train.max_steps=3", "train.trackers=[]", "train.lr=1e-2", "train.overwrite=true"))
    assert json.loads((out / "run_config.json").read_text())["train"]["lr"] == 1e-2
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        train(tiny_cfg(stray, "train.max_steps=3", "train.trackers=[]"))


def test_empty_data_and_not_a_causal_lm(tmp_path, monkeypatch):
    import huggingface_hub.constants

    # the Hub id below is looked up offline (this machine has no Hub; online it is a quick 404, offline
    # without this, ~25 s of connection retries)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="no training examples"):
        train(tiny_cfg(tmp_path / "a", f"data.source={empty}", "train.trackers=[]"))
    from transformers import ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(tmp_path / "vit")
    with pytest.raises(ValueError, match="not a causal language model"):
        train(tiny_cfg(tmp_path / "b", f"model={tmp_path / 'vit'}", "train.trackers=[]"))
    with pytest.raises(FileNotFoundError, match="no model folder at"):
        train(tiny_cfg(tmp_path / "c", f"model={tmp_path / 'nothing-here'}", "train.trackers=[]"))
    with pytest.raises(ValueError, match="cannot load a model config"):
        train(tiny_cfg(tmp_path / "d", "model=no-such-org/no-such-model", "train.trackers=[]"))


def test_cli_errors_are_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "headway.train.medusa", "--config", str(TINY), "train.bogus=1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "unknown config key 'train.bogus'" in res.stderr
    assert "Traceback" not in res.stderr


def test_training_on_cached_features_matches_online(tmp_path, monkeypatch):
    """Features cached to safetensors shards give the same training as online features."""
    from headway.heads.target import load_target
    from headway.train.data import build_datasets
    import headway.train.medusa as medusa_mod
    from headway.train.features import cache_features, feature_fingerprint

    cfg = tiny_cfg(tmp_path / "online", "train.max_steps=6", "train.trackers=[]")
    target, tok = load_target(cfg.model)
    tr, ho = build_datasets(cfg.data, tok, cfg.model)
    import dataclasses

    meta = {"model": cfg.model, "data": dataclasses.asdict(cfg.data)}
    fp = feature_fingerprint(target, tok, [target.config.num_hidden_layers])
    cache_features(target, tr, tmp_path / "feats" / "train", meta=meta, shard_size=100, dtype=torch.float32,
                   fingerprint=fp)
    cache_features(target, ho, tmp_path / "feats" / "heldout", meta=meta, dtype=torch.float32, fingerprint=fp)
    online = train(cfg)

    def no_online(*args, **kwargs):
        raise AssertionError("a run on cached features ran the target")

    monkeypatch.setattr(medusa_mod, "last_hidden_state", no_online)
    cached = train(tiny_cfg(tmp_path / "cached", "train.max_steps=6", "train.trackers=[]",
                            f"features={tmp_path / 'feats'}"))
    for k, v in online.items():
        assert cached[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    with pytest.raises(ValueError, match="recreate the cache"):
        train(tiny_cfg(tmp_path / "bad", "train.max_steps=2", "train.trackers=[]", "data.max_length=32",
                       f"features={tmp_path / 'feats'}"))


@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_reduced_draft_vocabulary_training(tmp_path, kind):
    """ce learns the data's tokens; kl (loss.kind) the target's own distribution through its lm_head
    rows of the draft vocabulary. The tiny target is random, so its next-token choices are not the
    data's: kl is judged by its held-out loss, the KL to the target's distribution, falling."""
    from headway.train.data import frequent_tokens

    final = train(tiny_cfg(tmp_path / "r", "heads.draft_vocab_size=48", "train.trackers=[]", "train.epochs=2",
                           f"loss.kind={kind}"))
    heads = load_drafter(tmp_path / "r")
    assert heads.config.draft_vocab_size == 48 and heads.lm_heads[0].weight.shape[0] == 48
    evals = [m for m in _metrics(tmp_path / "r") if "eval/head0/loss" in m]
    if kind == "ce":
        assert evals[-1]["eval/head0/top1"] > evals[0]["eval/head0/top1"] + 0.1
        assert 0 < final["head0/top1"] <= 1
    else:
        for k in range(heads.config.num_heads):
            assert evals[-1][f"eval/head{k}/loss"] < 0.6 * evals[0][f"eval/head{k}/loss"], (k, evals[0], evals[-1])
    ex = [{"input_ids": [5, 6, 6, 7, 7, 7], "loss_mask": [1, 1, 1, 1, 1, 0]}]
    assert frequent_tokens(ex, 2, 10) == [6, 7]  # 5 once, 6 and 7 twice each (the last 7 is unmasked)
    assert frequent_tokens(ex, 5, 10) == [6, 7, 5, 0, 1]  # fewer distinct tokens: lowest unused ids fill up
    with pytest.raises(ValueError, match="draft_vocab_size"):
        frequent_tokens(ex, 11, 10)


def test_resume_skips_a_metrics_line_cut_by_a_kill(tmp_path):
    out = tmp_path / "run"
    cfg = ["train.max_steps=4", "train.save_every=2", "train.trackers=[]", "train.log_every=1"]
    train(tiny_cfg(out, *cfg))
    (out / "model.safetensors").unlink()
    (out / "eval_metrics.json").unlink()  # as if killed after the step-2 checkpoint
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.2')
    train(tiny_cfg(out, *cfg))
    steps = [m["step"] for m in _metrics(out) if "loss" in m]
    assert steps == [1, 2, 3, 4]
    assert json.loads((out / "run_config.json").read_text())["num_processes"] == 1
