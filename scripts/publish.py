"""Publish an exported drafter folder to the Hugging Face Hub.

    python scripts/publish.py OUTPUT_DIR --repo-id me/my-heads [--private]

The folder is loaded first (so a corrupt or foreign export is refused before anything is
uploaded); then its config.json, model.safetensors, model card README.md and metrics go up.
Checkpoints, logs and caches stay local.
"""

from __future__ import annotations

import argparse
import sys

from huggingface_hub import HfApi

from headway.heads import load_drafter

UPLOADED = ["config.json", "model.safetensors", "README.md", "eval_metrics.json", "metrics.jsonl", "run_config.json"]


def publish(folder: str, repo_id: str, private: bool = False, token: str | None = None) -> str:
    load_drafter(folder)  # validates config and weights
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id=repo_id, private=private, exist_ok=True).repo_id
    return api.upload_folder(repo_id=repo_id, folder_path=folder, allow_patterns=UPLOADED,
                             commit_message="Upload headway drafter")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="a drafter folder exported by headway training")
    p.add_argument("--repo-id", required=True)
    p.add_argument("--private", action="store_true")
    args = p.parse_args(argv)
    try:
        url = publish(args.folder, args.repo_id, args.private)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"published {args.folder} to {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
