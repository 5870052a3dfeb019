"""What a drafter checkpoint is (headway.heads.hub.info, ``headway info``): headway's own folders read from
their JSON files and safetensors headers, foreign layouts imported to say what they hold, the training
records, the printed summary, and one-line errors for files it cannot read."""

import json
import re

import pytest

from headway.heads import MedusaConfig, MedusaHeads, load_drafter
from headway.heads.formats.convert import export_any
from headway.heads.hub.info import describe_checkpoint, describe_drafter, render_text
from tests.heads.hub.helpers import TARGET, tiny_heads

METRICS = {"head0/top1": 0.5, "head0/top5": 0.75, "head1/top1": 0.25}
RUN = {"model": TARGET, "features": "online", "data": {"source": "someorg/chats"}, "num_processes": 1,
       "train": {"lr": 0.001, "batch_size": 8, "grad_accum": 2, "epochs": 1, "max_steps": 10}}


def training_folder(folder, heads):
    heads.save_pretrained(folder)
    (folder / "eval_metrics.json").write_text(json.dumps(METRICS))
    (folder / "run_config.json").write_text(json.dumps(RUN))
    (folder / "metrics.jsonl").write_text('{"step": 5, "loss": 3.0, "tokens_per_s": 100.0}\n'
                                          '{"step": 10, "loss": 2.5, "tokens_per_s": 120.0}\n'
                                          '{"step": 10, "eval/head0/loss": 2.0}\n'
                                          '{"step": 11, "lo')  # the last line cut short by a kill
    return folder


def test_a_training_folder_is_described_from_its_files(tmp_path):
    heads = tiny_heads(0)
    folder = training_folder(tmp_path / "run", heads)
    info = describe_checkpoint(folder)
    assert (info["path"], info["format"], info["drafter_type"], info["kind"], info["target"]) == \
        (str(folder), "headway", "medusa", "medusa", TARGET)
    assert (info["hidden_size"], info["vocab_size"], info["draft_vocab_size"]) == (16, 32, None)
    assert (info["num_heads"], info["num_layers"], info["share_lm_head"]) == (2, 1, False)  # the kind's info_fields
    assert info["description"] == ("Medusa-1 heads: 2 heads x 1 ResBlock, own lm_head (full vocabulary); "
                                   "head k predicts token t+k+2")
    state = heads.state_dict()
    n = sum(t.numel() for t in state.values())
    size = (folder / "model.safetensors").stat().st_size
    assert info["weights"] == {"files": ["model.safetensors"], "bytes": size, "tensors": len(state), "parameters": n,
                               "dtypes": {"F32": n}}
    assert info["training"] == {"eval": METRICS, "steps": 10, "final_train_loss": 2.5, "tokens_per_s": 120.0,
                                "run": {"model": TARGET, "features": "online", "data": "someorg/chats",
                                        "num_processes": 1, "lr": 0.001, "batch_size": 8, "grad_accum": 2,
                                        "epochs": 1, "max_steps": 10}}
    lines = render_text(info).splitlines()
    assert lines == [
        str(folder),
        "  format      headway (medusa)",
        f"  drafter     {info['description']}",
        f"  target      {TARGET} (hidden size 16, vocabulary 32)",
        f"  weights     {n:,} parameters in {len(state)} tensors (F32), {size / 1024:.1f} KiB in model.safetensors",
        f"  run         model {TARGET}, data someorg/chats, features online, lr 0.001, batch 8 x 2 accum x 1 "
        "process(es)",
        "  trained     10 optimizer steps, final training loss 2.5000",
        "  held-out    head0: top1 0.5000  top5 0.7500",
        "  held-out    head1: top1 0.2500",
    ]


