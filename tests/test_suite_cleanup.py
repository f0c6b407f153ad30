"""The suite's own promise: a process a test starts is killed whole when its test or the session
ends, torchrun's workers included, which run in sessions of their own."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import kill_tree
from helpers import start_process

# a parent that starts a child in a session of its own (as torchrun starts its workers), says the
# child's pid, then waits
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def alive(pid):
    """Whether pid runs (a zombie, killed but not yet reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_a_killed_group_takes_a_child_in_a_session_of_its_own_with_it():
    parent = start_process([sys.executable, "-S", "-c", PARENT], stdout=subprocess.PIPE,
                           text=True)
    child = int(parent.stdout.readline())
    assert os.getsid(child) == child != os.getsid(parent.pid)
    kill_tree(parent)
    parent.wait()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(child)
