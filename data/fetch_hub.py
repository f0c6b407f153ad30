"""A small stand-in for the Hugging Face hub's file-download protocol, for offline tests and
measurements of data/cached_fineweb10B.py and data/text_to_shards.py (used by data/fetch_bench.py
and the tests).

What huggingface_hub's hf_hub_download does for a dataset file (checked against 2.4.0):
1. HEAD {endpoint}/datasets/{repo}/resolve/{revision}/{filename}, redirects not followed
   across hosts. It needs X-Repo-Commit and an ETag (X-Linked-Etag wins over ETag) and takes
   the size from X-Linked-Size, else Content-Length (not on a redirect). On a 302 to another
   host (the real hub's CDN) the download URL is the Location header. Errors are mapped by
   X-Error-Code (EntryNotFound, RepoNotFound, RevisionNotFound).
2. GET on that URL; on a dropped connection it retries with "Range: bytes=<done>-" and
   expects 206 plus Content-Range.
Sending X-Xet-Hash (or a Link rel="xet-auth") would switch the client to the Xet protocol,
so this server never sends either: downloads stay plain HTTP.

The one API call the fetch script makes besides (checked against 2.4.0):
HfApi.dataset_info(repo, files_metadata=True): GET {endpoint}/api/datasets/{repo}?blobs=True,
answered with JSON {"id", "sha", "siblings": [{"rfilename", "size", "blobId", "lfs": {"sha256",
"size", "pointerSize"}}]}: the commit, and the size and published sha256 of every LFS file (a file
added with lfs=False is kept in git: no "lfs", and its git blob id as "blobId" and ETag).

Two listeners share one state: the hub (serves /resolve/) and a "CDN" on another port, so a
302 from one to the other crosses origins the way huggingface.co -> CDN does.

Per-file behaviours (mode): "ok", "missing" (404 EntryNotFound), "corrupt" (magic number
flipped; HEAD size and ETag describe the corrupt bytes, as for a bad file on the hub),
"tampered" (a few token bytes changed, header and size intact; the sha256 the hub publishes, in
the API and the ETag, is still that of the true bytes, as when a mirror or CDN serves bad bytes),
"drop" (send `cut` bytes of the body, then close the connection; later GETs get `then`:
"fail" = HTTP 503, "serve" = served normally, Range included), "stall" (send `cut` bytes,
then hang until release()).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass
from dataclasses import field
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer
from pathlib import Path

import numpy as np
import shards

# any 40 hex digits will do
COMMIT = "4b1f0c2d9e8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c"


def shard_bytes(tokens: np.ndarray) -> bytes:
    """A token shard: its header, then uint16 tokens."""
    return shards.header(len(tokens)) + np.asarray(tokens, dtype="<u2").tobytes()


def git_blob_id(data: bytes) -> str:
    """What git (and the hub, for a file not in LFS) names `data` by."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def random_shard(n_tokens: int, seed: int) -> bytes:
    return shard_bytes(
        np.random.default_rng(seed).integers(0, 50257, n_tokens, dtype=np.uint16)
    )


