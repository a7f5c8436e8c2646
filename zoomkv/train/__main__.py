"""``python -m zoomkv.train --recipe recipes/...yaml [key=value ...]`` (also under ``accelerate launch -m``):
the ``zoomkv train`` subcommand as a program of its own."""

import sys

from zoomkv.cli import run_command

sys.exit(run_command("train", prog="python -m zoomkv.train"))
