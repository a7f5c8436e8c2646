"""Where adapters come from and go to: a local folder, or a Hub repository (through the local Hub cache).

Offline mode is read from the environment at each call (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``),
not from ``huggingface_hub.constants`` frozen at import: a process that turns offline later, and tests,
see it. Offline, a cached adapter loads from the cache and anything else fails at once with an error
saying so: nothing waits for a network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from zoomkv.adapters.config import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME
from zoomkv.adapters.errors import AdapterError, AdapterNotFoundError, AdapterOfflineError
from zoomkv.adapters.files import is_incomplete

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_TRUE = {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cache_dir() -> str | None:
    # HF_HUB_CACHE first, then HF_HOME/hub, like huggingface_hub, but read now rather than at its import.
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def check_local_folder(folder: Path) -> Path:
    if is_incomplete(folder):
        raise AdapterNotFoundError(f"{folder} is an incomplete export (interrupted); run the export again")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (folder / name).is_file():
            raise AdapterNotFoundError(f"{folder} is not an adapter folder: no {name}")
    return folder


def resolve_adapter(name_or_path: str | Path, *, revision: str | None = None, token: str | bool | None = None,
                    local_files_only: bool | None = None) -> Path:
    """A local folder holding ``adapter_config.json`` and ``adapter_model.safetensors`` for ``name_or_path``."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return check_local_folder(path)
    text = str(name_or_path)
    if not _HUB_ID.match(text) or text.count("/") > 1:
        raise AdapterNotFoundError(f"adapter {text!r}: no such folder, and not a Hub id (owner/name)")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline() if local_files_only is None else (local_files_only or hub_offline())
    folder: Path | None = None
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        try:
            file = hf_hub_download(text, name, revision=revision, cache_dir=hub_cache_dir(), token=token,
                                   local_files_only=offline, library_name="zoomkv")
        except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
            # Also raised online when the Hub cannot be reached and the file is not cached.
            why = "the Hub is offline (HF_HUB_OFFLINE)" if offline else "the Hub cannot be reached"
            raise AdapterOfflineError(
                f"adapter {text!r}{'@' + revision if revision else ''}: no such local folder; {why} and it "
                f"is not in the local Hub cache ({hub_cache_dir() or 'default cache'})"
            ) from err
        except RepositoryNotFoundError as err:
            raise AdapterNotFoundError(
                f"adapter {text!r}: no such local folder, and no such Hub repository (or no access)"
            ) from err
        except HFValidationError as err:  # 'a/..', '-x/y': the Hub's own rules for an id
            raise AdapterNotFoundError(f"adapter {text!r}: no such local folder, and not a valid Hub id ({err})") from err
        except RevisionNotFoundError as err:
            raise AdapterNotFoundError(f"adapter {text!r}: no revision {revision!r}") from err
        except EntryNotFoundError as err:
            raise AdapterNotFoundError(f"Hub repository {text!r} is not a zoomkv adapter: no {name}") from err
        except HfHubHTTPError as err:
            raise AdapterError(f"adapter {text!r}: the Hub answered {err}") from err
        folder = Path(file).parent
    assert folder is not None
    return folder


def push_folder(folder: str | Path, repo_id: str, *, private: bool | None = None, token: str | None = None,
                revision: str | None = None, commit_message: str | None = None, endpoint: str | None = None,
                create_pr: bool = False) -> str:
    """Upload an adapter folder (checked to load first) to ``repo_id``; returns the commit URL."""
    folder = check_local_folder(Path(folder))
    if hub_offline():
        raise AdapterOfflineError(f"cannot push to {repo_id!r}: the Hub is offline (HF_HUB_OFFLINE)")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=endpoint, token=token, library_name="zoomkv")
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            folder_path=str(folder), repo_id=repo_id, revision=revision, repo_type="model",
            allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, CARD_NAME],
            commit_message=commit_message or "Upload zoomkv adapter", create_pr=create_pr,
        )
    except (HfHubHTTPError, ValueError, OSError) as err:  # ValueError: the Hub rejected the card's metadata
        raise AdapterError(f"push to {repo_id!r} failed: {err}") from err
    except Exception as err:
        # Connection errors come from the HTTP client huggingface_hub uses (httpx or its vendored fork):
        # an unreachable Hub is a user-facing condition, not a bug.
        if type(err).__module__.split(".")[0].startswith(("httpx", "httpcore")):
            raise AdapterError(f"push to {repo_id!r} failed: the Hub cannot be reached ({err})") from err
        raise
    return str(getattr(info, "commit_url", info))
