"""Where offline calibration profiles live (``zoomkv calibrate NAME --model M`` writes them; the methods
that need one, ``needs_profile``, read them at prefill): next to the model cache, one folder per model."""

from __future__ import annotations

import re
from pathlib import Path

from zoomkv.models import cache_dir


def profile_dir(model_name: str) -> Path:
    """Where calibration profiles of ``model_name`` (a registered name, hub id or path) live."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "--", model_name.strip("/")) or "model"
    return cache_dir() / "profiles" / safe
