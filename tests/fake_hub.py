"""A Hugging Face hub on 127.0.0.1 for tests: it answers the routes huggingface_hub's snapshot_download and
hf_hub_download call (model info, the recursive tree, HEAD and GET of /REPO/resolve/REV/FILE, the hub's 404 codes), so
that a Hugging Face cache is filled by huggingface_hub itself (HF_ENDPOINT=FakeHub.url) from folders a test built.

Also `fill_hub_cache`: one child process with HF_ENDPOINT and HF_HOME set resolves hub ids with pagedllm's resolver
(huggingface_hub reads both variables at import, so a child is the honest way to set them).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

HUB_REPO = "tiny-org/tiny-llama"
HUB_GGUF_REPO = "tiny-org/tiny-llama-GGUF"
HUB_ONE_GGUF_REPO = "tiny-org/one-gguf"
HUB_SHARDED_REPO = "tiny-org/tiny-llama-sharded"
"""The repos of the `tiny_hub_cache` fixture (tests/conftest.py)."""


class FakeHub:
    """repos: {repo_id: {revision name: {path in repo: local file}}}; each revision gets a commit sha of its own
    (also accepted as a revision). `requests` records every (method, path) served."""

    def __init__(self, repos: dict[str, dict[str, dict[str, Path]]]):
        self.repos = {repo: {rev: (hashlib.sha1(f"{repo}@{rev}".encode()).hexdigest(), files)
                             for rev, files in revs.items()} for repo, revs in repos.items()}
        self.requests: list[tuple[str, str]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def commit(self, repo: str, revision: str = "main") -> str:
        return self.repos[repo][revision][0]

    def _lookup(self, repo: str, revision: str):
        revs = self.repos.get(repo)
        if revs is None:
            return "RepoNotFound", None
        for sha, files in revs.values():
            if revision == sha:
                return None, (sha, files)
        return (None, revs[revision]) if revision in revs else ("RevisionNotFound", None)  # the hub's X-Error-Code

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _json(self, obj) -> None:
                self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

            def _error(self, code: str, head: bool = False) -> None:
                self._send(404, json.dumps({"error": code}).encode(), {"X-Error-Code": code}, head)

            def _route(self, head: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append(("HEAD" if head else "GET", path))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"]:  # /api/models/ORG/NAME[/revision/REV | /tree/REV[/PATH]]
                    repo, rest = "/".join(parts[2:4]), parts[4:]
                    revision = rest[1] if len(rest) >= 2 else "main"
                    error, found = hub._lookup(repo, revision)
                    if error:
                        return self._error(error)
                    sha, files = found
                    if not rest or rest[0] == "revision":
                        return self._json({"id": repo, "modelId": repo, "sha": sha, "private": False,
                                           "siblings": [{"rfilename": name} for name in sorted(files)]})
                    if rest[0] == "tree":
                        return self._json([{"type": "file", "path": name, "size": file.stat().st_size,
                                            "oid": hashlib.sha1(file.read_bytes()).hexdigest()}
                                           for name, file in sorted(files.items())])
                    return self._send(404)
                if len(parts) >= 5 and parts[2] == "resolve":  # /ORG/NAME/resolve/REV/FILE
                    repo, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                    error, found = hub._lookup(repo, revision)
                    if error or name not in found[1]:
                        return self._error(error or "EntryNotFound", head)
                    sha, files = found
                    body = files[name].read_bytes()
                    return self._send(200, body, {"X-Repo-Commit": sha,
                                                  "ETag": f'"{hashlib.sha256(body).hexdigest()}"'}, head)
                self._send(404, head=head)

            def do_GET(self) -> None:
                self._route(head=False)

            def do_HEAD(self) -> None:
                self._route(head=True)

        return Handler


_RESOLVE_SCRIPT = """
import json, sys
from pagedllm.models.resolve import resolve_model, resolve_tokenizer
out = []
for kind, name, revision, download_dir in json.loads(sys.argv[1]):
    try:
        found = (resolve_model(name, revision=revision, download_dir=download_dir) if kind == "model"
                 else resolve_tokenizer(name, revision, download_dir))
        out.append({"kind": found.kind, "path": str(found.path), "name": found.name})
    except Exception as e:
        out.append({"error": f"{type(e).__name__}: {e}"})
print(json.dumps(out))
"""


def fill_hub_cache(hub_url: str, hf_home: Path, requests: list[tuple], env: dict[str, str] | None = None) -> list[dict]:
    """Resolve each (kind "model" or "tokenizer", hub id, revision, download_dir) in a child process with
    HF_ENDPOINT=hub_url and HF_HOME=hf_home (and `env`): huggingface_hub downloads into that cache. One dict per
    request: kind, path and name, or error."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    child_env.update(HF_ENDPOINT=hub_url, HF_HOME=str(hf_home), HF_HUB_DISABLE_PROGRESS_BARS="1",
                     HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ETAG_TIMEOUT="10", HF_HUB_DOWNLOAD_TIMEOUT="10",
                     **(env or {}))
    done = subprocess.run([sys.executable, "-c", _RESOLVE_SCRIPT, json.dumps(requests)], env=child_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
