import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import HfApi, constants

from headway.heads import MedusaConfig, MedusaHeads

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("publish", ROOT / "scripts" / "publish.py")
publish = importlib.util.module_from_spec(spec)
spec.loader.exec_module(publish)


def test_publish_uploads_only_the_export(tiny_llama, tmp_path, monkeypatch, capsys):
    calls = {}

    def create_commit(self, repo_id, operations, **kw):
        calls.update(repo_id=repo_id, files=sorted(op.path_in_repo for op in operations), **kw)
        return "https://hub.invalid/me/heads/commit/1"

    monkeypatch.setenv("HF_TOKEN", "hf_publishsecret123")
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr(HfApi, "create_branch", lambda self, repo_id, *, branch, **kw: calls.update(branch=branch))
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    target, _ = tiny_llama
    MedusaHeads.from_target(target, MedusaConfig(num_heads=2)).save_pretrained(tmp_path)
    (tmp_path / "eval_metrics.json").write_text(json.dumps({"head0/top1": 0.5}))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "model.safetensors").write_bytes(b"x")
    assert publish.main([str(tmp_path), "--repo-id", "me/heads", "--revision", "v2"]) == 0
    assert calls["repo_id"] == "me/heads" and calls["revision"] == calls["branch"] == "v2"
    assert calls["files"] == ["README.md", "config.json", "eval_metrics.json", "model.safetensors"]
    out = capsys.readouterr()
    assert "published" in out.out and "hf_publishsecret123" not in out.out + out.err


@pytest.mark.parametrize("case", ["broken", "bad_id", "no_token"])
def test_publish_bad_input_is_one_line(tmp_path, monkeypatch, capsys, case):
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: pytest.fail("must not contact the Hub"))
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    repo_id = "me/heads"
    if case == "broken":
        (tmp_path / "config.json").write_text("{}")
    else:
        MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=16, num_heads=1)).save_pretrained(tmp_path)
    if case == "bad_id":
        repo_id = "heads"
    if case == "no_token":
        monkeypatch.delenv("HF_TOKEN")
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    assert publish.main([str(tmp_path), "--repo-id", repo_id]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert {"broken": "not a headway drafter", "bad_id": "is not 'namespace/name'",
            "no_token": "hf auth login"}[case] in err
