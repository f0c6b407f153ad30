"""A data tool's worker processes: the standard library's process pool, with what the tools need
beyond it.

- Answers come in the order the tasks were given, with at most IN_FLIGHT tasks per worker handed
  out, so that memory stays flat whatever the input.
- A worker that dies ends the work in one line naming it and how it died (the pool says that one
  died, not which). One that cannot finish a task answers so, whatever was raised (pyo3's
  PanicException, a Rust panic, is no Exception). One that is stuck ends it too, on Linux: an
  answer awaited for STUCK_SECONDS in which no worker used the CPU (as /proc counts it) is one that
  no worker is making (a Rust panic holding the GIL, say, or a wait on nothing).
- A stop (Ctrl-C, SIGTERM, a closed terminal) is the run's to handle, at once, even while the
  workers are forked: it stops the run between two forks (Worker). The workers ignore Ctrl-C and a
  closed terminal.
- Workers never outlive the run: on Linux the kernel kills them when it ends, even by SIGKILL, and
  one that starts after the run ended leaves at once; elsewhere they leave once it is gone. A lock
  that the run holds is not theirs (a forked copy of its descriptor would hold it).
"""

import collections
import concurrent.futures
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool

IN_FLIGHT = 4
STUCK_SECONDS = 10
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LINUX = sys.platform.startswith("linux")
# Linux: fork, quick to start and nothing to pickle; elsewhere, the platform's default
BASE = multiprocessing.get_context("fork" if LINUX else None)
# in a worker: the function it answers with
WORKER = {}


class WorkerError(Exception):
    """A worker died, failed or is stuck: the message says which, and how."""


class Worker(BASE.Process):
    """A worker process. While it is forked, a stop signal is only noted: the run's handler would
    raise inside a fork's hooks (where Python prints the exception and forks on) or half-way
    through the start. It is raised again once the fork is done, before the next one."""

    def start(self):
        noted = []

        def note(signum, frame):
            noted.append(signum)

        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {signum: signal.signal(signum, note) for signum in STOP_SIGNALS}
        try:
            super().start()
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            if noted:
                signal.raise_signal(noted[0])


class Context(type(BASE)):
    """The pool's start method, its processes Workers, each kept in `created` (the pool's own list
    misses one whose start a stop cut short)."""

    def __init__(self):
        self.created = []

    def Process(self, *args, **kwargs):
        worker = Worker(*args, **kwargs)
        self.created.append(worker)
        return worker


