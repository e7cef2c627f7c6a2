"""A local stand-in of the Hugging Face Hub's file API, for the real ``huggingface_hub``
client pointed at it through ``endpoint=`` / ``HF_ENDPOINT``.

It answers what a model download touches, as the Hub does (status codes and the
``X-Error-Code`` / ``X-Error-Message`` headers the client turns into its typed errors):

- ``GET /api/models/{repo}/revision/{rev}``: the listing (``siblings`` with sizes);
- ``HEAD|GET /{repo}/resolve/{rev}/{file}``: a file, with ``X-Repo-Commit``, ``ETag`` and
  ``Range`` support;
- a token the Hub does not know: 401 ``Invalid credentials in Authorization header``; a
  missing or private repository: 401 ``RepoNotFound``; a gated repository's files without
  a granted token: 401/403 ``GatedRepo`` (its listing stays public); a missing revision or
  file: 404 ``RevisionNotFound`` / ``EntryNotFound``.

Every request's path and ``Authorization`` header are recorded (``requests``), so a test
can see the token reach the Hub.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    private: bool = False
    readers: set[str] = field(default_factory=set)
    """Tokens granted a gated or private repository."""
    revisions: tuple[str, ...] = ("main",)

    def commit(self, revision: str) -> str:
        digest = hashlib.sha1(f"{revision}:{sorted(self.files)}".encode()).hexdigest()
        return revision if len(revision) == 40 else digest


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    authorization: str | None


class HubStandIn:
    """The stand-in server: ``with HubStandIn(repos, tokens) as hub: hub.url``."""

    def __init__(self, repos: dict[str, Repo], tokens: set[str] | None = None) -> None:
        self.repos = repos
        self.tokens = tokens or set()
        self.requests: list[Seen] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def authorizations(self) -> set[str | None]:
        return {r.authorization for r in self.requests}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _fail(self, status: int, code: str | None, message: str) -> None:
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                payload = json.dumps({"error": message}).encode()
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _token(self) -> tuple[bool, str | None]:
                """(known, token): a token the Hub does not know is refused outright."""
                auth = self.headers.get("Authorization")
                if not auth:
                    return True, None
                token = auth.removeprefix("Bearer ").strip()
                return token in hub.tokens, token

            def _serve(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append(Seen(self.command, path, self.headers.get("Authorization")))
                known, token = self._token()
                if not known:
                    self._fail(401, None, "Invalid credentials in Authorization header")
                    return
                if path.startswith("/api/models/") and "/revision/" in path:
                    repo_id, revision = path[len("/api/models/") :].split("/revision/", 1)
                    self._listing(repo_id, revision, token)
                elif "/resolve/" in path:
                    repo_id, rest = path.lstrip("/").split("/resolve/", 1)
                    revision, _, filename = rest.partition("/")
                    self._file(repo_id, revision, filename, token, body)
                else:
                    self._fail(404, None, "Not Found")

            def _repo(self, repo_id: str, token: str | None) -> Repo | None:
                repo = hub.repos.get(repo_id)
                if repo is None or (repo.private and token not in repo.readers):
                    self._fail(401, "RepoNotFound", "Repository not found")
                    return None
                return repo

            def _revision(self, repo: Repo, revision: str) -> str | None:
                commits = {repo.commit(r): r for r in repo.revisions}
                if revision in repo.revisions:
                    return repo.commit(revision)
                if revision in commits:
                    return revision
                self._fail(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return None

            def _listing(self, repo_id: str, revision: str, token: str | None) -> None:
                repo = self._repo(repo_id, token)
                if repo is None or (commit := self._revision(repo, revision)) is None:
                    return
                info = {
                    "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": commit,
                    "private": repo.private,
                    "gated": "manual" if repo.gated else False,
                    "disabled": False,
                    "tags": [],
                    "siblings": [
                        {
                            "rfilename": name,
                            "size": len(data),
                            "blobId": hashlib.sha1(data).hexdigest(),
                        }
                        for name, data in sorted(repo.files.items())
                    ],
                }
                payload = json.dumps(info).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _file(
                self, repo_id: str, revision: str, filename: str, token: str | None, body: bool
            ) -> None:
                repo = self._repo(repo_id, token)
                if repo is None or (commit := self._revision(repo, revision)) is None:
                    return
                if repo.gated and token not in repo.readers:
                    status = 401 if token is None else 403
                    self._fail(status, "GatedRepo", "Access to this model is restricted")
                    return
                data = repo.files.get(filename)
                if data is None:
                    self._fail(404, "EntryNotFound", f"{filename} does not exist")
                    return
                start = 0
                ranged = self.headers.get("Range", "")
                if ranged.startswith("bytes="):
                    start = int(ranged[len("bytes=") :].split("-", 1)[0] or 0)
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if body:
                    self.wfile.write(data[start:])

        return Handler
