"""End-to-end EAGLE-1 / EAGLE-3 training on the tiny configs: learning, export, entry points,
kill-and-resume, 2-process CPU DDP, cached features, bad input."""

import dataclasses
import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.train.train_utils import kill_and_resume, two_process_cpu_run

from headway.heads import EagleHead, load_drafter
from headway.heads.target.features import capture_features
from headway.train.config import load_config
from headway.train.eagle import EagleRunConfig, EagleTrainingModule, main, train
from headway.train.batches import pad_batch
from headway.train.losses import summarize

ROOT = Path(__file__).resolve().parents[2]
EAGLE3 = ROOT / "configs" / "eagle" / "eagle3-tiny.yaml"
EAGLE1 = ROOT / "configs" / "eagle" / "eagle1-tiny.yaml"
LAYERS = [0, 1, 2]  # what EAGLE-3 reads on the 2-layer tiny target: its default feature layers, which include L


def tiny_cfg(config, out, *overrides):
    return load_config(EagleRunConfig, config, [f"train.output_dir={out}", *overrides])


def _metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _evals(out):
    return [m for m in _metrics(out) if "eval/step0/top1" in m]


@torch.no_grad()
def _heldout_metrics(head, target, cfg, examples, batch_size):
    """The held-out metrics of an exported drafter, batched as the loop's final evaluation."""
    module = EagleTrainingModule(head, target, cfg.loss).eval()
    totals = {}
    for i in range(0, len(examples), batch_size):
        _, counts = module(pad_batch(examples[i:i + batch_size]))
        for k, v in counts.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return summarize(totals)


@torch.no_grad()
def _greedy_step0_top1(head, target, examples, batch_size):
    """Step 0's top-1 as the docs define it, computed independently of the loss: the share of
    assistant positions where the drafter's greedy proposal (mapped to target ids) is the target's
    own greedy token; a target token outside the draft vocabulary is a miss."""
    hits = total = 0
    for i in range(0, len(examples), batch_size):
        b = pad_batch(examples[i:i + batch_size])
        ids = b["input_ids"]
        feats, logits = capture_features(target, ids, head.config.feature_layers, b["attention_mask"], with_logits=True)
        n = ids.shape[1] - 1  # row t reads f[t] and x[t+1] and proposes x[t+2]
        h = head(ids[:, 1:], head.input_hidden(feats[:, :-1]), torch.arange(n)[None].expand(len(ids), -1))
        proposal = head.to_target_ids(head.logits(h).argmax(-1))[:, :-1]  # [B, T-2]
        wanted = logits.argmax(-1)[:, 1:-1]  # the target's choice at t+1
        rows = b["loss_mask"][:, 2:].bool()  # x[t+2] is an assistant token
        hits += int((proposal == wanted)[rows].sum())
        total += int(rows.sum())
    return hits / total


