"""Publishing a drafter folder to the Hugging Face Hub.

``push`` uploads exactly what ``load_drafter`` reads (config.json, model.safetensors), a model card
built from the folder (``headway.heads.hub.card``) and the training metrics, in one commit; checkpoints,
logs and caches stay local. Bad input fails before anything is sent, with one line that says what
to do. The token comes from the argument or from huggingface_hub's own lookup (``HF_TOKEN``, then
the file ``hf auth login`` writes) and is never printed, logged or written.

Loading by id, with a pinned revision and offline from the cache, is ``load_drafter(repo_id,
revision=...)`` (``headway.heads.base.resolve_folder``).
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled
from huggingface_hub.utils import validate_repo_id

from headway.heads.base import CONFIG_NAME, WEIGHTS_NAME, load_drafter
from headway.heads.hub.card import BENCHMARK_NAME, EVAL_METRICS_NAME, RUN_CONFIG_NAME, model_card
from headway.heads.values import first_line

CARD_NAME = "README.md"
LOADER_FILES = (CONFIG_NAME, WEIGHTS_NAME)  # what load_drafter reads
METRIC_FILES = (EVAL_METRICS_NAME, RUN_CONFIG_NAME, "metrics.jsonl", BENCHMARK_NAME)  # uploaded when present
ADAPTER_FILES = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors")  # Medusa-2: the tuned target's LoRA
_REPO_ID = re.compile(r"[^/\s]+/[^/\s]+")


def push(folder, repo_id: str, *, private: bool = False, token: str | None = None, revision: str | None = None,
         commit_message: str = "Upload headway drafter") -> str:
    """Upload the drafter in ``folder`` to the Hub repo ``repo_id`` (``namespace/name``, created if
    absent; ``private`` applies on creation) on branch ``revision`` (default ``main``, created if
    absent). Returns the commit URL. The folder must load with ``load_drafter``; the card is
    rebuilt from it. Raises a one-line ``ValueError`` for a bad id, folder or credentials."""
    check_repo_id(repo_id)
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder: pass the output folder of a headway training run "
                         "or of save_pretrained")
    load_drafter(folder)  # a corrupt or foreign export is refused before anything is sent
    token = resolve_token(token)
    files = upload_plan(folder, repo_id)
    api = HfApi(token=token)
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(repo_id, [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data)
                                           for name, data in files.items()],
                                 commit_message=commit_message, revision=revision)
    except (HfHubHTTPError, OfflineModeIsEnabled, OSError) as exc:
        raise ValueError(redact(_upload_error(repo_id, exc), token)) from None
    return str(getattr(info, "commit_url", info))


def upload_plan(folder: Path, repo_id: str | None = None) -> dict[str, Path | bytes]:
    """``{path in repo: file or bytes}``: the loader's files, a fresh model card, the metrics present."""
    files: dict[str, Path | bytes] = {name: folder / name for name in LOADER_FILES}
    files[CARD_NAME] = model_card(folder, repo_id=repo_id).encode()
    files.update({name: folder / name for name in METRIC_FILES + ADAPTER_FILES if (folder / name).is_file()})
    return files


def check_repo_id(repo_id: str) -> None:
    """Raise a one-line ValueError unless ``repo_id`` is a valid ``namespace/name``."""
    if not isinstance(repo_id, str) or not _REPO_ID.fullmatch(repo_id):
        raise ValueError(f"repo id {repo_id!r} is not 'namespace/name': pass your user or organisation too, "
                         "e.g. --repo-id me/smollm2-135m-medusa")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ValueError(f"repo id {repo_id!r} is not a valid Hub name: use letters, digits, '-', '_' and '.' "
                         "(no '--' or '..', at most 96 characters), e.g. me/smollm2-135m-medusa") from None


def resolve_token(token: str | None = None) -> str:
    """``token`` or the one huggingface_hub finds (HF_TOKEN, then the saved login); never logged."""
    token = token or get_token()
    if not token:
        raise ValueError("no Hugging Face credentials found: run `hf auth login` (or `huggingface-cli login`), "
                         "or set HF_TOKEN to a token with write access, then push again")
    return token


def redact(text: str, token: str | None) -> str:
    """``text`` with every occurrence of ``token`` masked."""
    return text.replace(token, "hf_***") if token else text


def _upload_error(repo_id: str, exc: Exception) -> str:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE=1 forbids uploading: unset it to push"
    if status in (401, 403):
        return (f"the Hub refused the credentials for {repo_id} (HTTP {status}): log in with `hf auth login` "
                "using a token with write access to that namespace, or set HF_TOKEN")
    return (f"pushing to {repo_id} failed ({type(exc).__name__}: {first_line(exc)}); check the repo id and your "
            "connection")
