"""The data tools with the real huggingface_hub client, against a stand-in of the hub's download
protocol and of the one API call they make (dataset_info, for the published sha256 of each file)
on 127.0.0.1 (FakeHub, below): data/cached_fineweb10B.py, and at the end data/text_to_shards.py
on a dataset's files (its card's configs, the published hashes). Offline: HF_ENDPOINT points at the
stand-in, HF_HOME/HF_HUB_CACHE into tmp_path.

Most runs call the script's main() in this process, with the environment a fresh process would
have and huggingface_hub's constants read from it again (as its import does), its connections
closed after each run. What needs a process of its own runs as users run it (slow): Ctrl-C,
SIGTERM and SIGKILL mid-download, a file-size limit (a full disk), and a copy of the script run
from another folder."""

from __future__ import annotations

import collections
import contextlib
import errno
import glob
import gzip
import hashlib
import importlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import cached_fineweb10B
import files
import numpy as np
import pytest
import shards
import text_to_shards
import tiktoken
from helpers import launch_env
from helpers import run_process
from hub import HubError
from hub import card_patterns
from hub import glob_regex
from tiktoken_ext.openai_public import r50k_pat_str

ROOT = Path(__file__).resolve().parents[1]
try:  # the trainer's reader has the last word on what counts as a readable shard
    train_gpt = importlib.import_module("train_gpt")
except ImportError:
    train_gpt = None

SCRIPT = ROOT / "data" / "cached_fineweb10B.py"
VAL = "fineweb_val_000000.bin"


# --- the stand-in hub -------------------------------------------------------------------------
# The Hugging Face hub on 127.0.0.1, as the data tools ask of it through the real huggingface_hub
# client (2.4.0). dataset_info: GET /api/datasets/REPO, each file's size and hash (an LFS file's
# sha256, else its git blob id). hf_hub_download: HEAD /datasets/REPO/resolve/REV/NAME
# (X-Repo-Commit and an ETag needed, errors in X-Error-Code), for an LFS file (`redirect`) a 302
# to another host, the CDN, with X-Linked-Size and -Etag; then a GET, resumed with Range once
# dropped. A file added with `cut`: its first GET sends that many bytes and closes the connection
# (`then` "stall": once stop() is called); the GETs after it get HTTP 503 (`then` "fail") or the
# file. Bytes other than those published: change `files[NAME].data` once added.

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


def train(i: int) -> str:
    return f"fineweb_train_{i:06d}.bin"


@pytest.fixture
def hub():
    h = FakeHub()
    h.add(VAL, random_shard(2000, seed=0))
    for i in range(1, 4):
        h.add(train(i), random_shard(3000 + i, seed=i))
    yield h
    h.stop()


def env_for(endpoint: str, tmp_path: Path, download_timeout: int = 5) -> dict[str, str]:
    """The environment of a run: no user token, cache or endpoint leaks in from the caller's. The
    stand-in speaks plain HTTP: the client trusts an empty folder of certificate authorities
    (SSL_CERT_DIR, no SSL_CERT_FILE) rather than load a bundle, 55 ms of CPU at each run's new
    client."""
    env = {k: v for k, v in launch_env().items()
           if not k.startswith(("HF_", "HUGGING")) and k != "SSL_CERT_FILE"}
    authorities = tmp_path / "no_certificate_authorities"
    authorities.mkdir(exist_ok=True)
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(tmp_path / "hf_home"),
        HF_HUB_CACHE=str(tmp_path / "hf_cache"),
        HF_HUB_DOWNLOAD_TIMEOUT=str(download_timeout),
        SSL_CERT_DIR=str(authorities),
    )
    return env


def fetch(hub: FakeHub | str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """main(argv) in this process, as `python data/cached_fineweb10B.py ARGS --dir tmp/data` runs:
    its exit status (argparse's 2 included), stdout and stderr."""
    endpoint = hub if isinstance(hub, str) else hub.endpoint
    argv = [*args, "--dir", str(tmp_path / "data")]
    stdout = io.StringIO()
    stderr = io.StringIO()
    with hub_environment(env_for(endpoint, tmp_path)), contextlib.redirect_stdout(stdout):
        with contextlib.redirect_stderr(stderr):
            try:
                code = cached_fineweb10B.main(argv)
            except SystemExit as stop:
                code = stop.code
    return subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue())


