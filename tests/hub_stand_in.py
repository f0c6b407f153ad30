"""A stand-in for the Hugging Face hub on 127.0.0.1: what the data tools ask of it through the real
huggingface_hub client (2.4.0). dataset_info: GET /api/datasets/REPO, each file's size and hash (an
LFS file's sha256, else its git blob id). hf_hub_download: HEAD /datasets/REPO/resolve/REV/NAME
(X-Repo-Commit and an ETag needed, errors in X-Error-Code), for an LFS file (`redirect`) a 302 to
another host, the CDN, with X-Linked-Size and -Etag; then a GET, resumed with Range once dropped.

A file added with `cut`: its first GET sends that many bytes and closes the connection (`then`
"stall": once stop() is called); the GETs after it get HTTP 503 (`then` "fail") or the file. Bytes
other than those published: change `files[NAME].data` once added.
"""
import contextlib
import hashlib
import importlib
import json
import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import shards

COMMIT = "4b1f0c2d9e8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c"


def random_shard(tokens, seed):
    ids = np.random.default_rng(seed).integers(0, 50257, tokens, dtype=np.uint16)
    return shards.header(tokens) + ids.astype("<u2").tobytes()


class FakeHub:
    """The hub of dataset `repo`, and its CDN. `refuse`: a status for every hub request (401, 403).
    `log`: every request (server, method, filename of a GET, range, status, body bytes sent)."""

    def __init__(self, repo="kjj0/fineweb10B-gpt2", redirect=True):
        self.repo = repo
        self.redirect = redirect
        self.refuse = None
        self.files = {}
        self.log = []
        self.stalled = threading.Event()
        self.released = threading.Event()
        self.servers = []
        for role in ("hub", "cdn"):
            server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            server.daemon_threads = True
            server.fake, server.role = self, role
            threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
            self.servers.append(server)
        self.endpoint = f"http://127.0.0.1:{self.servers[0].server_port}"

    def add(self, name, content, cut=None, then="fail", lfs=True):
        blob_id = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
        published = hashlib.sha256(content).hexdigest() if lfs else blob_id
        self.files[name] = SimpleNamespace(data=content, published=published, lfs=lfs, cut=cut,
                                           then=then, gets=0)

    def served(self, name):
        return self.files[name].data

    def file_gets(self):
        return [r for r in list(self.log) if r.filename is not None]

    def stop(self):
        """From now on connections are refused, as by a hub that is down."""
        self.released.set()
        for server in self.servers:
            server.shutdown()
            server.server_close()


class Handler(BaseHTTPRequestHandler):
    # keep-alive, as the hub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        hub, role = self.server.fake, self.server.role
        path = self.path.split("?")[0]
        if role == "hub":
            found = re.fullmatch(r"/datasets/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
            repo, name = found.groups() if found else (None, None)
        else:
            # where the hub's redirect points
            repo, name = hub.repo, path.removeprefix("/cdn/")
        request = SimpleNamespace(server=role, method=self.command, range=self.headers.get("Range"),
                                  filename=name if self.command == "GET" else None, status=0,
                                  sent=0)
        hub.log.append(request)
        file = hub.files.get(name)
        if role == "hub" and hub.refuse:
            return self.send(request, hub.refuse, {"X-Error-Message": "Unauthorized"})
        if path == f"/api/datasets/{hub.repo}":
            return self.send(request, 200, {}, json.dumps(self.listing()).encode())
        if name is None or repo != hub.repo:
            return self.send(request, 404, {"X-Error-Code": "RepoNotFound"})
        if file is None:
            return self.send(request, 404, {"X-Error-Code": "EntryNotFound"})
        headers = {"ETag": f'"{file.published}"', "Accept-Ranges": "bytes"}
        if role == "hub" and hub.redirect:
            cdn = f"http://127.0.0.1:{hub.servers[1].server_port}/cdn/{name}"
            return self.send(request, 302, {**headers, "X-Linked-Etag": f'"{file.published}"',
                                            "X-Linked-Size": str(len(file.data)), "Location": cdn})
        cut = None
        if self.command == "GET" and file.cut is not None:
            file.gets += 1
            if file.gets > 1 and file.then == "fail":
                return self.send(request, 503, {})
            cut = file.cut if file.gets == 1 else None
        # the client asks for the rest of a file: bytes=START-
        start = int(re.fullmatch(r"bytes=(\d+)-", request.range)[1]) if request.range else 0
        if request.range:
            headers["Content-Range"] = f"bytes {start}-{len(file.data) - 1}/{len(file.data)}"
        self.send(request, 206 if request.range else 200, headers, file.data[start:], cut)
        if cut is not None:
            if file.then == "stall":
                hub.stalled.set()
                hub.released.wait(60)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    do_HEAD = do_GET

    def listing(self):
        """What dataset_info reads."""
        hub = self.server.fake
        siblings = []
        for name, file in hub.files.items():
            sibling = {"rfilename": name, "size": len(file.data), "blobId": file.published}
            if file.lfs:
                sibling["lfs"] = {"sha256": file.published, "size": len(file.data),
                                  "pointerSize": 134}
            siblings.append(sibling)
        return {"id": hub.repo, "sha": COMMIT, "siblings": siblings}

    def send(self, request, status, headers, body=b"", cut=None):
        """The answer's headers and, to a GET, its body (or its first `cut` bytes)."""
        request.status = status
        self.send_response(status)
        for header, value in {"X-Repo-Commit": COMMIT, **headers}.items():
            self.send_header(header, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            request.sent = len(body[:cut])
            self.wfile.write(body[:cut])


@contextlib.contextmanager
def hub_environment(env):
    """os.environ as `env`, and huggingface_hub's constants read from it again, as a fresh process
    reads them on import (HF_ENDPOINT, say); afterwards both as they were, the client's connections
    closed and its progress bars as they were, as at a process's end."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub import utils

    bars_off = utils.are_progress_bars_disabled()
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    importlib.reload(constants)
    try:
        yield
    finally:
        huggingface_hub.close_session()
        os.environ.clear()
        os.environ.update(saved)
        importlib.reload(constants)
        if not bars_off:
            utils.enable_progress_bars()