def write_random_shard(
    path: Path, n_tokens: int, seed: int, chunk: int = 1 << 24
) -> None:
    """Write a big shard without holding it in memory (for the throughput measurement)."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(shards.header(n_tokens))
        for start in range(0, n_tokens, chunk):
            block = rng.integers(
                0, 50257, min(chunk, n_tokens - start), dtype=np.uint16
            )
            f.write(block.astype("<u2").tobytes())


@dataclass
class Entry:
    # big files are served from disk ...
    path: Path | None
    # ... small ones from memory
    data: bytes | None
    mode: str = "ok"
    cut: int = 0
    then: str = "fail"
    gets: int = 0

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else self.path.stat().st_size

    def read(self, start: int, end: int) -> bytes:
        if self.data is not None:
            return self.data[start:end]
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def sha256(self) -> str:
        h = hashlib.sha256()
        if self.data is not None:
            h.update(self.data)
        else:
            with open(self.path, "rb") as f:
                while block := f.read(1 << 24):
                    h.update(block)
        return h.hexdigest()


@dataclass
class Request:
    server: str  # "hub" or "cdn"
    method: str
    path: str
    filename: str | None
    range: str | None
    status: int = 0
    # body bytes written
    sent: int = 0


@dataclass
class FakeHub:
    repo: str = "kjj0/fineweb10B-gpt2"
    # answer /resolve/ with a 302 to the CDN listener, as the hub does for big files
    redirect: bool = True
    # answer every hub request with this status (401, 403), as without a token
    refuse: int | None = None
    files: dict[str, Entry] = field(default_factory=dict)
    log: list[Request] = field(default_factory=list)

    def __post_init__(self):
        self._lock = threading.Lock()
        self._release = threading.Event()
        # set once a "stall" file has sent its bytes
        self.stalled = threading.Event()
        self._etags: dict[str, str] = {}
        # names of files kept in git itself, not in LFS
        self._in_git: dict[str, bool] = {}
        self._stopped = False
        self.hub = _Server(("127.0.0.1", 0), self, "hub")
        self.cdn = _Server(("127.0.0.1", 0), self, "cdn")
        self.endpoint = f"http://127.0.0.1:{self.hub.server_port}"
        # stop() waits up to one poll interval for each listener
        self._threads = [
            threading.Thread(target=s.serve_forever, args=(0.01,), daemon=True)
            for s in (self.hub, self.cdn)
        ]
        for t in self._threads:
            t.start()

    # ---- set-up
    def add(
        self,
        name: str,
        content: bytes | Path,
        mode: str = "ok",
        cut: int = 0,
        then: str = "fail",
        lfs: bool = True,
    ) -> None:
        """Serve `content` as `name`: an LFS file (the hub publishes its sha256), or with `lfs`
        False a file kept in git itself (the hub publishes its git blob id)."""
        if isinstance(content, Path):
            entry = Entry(content, None, mode, cut, then)
        else:
            # flip the magic number
            if mode == "corrupt":
                content = (shards.MAGIC + 1).to_bytes(4, "little") + content[4:]
            entry = Entry(None, bytes(content), mode, cut, then)
        published = entry.sha256() if lfs else git_blob_id(entry.read(0, entry.size))
        # change two token bytes after the hash was published
        if mode == "tampered":
            flipped = bytes(b ^ 0xFF for b in content[1030:1032])
            entry.data = content[:1030] + flipped + content[1032:]
        with self._lock:
            self.files[name] = entry
            self._etags[name] = published
            self._in_git[name] = not lfs

    def served(self, name: str) -> bytes:
        """The exact bytes a client gets for `name` (after any corruption)."""
        entry = self.files[name]
        return entry.read(0, entry.size)

    def release(self) -> None:
        self._release.set()

    def stop(self) -> None:
        """Close both listeners: from now on connections are refused, like a hub that is down."""
        self._release.set()
        if self._stopped:
            return
        self._stopped = True
        for s in (self.hub, self.cdn):
            s.shutdown()
            s.server_close()

    # ---- inspection
    def requests(self, method: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.log if method is None or r.method == method]

    def file_gets(self) -> list[Request]:
        """GETs that transfer file bodies (on the hub or the CDN)."""
        return [r for r in self.requests("GET") if r.filename is not None]


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, hub: FakeHub, role: str):
        self.fake = hub
        self.role = role
        super().__init__(address, _Handler)


RESOLVE = re.compile(
    r"^/datasets/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<name>[^?]+)$"
)
API = re.compile(r"^/api/datasets/(?P<repo>[^/]+/[^/]+)$")
CDN = re.compile(r"^/cdn/(?P<name>[^?]+)$")


class _Handler(BaseHTTPRequestHandler):
    # keep-alive, as the real hub
    protocol_version = "HTTP/1.1"
    server: _Server

    # keep test output clean
    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self._handle(body=False)

    def do_GET(self):
        self._handle(body=True)

    # ---- request handling
    def _handle(self, body: bool):
        fake, role = self.server.fake, self.server.role
        path = self.path.split("?")[0]
        m = (RESOLVE if role == "hub" else CDN).match(path)
        name = m["name"] if m else None
        req = Request(
            role,
            self.command,
            self.path,
            name if body else None,
            self.headers.get("Range"),
        )
        with fake._lock:
            fake.log.append(req)
        if role == "hub" and fake.refuse:
            return self._error(req, fake.refuse, None, "Unauthorized")
        if role == "hub" and (api := API.match(path)):
            return self._dataset_info(req, api)
        entry = fake.files.get(name) if m else None
        if m is None or (role == "hub" and m["repo"] != fake.repo):
            return self._error(req, 404, "RepoNotFound", "Repository not found")
        if entry is None or entry.mode == "missing":
            return self._error(
                req, 404, "EntryNotFound", f"{name} does not exist on 'main'"
            )
        if role == "hub" and fake.redirect:
            return self._redirect(req, name, entry)
        self._send_file(req, name, entry, body)

    def _dataset_info(self, req: Request, m: re.Match):
        fake = self.server.fake
        with fake._lock:
            files = {n: e for n, e in fake.files.items() if e.mode != "missing"}
        if m["repo"] != fake.repo:
            return self._error(req, 404, "RepoNotFound", "Repository not found")
        siblings = [
            {"rfilename": n, "size": e.size, "blobId": fake._etags[n]}
            if fake._in_git[n] else
            {"rfilename": n, "size": e.size, "blobId": "0" * 40,
             "lfs": {"sha256": fake._etags[n], "size": e.size, "pointerSize": 134}}
            for n, e in files.items()
        ]
        body = json.dumps({"id": fake.repo, "sha": COMMIT, "siblings": siblings}).encode()
        req.status = 200
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _common_headers(self, name: str, entry: Entry):
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{self.server.fake._etags[name]}"')
        self.send_header("Accept-Ranges", "bytes")

    def _redirect(self, req: Request, name: str, entry: Entry):
        # What huggingface.co answers for an LFS file: metadata in X-Linked-*, bytes elsewhere.
        cdn_port = self.server.fake.cdn.server_port
        req.status = 302
        self.send_response(302)
        self._common_headers(name, entry)
        self.send_header("X-Linked-Etag", f'"{self.server.fake._etags[name]}"')
        self.send_header("X-Linked-Size", str(entry.size))
        self.send_header("Location", f"http://127.0.0.1:{cdn_port}/cdn/{name}?sig=test")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send_file(self, req: Request, name: str, entry: Entry, body: bool):
        fake = self.server.fake
        size = entry.size
        start = 0
        end = entry.size
        first_get = False
        if body:
            with fake._lock:
                entry.gets += 1
                first_get = entry.gets == 1
            if entry.mode == "drop" and not first_get and entry.then == "fail":
                return self._error(req, 503, None, "Service unavailable")
        rng = re.fullmatch(r"bytes=(\d+)-(\d*)", req.range or "")
        if rng:
            start = int(rng[1])
            end = min(size, int(rng[2]) + 1) if rng[2] else size
            if start >= size:
                return self._error(req, 416, None, "Range not satisfiable")
        req.status = 206 if rng else 200
        self.send_response(req.status)
        self._common_headers(name, entry)
        self.send_header("Content-Length", str(end - start))
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if not body:
            return
        limit = end
        if entry.mode in ("drop", "stall") and first_get:
            limit = min(end, start + entry.cut)
        self._write_body(req, entry, start, limit)
        # cut the transfer short
        if limit < end:
            if entry.mode == "stall":
                fake.stalled.set()
                fake._release.wait(timeout=60)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def _write_body(self, req: Request, entry: Entry, start: int, end: int):
        # big file: zero-copy from disk
        if entry.path is not None:
            with open(entry.path, "rb") as f:
                req.sent = self.connection.sendfile(f, start, end - start)
        else:
            self.wfile.write(entry.data[start:end])
            req.sent = end - start

    def _error(self, req: Request, status: int, code: str | None, message: str):
        body = json.dumps({"error": message}).encode()
        req.status = status
        self.send_response(status)
        self.send_header("X-Repo-Commit", COMMIT)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