def command(tmp_path: Path, *args: str, wrapper: list[str] = ()) -> list[str]:
    return [sys.executable, *wrapper, str(SCRIPT), *args, "--dir", str(tmp_path / "data")]


def fetch_in_a_process(hub: FakeHub, tmp_path: Path, *args: str, wrapper: list[str] = (),
                       timeout: int = 60) -> subprocess.CompletedProcess:
    """The script run as users run it, in a process of its own."""
    return run_process(command(tmp_path, *args, wrapper=wrapper), timeout,
                       env=env_for(hub.endpoint, tmp_path))


class NoPause:
    """The time module, whose sleep returns at once."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds):
        pass


@pytest.fixture
def no_retry_pause(monkeypatch):
    """The hub client waits 1 s before it resumes a dropped download (file_download.http_get);
    the retry stays, the wait goes."""
    from huggingface_hub import file_download

    monkeypatch.setattr(file_download, "time", NoPause())


def header_ok(raw: bytes) -> bool:
    """The shard format (header of 256 int32: magic, version, count; then uint16 tokens), checked
    independently of both the fetch script and the trainer."""
    if len(raw) < 1024:
        return False
    magic, version, n = np.frombuffer(raw[:12], dtype="<i4")
    return magic == 20240520 and version == 1 and len(raw) == 1024 + 2 * n


def reader_accepts(path: Path) -> bool:
    ok = header_ok(path.read_bytes())
    if train_gpt is not None:
        try:
            tokens = train_gpt.load_data_shard(str(path))
            accepted = True
        except train_gpt.UserError:
            accepted = False
        assert accepted == ok, f"trainer and the shard format disagree about {path.name}"
        if accepted:  # and it reads the same tokens
            expected = np.frombuffer(path.read_bytes()[1024:], dtype="<u2")
            assert np.array_equal(
                np.asarray(tokens).astype(np.int64), expected.astype(np.int64)
            )
    return ok


def assert_only_good_shards(dest: Path, hub: FakeHub, expected: list[str]) -> None:
    """The folder holds exactly `expected`, byte-equal to what the hub served, and nothing
    the trainer's file patterns could pick up besides; no staging debris is left."""
    assert sorted(os.listdir(dest)) == sorted(expected)
    for name in expected:
        assert (dest / name).read_bytes() == hub.served(name), name
        assert reader_accepts(dest / name)
    for path in glob.glob(str(dest / "fineweb_*.bin")):
        assert reader_accepts(Path(path))


def assert_clean_failure(result: subprocess.CompletedProcess, *phrases: str) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr


# ----------------------------------------------------------------------------- happy paths


@pytest.mark.parametrize("redirect", [True, False], ids=["cdn-redirect", "direct"])
def test_fresh_download_of_val_and_two_shards(hub, tmp_path, redirect):
    hub.redirect = redirect
    result = fetch(hub, tmp_path, "2", "--workers", "3")
    assert result.returncode == 0, result.stderr
    dest = tmp_path / "data"
    assert_only_good_shards(dest, hub, [VAL, train(1), train(2)])
    assert sorted(r.filename for r in hub.file_gets()) == sorted(
        [VAL, train(1), train(2)]
    )
    assert all(
        r.range is None and r.server == ("cdn" if redirect else "hub")
        for r in hub.file_gets()
    )
    assert "3 of 3 shards present" in result.stdout
    assert f"{2000 + 3001 + 3002:,} tokens" in result.stdout
    # No second copy in the hub cache: nothing there bigger than a metadata file.
    cached = [p for p in (tmp_path / "hf_cache").rglob("*") if p.is_file()]
    assert all(p.stat().st_size < 1024 for p in cached), cached


def test_second_run_downloads_nothing_and_needs_no_network(hub, tmp_path):
    assert fetch(hub, tmp_path, "2").returncode == 0
    dest = tmp_path / "data"
    before = {n: (dest / n).stat() for n in os.listdir(dest)}
    hub.log.clear()

    again = fetch(hub, tmp_path, "2")
    assert again.returncode == 0, again.stderr
    assert hub.log == []  # not a single request, let alone a file GET
    assert "downloaded 0" in again.stdout

    hub.stop()  # and with the hub gone it still succeeds
    offline = fetch(hub, tmp_path, "2")
    assert offline.returncode == 0, offline.stderr
    after = {n: (dest / n).stat() for n in os.listdir(dest)}
    assert {n: (s.st_ino, s.st_mtime_ns) for n, s in after.items()} == {
        n: (s.st_ino, s.st_mtime_ns) for n, s in before.items()
    }


