"""Upload an exported adapter folder to the Hugging Face Hub.

    zoomkv push checkpoints/sekv-smollm2 --repo-id user/sekv-smollm2
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", metavar="FOLDER")
    parser.add_argument("--repo-id", required=True, help="owner/name")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--token", default=None, help="default: the token of `hf auth login` / HF_TOKEN")
    parser.add_argument("--revision", default=None, help="branch to push to (default: main)")
    parser.add_argument("--message", default=None, help="commit message")
    parser.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")


def run(args: argparse.Namespace) -> int:
    from zoomkv.adapters.hub import push_folder
    from zoomkv.adapters.model import ZoomAdapter

    ZoomAdapter.from_pretrained(args.folder)  # never upload something that does not load
    url = push_folder(args.folder, args.repo_id, private=args.private or None, token=args.token,
                      revision=args.revision, commit_message=args.message, endpoint=args.endpoint)
    log.info("pushed %s to %s: %s", args.folder, args.repo_id, url)
    return 0
