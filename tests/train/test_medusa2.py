"""Medusa-2 on the tiny config: joint LoRA + heads training, export in peft's format, exact runtime."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.train.train_utils import kill_at_checkpoint

import headway.train.medusa2 as m2
from headway.heads import MedusaHeads, load_drafter
from headway.heads.target import load_target
from headway.inference import SpeculativeGenerator
from headway.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "medusa2" / "tiny.yaml"
STAGE1, WARMUP, LAMBDA = 10, 10, 0.2  # as in configs/medusa2/tiny.yaml


def tiny_cfg(out, *overrides):
    return load_config(m2.Medusa2RunConfig, TINY, [f"train.output_dir={out}", *overrides])


def _metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _prompt(tok, text: str) -> torch.Tensor:
    # [1, T] chat prompt ending with the assistant's turn
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny joint run (40 steps, a few seconds), its live tuned model and its metrics."""
    base = tmp_path_factory.getbasetemp()
    with pytest.MonkeyPatch.context() as mp:  # the autouse env fixture is per test: repeat it here
        mp.setenv("HF_HOME", str(base / "hf_home"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HEADWAY_CACHE", str(base / "headway_cache"))
        captured = {}
        wrap = m2.wrap_with_lora
        mp.setattr(m2, "wrap_with_lora", lambda target, lora: captured.setdefault("tuned", wrap(target, lora)))
        out = base / "medusa2-run"
        final = m2.train(tiny_cfg(out, "merge=true", "train.keep_checkpoints=10"))
    return {"out": out, "final": final, "tuned": captured["tuned"]}


def test_joint_training_learns_with_warmup_and_heads_only_stage(run):
    logs = _metrics(run["out"])
    evals = [m for m in logs if "eval/head0/loss" in m]
    before, after = evals[0], evals[-1]
    for k in range(3):  # the heads learn
        assert after[f"eval/head{k}/top1"] > before[f"eval/head{k}/top1"] + 0.2, (before, after)
    # the tuned target starts as the original (KL exactly 0) and ends near it, but not on it
    assert before["eval/joint/kl"] == 0.0
    assert 0 < after["eval/joint/kl"] < 0.1 and after["eval/joint/kl"] == run["final"]["joint/kl"]
    train = {m["step"]: m for m in logs if "loss" in m}
    for step in range(1, STAGE1 + 1):  # step s logs optimizer step s-1
        assert train[step]["train/joint/heads_only"] == 1.0 and train[step]["train/joint/kl"] == 0.0
        assert train[step]["train/joint/lambda"] == 0.0
    for step in range(STAGE1 + 1, 41):
        assert train[step]["train/joint/heads_only"] == 0.0
        assert train[step]["train/joint/lambda"] == pytest.approx(LAMBDA * min(1, (step - STAGE1) / WARMUP), rel=1e-6)
    assert train[STAGE1 + 3]["train/joint/kl"] > 0


def test_only_adapter_and_heads_change(run):
    ckpts = run["out"] / "checkpoints"
    at_stage1 = load_file(str(ckpts / f"step-{STAGE1:07d}" / "model.safetensors"))
    later = load_file(str(ckpts / "step-0000030" / "model.safetensors"))
    # what trains: the heads and the LoRA matrices, nothing else
    assert {k.split(".")[0] for k in later} == {"heads", "tuned"}
    assert all("lora_A" in k or "lora_B" in k for k in later if k.startswith("tuned."))
    lora_b = [k for k in later if "lora_B" in k]
    assert lora_b and all(torch.count_nonzero(at_stage1[k]) == 0 for k in lora_b)  # frozen in the heads-only stage
    assert all(torch.count_nonzero(later[k]) > 0 for k in lora_b)
    # the target's own weights are bit-identical to a fresh load
    fresh = dict(load_target("tiny-random-llama", device="cpu")[0].named_parameters())
    base = [(n, p) for n, p in run["tuned"].get_base_model().named_parameters() if "lora_" not in n]
    assert len(base) == len(fresh)
    for name, p in base:
        assert torch.equal(p, fresh[name.replace(".base_layer", "")]), name


def test_export_is_peft_format_and_merged_equals_unmerged(run):
    from peft import PeftModel

    out = run["out"]
    for f in ("config.json", "model.safetensors", "adapter/adapter_config.json", "adapter/adapter_model.safetensors",
              "merged/config.json", "merged/model.safetensors", "merged/tokenizer.json"):
        assert (out / f).is_file(), f
    assert isinstance(load_drafter(out), MedusaHeads)
    base, tok = load_target("tiny-random-llama", device="cpu")
    peft_model = PeftModel.from_pretrained(base, str(out / "adapter")).eval()  # peft's own loader
    saved = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    ids = _prompt(tok, "what is your favorite color ?")
    with torch.no_grad():
        live = run["tuned"].eval()(input_ids=ids).logits
        unmerged = peft_model(input_ids=ids).logits
        merged = load_target(str(out / "merged"), device="cpu")[0](input_ids=ids).logits
        at_load = load_target("tiny-random-llama", device="cpu", adapter=out / "adapter")[0](input_ids=ids).logits
        original = load_target("tiny-random-llama", device="cpu")[0](input_ids=ids).logits
    assert torch.equal(live, unmerged)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)
    assert torch.equal(merged, at_load)
    assert not torch.allclose(unmerged, original, atol=1e-4)  # the adapter does something


def test_greedy_speculation_equals_the_tuned_target(run):
    out = run["out"]
    tuned, tok = load_target("tiny-random-llama", device="cpu", adapter=out / "adapter")
    original = load_target("tiny-random-llama", device="cpu")[0]
    gen = SpeculativeGenerator(tuned, load_drafter(out), tree=None)
    differs = 0
    for text in ("what is your favorite color ?", "do you like to play music with your friend ?",
                 "tell me about your school and your teacher .", "hello ! how are you today ?"):
        ids = _prompt(tok, text)
        spec = gen.generate(ids, max_new_tokens=24, temperature=0.0)
        plain = tuned.generate(ids, max_new_tokens=24, do_sample=False)
        assert spec.sequences.tolist() == plain.tolist()
        differs += original.generate(ids, max_new_tokens=24, do_sample=False).tolist() != plain.tolist()
    assert differs, "the tuned target generates like the original: the adapter was not applied"


def test_unmerged_peft_target_runs_speculation_exactly(run):
    out = run["out"]
    tuned, tok = load_target("tiny-random-llama", device="cpu", adapter=out / "adapter", merge=False)
    ids = _prompt(tok, "hello !")
    spec = SpeculativeGenerator(tuned, load_drafter(out)).generate(ids, max_new_tokens=16)
    assert spec.sequences.tolist() == tuned.generate(input_ids=ids, max_new_tokens=16, do_sample=False).tolist()


def _launch(out, *overrides):
    cmd = [sys.executable, "-m", "headway.train.medusa2", "--config", str(TINY), f"train.output_dir={out}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_kill_and_resume_equals_uninterrupted(tmp_path, run):
    """SIGKILL in the joint stage, rerun: heads and adapter equal the uninterrupted run's."""
    out = tmp_path / "killed"
    proc = _launch(out, "train.save_every=5")
    kill_at_checkpoint(proc, out / "checkpoints", "step-0000020")
    assert not (out / "model.safetensors").exists()
    resumed = _launch(out, "train.save_every=5")
    log, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, log
    assert "resumed from" in log
    ref = run["out"]  # the same run config apart from merge and checkpoint keeping
    for f in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(str(ref / f)), load_file(str(out / f))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f


def test_bad_input_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="features=.*use features=online"):
        m2.train(tiny_cfg(tmp_path / "a", f"features={tmp_path}"))
    with pytest.raises(ValueError, match="'qkv' matches no module.*down_proj.*q_proj"):
        m2.train(tiny_cfg(tmp_path / "b", "lora.target_modules=[q_proj,qkv]"))
    with pytest.raises(ValueError, match="share_lm_head=true"):
        m2.train(tiny_cfg(tmp_path / "c", "lora.train_lm_head=true", "heads.share_lm_head=true"))
    with pytest.raises(ValueError, match="loss.kind=kl with lora.train_lm_head=true"):
        m2.train(tiny_cfg(tmp_path / "f", "lora.train_lm_head=true", "loss.kind=kl"))
    with pytest.raises(ValueError, match="loss.kind: unknown loss kind 'nla'"):
        m2.train(tiny_cfg(tmp_path / "g", "loss.kind=nla"))
    with pytest.raises(ValueError, match="Medusa-2 under FSDP is not supported"):
        m2.train(tiny_cfg(tmp_path / "e", "train.fsdp=true"))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_target("tiny-random-llama", device="cpu", adapter=tmp_path)
    res = subprocess.run([sys.executable, "-m", "headway.train.medusa2", "--config", str(TINY),
                          f"train.output_dir={tmp_path / 'd'}", "features=/no/cache"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.startswith("error: features='/no/cache'"), res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "medusa2").glob("*.yaml")), ids=lambda p: p.name)