@pytest.mark.parametrize("damage", ["truncated", "bad-magic", "empty"])
def test_bad_local_shard_is_replaced(hub, tmp_path, damage):
    dest = tmp_path / "data"
    dest.mkdir()
    for name in (VAL, train(1)):
        (dest / name).write_bytes(hub.served(name))
    good = hub.served(train(2))
    bad = {
        "truncated": good[: len(good) // 2],
        "bad-magic": b"\0\0\0\0" + good[4:],
        "empty": b"",
    }[damage]
    (dest / train(2)).write_bytes(bad)

    result = fetch(hub, tmp_path, "2")
    assert result.returncode == 0, result.stderr
    # Only the bad one is fetched.
    assert [r.filename for r in hub.file_gets()] == [train(2)]
    assert f"{train(2)}: not a valid shard" in result.stderr
    assert_only_good_shards(dest, hub, [VAL, train(1), train(2)])


def test_resumes_after_a_dropped_connection(hub, tmp_path, no_retry_pause):
    # The hub client writes in 10 MiB chunks and resumes from the last whole chunk, so this
    # shard is 12 MB and the connection drops 10.5 MB in; the retry must ask for the rest only.
    chunk, cut = 10 * 2**20, 11_000_000
    hub.add(
        train(2), random_shard(6_000_000, seed=2), cut=cut, then="serve"
    )
    result = fetch(hub, tmp_path, "2")
    assert result.returncode == 0, result.stderr
    assert_only_good_shards(tmp_path / "data", hub, [VAL, train(1), train(2)])
    gets = [r for r in hub.file_gets() if r.filename == train(2)]
    size = len(hub.served(train(2)))
    assert [(r.range, r.status, r.sent) for r in gets] == [
        (None, 200, cut),
        (f"bytes={chunk}-", 206, size - chunk),
    ]


@pytest.mark.slow
def test_sister_dataset_and_default_folder_beside_the_script(tmp_path):
    # A copy of the script, run from another folder without --dir: files land beside the copy.
    copy = tmp_path / "repo" / "data" / "cached_fineweb10B.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(SCRIPT, copy)
    # with the modules it imports from its folder
    for helper in ("shards.py", "hub.py", "files.py"):
        shutil.copy(SCRIPT.parent / helper, copy.parent / helper)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    edu = FakeHub(repo="kjj0/finewebedu10B-gpt2")
    try:
        edu.add("finewebedu_val_000000.bin", random_shard(1000, seed=7))
        edu.add("finewebedu_train_000001.bin", random_shard(1500, seed=8))
        result = run_process([sys.executable, str(copy), "1", "--dataset", "finewebedu10B"],
                             60, cwd=elsewhere, env=env_for(edu.endpoint, tmp_path))
        assert result.returncode == 0, result.stderr
        folder = copy.parent / "finewebedu10B"
        assert_only_good_shards(
            folder, edu, ["finewebedu_val_000000.bin", "finewebedu_train_000001.bin"]
        )
        assert os.listdir(elsewhere) == []
    finally:
        edu.stop()


# ----------------------------------------------------------------------------- failures


@pytest.mark.parametrize("corruption", ["corrupt", "short"])
def test_bad_shard_on_the_hub_is_rejected(hub, tmp_path, corruption):
    if corruption == "corrupt":
        # The magic number is flipped (and the hub publishes the hash of those bytes).
        hub.add(train(2), (20240521).to_bytes(4, "little") + hub.served(train(2))[4:])
        why = "magic number 20240521"
    else:
        # The header promises more tokens than follow.
        hub.add(train(2), hub.served(train(2))[:2048])
        why = "header promises 3002 tokens"
    result = fetch(hub, tmp_path, "2")
    assert_clean_failure(result, train(2), "not a valid shard", why, "deleted")
    # It really was downloaded, and then refused.
    assert [r.filename for r in hub.file_gets()].count(train(2)) == 1
    assert_only_good_shards(tmp_path / "data", hub, [VAL, train(1)])
    assert f"missing: {train(2)}" in result.stdout


def test_shard_with_changed_bytes_is_rejected_by_its_hash(hub, tmp_path):
    # Right size, right header, two token bytes changed; the hub publishes the true bytes' sha256.
    true_bytes = hub.served(train(2))
    flipped = bytes(b ^ 0xFF for b in true_bytes[1030:1032])
    hub.files[train(2)].data = true_bytes[:1030] + flipped + true_bytes[1032:]
    served = hub.served(train(2))
    assert len(served) == len(true_bytes) and served[:1024] == true_bytes[:1024]
    assert served != true_bytes
    assert header_ok(served)  # so only a hash check can catch it
    result = fetch(hub, tmp_path, "2")
    got, published = (hashlib.sha256(b).hexdigest()[:16] for b in (served, true_bytes))
    mismatch = f"sha256 {got}... is not the hub's {published}..."
    assert_clean_failure(result, train(2), mismatch, "deleted")
    assert result.stderr.count("error:") == 1
    assert [r.filename for r in hub.file_gets()].count(train(2)) == 1
    assert_only_good_shards(tmp_path / "data", hub, [VAL, train(1)])
    assert f"missing: {train(2)}" in result.stdout


def test_present_shards_are_rehashed_only_with_verify(hub, tmp_path):
    dest = tmp_path / "data"
    dest.mkdir()
    good = hub.served(train(1))
    changed = good[:2000] + bytes([good[2000] ^ 1]) + good[2001:]
    (dest / VAL).write_bytes(hub.served(VAL))
    (dest / train(1)).write_bytes(changed)
    # By default a present shard is judged by header and size: kept, no network.
    plain = fetch(hub, tmp_path, "1")
    assert plain.returncode == 0, plain.stderr
    assert hub.log == [] and (dest / train(1)).read_bytes() == changed
    # --verify compares it with the hub's sha256, deletes it and fetches the true bytes.
    verified = fetch(hub, tmp_path, "1", "--verify")
    assert verified.returncode == 0, verified.stderr
    claimed, published = (hashlib.sha256(b).hexdigest()[:16] for b in (changed, good))
    assert f"{train(1)}: sha256 {claimed}... is not the hub's {published}..." in verified.stderr
    assert [r.filename for r in hub.file_gets()] == [train(1)]
    assert_only_good_shards(dest, hub, [VAL, train(1)])


@pytest.mark.parametrize("refusal", [401, 403, "no-such-dataset"])
def test_hub_refusals_are_one_line(hub, tmp_path, refusal):
    args = ["1"]
    if refusal == "no-such-dataset":  # the stand-in holds fineweb10B only
        args += ["--dataset", "finewebedu10B"]
        expected = ["the dataset kjj0/finewebedu10B-gpt2 was not found", hub.endpoint]
    else:
        hub.refuse = refusal
        expected = [f"HTTP {refusal}", "HF_TOKEN", hub.endpoint]
    result = fetch(hub, tmp_path, *args)
    assert_clean_failure(result, *expected)
    assert result.stderr.count("error:") == 1 and hub.file_gets() == []


def test_unreachable_hub_is_reported_and_good_shards_are_kept(hub, tmp_path):
    assert fetch(hub, tmp_path, "1").returncode == 0
    hub.stop()
    start = time.monotonic()
    result = fetch(hub, tmp_path, "2")
    # Fails fast instead of retrying for ~20 s per file.
    assert time.monotonic() - start < 10
    assert_clean_failure(result, "cannot reach", hub.endpoint, "are kept", "HF_ENDPOINT")
    assert result.stderr.count("error:") == 1
    assert_only_good_shards(tmp_path / "data", hub, [VAL, train(1)])


@pytest.mark.parametrize("first", [True, False], ids=["first-missing", "later"])
def test_file_missing_on_the_hub(hub, tmp_path, first):
    absent = train(1) if first else train(2)
    del hub.files[absent]
    if first:  # the run's first request (the reachability probe) is for the absent file
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / VAL).write_bytes(hub.served(VAL))
    result = fetch(hub, tmp_path, "3")
    assert_clean_failure(
        result, f"{absent} was not found in the dataset kjj0/fineweb10B-gpt2"
    )
    # The others still come.
    others = [n for n in (VAL, train(1), train(2), train(3)) if n != absent]
    assert_only_good_shards(tmp_path / "data", hub, others)