@pytest.mark.parametrize("version", [3, 1])
def test_tiny_training_learns_and_exports(tmp_path, version):
    from headway.heads.target import load_target
    from headway.train.data import build_datasets

    out = tmp_path / "run"
    cfg = tiny_cfg(EAGLE3 if version == 3 else EAGLE1, out, *(["train.trackers=[]"] if version == 1 else []))
    final = train(cfg)
    steps = cfg.loss.ttt_steps if version == 3 else 1
    assert steps == (3 if version == 3 else 1)
    expected = {f"step{i}/{m}" for i in range(steps) for m in ("loss", "top1", "top5")}
    expected |= {"step0/reg"} if version == 1 else set()
    expected |= {"simulated_acc_len", "simulated_tau"}  # at every evaluation, from the per-step top-1
    assert set(final) == expected, sorted(final)  # one set of keys per unrolled step, nothing beyond ttt_steps
    top1 = [final[f"step{i}/top1"] for i in range(steps)]
    assert final["simulated_acc_len"] == pytest.approx(sum(math.prod(top1[:k + 1]) for k in range(steps)))

    evals = _evals(out)
    before, after = evals[0], evals[-1]
    assert before["step"] == 0 and after["step"] > 0
    assert set(before) == set(after) == {"step"} | {f"eval/{k}" for k in expected}
    assert after == {"step": after["step"], **{f"eval/{k}": v for k, v in final.items()}}
    target, tok = load_target(cfg.model)
    heldout = build_datasets(cfg.data, tok, cfg.model)[1]
    for i in range(steps):  # every unrolled step learns
        assert after[f"eval/step{i}/top1"] > before[f"eval/step{i}/top1"] + 0.15, (i, before, after)
        assert after[f"eval/step{i}/loss"] < before[f"eval/step{i}/loss"]
        assert final[f"step{i}/top5"] >= final[f"step{i}/top1"]
    if version == 1:  # the feature regression falls clearly
        assert after["eval/step0/reg"] < 0.5 * before["eval/step0/reg"], (before, after)
    train_logs = [m for m in _metrics(out) if "loss" in m]
    assert train_logs and all(f"train/step{steps - 1}/top1" in m for m in train_logs)
    assert any(m["tokens_per_s"] > 0 for m in train_logs)

    # the export: an EagleHead of the right version with a model card and the metrics
    head = load_drafter(out)
    assert isinstance(head, EagleHead) and head.config.version == version
    assert head.config.base_model_name_or_path == "tiny-random-llama"
    assert head.config.num_target_layers == 2
    if version == 3:
        assert head.config.feature_layers == LAYERS and head.config.draft_vocab_size == 128
        assert head.lm_head.weight.shape == (128, head.config.hidden_size)
        assert list((out / "headway").rglob("events.out.tfevents*")), "TensorBoard events were not written"
    else:
        assert head.config.feature_layers == [2] and head.config.draft_vocab_size is None
    assert "step0/top1" in (out / "README.md").read_text()
    assert json.loads((out / "eval_metrics.json").read_text()) == final
    # the exported drafter scores the held-out data exactly as reported (evaluation is deterministic)
    head.bind_target(target)
    again = _heldout_metrics(head, target, cfg, heldout, cfg.train.eval_batch_size)
    assert again.keys() == final.keys()
    for k, v in final.items():
        assert again[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, again[k], v)
    # and the reported step-0 top-1 is the greedy acceptance rate (out-of-draft-vocabulary tokens are misses)
    greedy = _greedy_step0_top1(head, target, heldout, cfg.train.eval_batch_size)
    assert final["step0/top1"] == pytest.approx(greedy, abs=0.005), (final["step0/top1"], greedy)


def test_lk_loss_trains_and_the_best_evaluation_is_exported(tmp_path):
    """loss.kind=lk_lambda (KL and TV mixed by acceptance) learns through the one loop, and with
    train.select_best=simulated_tau the export is the evaluation with the highest simulated tau: its
    metrics, its step, and weights that score exactly that on the held-out data."""
    from headway.heads.target import load_target
    from headway.train.data import build_datasets

    out = tmp_path / "run"
    cfg = tiny_cfg(EAGLE3, out, "train.trackers=[]", "train.max_steps=30", "train.eval_every=10",
                   "train.select_best=simulated_tau", "loss.kind=lk_lambda")
    final = train(cfg)
    evals = _evals(out)
    assert [e["step"] for e in evals] == [0, 10, 20, 30]
    trained = [e for e in evals if e["step"] > 0]
    best = max(trained, key=lambda e: e["eval/simulated_tau"])  # the first of equals: a tie never replaces
    assert best["eval/simulated_tau"] > evals[0]["eval/simulated_tau"] + 0.2, evals  # it learns
    assert final["selected_step"] == best["step"]
    assert final == {**{k[5:]: v for k, v in best.items() if k.startswith("eval/")}, "selected_step": best["step"]}
    assert json.loads((out / "eval_metrics.json").read_text()) == final
    target, tok = load_target(cfg.model)
    head = load_drafter(out).bind_target(target)
    again = _heldout_metrics(head, target, cfg, build_datasets(cfg.data, tok, cfg.model)[1], cfg.train.eval_batch_size)
    assert again["simulated_tau"] == pytest.approx(best["eval/simulated_tau"], rel=1e-5)


