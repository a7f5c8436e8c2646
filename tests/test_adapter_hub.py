"""Hub sharing: push and pull through huggingface_hub's real client code against a Hub-API server on
loopback, then the offline rules against the local Hub cache.

PyPI's ``hf-local-hub`` wheel ships only a Python wrapper around a Go binary it does not include, so the
server is the minimal Hub subset below (``http.server`` in a thread): create repo, preupload (every file
"regular"), commit (NDJSON, base64 contents), and ``resolve`` (HEAD/GET with the commit and ETag headers
the client needs). ``HfApi.upload_folder`` and ``hf_hub_download`` run unmodified against it. A second
test builds the cache layout by hand (``models--owner--name/snapshots/<rev>/``, ``refs/main``), as a
user's cache would hold it without this server.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_adapter_artifact import fresh_adapter, llama, probe_method, run  # noqa: F401  (fixtures)
from zoomkv.adapters.config import CONFIG_NAME, WEIGHTS_NAME
from zoomkv.adapters.errors import AdapterNotFoundError, AdapterOfflineError
from zoomkv.adapters.model import ZoomAdapter
from zoomkv.models import load_model


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, dict[str, bytes]]] = {}  # repo → commit → files
        self.heads: dict[str, str] = {}
        self.requests: list[str] = []
        self.validated = 0

    def commit(self, repo: str, files: dict[str, bytes]) -> str:
        parent = self.repos[repo].get(self.heads.get(repo, ""), {})
        sha = hashlib.sha1(json.dumps(sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items())).encode()
                           + str(time.time_ns()).encode()).hexdigest()
        self.repos[repo][sha] = {**parent, **files}
        self.heads[repo] = sha
        return sha


def validate_card_metadata(content: str) -> list[str]:
    import yaml

    if not content.startswith("---\n") or "\n---" not in content[4:]:
        return ["no YAML front matter"]
    try:
        meta = yaml.safe_load(content[4:content.index("\n---", 4)])
    except yaml.YAMLError as err:
        return [f"invalid YAML: {err}"]
    if not isinstance(meta, dict):
        return ["metadata is not a mapping"]
    problems = []
    if not isinstance(meta.get("library_name"), str):
        problems.append("library_name must be a string")
    if "tags" in meta and not (isinstance(meta["tags"], list) and all(isinstance(t, str) for t in meta["tags"])):
        problems.append("tags must be a list of strings")
    if "base_model" in meta and not isinstance(meta["base_model"], (str, list)):
        problems.append("base_model must be a model id")
    return problems


def make_handler(hub: FakeHub, port_box: list[int]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            pass

        def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None,
                  head: bool = False) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, code: int, obj: Any) -> None:
            self._send(code, json.dumps(obj).encode(), {"Content-Type": "application/json"})

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_POST(self) -> None:
            hub.requests.append(f"POST {self.path}")
            body = self._body()
            parts = self.path.split("?")[0].strip("/").split("/")
            if parts[:3] == ["api", "repos", "create"]:
                data = json.loads(body)
                repo = f"{data.get('organization') or 'user'}/{data['name']}" if "/" not in data["name"] else data["name"]
                if repo in hub.repos:
                    return self._json(409, {"error": "You already created this model repo", "url": repo})
                hub.repos[repo] = {}
                hub.commit(repo, {})
                return self._json(200, {"url": f"http://127.0.0.1:{port_box[0]}/{repo}"})
            if parts[:2] == ["api", "validate-yaml"]:
                # The README's front matter, as the Hub checks it before accepting a commit that touches it.
                problems = validate_card_metadata(json.loads(body)["content"])
                hub.validated += 1
                return self._json(400, {"error": "; ".join(problems)}) if problems else self._json(200, {})
            if parts[0] == "api" and parts[1] == "models" and parts[4] in ("preupload", "commit"):
                repo = f"{parts[2]}/{parts[3]}"
                if repo not in hub.repos:
                    return self._json(404, {"error": "Repository not found"})
                if parts[4] == "preupload":
                    files = json.loads(body)["files"]
                    return self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False} for f in files]})
                files: dict[str, bytes] = {}
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                sha = hub.commit(repo, files)
                return self._json(200, {"commitUrl": f"http://127.0.0.1:{port_box[0]}/{repo}/commit/{sha}",
                                        "commitOid": sha})
            self._json(404, {"error": "not implemented"})

        def _resolve(self, head: bool) -> None:
            hub.requests.append(f"{'HEAD' if head else 'GET'} {self.path}")
            parts = self.path.split("?")[0].strip("/").split("/")
            if len(parts) < 5 or parts[2] != "resolve":
                return self._send(404, head=head)
            repo, rev, name = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
            if repo not in hub.repos:
                return self._send(401, headers={"X-Error-Code": "RepoNotFound"}, head=head)
            sha = hub.heads[repo] if rev == "main" else rev
            files = hub.repos[repo].get(sha)
            if files is None:
                return self._send(404, headers={"X-Error-Code": "RevisionNotFound"}, head=head)
            if name not in files:
                return self._send(404, headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}, head=head)
            data = files[name]
            etag = '"' + hashlib.sha1(data).hexdigest() + '"'
            self._send(200, data, {"X-Repo-Commit": sha, "ETag": etag, "Content-Type": "application/octet-stream"},
                       head=head)

        def do_HEAD(self) -> None:
            self._resolve(head=True)

        def do_GET(self) -> None:
            self._resolve(head=False)

    return Handler


@pytest.fixture(autouse=True)
def _hub_mode_of_the_test(monkeypatch):
    """Every test here sets the Hub mode it needs itself: the environment's (HF_HUB_OFFLINE=1, as on many offline
    clusters) is cleared, and so is huggingface_hub's copy of it, read once when it was imported. zoomkv reads
    the variables at each call; a test that wants offline sets them."""
    import huggingface_hub.constants as c

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    hub = FakeHub()
    port_box: list[int] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(hub, port_box))
    port_box.append(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{port_box[0]}"
    import huggingface_hub.constants as c

    # The client reads the endpoint at import into constants; point both at the loopback server.
    monkeypatch.setattr(c, "ENDPOINT", endpoint)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    import huggingface_hub.hf_api as hf_api

    # Module-level helpers (hf_api.file_exists, used by PEFT) are bound to an HfApi made at import.
    monkeypatch.setattr(hf_api.api, "endpoint", endpoint)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_for_loopback_only")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    yield hub, endpoint
    server.shutdown()
    server.server_close()


def test_push_then_pull_through_loopback_hub(tmp_path, fake_hub, probe_method, llama, monkeypatch):  # noqa: F811
    hub, endpoint = fake_hub
    model, tok = llama
    adapter = fresh_adapter(model)
    expected = run(model, tok, adapter)
    url = adapter.push_to_hub("alice/probe-tiny", scores={"summary": [{"name": "niah", "accuracy": 0.9}],
                                                            "rows": []})
    assert "alice/probe-tiny" in url
    files = hub.repos["alice/probe-tiny"][hub.heads["alice/probe-tiny"]]
    assert sorted(files) == ["README.md", CONFIG_NAME, WEIGHTS_NAME]
    assert b"library_name: zoomkv" in files["README.md"] and hub.validated >= 1

    pulled = ZoomAdapter.from_pretrained("alice/probe-tiny")  # online: downloads into HF_HUB_CACHE
    assert run(model, tok, pulled) == expected
    assert any(r.startswith("GET /alice/probe-tiny/resolve/") for r in hub.requests)

    # Offline, the cached copy loads without a single request; an uncached id fails at once, saying so.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = len(hub.requests)
    assert run(model, tok, ZoomAdapter.from_pretrained("alice/probe-tiny")) == expected
    start = time.perf_counter()
    with pytest.raises(AdapterOfflineError, match="offline"):
        ZoomAdapter.from_pretrained("alice/never-pushed")
    assert time.perf_counter() - start < 5 and len(hub.requests) == n


def test_cli_push_and_missing_repo(tmp_path, fake_hub, probe_method, llama, capsys):  # noqa: F811
    from zoomkv.cli import main

    hub, endpoint = fake_hub
    folder = fresh_adapter(llama[0]).save_pretrained(tmp_path / "checkpoints" / "probe")
    assert main(["push", str(folder), "--repo-id", "bob/probe", "--endpoint", endpoint]) == 0
    assert "bob/probe" in capsys.readouterr().err  # a log line: stdout carries command output only
    assert sorted(hub.repos["bob/probe"][hub.heads["bob/probe"]]) == ["README.md", CONFIG_NAME, WEIGHTS_NAME]
    with pytest.raises(AdapterNotFoundError, match="no such Hub repository"):
        ZoomAdapter.from_pretrained("bob/does-not-exist")


def _hand_built_cache(cache: Path, repo_id: str, folder: Path, revision: str = "a" * 40) -> None:
    """huggingface_hub's cache layout: blobs by hash, snapshot files linking to them, refs/main."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    snap = root / "snapshots" / revision
    (root / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    for file in folder.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        (root / "blobs" / digest).write_bytes(file.read_bytes())
        (snap / file.name).symlink_to(Path("..") / ".." / "blobs" / digest)


def test_offline_hand_built_cache(tmp_path, probe_method, llama, monkeypatch):  # noqa: F811
    model, tok = llama
    adapter = fresh_adapter(model)
    folder = adapter.save_pretrained(tmp_path / "export")
    cache = tmp_path / "hub"
    _hand_built_cache(cache, "carol/probe", folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # An endpoint nobody listens on: were anything to reach for the network, it would fail, not hang.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    loaded = ZoomAdapter.from_pretrained("carol/probe")
    assert run(model, tok, loaded) == run(model, tok, adapter)
    with pytest.raises(AdapterOfflineError, match=r"offline \(HF_HUB_OFFLINE\) and it is not in the local Hub cache"):
        ZoomAdapter.from_pretrained("carol/not-cached")
    with pytest.raises(AdapterOfflineError, match="offline"):
        adapter.push_to_hub("carol/probe")
    assert torch.equal(loaded.modules.query_shift, adapter.modules.query_shift)


def test_peft_push_and_pull_through_loopback_hub(tmp_path, fake_hub, probe_method, llama):  # noqa: F811
    peft = pytest.importorskip("peft")
    from tests.test_adapter_peft import peft_run
    from zoomkv.adapters.peft_integration import ZoomKVPeftConfig

    hub, _ = fake_hub
    model, tok = llama
    adapter = fresh_adapter(model)
    expected = run(model, tok, adapter)
    adapter.push_to_hub("dave/probe")
    # PEFT pulls a zoomkv-pushed adapter by Hub id...
    pulled = peft.PeftModel.from_pretrained(load_model("tiny-llama")[0], "dave/probe")
    assert peft_run(pulled, tok) == expected
    # ...and pushes its own, which zoomkv pulls.
    fresh, _ = load_model("tiny-llama")
    torch.manual_seed(5)
    peft_model = peft.get_peft_model(fresh, ZoomKVPeftConfig.for_model(fresh, "adapter_probe", {"scale": 4.0}))
    peft_expected = peft_run(peft_model, tok)
    peft_model.push_to_hub("dave/probe-peft")
    assert WEIGHTS_NAME in hub.repos["dave/probe-peft"][hub.heads["dave/probe-peft"]]
    assert run(load_model("tiny-llama")[0], tok, ZoomAdapter.from_pretrained("dave/probe-peft")) == peft_expected


def test_peft_push_to_hub_and_zoomkv_push_publish_the_same_repo(tmp_path, fake_hub, probe_method, llama):  # noqa: F811
    """One adapter published both ways: `zoomkv push` of its export, and PeftModel.push_to_hub of the PEFT model
    loaded from that export. The same files, the same card (zoomkv's, not PEFT's generic one), and each loads
    through the other's loader to the same tokens."""
    from huggingface_hub import ModelCard

    peft = pytest.importorskip("peft")
    from tests.test_adapter_peft import peft_run
    from zoomkv.cli import main

    hub, endpoint = fake_hub
    model, tok = llama
    adapter = fresh_adapter(model)
    expected = run(model, tok, adapter)
    folder = adapter.save_pretrained(tmp_path / "export")
    assert main(["push", str(folder), "--repo-id", "fay/probe", "--endpoint", endpoint]) == 0
    peft_model = peft.PeftModel.from_pretrained(load_model("tiny-llama")[0], str(folder))
    peft_model.push_to_hub("fay/probe-peft")
    ours = hub.repos["fay/probe"][hub.heads["fay/probe"]]
    theirs = hub.repos["fay/probe-peft"][hub.heads["fay/probe-peft"]]
    assert sorted(ours) == sorted(theirs) == ["README.md", CONFIG_NAME, WEIGHTS_NAME]
    assert theirs["README.md"] == ours["README.md"]
    card = ModelCard(theirs["README.md"].decode())
    assert card.data.library_name == "zoomkv" and "Model Card for Model ID" not in card.text
    ours_config, theirs_config = json.loads(ours[CONFIG_NAME]), json.loads(theirs[CONFIG_NAME])
    for key in ("peft_type", "task_type", "base_model_name_or_path", "method", "hyper", "base_model", "budget"):
        assert ours_config[key] == theirs_config[key], key
    assert run(load_model("tiny-llama")[0], tok, ZoomAdapter.from_pretrained("fay/probe-peft")) == expected
    assert peft_run(peft.PeftModel.from_pretrained(load_model("tiny-llama")[0], "fay/probe"), tok) == expected

    # A card of the user's own in the folder PEFT saves into is theirs: PEFT adds its tags, zoomkv leaves it.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "README.md").write_text("---\nlicense: mit\n---\n\n# My adapter\n\nNotes.\n")
    peft_model.save_pretrained(mine)
    assert "# My adapter" in (mine / "README.md").read_text()


def test_push_to_unreachable_hub_is_a_one_line_error(tmp_path, probe_method, llama, monkeypatch, capsys):  # noqa: F811
    from zoomkv.cli import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_for_loopback_only")
    folder = fresh_adapter(llama[0]).save_pretrained(tmp_path / "probe")
    # Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
    assert main(["push", str(folder), "--repo-id", "eve/probe", "--endpoint", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zoomkv: error: push to 'eve/probe' failed") and len(err.strip().splitlines()) == 1
