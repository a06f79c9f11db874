"""A stand-in for the Hugging Face Hub's HTTP endpoints that huggingface_hub's download and upload use,
served on 127.0.0.1 only (the tests point HF_ENDPOINT at it). Not a mock of our code: huggingface_hub talks to
it exactly as to the Hub, and a request it does not know is recorded and answered 404.

Downloads: ``GET /api/{models,datasets}/ORG/NAME[/revision/REV]`` (repo info), ``GET .../tree/REV`` (file
listing), ``HEAD|GET /[datasets/]ORG/NAME/resolve/REV/FILE`` (file content, with the commit and ETag headers).
Uploads: ``POST /api/repos/create``, ``POST /api/validate-yaml`` (a README's front matter: accepted), ``POST /api/models/ORG/NAME/preupload/REV`` (every file "regular", i.e.
inline), ``POST /api/models/ORG/NAME/commit/REV`` (NDJSON: header, then base64 files), which makes the files
the repository's new content.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class HubState:
    """Repositories by (type, id): {path: bytes}, plus what was asked and committed."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], dict[str, bytes]] = {}
        self.unknown: list[str] = []
        self.commits: list[dict] = []
        self.downloads: list[str] = []
        self.validated: list[str] = []
        self.created: dict[tuple[str, str], dict] = {}  # (type, id) -> the create request (its `visibility`)
        self.paths: list[str] = []  # every request's path (a download at a revision names it)

    def add(self, kind: str, repo_id: str, files: dict[str, bytes]) -> None:
        """Create or replace a repository (``kind``: model or dataset)."""
        self.repos[(kind, repo_id)] = dict(files)

    def sha(self, kind: str, repo_id: str) -> str:
        """A 40-hex commit id that changes with the content."""
        h = hashlib.sha1(f"{kind}:{repo_id}".encode())
        for path, data in sorted(self.repos[(kind, repo_id)].items()):
            h.update(path.encode() + hashlib.sha1(data).digest())
        return h.hexdigest()


def _handler(state: HubState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(
            self, code: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False
        ) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, obj: object, code: int = 200) -> None:
            self._send(code, json.dumps(obj).encode(), {"Content-Type": "application/json"})

        def _not_found(self, head: bool = False) -> None:
            state.unknown.append(f"{self.command} {self.path}")
            self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head=head)

        def _repo(self, parts: list[str]) -> tuple[str, str, list[str]] | None:
            """(kind, repo_id, rest) of /api/{models,datasets}/ORG/NAME/rest..."""
            if len(parts) < 4 or parts[0] != "api" or parts[1] not in ("models", "datasets"):
                return None
            kind = "model" if parts[1] == "models" else "dataset"
            repo_id = f"{parts[2]}/{parts[3]}"
            return (kind, repo_id, parts[4:]) if (kind, repo_id) in state.repos else None

        def _resolve(self, head: bool) -> bool:
            state.paths.append(unquote(urlparse(self.path).path))
            parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
            kind = "model"
            if parts and parts[0] == "datasets":
                kind, parts = "dataset", parts[1:]
            if len(parts) < 5 or parts[2] != "resolve":
                return False
            repo_id, path = f"{parts[0]}/{parts[1]}", "/".join(parts[4:])
            files = state.repos.get((kind, repo_id))
            if files is None or path not in files:
                self._send(
                    404, b"{}", {"X-Error-Code": "EntryNotFound" if files else "RepoNotFound"}, head=head
                )
                return True
            data = files[path]
            if not head:
                state.downloads.append(f"{kind}:{repo_id}/{path}")
            self._send(
                200,
                data,
                {
                    "X-Repo-Commit": state.sha(kind, repo_id),
                    "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                    "Content-Type": "application/octet-stream",
                },
                head=head,
            )
            return True

        def do_HEAD(self) -> None:
            if not self._resolve(head=True):
                self._not_found(head=True)

        def do_GET(self) -> None:
            if self._resolve(head=False):
                return
            parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
            found = self._repo(parts)
            if found is None:
                return self._not_found()
            kind, repo_id, rest = found
            files = state.repos[(kind, repo_id)]
            sha = state.sha(kind, repo_id)
            if not rest or rest[0] == "revision":
                return self._json(
                    {
                        "id": repo_id,
                        "sha": sha,
                        "private": False,
                        "siblings": [{"rfilename": p, "size": len(d)} for p, d in sorted(files.items())],
                    }
                )
            if rest[0] == "tree":
                entries = [
                    {"type": "file", "path": p, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                    for p, d in sorted(files.items())
                ]
                return self._json(entries)
            return self._not_found()

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
            if parts[:2] == [
                "api",
                "validate-yaml",
            ]:  # the Hub checks a README's front matter before a commit
                state.validated.append(json.loads(body or b"{}").get("content", ""))
                return self._json({"errors": [], "warnings": []})
            if parts[:3] == ["api", "repos", "create"]:
                req = json.loads(body or b"{}")
                org = req.get("organization") or req.get("namespace")
                repo_id = f"{org}/{req['name']}" if org else req["name"]
                kind = req.get("type") or "model"
                state.repos.setdefault((kind, repo_id), {})
                state.created.setdefault((kind, repo_id), req)
                return self._json({"url": f"http://{self.headers['Host']}/{repo_id}", "name": repo_id})
            if len(parts) >= 5 and parts[0] == "api" and parts[1] == "models":
                repo_id = f"{parts[2]}/{parts[3]}"
                if ("model", repo_id) not in state.repos:
                    return self._not_found()
                if parts[4] == "preupload":
                    req = json.loads(body)
                    return self._json(
                        {
                            "files": [
                                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                for f in req["files"]
                            ],
                            "commitOid": state.sha("model", repo_id),
                        }
                    )
                if parts[4] == "commit":
                    lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
                    files = dict(state.repos[("model", repo_id)])
                    header = {}
                    for item in lines:
                        v = item.get("value", {})
                        if item["key"] == "header":
                            header = v
                        elif item["key"] == "file":
                            files[v["path"]] = base64.b64decode(v["content"])
                        elif item["key"] == "deletedFile":
                            files.pop(v["path"], None)
                        else:
                            return self._json({"error": f"unsupported commit item {item['key']}"}, 400)
                    state.repos[("model", repo_id)] = files
                    state.commits.append({"repo": repo_id, "header": header, "files": sorted(files)})
                    oid = state.sha("model", repo_id)
                    return self._json(
                        {
                            "commitUrl": f"http://{self.headers['Host']}/{repo_id}/commit/{oid}",
                            "commitOid": oid,
                            "success": True,
                        }
                    )
            return self._not_found()

    return Handler


class HubServer:
    """The stand-in, serving in a thread while used as a context manager; ``url`` is its HF_ENDPOINT."""

    def __init__(self) -> None:
        self.state = HubState()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.state))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
