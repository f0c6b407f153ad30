"""A data tool's worker processes: the standard library's process pool, with what the tools need
beyond it.

- Answers come in the order the tasks were given, with at most IN_FLIGHT tasks per worker handed
  out, so that memory stays flat whatever the input.
- A worker that dies ends the work in one line naming it and how it died (the pool says that one
  died, not which); one that cannot finish a task answers so.
- Workers never outlive the run: on Linux the kernel kills them when it ends, even by SIGKILL.
  Ctrl-C and a closed terminal are the run's to handle, and a lock that the run holds is not
  theirs (a forked copy of its descriptor would hold it).
"""

import collections
import concurrent.futures
import ctypes
import multiprocessing
import os
import signal
import sys
from concurrent.futures.process import BrokenProcessPool

IN_FLIGHT = 4
# in a worker: its function
WORKER = {}


class WorkerError(Exception):
    """A worker died or failed: the message says which, and how."""


class Workers:
    """`count` processes answering function(task) for the tasks given to answers()."""

    def __init__(self, count, function, lock=None, name="worker"):
        # Linux: fork, quick to start and nothing to pickle; elsewhere, the platform's default
        context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else None)
        forked = context.get_start_method() == "fork"
        self.count = count
        self.name = name
        arguments = (function, lock if forked else None)
        self.pool = concurrent.futures.ProcessPoolExecutor(count, context, start, arguments)

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
            window.append(self.pool.submit(work, task))
            if len(window) >= IN_FLIGHT * self.count:
                yield self.answer(window.popleft())
        while window:
            yield self.answer(window.popleft())

    def answer(self, future):
        try:
            finished, answer = future.result()
        except BrokenProcessPool:
            raise WorkerError(self.death()) from None
        except Exception as e:  # noqa: BLE001 - an answer that could not be sent, say
            finished, answer = False, f"{type(e).__name__}: {e}"
        if not finished:
            raise WorkerError(f"a {self.name} failed ({answer})")
        return answer

    def death(self):
        """Which worker died, and how: the pool terminates (SIGTERM) the others."""
        processes = list(self.pool._processes.values())
        self.pool.shutdown(wait=True)
        dead = [p for p in processes if p.exitcode not in (None, -signal.SIGTERM)]
        victim = (dead or [p for p in processes if p.exitcode is not None] or processes)[0]
        if victim.exitcode is not None and victim.exitcode < 0:
            how = f"was killed by {signal.Signals(-victim.exitcode).name}"
        else:
            how = f"exited with status {victim.exitcode}"
        return f"a {self.name} (pid {victim.pid}) {how}"

    def stop(self, gracefully):
        """End the workers: let them finish when all went well, else kill them now."""
        if not gracefully:
            for process in list((self.pool._processes or {}).values()):
                process.kill()
        self.pool.shutdown(wait=True, cancel_futures=True)


def start(function, lock):
    """The pool's initializer, in each worker."""
    if lock is not None:
        os.close(lock)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # a stop signal sent to a worker alone kills it (the run then says so)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        # PR_SET_PDEATHSIG: the kernel kills this process when the run ends
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
    WORKER["function"] = function


def work(task):
    """(True, function(task)), or (False, why) for a task the worker cannot finish."""
    try:
        return True, WORKER["function"](task)
    except Exception as error:  # noqa: BLE001 - told to the run, which then ends the workers
        return False, f"{type(error).__name__}: {error}"
