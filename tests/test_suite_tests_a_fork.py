"""The suite's own promise to a fork: `python -m pytest tests --trainer FILE` tests FILE, both where
a test imports the trainer and where it runs the trainer as a process. Two of the suite's tests, one
of each kind, on a faithful copy of the trainer under another name (they pass) and on a copy whose
main() is broken (they fail)."""
import re
import sys

import pytest
from helpers import REPO
from helpers import TRAINER
from helpers import launch_env
from helpers import run_process

# a test that calls the trainer's main() in its own process, and one that runs the trainer as a
# process
IN_PROCESS = "tests/test_start_up.py::test_a_shard_matched_by_both_train_and_val_files_is_refused"
AS_A_PROCESS = ("tests/test_start_up.py::"
                "test_without_triton_the_trainer_trains_and_refuses_only_the_fused_head_loss")


def pytest_of_its_own(*args):
    """`python -m pytest ARGS` in one process, not a worker of this session; gives its result."""
    command = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", *map(str, args)]
    env = {name: value for name, value in launch_env().items() if not name.startswith("PYTEST_")}
    return run_process(command, 300, cwd=REPO, env=env)


def pytest_on(trainer, tmp_path):
    """The two tests with --trainer; gives the output, each test's outcome on a line of its own."""
    return pytest_of_its_own("-rA", "--basetemp", tmp_path / trainer.stem, "--trainer", trainer,
                             IN_PROCESS, AS_A_PROCESS).stdout


@pytest.mark.slow
def test_the_suite_tests_the_file_given_with_trainer_and_not_train_gpt(tmp_path):
    source = TRAINER.read_text()
    (tmp_path / "my_attempt.py").write_text(source)
    out = pytest_on(tmp_path / "my_attempt.py", tmp_path)
    assert re.findall(r"^PASSED (\S+)", out, re.M) == [IN_PROCESS, AS_A_PROCESS], out[-3000:]
    # main() returns at once: no run, exit code 3
    broken, count = re.subn(r"^def main\(.*:$", r"\g<0>\n    return 3", source, flags=re.M)
    assert count == 1
    (tmp_path / "broken.py").write_text(broken)
    out = pytest_on(tmp_path / "broken.py", tmp_path)
    assert re.findall(r"^FAILED (\S+)", out, re.M) == [IN_PROCESS, AS_A_PROCESS], out[-3000:]


@pytest.mark.slow
def test_a_trainer_that_is_not_there_is_a_usage_error(tmp_path):
    result = pytest_of_its_own("--trainer", tmp_path / "missing.py", "tests/test_gpu_checks.py")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR
    assert f"--trainer {tmp_path / 'missing.py'}: no such file" in result.stderr
