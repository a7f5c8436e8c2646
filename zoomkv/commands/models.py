"""List the registered models (and the command that installs each one's package)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from zoomkv.models import list_models

    for spec in list_models():
        extra = f"  (install: {spec.install})" if getattr(spec, "install", None) else ""
        print(f"{spec.name:16s} {spec.description}{extra}")
    print("Any Hugging Face model id or local folder (Llama, Qwen2/3, Mistral, Gemma 3) works too.")
    return 0