@pytest.mark.parametrize(
    "args",
    [["104"], ["-1"], ["2", "--workers", "0"], ["100", "--dataset", "finewebedu10B"]],
)
def test_bad_command_line(hub, tmp_path, args):
    result = fetch(hub, tmp_path, *args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    expected = {
        "104": "between 0 and 103",
        "-1": "between 0 and 103",
        "2": "--workers",
        "100": "between 0 and 99",
    }
    assert expected[args[0]] in result.stderr
    assert hub.log == []


def test_an_empty_dir_is_refused_in_one_line(hub, tmp_path, capsys):
    # not the current folder, unasked
    with pytest.raises(SystemExit) as stop:
        cached_fineweb10B.main(["2", "--dir", ""])
    assert stop.value.code == 2
    assert capsys.readouterr().err == "error: argument --dir: empty: give a folder's path; see --help\n"
    assert hub.log == []


@pytest.mark.parametrize("what", ["read-only", "record-is-a-folder", "staging-is-a-file"])
def test_a_folder_the_run_cannot_write_in_is_one_line(hub, tmp_path, monkeypatch, what):
    dest = tmp_path / "data"
    assert fetch(hub, tmp_path, "1").returncode == 0
    if what == "read-only":
        # as on a read-only file system (root writes past permission bits)
        def read_only(path, data):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

        monkeypatch.setattr(files, "write_atomically", read_only)
        line = f"error: cannot write to the folder {dest} (Read-only file system): make it writable"
    elif what == "record-is-a-folder":
        (dest / files.OWNER).mkdir()
        line = f"error: {dest / files.OWNER}: a folder, where the lock's record goes: move it away"
    else:
        (dest / cached_fineweb10B.STAGING).write_text("kept")
        line = f"error: {dest / cached_fineweb10B.STAGING}: not a folder, where the downloads are"
    result = fetch(hub, tmp_path, "2")
    assert result.returncode == 1
    errors = [text for text in result.stderr.splitlines() if text.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(line), result.stderr
    assert "Traceback" not in result.stderr
    assert (dest / train(1)).read_bytes() == hub.served(train(1))
    if what == "staging-is-a-file":
        assert (dest / cached_fineweb10B.STAGING).read_text() == "kept"


def test_dropped_connection_leaves_no_shard(hub, tmp_path, no_retry_pause):
    # The server cuts the body after 3000 bytes and refuses the client's resume request.
    hub.add(train(2), hub.served(train(2)), cut=3000, then="fail")
    result = fetch(hub, tmp_path, "2", "--workers", "1")
    assert_clean_failure(result, "503", train(2), "are kept")
    gets = [r for r in hub.file_gets() if r.filename == train(2)]
    assert [(r.status, r.sent) for r in gets] == [(200, 3000), (503, 0)]
    dest = tmp_path / "data"
    assert not (dest / train(2)).exists()
    # Wherever a partial file might hide, the trainer refuses it.
    for path in dest.rglob(train(2)):
        assert not reader_accepts(path)
    assert_only_good_shards(dest, hub, [VAL, train(1)])


@pytest.mark.slow
def test_disk_full_is_reported(hub, tmp_path):
    # A file-size limit makes writes past 6000 bytes fail (EFBIG), as a full disk would (ENOSPC).
    limit = 6000
    assert len(hub.served(VAL)) < limit < len(hub.served(train(1)))
    code = (
        "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
        "os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
    )
    wrapper = ["-c", code]
    result = fetch_in_a_process(hub, tmp_path, "1", "--workers", "1", wrapper=wrapper)
    assert_clean_failure(result, "disk is full", train(1), "are kept")
    assert_only_good_shards(tmp_path / "data", hub, [VAL])


def test_not_enough_space_is_reported_before_downloading(hub, tmp_path, monkeypatch):
    # The script sees 5000 bytes free; the hub's listing says the three shards need more.
    need = sum(len(hub.served(n)) for n in (VAL, train(1), train(2)))
    usage = collections.namedtuple("usage", "total used free")(10**12, 10**12, 5000)
    # for the script and the hub client, as in a process where it were so
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    result = fetch(hub, tmp_path, "2")
    assert_clean_failure(result, "not enough disk space", f"need {need:,} bytes",
                         "5,000 bytes is free")
    assert hub.file_gets() == []
    assert os.listdir(tmp_path / "data") == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
    ids=["ctrl-c", "term", "kill"],
)
def test_interrupted_download_leaves_no_shard(hub, tmp_path, sig):
    """In a process of its own: the signal ends it."""
    good = hub.served(train(1))
    # The server sends 3000 bytes, then hangs; the client would wait 60 s before retrying.
    hub.add(train(1), good, cut=3000, then="stall")
    env = env_for(hub.endpoint, tmp_path, download_timeout=60)
    proc = subprocess.Popen(command(tmp_path, "1", "--workers", "1"), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert hub.stalled.wait(30), "the download never started"
        # A second run meanwhile (in this process) is turned away, not let into .incoming/.
        if sig == signal.SIGINT:
            second = fetch(hub, tmp_path, "1")
            assert_clean_failure(second, f"another run (pid {proc.pid} on ", "is writing to")
        proc.send_signal(sig)
        # It exits at once, not after the stalled download.
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    dest = tmp_path / "data"
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 130
        assert "interrupted" in err and "Traceback" not in err
        assert not (dest / ".incoming").exists()
    assert not (dest / train(1)).exists()
    # With one worker the val shard came first: finished before the stall, it is kept.
    assert (dest / VAL).read_bytes() == hub.served(VAL)
    for path in glob.glob(str(dest / "fineweb_*.bin")):
        assert reader_accepts(Path(path))

    hub.add(train(1), good)  # the next run completes and clears any debris
    result = fetch(hub, tmp_path, "1")
    assert result.returncode == 0, result.stderr
    assert_only_good_shards(dest, hub, [VAL, train(1)])


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_a_pipe_or_a_folder_at_a_shards_name_is_reported_not_opened(hub, tmp_path, verify):
    """In a process of its own: opening the pipe would wait for a writer forever."""
    dest = tmp_path / "data"
    dest.mkdir()
    (dest / VAL).write_bytes(hub.served(VAL))
    os.mkfifo(dest / train(1))
    (dest / train(3)).mkdir()
    args = ["3", "--workers", "1"] + (["--verify"] if verify else [])
    result = fetch_in_a_process(hub, tmp_path, *args, timeout=30)
    assert_clean_failure(
        result, f"error: {dest / train(1)}: a pipe, not a regular file, where a shard should be: "
        "move it away, then rerun", f"error: {dest / train(3)}: a folder, not a file, where a "
        "shard should be")
    assert result.stderr.count("error:") == 2
    # left as they were; the others are there
    assert (dest / train(1)).is_fifo() and (dest / train(3)).is_dir()
    for name in (VAL, train(2)):
        assert (dest / name).read_bytes() == hub.served(name)
    assert [r.filename for r in hub.file_gets()] == [train(2)]


# --- data/text_to_shards.py on the hub's files, in a byte-level encoding ------------------------
EOT = 50256
WORDS = ["the", "speedrun", "na\u00efve", "\u65e5\u672c", "token", "shard", "\U0001F680",
         "d\u00e9j\u00e0", "42"]


def corpus(count, seed):
    """`count` documents of 0 to 60 words, seeded."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(0, 61))) for _ in range(count)]


def json_lines(documents):
    records = ({"id": i, "text": doc} for i, doc in enumerate(documents))
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def byte_encoding():
    """A stand-in for GPT-2's BPE: one token per UTF-8 byte, EOT at 50256."""
    return tiktoken.Encoding("bytes", pat_str=r50k_pat_str, special_tokens={"<|endoftext|>": EOT},
                             mergeable_ranks={bytes([b]): b for b in range(256)})


def byte_documents(out, name):
    """The documents of the shards text_to_shards wrote, the val shard first, read after their
    header (256 int32); each led by an EOT, decoded a byte per token."""
    paths = sorted(out.glob(f"{name}_val_*.bin")) + sorted(out.glob(f"{name}_train_*.bin"))
    tokens = np.concatenate([np.fromfile(path, "<u2", offset=1024) for path in paths])
    assert tokens[0] == EOT
    documents = np.split(tokens, np.flatnonzero(tokens == EOT))[1:]
    return [bytes(document[1:].tolist()).decode() for document in documents]


CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/*/*
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
---
# A stand-in dataset
"""


def test_hub_dataset_config_is_fetched_and_tokenized_in_file_order(tmp_path):
    stand_in = FakeHub(repo="someone/corpus", redirect=False)
    documents = corpus(60, seed=7)
    stand_in.add("README.md", CARD.encode())
    # listed out of order: read sorted by path
    for i in (2, 0, 1):
        part = gzip.compress(json_lines(documents[i::3]).encode())
        stand_in.add(f"sample/10BT/{i:03d}_00000.jsonl.gz", part)
    # another config's file
    stand_in.add("data/CC-MAIN-2024/000.jsonl.gz", gzip.compress(json_lines(documents).encode()))
    argv = ["--hub", "someone/corpus", "--hub_config", "sample-10BT", "--name", "edu", "--out",
            str(tmp_path / "out"), "--val_tokens", "100", "--workers", "1"]
    try:
        with hub_environment(env_for(stand_in.endpoint, tmp_path)):
            status = text_to_shards.main(argv, encoding=byte_encoding())
    finally:
        stand_in.stop()
    assert status == 0
    in_file_order = [doc for i in range(3) for doc in documents[i::3]]
    assert byte_documents(tmp_path / "out", "edu") == in_file_order
    fetched = [request.filename for request in stand_in.file_gets()]
    assert fetched == ["README.md"] + [f"sample/10BT/{i:03d}_00000.jsonl.gz" for i in range(3)]


# in LFS, the hub publishes a file's sha256 (and redirects to a CDN); in git, its git blob id
@pytest.mark.parametrize("lfs", [True, False])
def test_hub_bytes_that_are_not_the_published_ones_are_refused_then_fetched_again(tmp_path, capsys,
                                                                                  lfs):
    stand_in = FakeHub(repo="someone/corpus", redirect=lfs)
    documents = corpus(60, seed=3)
    parts = [json_lines(documents[:30]).encode(), json_lines(documents[30:]).encode()]
    stand_in.add("data/a.jsonl", parts[0], lfs=lfs)
    stand_in.add("data/b.jsonl", parts[1], lfs=lfs)
    # other words than those the hub published the hash of, as from a bad mirror
    assert b"speedrun" in parts[1]
    stand_in.files["data/b.jsonl"].data = parts[1].replace(b"speedrun", b"speedrum")
    out = tmp_path / "out"
    argv = ["--hub", "someone/corpus", "--hub_files", "data/*.jsonl", "--name", "c", "--out",
            str(out), "--val_tokens", "100", "--workers", "1"]
    try:
        with hub_environment(env_for(stand_in.endpoint, tmp_path)):
            status = text_to_shards.main(argv, encoding=byte_encoding())
            # after the progress bar's line
            last = capsys.readouterr().err.splitlines()[-1]
            assert status == 1
            assert last.startswith("error: someone/corpus:data/b.jsonl: ") and "rerun" in last
            # the hub serves the true bytes again: the rerun fetches them, not the refused ones
            stand_in.add("data/b.jsonl", parts[1], lfs=lfs)
            assert text_to_shards.main(argv, encoding=byte_encoding()) == 0
    finally:
        stand_in.stop()
    assert byte_documents(out, "c") == documents


def test_a_config_or_split_the_card_lacks_is_one_line(tmp_path):
    card = tmp_path / "README.md"
    card.write_text(CARD)
    patterns = card_patterns("someone/corpus", card, "sample-10BT", "train")
    assert patterns == ["sample/10BT/*"]
    unknown_config = r"no config 'nope' \(its configs: default, sample-10BT\)"
    with pytest.raises(HubError, match=unknown_config):
        card_patterns("someone/corpus", card, "nope", "train")
    unknown_split = r"has no split 'test' \(it has train\); pass --hub_split"
    with pytest.raises(HubError, match=unknown_split):
        card_patterns("someone/corpus", card, None, "test")
    pattern = glob_regex("data/*/*.parquet")
    assert pattern.fullmatch("data/CC-MAIN-2024/000.parquet")
    assert not pattern.fullmatch("data/a/b/000.parquet")
    assert glob_regex("data/**/*.parquet").fullmatch("data/a/b/000.parquet")
    some = glob_regex("sample/10BT/00[0-2]_?.parquet")
    matched = [some.fullmatch(f"sample/10BT/00{i}_0.parquet") is not None for i in range(4)]
    assert matched == [True, True, True, False]
    assert not glob_regex("[!d]*").fullmatch("data")
