"""The processes the tests start: their environment, their lifetime (each in a group of its own,
killed whole when its test or the session ends) and the warm interpreter that forks those which need
no launcher. No torch here: conftest.py starts the warm interpreter first, so that its imports run
beside this process's own and the collection."""
import atexit
import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# CPU steps allocate logits of 100+ MB; glibc maps and zeroes each afresh, which was 40% of a smoke
# run (page faults). Freed memory stays in the heap instead: in this process, and in every process
# the tests start
MALLOC_KEEP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2 ** 31 - 1),
               "MALLOC_TOP_PAD_": str(2 ** 28)}
# mallopt's M_MMAP_MAX, M_TRIM_THRESHOLD and M_TOP_PAD
MALLOPT = {"MALLOC_MMAP_MAX_": -4, "MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2}
os.environ.update(MALLOC_KEEP)
for name, option in MALLOPT.items():
    ctypes.CDLL(None).mallopt(option, int(MALLOC_KEEP[name]))

# The environment of every process the tests start, as it was at session start, without
# torchrun's variables: an in-process test that sets WORLD_SIZE (monkeypatch) while a background run
# starts must not reach that run.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "GROUP_RANK", "ROLE_RANK")
SESSION_ENV = {name: value for name, value in os.environ.items()
               if name not in LAUNCH_VARIABLES and not name.startswith("TORCHELASTIC_")}


def launch_env(**extra):
    """The session's environment for a started process, with `extra` set."""
    return dict(SESSION_ENV, **extra)


def worker_env(**extra):
    """launch_env for the worker scripts in tests/, which import train_gpt from the repository
    whatever the working directory."""
    path = os.pathsep.join(filter(None, [str(REPO), SESSION_ENV.get("PYTHONPATH")]))
    return launch_env(PYTHONPATH=path, **extra)


# --- processes: each in a group of its own, killed whole when its test or the session ends ---

LIVE_GROUPS = set()
LIVE_LOCK = threading.Lock()


def descendants(pid):
    """The processes under pid, found through /proc's parent links (none where there is no /proc).
    torchrun starts each worker in a session of its own, out of its launcher's process group."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the fields after the command's closing parenthesis: state, parent, ...
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found = []
    frontier = [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def kill_group(process):
    """Kill the process and everything it started: its group (run.sh's children) and every
    descendant, listed first (torchrun's workers, each in a session of its own)."""
    tree = descendants(process.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with LIVE_LOCK:
        LIVE_GROUPS.discard(process)


def kill_every_live_group():
    """What a failed, stopped or timed-out test left running: killed at the end of the session."""
    with LIVE_LOCK:
        live = list(LIVE_GROUPS)
    for process in live:
        kill_group(process)


# and whatever is still alive when this interpreter exits
atexit.register(kill_every_live_group)


def start_process(command, **kwargs):
    """subprocess.Popen in a new session (so its process group can be killed whole), remembered
    until kill_group or the end of the session."""
    process = subprocess.Popen(command, start_new_session=True, **kwargs)
    with LIVE_LOCK:
        LIVE_GROUPS.add(process)
    return process


@contextlib.contextmanager
def started(command, **kwargs):
    """start_process for a `with` block; the group is killed when the block ends, however it
    ends."""
    process = start_process(command, **kwargs)
    try:
        yield process
    finally:
        kill_group(process)
        process.wait()


def run_process(command, timeout, **kwargs):
    """subprocess.run(command, capture_output=True, text=True, timeout=timeout) whose process group
    (torchrun's workers too) is killed when it ends, times out or the test stops."""
    with started(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(process)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


# --- a warm interpreter: `python -c CODE` forked from one that has imported torch -----------------

# Its loop: one request (a JSON line) at a time, each forked into a child that runs it as `python
# -c CODE ARGS...` would (a session of its own, the request's environment, working directory and
# output files, stdin empty; at its end the threads joined and the atexit functions run); the
# child's process id answered at once, its exit code and CPU seconds once it has ended. The imports
# are made with the collector off, their objects then frozen (helpers.imported_frozen); inductor's
# among them (about 2 s of each compiling child's CPU), none of its caches read or written. They
# are made where `import triton` fails (as on macOS and Windows), which the smoke runs need and the
# others do not mind; a child may make triton importable again (del sys.modules["triton"]).
WARM_LOOP = """import gc
gc.disable()
import atexit, json, os, sys, threading, traceback
sys.modules["triton"] = None
import torch, torch._dynamo, torch._inductor.compile_fx, train_gpt
gc.freeze()
gc.enable()


def run(request):
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    sys.argv = ["-c", *request["args"]]
    try:
        exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code or 0)


for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        run(request)
    print(json.dumps({"pid": pid}), flush=True)
    _, status, usage = os.wait4(pid, 0)
    cpu = usage.ru_utime + usage.ru_stime
    print(json.dumps({"code": os.waitstatus_to_exitcode(status), "cpu": cpu}), flush=True)
"""


class ForkedChild:
    """A child of the warm interpreter, for kill_group: its process id is its group's."""

    def __init__(self, pid):
        self.pid = pid


class WarmPython:
    """`python -c CODE` without paying for torch's import each time (about 5 s of CPU with
    torch._dynamo's, most of a small process's time): each run is forked from one interpreter that
    imported torch, torch._dynamo, inductor and train_gpt once, without triton (WARM_LOOP), started
    with worker_env and one thread. What a run reads from the environment at start-up (PYTHONPATH,
    the thread count) is that interpreter's; what it reads later (cache folders, say) is its own.
    One run at a time; each child's CPU seconds are added to `cpu_seconds`."""

    def __init__(self):
        self.process = None
        self.lock = threading.Lock()
        self.cpu_seconds = 0.0

    def start(self):
        """Starts the interpreter (its imports then run beside whatever comes next), once."""
        with self.lock:
            if self.process is None:
                # unbuffered: a line read never takes the next one with it, unseen by select
                self.process = start_process(
                    [sys.executable, "-c", WARM_LOOP], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, bufsize=0, cwd=REPO,
                    env=worker_env(OMP_NUM_THREADS="1"))

    def answer(self, timeout=None):
        """The loop's next line, parsed; waits at most `timeout` seconds (None: no limit)."""
        if timeout is not None and not select.select([self.process.stdout], [], [], timeout)[0]:
            return None
        line = self.process.stdout.readline()
        assert line, "the warm interpreter has ended (its error is above)"
        return json.loads(line)

    def run(self, code, args=(), timeout=300, cwd=REPO, env=None):
        """subprocess.run([python, "-c", code, *args], capture_output=True, text=True, ...) as a
        fork of the warm interpreter; `env` by default worker_env()."""
        self.start()
        with self.lock, tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {"code": code, "args": list(map(str, args)), "cwd": str(cwd),
                       "env": worker_env() if env is None else env, "stdout": str(out),
                       "stderr": str(err)}
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            child = ForkedChild(self.answer()["pid"])
            with LIVE_LOCK:
                LIVE_GROUPS.add(child)
            ended = self.answer(timeout)
            # whatever it started is killed with it
            kill_group(child)
            if ended is None:
                self.answer()
                raise subprocess.TimeoutExpired(["python", "-c", code, *args], timeout)
            self.cpu_seconds += ended["cpu"]
            return subprocess.CompletedProcess(["python", "-c", code, *args], ended["code"],
                                               out.read_text(), err.read_text())


WARM_PYTHON = WarmPython()
