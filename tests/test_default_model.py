"""The real embedded default, SmolLM2-135M-Instruct (packaged GGUF): features, training, export."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headway.heads import MedusaHeads, load_drafter
from headway.train.config import load_config
from headway.train.batches import last_hidden_state
from headway.train.medusa import MedusaRunConfig, train

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "medusa" / "smollm2-135m.yaml"


def test_default_target_shape_and_features(smollm2):
    model, tokenizer = smollm2
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == ("llama", 576, 30, 49152)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    feats = last_hidden_state(model, ids)
    # the Medusa/EAGLE-1 feature is the final-norm hidden state: lm_head(feature) == logits
    torch.testing.assert_close(feats, out.hidden_states[-1])
    torch.testing.assert_close(model.lm_head(feats), out.logits, rtol=1e-5, atol=1e-4)


@pytest.mark.slow  # trains the real default model
def test_few_training_steps_export_and_reload(smollm2, tmp_path):
    out = tmp_path / "heads"
    cfg = load_config(MedusaRunConfig, CONFIG, [
        "data.source=packaged", "data.max_examples=24", "data.max_length=48", "train.batch_size=4",
        "train.max_steps=3", "train.trackers=[]", f"train.output_dir={out}", "heads.num_heads=2"])
    metrics = train(cfg)
    assert {"head0/top1", "head1/top5"} <= set(metrics)
    heads = load_drafter(out)
    assert isinstance(heads, MedusaHeads) and heads.config.share_lm_head
    model, _ = smollm2
    heads.bind_target(model)
    logits = heads(torch.zeros(1, 2, 576))
    assert logits.shape == (2, 1, 2, 8192)  # the config's reduced draft vocabulary
    assert heads.to_target_ids(logits.argmax(-1)).max() < 49152
    # the trained ResBlocks moved away from their zero initialisation
    assert any(torch.count_nonzero(p) for n, p in heads.named_parameters() if n.endswith("linear.weight"))


@pytest.mark.slow
def test_pipeline_generate_cache_train(tmp_path):
    """The demo's path at a small size: self-distil, cache features, train from the cache, reload."""
    data = tmp_path / "distilled.jsonl"
    run = lambda *a: subprocess.run([sys.executable, *map(str, a)], capture_output=True, text=True, timeout=900)
    res = run(ROOT / "scripts" / "generate_data.py", "--out", data, "--num-prompts", "8", "--max-new-tokens", "24")
    assert res.returncode == 0, res.stderr[-2000:]
    records = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(records) == 8 and all(r["messages"][1]["role"] == "assistant" for r in records)
    overrides = [f"data.source={data}", "data.heldout_fraction=0.25", f"train.output_dir={tmp_path / 'heads'}",
                 "train.batch_size=2", "train.epochs=2", "train.trackers=[]"]
    res = run(ROOT / "scripts" / "cache_features.py", "--config", CONFIG, "--out", tmp_path / "feats", *overrides)
    assert res.returncode == 0, res.stderr[-2000:]
    assert list((tmp_path / "feats" / "train").glob("shard-*.safetensors"))
    res = run("-m", "headway.train.medusa", "--config", CONFIG, f"features={tmp_path / 'feats'}", *overrides)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "held-out top-1" in res.stdout
    heads = load_drafter(tmp_path / "heads")
    assert heads.config.base_model_name_or_path == "smollm2-135m"
