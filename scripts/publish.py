"""Publish an exported drafter folder to the Hugging Face Hub (same as ``headway push``).

    python scripts/publish.py OUTPUT_DIR --repo-id me/my-heads [--private] [--revision BRANCH]

A thin wrapper over :func:`headway.heads.hub.push`: the folder is loaded first (a corrupt or
foreign export is refused before anything is uploaded); then config.json, model.safetensors, a
model card README.md built from the folder and the metrics go up in one commit. Checkpoints, logs
and caches stay local. Credentials: ``hf auth login`` or HF_TOKEN.
"""

from __future__ import annotations

import argparse
import sys

from headway.heads.hub import push


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="a drafter folder exported by headway training or save_pretrained")
    p.add_argument("--repo-id", required=True, help="namespace/name of the Hub repo (created if absent)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default=None, help="branch to push to (default main; created if absent)")
    args = p.parse_args(argv)
    try:
        url = push(args.folder, args.repo_id, private=args.private, revision=args.revision)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"published {args.folder} to {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
