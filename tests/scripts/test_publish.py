import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from headway.heads import MedusaConfig, MedusaHeads

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("publish", ROOT / "scripts" / "publish.py")
publish = importlib.util.module_from_spec(spec)
spec.loader.exec_module(publish)


def test_publish_uploads_only_the_export(tiny_llama, tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    calls = {}
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: calls.update(kw) or "https://hub.invalid/x")
    target, _ = tiny_llama
    MedusaHeads.from_target(target, MedusaConfig(num_heads=2)).save_pretrained(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert publish.main([str(tmp_path), "--repo-id", "me/heads"]) == 0
    assert calls["repo_id"] == "me/heads" and "model.safetensors" in calls["allow_patterns"]
    assert not any("checkpoints" in p for p in calls["allow_patterns"])


def test_publish_refuses_a_broken_folder(tmp_path, monkeypatch, capsys):
    from huggingface_hub import HfApi

    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: pytest.fail("must not contact the Hub"))
    (tmp_path / "config.json").write_text("{}")
    assert publish.main([str(tmp_path), "--repo-id", "me/heads"]) == 2
    assert "not a headway drafter" in capsys.readouterr().err
