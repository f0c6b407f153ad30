"""A data tool's worker processes: the standard library's process pool, with what the tools need
beyond it.

- Answers come in the order the tasks were given, with at most IN_FLIGHT tasks per worker handed
  out, so that memory stays flat whatever the input.
- A worker that dies ends the work in one line naming it and how it died (the pool says that one
  died, not which). One that cannot finish a task answers so, whatever was raised (pyo3's
  PanicException, a Rust panic, is no Exception). One that is stuck is found too: each worker
  beats into memory it shares with the run (its pid, its main thread's CPU seconds, the tasks it
  began and finished), and one that has held a task for STUCK_SECONDS without progress is stuck
  (in a Rust panic holding the GIL, say, or waiting on nothing).
- Workers never outlive the run: on Linux the kernel kills them when it ends, even by SIGKILL;
  elsewhere they leave once it is gone. Ctrl-C and a closed terminal are the run's to handle, and a
  lock that the run holds is not theirs (a forked copy of its descriptor would hold it).
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

import numpy as np

IN_FLIGHT = 4
STUCK_SECONDS = 10
# what the run stops on: only noted while the workers are forked (see Workers)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
BEAT_SECONDS = 0.5
# a worker's row in the memory it shares with the run
PID, CPU, BEGUN, DONE = range(4)
# in a worker: its function and its row
WORKER = {}


class WorkerError(Exception):
    """A worker died, failed or is stuck: the message says which, and how."""


class Workers:
    """`count` processes answering function(task) for the tasks given to answers()."""

    def __init__(self, count, function, lock=None, name="worker"):
        # Linux: fork, quick to start and nothing to pickle; elsewhere, the platform's default
        context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else None)
        forked = context.get_start_method() == "fork"
        self.count = count
        self.name = name
        shared = context.RawArray("d", 4 * count)
        self.rows = np.frombuffer(shared).reshape(count, 4)
        # pid: (CPU seconds, tasks done, when either last moved)
        self.progress = {}
        arguments = (function, shared, context.Value("i", 0), os.getpid(), lock if forked else None)
        self.pool = concurrent.futures.ProcessPoolExecutor(count, context, start, arguments)
        # Started now, a stop signal only noted meanwhile, then raised again: the run's handler,
        # run inside an at-fork hook, would raise there, where Python prints it and goes on.
        noted = []

        def note(signum, frame):
            noted.append(signum)

        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {signum: signal.signal(signum, note) for signum in STOP_SIGNALS}
        try:
            try:
                self.pool.submit(int).result()
            finally:
                for signum, handler in handlers.items():
                    signal.signal(signum, handler)
                if noted:
                    signal.raise_signal(noted[0])
        except BrokenProcessPool:
            raise WorkerError(self.death()) from None
        # a stop that came meanwhile, raised as the signals are let through
        except BaseException:
            self.stop(gracefully=False)
            raise

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
        """The future's answer; meanwhile, every second, a look for a stuck worker."""
        while True:
            try:
                finished, answer = future.result(timeout=1)
            except concurrent.futures.TimeoutError:
                self.look_for_a_stuck_worker()
                continue
            except BrokenProcessPool:
                raise WorkerError(self.death()) from None
            except Exception as e:  # noqa: BLE001 - an answer that could not be sent, say
                finished, answer = False, f"{type(e).__name__}: {e}"
            if not finished:
                raise WorkerError(f"a {self.name} failed ({answer})")
            return answer

    def look_for_a_stuck_worker(self):
        """A dead worker (the pool may not see it: a worker killed while it sent an answer leaves
        the pool waiting for the rest), or one without progress for STUCK_SECONDS, is an error."""
        if any(p.exitcode is not None for p in list(self.pool._processes.values())):
            raise WorkerError(self.death())
        now = time.monotonic()
        for pid, cpu, begun, done in self.rows:
            moved = self.progress.get(pid)
            if moved is None or begun == done or cpu - moved[0] > 0.05 or done != moved[1]:
                self.progress[pid] = cpu, done, now
            elif now - moved[2] > STUCK_SECONDS:
                raise WorkerError(f"a {self.name} (pid {int(pid)}) stopped answering (no progress "
                                  f"in {STUCK_SECONDS} s)")

    def death(self):
        """Which worker died, and how (the pool terminates the others with SIGTERM); then the others
        are ended."""
        processes = list(self.pool._processes.values())
        # the pool can see a death (half an answer) a moment before the process's end is known
        deadline = time.monotonic() + 1
        while all(p.exitcode is None for p in processes) and time.monotonic() < deadline:
            time.sleep(0.01)
        exited = [p for p in processes if p.exitcode is not None]
        victim = ([p for p in exited if p.exitcode != -signal.SIGTERM] or exited or processes)[0]
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
            processes = list((self.pool._processes or {}).values())
            for process in processes:
                process.kill()
            for process in processes:
                process.join()
            if self.pool._result_queue is not None:
                self.pool._result_queue._writer.close()
        self.pool.shutdown(wait=True, cancel_futures=True)


def start(function, shared, rows_taken, parent, lock):
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
    with rows_taken.get_lock():
        row = np.frombuffer(shared).reshape(-1, 4)[rows_taken.value]
        rows_taken.value += 1
    row[PID] = os.getpid()
    WORKER.update(function=function, row=row)
    threading.Thread(target=beat, args=(row, parent), daemon=True).start()


def beat(row, parent):
    """The main thread's CPU seconds into the worker's row every BEAT_SECONDS, until the run is
    gone (where the kernel does not end this process with it)."""
    while os.getppid() == parent:
        row[CPU] = time.process_time() - time.thread_time()
        time.sleep(BEAT_SECONDS)
    os._exit(1)


def work(task):
    """(True, function(task)), or (False, why) for a task the worker cannot finish."""
    row = WORKER["row"]
    row[BEGUN] += 1
    try:
        return True, WORKER["function"](task)
    except BaseException as error:  # noqa: BLE001 - told to the run, which then ends the workers
        return False, f"{type(error).__name__}: {error}"
    finally:
        row[DONE] += 1