def test_eagle31_trains_exports_and_loads_back(tmp_path):
    """eagle.normalize_features=true (EAGLE-3.1) through the one loop: it learns, its per-layer norms
    are saved and read back, and the exported drafter scores the held-out data as reported."""
    from headway.heads.target import load_target
    from headway.train.data import build_datasets

    out = tmp_path / "run"
    cfg = tiny_cfg(EAGLE3, out, "train.trackers=[]", "train.max_steps=30", "eagle.normalize_features=true")
    final = train(cfg)
    evals = _evals(out)
    assert final["step0/top1"] > evals[0]["eval/step0/top1"] + 0.15, (evals[0], final)
    head = load_drafter(out)
    assert head.config.normalize_features and len(head.fc_norm) == len(head.config.feature_layers)
    assert any(not torch.equal(n.weight, torch.ones_like(n.weight)) for n in head.fc_norm)  # trained
    target, tok = load_target(cfg.model)
    again = _heldout_metrics(head.bind_target(target), target, cfg, build_datasets(cfg.data, tok, cfg.model)[1],
                             cfg.train.eval_batch_size)
    assert again["simulated_tau"] == pytest.approx(final["simulated_tau"], rel=1e-5)


@pytest.mark.parametrize("version", [3, 1])
def test_positions_all_trains_on_every_real_token_and_evaluates_answers(version):
    """loss.positions=all: in training every real token's next-token distribution is learnt (prompt
    and template too: the labels are the target's own); held-out evaluation stays on the answers."""
    from headway.heads.target import load_target
    from headway.train.eagle import EagleLossConfig

    cfg = tiny_cfg(EAGLE3 if version == 3 else EAGLE1, "unused")
    target, _ = load_target(cfg.model)
    head = EagleHead.from_target(target, version=version)
    ids = torch.randint(0, target.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0  # row 1: 9 real tokens, then padding
    answer = torch.zeros_like(ids)
    answer[0, 8:] = 1  # row 0: a 4-token answer after an 8-token prompt
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": answer}
    counts = {}
    for positions in ("assistant", "all"):
        module = EagleTrainingModule(head, target, EagleLossConfig(ttt_steps=2, positions=positions))
        counts[positions] = int(module.train()(batch)[1]["step0/count"]), int(module.eval()(batch)[1]["step0/count"])
    # step 0 counts the rows whose token t+2 is trained: the answer's last 4 (assistant) or every real one
    assert counts == {"assistant": (4, 4), "all": (10 + 7, 4)}, counts
    with pytest.raises(ValueError, match="loss.positions must be 'assistant' or 'all'"):
        EagleLossConfig(positions="answers")


def test_eagle1_reduced_draft_vocabulary(tmp_path):
    """EAGLE-1 scores through the target's lm_head rows of a reduced draft vocabulary; its top-1 is
    still the greedy acceptance rate (a target token outside the draft vocabulary is a miss)."""
    from headway.heads.target import load_target
    from headway.train.data import build_datasets

    cfg = tiny_cfg(EAGLE1, tmp_path / "r", "train.trackers=[]", "train.max_steps=20", "eagle.draft_vocab_size=64")
    final = train(cfg)
    head = load_drafter(tmp_path / "r")
    assert head.config.version == 1 and head.config.draft_vocab_size == 64 and head.d2t.shape == (64,)
    target, tok = load_target(cfg.model)
    heldout = build_datasets(cfg.data, tok, cfg.model)[1]
    head.bind_target(target)
    greedy = _greedy_step0_top1(head, target, heldout, cfg.train.eval_batch_size)
    assert final["step0/top1"] == pytest.approx(greedy, abs=0.005), (final["step0/top1"], greedy)


def _command(out, *overrides, module=True, config=EAGLE3):
    cmd = [sys.executable, "-m", "headway.train.eagle"] if module else [sys.executable, str(ROOT / "train" / "eagle.py")]
    return cmd + ["--config", str(config), f"train.output_dir={out}", "train.trackers=[]", *overrides]


def _launch(out, *overrides, module=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(_command(out, *overrides, module=module), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _same_weights(a_dir, b_dir):
    a, b = load_file(str(Path(a_dir) / "model.safetensors")), load_file(str(Path(b_dir) / "model.safetensors"))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.filterwarnings("ignore:'headway.train.eagle' found in sys.modules:RuntimeWarning")  # runpy re-runs it as __main__
def test_module_and_path_entry_points(tmp_path, monkeypatch, capsys):
    """``python train/eagle.py`` (a real interpreter: sys.path[0] is train/) and ``python -m
    headway.train.eagle`` (through runpy, as ``-m`` does; the kill test launches it for real) both
    train and export; the same config gives the same drafter (train.seed fixes the initialisation)."""
    steps = ["train.max_steps=3", "train.save_every=0"]
    by_path = _launch(tmp_path / "path", *steps, module=False)
    monkeypatch.setattr(sys, "argv", ["eagle.py", *_command(tmp_path / "module", *steps)[3:]])
    runpy.run_module("headway.train.eagle", run_name="__main__", alter_sys=True)
    logs = {"module": capsys.readouterr().out}
    logs["path"], _ = by_path.communicate(timeout=300)
    assert by_path.returncode == 0, logs["path"]
    for name, log in logs.items():
        assert "step 2 (token t+4): held-out top-1" in log and f"exported to {tmp_path / name}" in log, log
        head = load_drafter(tmp_path / name)
        assert isinstance(head, EagleHead) and head.config.version == 3
        assert [m["step"] for m in _metrics(tmp_path / name) if "loss" in m] == [3]
    assert _same_weights(tmp_path / "module", tmp_path / "path"), \
        "two runs of one config gave different drafters: the initialisation does not follow train.seed"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kill_and_resume_equals_uninterrupted(tmp_path):
    """SIGKILL mid-run, rerun the same command: final weights equal an uninterrupted run's."""
    ref, out = kill_and_resume(_launch, tmp_path, ["train.max_steps=60", "train.save_every=10"], "step-0000020")
    assert _same_weights(ref, out), "the resumed run's drafter differs from the uninterrupted run's"
    steps_logged = [m["step"] for m in _metrics(out) if "loss" in m]
    assert steps_logged == sorted(set(steps_logged)), "metrics were duplicated by the rerun"
    assert json.loads((out / "eval_metrics.json").read_text()) == json.loads((ref / "eval_metrics.json").read_text())


@pytest.mark.slow  # launches two training processes
@pytest.mark.multiprocess
def test_two_process_cpu_ddp_stays_in_sync(tmp_path):
    out = tmp_path / "ddp"
    res, _ = two_process_cpu_run(ROOT / "train" / "eagle.py", EAGLE3, out, "train.max_steps=12", "train.batch_size=8",
                                 "train.save_every=0")
    assert "2 process(es) on cpu" in res.stdout
    assert json.loads((out / "run_config.json").read_text())["num_processes"] == 2
    evals = _evals(out)
    assert evals[-1]["step"] == 12
    for i in range(3):  # it trained (12 steps of 2 x 8 sequences)
        assert evals[-1][f"eval/step{i}/top1"] > evals[0][f"eval/step{i}/top1"] + 0.05, (evals[0], evals[-1])
    head = load_drafter(out)
    assert isinstance(head, EagleHead) and head.config.version == 3 and head.config.draft_vocab_size == 128


def _cache(target, tok, cfg, examples, out, layers):
    from headway.train.features import cache_features, feature_fingerprint

    cache_features(target, examples, out, layers=layers, meta={"model": cfg.model, "data": dataclasses.asdict(cfg.data)},
                   dtype=torch.float32, fingerprint=feature_fingerprint(target, tok, layers))


def test_training_on_cached_features_matches_online(tmp_path, monkeypatch, capsys):
    """Cached features train exactly like online ones, never run the target's forward, and a cache
    without the drafter's layers is refused with one line naming them."""
    import headway.train.eagle as eagle_mod
    from headway.heads.target import load_target
    from headway.train.data import build_datasets

    short = ["train.max_steps=6", "train.trackers=[]"]
    cfg = tiny_cfg(EAGLE3, tmp_path / "online", *short)
    target, tok = load_target(cfg.model)
    tr, ho = build_datasets(cfg.data, tok, cfg.model)
    for split, examples in (("train", tr), ("heldout", ho)):
        _cache(target, tok, cfg, examples, tmp_path / "all" / split, LAYERS)
        _cache(target, tok, cfg, examples, tmp_path / "last" / split, [2])

    # the same initialisation for both runs (see test_module_and_path_entry_points for the seed itself)
    torch.manual_seed(0)
    online = train(cfg)
    torch.manual_seed(0)
    e1_online = train(tiny_cfg(EAGLE1, tmp_path / "e1-online", *short))

    def no_target(*args, **kwargs):
        raise AssertionError("a run on cached features ran the target")

    monkeypatch.setattr(eagle_mod, "capture_features", no_target)
    torch.manual_seed(0)
    cached = train(tiny_cfg(EAGLE3, tmp_path / "cached", *short, f"features={tmp_path / 'all'}"))
    assert cached.keys() == online.keys()
    for k, v in online.items():
        assert cached[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    # EAGLE-1 reads the final norm only: from the [L]-only cache
    torch.manual_seed(0)
    e1_cached = train(tiny_cfg(EAGLE1, tmp_path / "e1-cached", *short, f"features={tmp_path / 'last'}"))
    assert e1_cached.keys() == e1_online.keys()
    for k, v in e1_online.items():
        assert e1_cached[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k

    # EAGLE-3 needs layers 0, 1, 2: the [2]-only cache is refused, naming what it holds and needs
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(EAGLE3), f"train.output_dir={tmp_path / 'bad'}", "train.trackers=[]",
              f"features={tmp_path / 'last'}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "holds layers [2]" in lines[0] and "needs [0, 1, 2]" in lines[0], lines[0]


@pytest.mark.parametrize("config, override, message", [
    (EAGLE3, "eagle.bogus=1", "unknown config key 'eagle.bogus'"),
    (EAGLE3, "eagle.feature_layers=[0,1,9]", "feature_layers [0, 1, 9] has ids [9] outside the target's depth"),
    (EAGLE3, "eagle.draft_vocab_size=100000", "draft_vocab_size=100000"),
    (EAGLE1, "eagle.feature_layers=[0,1,2]", "EAGLE-1 reads one feature layer"),
    (EAGLE3, "loss.ttt_steps=0", "loss.ttt_steps must be >= 1"),
    (EAGLE1, "eagle.normalize_features=true", "normalize_features (EAGLE-3.1) normalises each of EAGLE-3's"),
    (EAGLE3, "loss.kind=kld", "loss.kind: unknown loss kind 'kld'; choose one of ce, kl, rkl, jsd, tv, lk_alpha"),
    (EAGLE3, "train.select_best=loss", "train.select_best must be one of last, simulated_tau"),
], ids=["unknown-key", "layer-outside-depth", "draft-vocab-too-large", "eagle1-three-layers", "ttt-steps-0",
        "eagle31-on-eagle1", "unknown-loss-kind", "unknown-best-metric"])
def test_bad_input_is_one_line_error(tmp_path, capsys, config, override, message):
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(config), f"train.output_dir={tmp_path / 'run'}", "train.trackers=[]", override])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert message in lines[0], lines[0]
    assert not (tmp_path / "run" / "model.safetensors").exists()
