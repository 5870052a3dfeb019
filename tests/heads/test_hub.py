"""The Hub end to end without the network (headway.heads.hub): push (captured at HfApi) and loading by repo
id with a pinned revision from a pre-populated cache under HF_HUB_OFFLINE=1. The card: hub/test_card.py."""

import hashlib
import json
import logging
import os

import pytest
import torch
from huggingface_hub import HfApi, ModelCard, constants
from safetensors.torch import load as load_safetensors

from headway.heads import MedusaHeads, load_drafter
from headway.heads.hub import push
from tests.heads.hub.helpers import TARGET, tiny_heads


TOKEN = "hf_SeCrEtToKeN0123456789abcdefXYZ"


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty HF cache, offline; huggingface_hub reads these at import time, so patch both."""
    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def populate(cache, repo_id: str, commit: str, files: dict[str, bytes], refs=("main",)) -> None:
    """Write ``files`` as the Hub cache does: content-addressed blobs, snapshot symlinks, refs."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)


@pytest.fixture
def fake_hub(monkeypatch):
    """HfApi's write calls captured; a commit id per commit; HF_TOKEN set to a secret."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    calls = {"commits": [], "repos": [], "branches": []}

    def create_repo(self, repo_id, **kw):
        calls["repos"].append((repo_id, kw, self.token))
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def create_branch(self, repo_id, *, branch, **kw):
        calls["branches"].append((repo_id, branch))

    def create_commit(self, repo_id, operations, *, commit_message, revision=None, **kw):
        files = {}
        for op in operations:
            with op.as_file() as f:
                files[op.path_in_repo] = f.read()
        sha = hashlib.sha1(b"".join(files[k] for k in sorted(files))).hexdigest()
        calls["commits"].append({"repo_id": repo_id, "files": files, "revision": revision, "sha": sha,
                                 "message": commit_message, "token": self.token})
        return f"https://hub.invalid/{repo_id}/commit/{sha}"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_branch", create_branch)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return calls


def training_folder(folder, heads: MedusaHeads, tau: float | None = None):
    """What a training run leaves: the export, metrics, run config, plus files that must stay local."""
    metrics = {"head0/loss": 2.0, "head0/top1": 0.4321, "head0/top5": 0.6543, "head1/loss": 2.5,
               "head1/top1": 0.2109, "head1/top5": 0.4444}
    run = {"model": TARGET, "data": {"source": "someorg/chats", "max_length": 64, "heldout_fraction": 0.1,
                                     "max_examples": 600}, "train_sequences": 540, "heldout_sequences": 60}
    folder.mkdir()
    (folder / "run_config.json").write_text(json.dumps(run))
    heads.save_pretrained(folder, metrics=metrics)
    (folder / "eval_metrics.json").write_text(json.dumps(metrics))
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (folder / "distributed.json").write_text("{}")
    if tau is not None:
        (folder / "benchmark.json").write_text(json.dumps({"tau": tau, "tree": "tree-7", "speedup": 1.234}))
    (folder / "checkpoints" / "step-1").mkdir(parents=True)
    (folder / "checkpoints" / "step-1" / "model.safetensors").write_bytes(b"x")
    return folder


def test_push_then_load_by_pinned_revision_offline(tmp_path, fake_hub, hub_cache, capsys, caplog):
    """Push uploads exactly the loader's files, the card and the metrics; the uploaded bytes, put in
    a cache as the Hub would serve them, load by id at the pinned commit and at main, bit for bit."""
    caplog.set_level(logging.DEBUG)
    # the target's license, as its cached README states it
    populate(hub_cache, TARGET, "c" * 40, {"README.md": b"---\nlicense: mit\n---\n# tiny\n"})
    v1, v2 = tiny_heads(0), tiny_heads(1)
    url1 = push(training_folder(tmp_path / "run1", v1), "me/heads", private=True, revision="v1")
    url2 = push(training_folder(tmp_path / "run2", v2, tau=2.271), "me/heads")

    first, second = fake_hub["commits"]
    assert url1.endswith(first["sha"]) and url2.endswith(second["sha"])
    assert (first["revision"], second["revision"]) == ("v1", None) and fake_hub["branches"] == [("me/heads", "v1")]
    assert fake_hub["repos"][0][1]["private"] is True and first["token"] == TOKEN
    assert sorted(first["files"]) == ["README.md", "config.json", "eval_metrics.json", "metrics.jsonl",
                                      "model.safetensors", "run_config.json"]
    assert first["files"]["config.json"] == (tmp_path / "run1" / "config.json").read_bytes()
    assert sorted(second["files"]) == sorted([*first["files"], "benchmark.json"])
    assert "(tau, new tokens per target forward): **2.27** (tree tree-7, speedup 1.23)" in \
        second["files"]["README.md"].decode()
    uploaded = load_safetensors(first["files"]["model.safetensors"])
    assert all(torch.equal(uploaded[k], v) for k, v in v1.state_dict().items())

    card = first["files"]["README.md"].decode()
    meta = ModelCard(card).data.to_dict()
    assert meta == {"base_model": TARGET, "library_name": "headway", "license": "mit",
                    "pipeline_tag": "text-generation", "tags": ["speculative-decoding", "medusa"],
                    "datasets": ["someorg/chats"]}
    for text in ["| head 0 | token t+2 | 0.432 | 0.654 |", "| head 1 | token t+3 | 0.211 | 0.444 |",
                 "`someorg/chats`, 540 training / 60 held-out sequences", 'load_drafter("me/heads")',
                 "headway generate --model someorg/tiny-target --drafter me/heads",
                 "hf download me/heads --local-dir drafter",
                 "headway convert --to vllm-medusa drafter drafter-vllm-medusa",
                 'vllm serve someorg/tiny-target --speculative-config \'{"method": "medusa", "model": '
                 '"drafter-vllm-medusa", "num_speculative_tokens": 2}\'',
                 "SGLang does not serve Medusa heads", "tau): not recorded"]:
        assert text in card, text
    out = capsys.readouterr()
    cards = [c["files"]["README.md"].decode() for c in fake_hub["commits"]]
    for where in [out.out, out.err, caplog.text, *cards]:
        assert TOKEN not in where

    # the Hub serves what was pushed: v1 at its commit and tag, v2 at main
    populate(hub_cache, "me/heads", first["sha"], first["files"], refs=("v1",))
    populate(hub_cache, "me/heads", second["sha"], second["files"], refs=("main",))
    assert_same(load_drafter("me/heads", revision=first["sha"]), v1)
    assert_same(load_drafter("me/heads", revision="v1"), v1)
    assert_same(load_drafter("me/heads"), v2)
    for bad in ["0" * 40, "no-such-branch"]:
        with pytest.raises(FileNotFoundError) as info:
            load_drafter("me/heads", revision=bad)
        msg = str(info.value)
        assert "\n" not in msg and repr(bad) in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        load_drafter("me/never-pushed")


def test_drafter_push_to_hub_goes_through_push(fake_hub):
    heads = tiny_heads(2)
    url = heads.push_to_hub("me/direct", metrics={"head0/top1": 0.5})
    commit = fake_hub["commits"][0]
    assert url.endswith(commit["sha"]) and commit["repo_id"] == "me/direct"
    assert sorted(commit["files"]) == ["README.md", "config.json", "eval_metrics.json", "model.safetensors"]
    assert json.loads(commit["files"]["eval_metrics.json"]) == {"head0/top1": 0.5}
    assert "| head 0 | token t+2 | 0.500 |" in commit["files"]["README.md"].decode()
    state = load_safetensors(commit["files"]["model.safetensors"])
    assert all(torch.equal(state[k], v) for k, v in heads.state_dict().items())


@pytest.mark.parametrize("repo_id", ["heads", "me/heads/extra", "me/bad--name", "me/", "/heads", "me heads/x"])
def test_bad_repo_id_is_one_line(tmp_path, fake_hub, repo_id):
    tiny_heads(0).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as info:
        push(tmp_path, repo_id)
    msg = str(info.value)
    assert "\n" not in msg and ("is not 'namespace/name'" in msg or "is not a valid Hub name" in msg)
    assert fake_hub["commits"] == [] and fake_hub["repos"] == []


def test_push_without_credentials_is_one_line(tmp_path, fake_hub, monkeypatch):
    for name in ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"]:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "empty_hf_home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    tiny_heads(0).save_pretrained(tmp_path / "d")
    with pytest.raises(ValueError) as info:
        push(tmp_path / "d", "me/heads")
    msg = str(info.value)
    assert "\n" not in msg and "hf auth login" in msg and "huggingface-cli login" in msg and "HF_TOKEN" in msg
    assert fake_hub["repos"] == []


def test_push_refuses_a_broken_folder_before_the_hub(tmp_path, fake_hub):
    (tmp_path / "config.json").write_text('{"medusa_num_heads": 3}')
    with pytest.raises(ValueError, match="headway convert --to headway SRC DST"):
        push(tmp_path, "me/heads")
    with pytest.raises(ValueError, match="is not a folder"):
        push(tmp_path / "missing", "me/heads")
    assert fake_hub["repos"] == []


def test_hub_errors_never_echo_the_token(tmp_path, fake_hub, monkeypatch):
    def leaky(self, *a, **k):
        raise OSError(f"connection reset while sending Authorization: Bearer {self.token}")

    monkeypatch.setattr(HfApi, "create_commit", leaky)
    tiny_heads(0).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as info:
        push(tmp_path, "me/heads")
    assert TOKEN not in str(info.value) and "hf_***" in str(info.value) and "\n" not in str(info.value)


def test_medusa2_push_carries_its_adapter(tmp_path, fake_hub):
    """A Medusa-2 run's LoRA adapter goes up with the heads (they are useless without it), and the card says so."""
    from headway.heads.hub import push

    folder = training_folder(tmp_path / "m2", tiny_heads(5))
    (folder / "adapter").mkdir()
    (folder / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"lora")
    (folder / "merged").mkdir()
    (folder / "merged" / "model.safetensors").write_bytes(b"big")
    push(str(folder), "me/m2-heads")
    files = fake_hub["commits"][-1]["files"]
    assert files["adapter/adapter_model.safetensors"] == b"lora" and "adapter/adapter_config.json" in files
    assert not any(name.startswith(("merged/", "checkpoints/")) for name in files)
    assert b"adapter/" in files["README.md"] and b"tuned target" in files["README.md"]