def test_every_medusa2_config_loads(path):
    cfg = load_config(m2.Medusa2RunConfig, path)
    assert cfg.features == "online" and cfg.train.output_dir and cfg.lora.target_modules
    assert not (cfg.lora.train_lm_head and cfg.heads.share_lm_head)
    assert cfg.loss.weight(cfg.loss.stage1_steps + max(cfg.loss.lambda_warmup_steps, 1) - 1) == cfg.loss.lambda_max


@pytest.mark.parametrize("merge", [True, False])
def test_sampled_wiring_against_the_tuned_target(run, merge, monkeypatch):
    """Sampling with the jointly tuned target (merged, and as a live PeftModel): at every verified
    node p is the tuned target's own processed distribution after that node's context (a plain
    forward), the candidates are the heads' top-k on its hidden state, and the output is what the
    rounds accepted (the same exact wiring check as every other drafter; float64 so tolerances are tight)."""
    from tests.inference.spec_utils import SETTINGS, VerifyRecorder, WiringCase, check_wiring, medusa_check

    out = run["out"]
    tuned, tok = load_target("tiny-random-llama", device="cpu", adapter=out / "adapter", merge=merge)
    tuned, heads = tuned.double(), load_drafter(out).double()
    case = WiringCase(heads, check_draft=medusa_check(tuned, heads))
    prompt = _prompt(tok, "do you like to play music with your friend ?")[0].tolist()
    recorder = VerifyRecorder(monkeypatch)
    gen = SpeculativeGenerator(tuned, heads, tree=None)
    g = torch.Generator().manual_seed(0)
    rounds = 0
    for params in SETTINGS.values():
        for _ in range(2):
            res = gen.generate(torch.tensor([prompt]), max_new_tokens=10, temperature=params.temperature,
                               top_k=params.top_k, top_p=params.top_p, generator=g, eos_token_id=None)
            calls = recorder.take()
            check_wiring(tuned, case, gen.tree, prompt, params, 10, calls, res, blind_first=True)
            rounds += len(calls)
    assert rounds >= 8


def test_the_heads_loss_is_chunked_as_loss_chunk_size_says(tmp_path, monkeypatch):
    seen = set()
    loss = m2.medusa_loss
    monkeypatch.setattr(m2, "medusa_loss", lambda *a, **kw: seen.add(kw.get("chunk_size")) or loss(*a, **kw))
    m2.train(tiny_cfg(tmp_path / "out", "loss.chunk_size=3", "train.max_steps=1", "train.eval_every=0",
                      "train.trackers=[]"))
    assert seen == {3}
