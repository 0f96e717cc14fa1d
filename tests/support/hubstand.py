"""A stand-in for the Hugging Face Hub on 127.0.0.1: serves one directory as one model repo,
enough of the API for huggingface_hub's snapshot_download (repo info, tree, resolve), and
records which files were fetched. There is no internet here; HF_ENDPOINT points at this."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    def __init__(self, repo: str, directory: Path):
        self.repo, self.dir = repo, directory
        self.fetched: list[str] = []  # file paths whose bytes were sent (GET)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self) -> list[Path]:
        return sorted(p for p in self.dir.rglob("*") if p.is_file())

    def entry(self, path: Path) -> dict:
        data = path.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        item = {"type": "file", "oid": blob, "size": len(data)}
        item["path"] = path.relative_to(self.dir).as_posix()
        if path.suffix in (".safetensors", ".bin"):  # the Hub keeps weights in LFS
            lfs = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            item["lfs"] = lfs
        return item

    def answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(req.path).path)
        api = f"/api/models/{self.repo}"
        resolve = f"/{self.repo}/resolve/"
        if path in (api, f"{api}/revision/main", f"{api}/revision/{COMMIT}"):
            siblings = [{"rfilename": e["path"]} for e in map(self.entry, self.files())]
            info = {"id": self.repo, "modelId": self.repo, "sha": COMMIT, "siblings": siblings}
            return self.send(req, 200, json.dumps(info).encode(), body, "application/json")
        if path.startswith(f"{api}/tree/"):
            listing = [self.entry(p) for p in self.files()]
            return self.send(req, 200, json.dumps(listing).encode(), body, "application/json")
        if path.startswith(resolve):
            name = path[len(resolve) :].split("/", 1)[1]
            file = self.dir / name
            if not file.is_file():
                return self.send(req, 404, b"", body, headers={"X-Error-Code": "EntryNotFound"})
            entry = self.entry(file)
            etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"'}
            if body:
                self.fetched.append(name)
            return self.send(req, 200, file.read_bytes(), body, headers=headers)
        self.send(req, 404, b"", body, headers={"X-Error-Code": "RepoNotFound"})

    @staticmethod
    def send(req, status, data, body, ctype="application/octet-stream", headers=None) -> None:
        req.send_response(status)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            req.send_header(key, value)
        req.end_headers()
        if body:
            req.wfile.write(data)
