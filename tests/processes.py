"""Kept for the test modules that still import from here: the one process helper is in helpers."""
from helpers import launch_env  # noqa: F401
from helpers import run_process  # noqa: F401
from helpers import start_process  # noqa: F401
from helpers import started  # noqa: F401