class Workers:
    """`count` processes answering function(task) for the tasks given to answers()."""

    def __init__(self, count, function, lock=None, name="worker"):
        self.count = count
        self.name = name
        self.context = Context()
        lock = lock if self.context.get_start_method() == "fork" else None
        arguments = (function, os.getpid(), lock)
        self.pool = concurrent.futures.ProcessPoolExecutor(count, self.context, start, arguments)
        try:
            # forks them all (the pool does, for the fork start method), and waits for one
            self.pool.submit(int).result()
        except BrokenProcessPool:
            raise WorkerError(self.death()) from None
        # a fork refused: too little memory, or too many processes
        except OSError as e:
            self.stop(gracefully=False)
            raise WorkerError(f"cannot start a {self.name} ({e.strerror or e})") from None
        # a stop that came meanwhile
        except BaseException:
            self.stop(gracefully=False)
            raise

    def started(self):
        return [worker for worker in self.context.created if worker.pid is not None]

    def answers(self, tasks):
        """function(task) for each task, in order; an error raised by `tasks` comes after the
        answers to the tasks before it."""
        window = collections.deque()
        tasks = iter(tasks)
        while True:
            try:
                task = next(tasks)
            except StopIteration:
                break
            except Exception as error:
                while window:
                    yield self.answer(window.popleft())
                raise error
            try:
                window.append(self.pool.submit(work, task))
            # a worker died since the last answer
            except BrokenProcessPool:
                raise WorkerError(self.death()) from None
            if len(window) >= IN_FLIGHT * self.count:
                yield self.answer(window.popleft())
        while window:
            yield self.answer(window.popleft())

    def answer(self, future):
        """The future's answer; meanwhile, every second, a look for a dead or stuck worker."""
        # the workers' CPU time, and when it last moved
        progress = None
        while True:
            try:
                finished, answer = future.result(timeout=1)
            except concurrent.futures.TimeoutError:
                progress = self.look_for_a_dead_or_stuck_worker(progress)
                continue
            except BrokenProcessPool:
                raise WorkerError(self.death()) from None
            except Exception as e:  # noqa: BLE001 - an answer that could not be sent, say
                finished, answer = False, f"{type(e).__name__}: {e}"
            if not finished:
                raise WorkerError(f"a {self.name} failed ({answer})")
            return answer

    def look_for_a_dead_or_stuck_worker(self, progress):
        """A dead worker (the pool may not see it: one killed while it sent an answer leaves the
        pool waiting for the rest), or no worker using the CPU for STUCK_SECONDS, is an error; else
        the new progress."""
        if any(worker.exitcode is not None for worker in self.started()):
            raise WorkerError(self.death())
        if not LINUX:
            return None
        now = time.monotonic()
        ticks = cpu_ticks(self.started())
        if progress is None or ticks != progress[0]:
            return ticks, now
        if now - progress[1] > STUCK_SECONDS:
            raise WorkerError(f"a {self.name} stopped answering (no worker used the CPU in "
                              f"{STUCK_SECONDS} s)")
        return progress

    def death(self):
        """Which worker died, and how; then the others are ended."""
        started = self.started()
        # the pool ends the others with SIGTERM, and the exit of one may be known a moment later
        # than the pool's news of it, or than theirs
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            exited = [worker for worker in started if worker.exitcode is not None]
            died = [worker for worker in exited if worker.exitcode != -signal.SIGTERM]
            if died or len(exited) == len(started):
                break
            time.sleep(0.01)
        victim = (died or exited or started)[0]
        code = victim.exitcode
        self.stop(gracefully=False)
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        return f"a {self.name} (pid {victim.pid}) {how}"

    def stop(self, gracefully):
        """End the workers: let them finish when all went well, else kill them now. Then no worker
        can write to the pipe of answers: this process's end of it is closed, so that the pool's
        thread, if a killed worker left it waiting for the rest of an answer, reads its end."""
        if not gracefully:
            started = self.started()
            for worker in started:
                worker.kill()
            for worker in started:
                worker.join()
            if self.pool._result_queue is not None:
                self.pool._result_queue._writer.close()
        self.pool.shutdown(wait=True, cancel_futures=True)


def cpu_ticks(processes):
    """The CPU time that the processes used so far, in clock ticks (/proc/PID/stat's utime and
    stime, the 14th and 15th fields)."""
    ticks = 0
    for process in processes:
        try:
            with open(f"/proc/{process.pid}/stat") as f:
                ticks += sum(map(int, f.read().rsplit(")", 1)[1].split()[11:13]))
        except OSError:
            pass
    return ticks


def start(function, parent, lock):
    """The pool's initializer, in each worker."""
    if lock is not None:
        os.close(lock)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # a stop signal sent to a worker alone kills it (the run then says so)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if LINUX:
        # PR_SET_PDEATHSIG: the kernel kills this process when the run ends
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
    else:
        threading.Thread(target=leave_with, args=(parent,), daemon=True).start()
    # the run ended before this worker could ask for that
    if os.getppid() != parent:
        os._exit(1)
    WORKER["function"] = function


def leave_with(parent):
    """End this worker once the run is gone (where the kernel does not end it with the run)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def work(task):
    """(True, function(task)), or (False, why) for a task the worker cannot finish."""
    try:
        return True, WORKER["function"](task)
    except BaseException as error:  # noqa: BLE001 - told to the run, which then ends the workers
        return False, f"{type(error).__name__}: {error}"