def test_foreign_layouts_are_imported_to_say_what_they_hold(tmp_path):
    heads = tiny_heads(0)
    n = sum(t.numel() for t in heads.state_dict().values())
    vllm = describe_checkpoint(export_any(heads, tmp_path / "vllm", "vllm-medusa"))
    assert (vllm["format"], vllm["kind"], vllm["target"], vllm["num_heads"]) == ("vllm-medusa", "medusa", TARGET, 2)
    assert vllm["training"] is None
    assert render_text(vllm).splitlines()[1:2] == ["  format      vllm-medusa"]
    assert render_text(vllm).endswith("\n  training    no records in this folder\n")
    v01 = describe_checkpoint(export_any(heads, tmp_path / "v01", "medusa-v0.1"))
    assert v01["format"] == "medusa-v0.1" and v01["weights"]["files"] == ["medusa_lm_head.pt"]
    assert v01["weights"]["tensors"] == 0 and v01["weights"]["dtypes"] == {}  # a pickle is sized, never opened
    assert v01["weights"]["parameters"] == n  # counted on the imported drafter
    assert v01["weights"]["bytes"] == (tmp_path / "v01" / "medusa_lm_head.pt").stat().st_size


def test_a_foreign_folder_that_needs_its_target_is_described_from_its_config(tmp_path):
    shared = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=32, num_heads=2, share_lm_head=True))
    out = export_any(shared, tmp_path / "v2", "medusa-v2")
    config = json.loads((out / "config.json").read_text())
    del config["vocab_size"]  # as TGI's own configs: the vocabulary is the target's
    (out / "config.json").write_text(json.dumps(config))
    info = describe_checkpoint(out)
    assert (info["format"], info["kind"], info["drafter_type"]) == ("medusa-v2", None, None)
    assert (info["hidden_size"], info["vocab_size"], info["num_heads"], info["num_layers"]) == (16, None, 2, 1)
    assert info["description"] == "a medusa-v2 drafter (`headway convert --target MODEL` reads it with its target)"
    assert describe_drafter({"kind": None, "drafter_type": "mystery"}) == "mystery drafter"


def test_files_it_cannot_read_are_one_line_errors(tmp_path):
    folder = tmp_path / "d"
    tiny_heads(0).save_pretrained(folder)
    (folder / "eval_metrics.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"eval_metrics.json is not valid JSON \(.* at line 1\)$"):
        describe_checkpoint(folder)
    (folder / "eval_metrics.json").unlink()
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json holds a list, not a drafter config"):
        describe_checkpoint(tmp_path / "list")
    with pytest.raises(FileNotFoundError, match="no drafter folder at"):
        describe_checkpoint(tmp_path / "missing")


@pytest.mark.parametrize("damage, problem", [
    ("truncated", r"model.safetensors is corrupt or truncated \(.*\); re-export or re-download it$"),
    ("cut header", r"model.safetensors is corrupt or truncated \(.*\); re-export or re-download it$"),
    ("missing", r"has no model.safetensors; headway reads safetensors weights only$"),
    ("other shapes", r"model.safetensors: .* has shape \(16,\), config expects \(8,\)$"),
])
def test_a_folder_load_drafter_refuses_is_described_with_its_problem(damage, problem, tmp_path, capsys):
    """`headway info` still describes it, names what load_drafter would refuse first, and exits 1."""
    from headway.cli import main

    folder = tmp_path / "d"
    tiny_heads(0).save_pretrained(folder)
    weights, config = folder / "model.safetensors", json.loads((folder / "config.json").read_text())
    if damage == "missing":
        weights.unlink()
    elif damage == "other shapes":
        (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 8}))
    else:
        weights.write_bytes(weights.read_bytes()[:40 if damage == "cut header" else -100])
    info = describe_checkpoint(folder)
    assert re.search(problem, info["problem"]) and "\n" not in info["problem"], info["problem"]
    assert (info["format"], info["kind"], info["num_heads"]) == ("headway", "medusa", 2)
    with pytest.raises(ValueError, match=problem):
        load_drafter(folder)  # the same refusal
    assert main(["info", str(folder)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"  PROBLEM     this folder does not load: {info['problem']}" and lines[2].startswith("  format")
    assert main(["info", str(folder), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["problem"] == info["problem"]


def test_a_healthy_folder_has_no_problem(tmp_path, capsys):
    from headway.cli import main

    folder = training_folder(tmp_path / "run", tiny_heads(0))
    assert describe_checkpoint(folder)["problem"] is None
    assert main(["info", str(folder)]) == 0 and "PROBLEM" not in capsys.readouterr().out
    assert main(["info", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["problem"] is None
