"""How a run is launched, and how it ends beyond one process: torchrun's variables left in a shell,
whatever their mix, run.sh (with a stand-in `python` that reports GPUs, or a stand-in `nvidia-smi`,
on PATH), torchrun's report naming the rank that failed first (and one killed), a rank that stops
answering, a stop while another rank is frozen, the command printed to resume, a console that goes
away, and nvidia-smi in the log."""
import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO
from helpers import TINY_RUN
from helpers import TRAINER
from helpers import finished_log
from helpers import launch_env
from helpers import run_process
from helpers import started
from helpers import tiny
from helpers import torchrun
from helpers import with_trainer

import train_gpt

# run.sh starts torchrun, not the trainer's own GPU check, where this torch sees a GPU
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")


@pytest.mark.parametrize("leftovers", [
    {"RANK": "1"}, {"WORLD_SIZE": "2"}, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"},
    {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"},
    # torchrun's own id alone, or with a world: no other variable is trusted for it
    {"TORCHELASTIC_RUN_ID": "a1b2"}, {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "a1b2"},
])
def test_torchrun_variables_left_in_a_shell_are_one_line_naming_them(leftovers, tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for name, value in leftovers.items():
        monkeypatch.setenv(name, value)
    # RANK=1 alone used to train with no log and exit 0
    assert train_gpt.main([*TINY_RUN, "--log_dir", str(tmp_path / "logs")]) == 1
    err = capsys.readouterr().err
    settings = " ".join(f"{name}={value}" for name, value in leftovers.items())
    not_torchrun = "set in the environment, but this process was not started by torchrun"
    assert err.startswith(f"error: {settings} {not_torchrun}")
    assert f"`unset {' '.join(leftovers)}`" in err and "./run.sh or torchrun" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "logs").exists()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_1_workers_seven_variables_left_in_a_shell_are_one_line_not_a_wait(
        tmp_path, capsys, monkeypatch):
    """The seven a script exports from a worker of rank 1 (local rank 1, whose errors a node's
    console does not show): refused on this process too, in seconds, never a wait for rank 0."""
    leftovers = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TORCHELASTIC_RUN_ID="x")
    for name, value in leftovers.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train_gpt, "start_process_group",
                        lambda device: pytest.fail("it waits for rank 0"))
    assert train_gpt.main([*TINY_RUN, "--log_dir", str(tmp_path / "logs")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 ")
    assert "but this process was not started by torchrun" in err and err.count("\n") == 1


def test_a_world_of_two_without_torchrun_ends_in_seconds_rather_than_waiting_for_the_second(
        tmp_path, capsys, monkeypatch):
    """Rank 0 of 2 started by hand, without torchrun, in this process as `python train_gpt.py` runs
    it: refused before its process group would wait gloo's 30 minutes for rank 1 (a process group
    started fails the test at once)."""
    launched = dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(train_gpt, "start_process_group",
                        lambda device: pytest.fail("it waits for rank 1"))
    # options that suit two processes
    two_processes = ["--preset", "smoke", "--batch_size", "256", "--max_device_batch_size", "128",
                     "--val_tokens", "256", "--log_dir", str(tmp_path)]
    started_at = time.monotonic()
    code = train_gpt.main(two_processes)
    assert time.monotonic() - started_at < 60
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    settings = " ".join(f"{name}={value}" for name, value in launched.items())
    assert err.startswith(f"error: {settings} set in the environment")


# the first rank of each node, and only it, says that a checkpoint is missing: on several nodes only
# global rank 0's
# node has the checkpoints, and a node without them says so on its own console
@pytest.mark.parametrize("rank,local_rank,prints", [(2, 0, True), (3, 1, False), (0, 0, True)])
def test_a_missing_resume_file_is_named_on_each_node(rank, local_rank, prints, tmp_path, capsys,
                                                     torchrun_worker):
    torchrun_worker(RANK=rank, LOCAL_RANK=local_rank, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2)
    missing = tmp_path / "state_step000800.pt"
    assert train_gpt.main(["--resume", str(missing), "--log_dir", str(tmp_path / "logs")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --resume {str(missing)!r}: cannot read it ") == prints
    assert err.count("\n") == prints


def test_the_resume_command_pastes_as_the_run_was_launched(tmp_path, monkeypatch):
    path = str(tmp_path / "Bob's runs" / "state_step000400.pt")
    script = os.path.relpath(TRAINER)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert shlex.split(train_gpt.resume_command(path, 1)) == ["python", script, "--resume", path]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    torchrun = ["torchrun", "--standalone", "--nproc_per_node=1", script, "--resume", path]
    assert shlex.split(train_gpt.resume_command(path, 1)) == torchrun
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert shlex.split(train_gpt.resume_command(path, 8))[2] == "--nproc_per_node=8"
    # two nodes: no --standalone command, which would start two separate runs
    text = train_gpt.resume_command(path, 16)
    assert "--nnodes=2 --nproc_per_node=8" in text and "--standalone" not in text
    assert f"{script} --resume {shlex.quote(path)}" in text and "copy it" in text


def test_nvidia_smi_runs_once_a_run_with_a_time_limit(tmp_path, monkeypatch):
    timeouts = []

    def hanging_nvidia_smi(command, **kwargs):
        timeouts.append(kwargs.get("timeout"))
        raise subprocess.TimeoutExpired(command, kwargs.get("timeout"))

    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(subprocess, "run", hanging_nvidia_smi)
    args = train_gpt.Hyperparameters(log_dir=str(tmp_path))
    loader = SimpleNamespace(files=["shard.bin"])
    for master in (False, True):  # rank 1, then rank 0
        with train_gpt.RunLog(args, master) as log:
            log.header(args, 2, torch.device("cpu"), (loader, loader), 0.5, [])
    assert len(timeouts) == 1 and 0 < timeouts[0] <= 60
    # the rest of the header follows, without the table
    assert "hyperparameters:" in finished_log(tmp_path).read_text().splitlines()


# run.sh -------------------------------------------------------------------------------------------

def stand_in(folder, name, code):
    """An executable `name` in folder: Python code run by this interpreter."""
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(f"#!{sys.executable}\n{code}")
    (folder / name).chmod(0o755)


# nvidia-smi listing two GPUs (-L for run.sh, --query-gpu for the trainer), or not answering
NVIDIA_SMI = """import sys
if sys.argv[1:] == ["-L"]:
    print("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)")
elif sys.argv[1:2] == ["--query-gpu=name,driver_version"]:
    print("NVIDIA H100 80GB HBM3, 535.104.05\\n" * 2, end="")
else:
    sys.exit(9)
"""

# python for run.sh: asked for the GPU count, $GPUS (without importing torch: quicker); otherwise
# this interpreter, with train_gpt.py replaced by $RUN_SH_SCRIPT (the trainer under test, or a
# worker that fails or stops)
PYTHON = """import os, shlex, sys
if "torch.cuda.device_count()" in " ".join(sys.argv):
    print(os.environ["GPUS"])
    sys.exit()
args = []
for arg in sys.argv[1:]:
    args += shlex.split(os.environ["RUN_SH_SCRIPT"]) if arg == "train_gpt.py" else [arg]
os.execv(sys.executable, [sys.executable, *args])
"""


def run_sh_env(bin_folder, gpus, **extra):
    """run.sh's environment: the stand-in python, with `gpus` GPUs, first on PATH; the trainer under
    test in place of train_gpt.py unless RUN_SH_SCRIPT is given."""
    stand_in(bin_folder, "python", PYTHON)
    path = os.pathsep.join([str(bin_folder), os.environ["PATH"]])
    extra.setdefault("RUN_SH_SCRIPT", shlex.quote(str(TRAINER)))
    env = launch_env(PATH=path, GPUS=str(gpus), OMP_NUM_THREADS="1", **extra)
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    return env


# stands in for the trainer where run.sh hands the run over to it: its options, and exit code 1
STAND_IN_TRAINER = """import sys
print("the trainer, given:", *sys.argv[1:], file=sys.stderr)
sys.exit(1)
"""


@needs_no_gpu
@pytest.mark.parametrize("nvidia_smi,visible", [
    # GPUs this torch cannot use: the trainer's line names them and the fix
    # (test_gpus_this_torch_cannot_use_are_named_with_the_fix, below)
    (NVIDIA_SMI, None),
    ("import sys; sys.exit(9)", None),  # nvidia-smi does not answer: no GPU
    (NVIDIA_SMI, ""),  # CUDA_VISIBLE_DEVICES="": the GPUs are hidden on purpose
], ids=["gpus_listed", "no_answer", "gpus_hidden"])
@pytest.mark.slow
def test_run_sh_without_a_usable_gpu_runs_the_trainer_with_every_option(nvidia_smi, visible,
                                                                        tmp_path):
    """One process on the CPU, the trainer's own exit code and every option it was given."""
    stand_in(tmp_path / "bin", "nvidia-smi", nvidia_smi)
    (tmp_path / "trainer.py").write_text(STAND_IN_TRAINER)
    # torch sees no GPU
    env = run_sh_env(tmp_path / "bin", 0, RUN_SH_SCRIPT=shlex.quote(str(tmp_path / "trainer.py")))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    options = ["--preset", "smoke", "--checkpoint_every", "4", "--log_dir", str(tmp_path / "logs")]
    result = run_process(["bash", str(REPO / "run.sh"), *options], 120, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines() == [f"the trainer, given: {' '.join(options)}"]


@needs_no_gpu
@pytest.mark.slow
def test_run_sh_runs_nproc_processes_on_the_cpu_and_refuses_a_count_that_is_none(tmp_path):
    fork = tmp_path / "my_attempt.py"
    fork.write_text(FORK)
    env = run_sh_env(tmp_path / "bin", 0, NPROC="2")
    command = ["bash", str(REPO / "run.sh"), str(fork), "--checkpoint_every", "4"]
    result = run_process(command, 120, env=env)
    ran = sorted(line for line in result.stderr.splitlines() if line.startswith("rank "))
    assert result.returncode == 0 and ran == ["rank 0 of 2 ran my_attempt.py --checkpoint_every 4",
                                              "rank 1 of 2 ran my_attempt.py --checkpoint_every 4"]
    result = run_process(command, 60, env=dict(env, NPROC="two"))
    assert result.returncode == 1
    assert result.stderr == "run.sh: NPROC=two: give a number of processes\n"


@needs_no_gpu
def test_gpus_this_torch_cannot_use_are_named_with_the_fix(tmp_path, capsys, monkeypatch):
    """The trainer, run as run.sh runs it where nvidia-smi (a stand-in on PATH) lists GPUs that
    this torch does not see: one line naming them and the fix, before anything is written."""
    stand_in(tmp_path / "bin", "nvidia-smi", NVIDIA_SMI)
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "bin"), os.environ["PATH"]]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert train_gpt.main(["--log_dir", str(tmp_path / "logs")]) == 1
    err = capsys.readouterr().err
    this_torch = f"torch {torch.__version__} (CUDA {torch.version.cuda}; None: CPU only)"
    listed = "the 2 x NVIDIA H100 80GB HBM3 nvidia-smi lists"
    assert err.startswith(f"error: {this_torch} cannot use {listed}") and err.count("\n") == 1
    assert "Traceback" not in err and not (tmp_path / "logs").exists()


# a rank of the trainer where rank 1 runs out of GPU memory in Muon's step of train step 1 (the
# exception a GPU raises), while rank 0 goes on into the step's all-gather with it
OUT_OF_MEMORY_ON_RANK_1 = """import os
import torch
import train_gpt
muon_step = train_gpt.Muon.step
steps = []


def muon_step_out_of_memory_on_rank_1(self):
    steps.append(len(steps) + 1)
    if len(steps) == 1 and os.environ["RANK"] == "1":
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.14 GiB")
    return muon_step(self)


train_gpt.Muon.step = muon_step_out_of_memory_on_rank_1
sys.exit(train_gpt.main())
"""


def root_cause(stderr):
    """The first failure in torchrun's report: {field: value} (rank, exitcode, traceback, ...)."""
    assert "Root Cause (first observed failure):" in stderr, stderr[-3000:]
    block = stderr.split("Root Cause (first observed failure):")[1].split("=" * 20)[0]
    return dict(re.findall(r"^\s*(\w+)\s*: (.*?)\s*$", block, re.M))


@pytest.mark.slow
@needs_no_gpu
def test_under_run_sh_torchruns_report_names_the_failing_rank_its_line_and_exit_code(
        markov_shards, tmp_path):
    """Rank 1 runs out of memory in step 1; rank 0, waiting for it in the step's collective, fails
    after it, and torchrun ends it: the report's first failure is rank 1, with its exit code and its
    line."""
    rank = tmp_path / "rank.py"
    rank.write_text(with_trainer(OUT_OF_MEMORY_ON_RANK_1))
    env = run_sh_env(tmp_path / "bin", 2, RUN_SH_SCRIPT=shlex.quote(str(rank)))
    options = tiny(markov_shards, tmp_path / "logs", "--val_loss_every", "0")
    result = run_process(["bash", str(REPO / "run.sh"), *options], 300, env=env)
    out_of_memory = ("error: out of GPU memory with micro-batches of 128 tokens: "
                     "pass --max_device_batch_size 64 "
                     "(half usually fits; the global batch and the maths stay the same)")
    first = root_cause(result.stderr)
    assert first["rank"] == "1 (local_rank: 1)" and first["traceback"] == out_of_memory, first
    assert first["exitcode"].startswith("1 (pid")
    assert result.returncode == 1
    # rank 0's own error and traceback are kept: printed, and in its log
    last = finished_log(tmp_path / "logs").read_text().splitlines()[-1]
    assert re.match(r"RuntimeError: .* by peer", last), last


# a worker that stops on SIGTERM or SIGHUP (unless ignored) as the trainer does; it first reports
# how it started, in a file of its own (rank.RANK, renamed into place once written)
STOPPING_WORKER = """import os, signal, sys, time
stops = []
def on_signal(signum, frame):
    stops.append(signum)
hangups_ignored = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
for signum in [signal.SIGTERM] + [signal.SIGHUP] * (not hangups_ignored):
    signal.signal(signum, on_signal)
report = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank." + os.environ["RANK"])
with open(report + ".tmp", "w") as f:
    timeout = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    print(os.environ["RANK"], hangups_ignored, timeout, file=f)
os.replace(report + ".tmp", report)
while not stops:
    time.sleep(0.01)
print(f"rank {os.environ['RANK']} stopped by {signal.Signals(stops[0]).name}", file=sys.stderr)
sys.exit(128 + stops[0])
"""


def as_nohup_starts_it():
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


# a fork that says where it ran and with what
# one write per line: the ranks share stderr, and print's pieces of two lines can interleave
FORK = """import os, sys
words = ["rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "ran",
         os.path.basename(__file__), *sys.argv[1:]]
os.write(2, (" ".join(words) + "\\n").encode())
"""


@needs_no_gpu
@pytest.mark.slow
def test_run_sh_launches_the_script_it_is_given_first_with_the_options_after_it(tmp_path):
    """`./run.sh my_attempt.py --num_iterations 200` from another folder, on two stand-in GPUs:
    torchrun runs the fork (not train_gpt.py) on both, with its options."""
    fork = tmp_path / "forks" / "my_attempt.py"
    fork.parent.mkdir()
    fork.write_text(FORK)
    env = run_sh_env(tmp_path / "bin", 2)
    command = ["bash", str(REPO / "run.sh"), "forks/my_attempt.py", "--num_iterations", "200"]
    result = run_process(command, 120, env=env, cwd=tmp_path)
    ran = sorted(line for line in result.stderr.splitlines() if line.startswith("rank "))
    assert result.returncode == 0 and ran == [
        "rank 0 of 2 ran my_attempt.py --num_iterations 200",
        "rank 1 of 2 ran my_attempt.py --num_iterations 200"], result.stderr[-3000:]
    missing = run_process(["bash", str(REPO / "run.sh"), "nothere.py"], 60, env=env, cwd=tmp_path)
    assert missing.returncode == 1 and missing.stderr == "run.sh: nothere.py: no such script\n"


@needs_no_gpu
@pytest.mark.slow
def test_under_nohup_run_sh_ignores_a_hang_up_and_stops_every_rank_on_sigterm(tmp_path):
    """run.sh on two stand-in GPUs as nohup starts it, sent SIGHUP once both workers have started,
    then SIGTERM: the hang-up stays ignored, the stop reaches both, with 300 s to finish."""
    worker = tmp_path / "worker.py"
    worker.write_text(STOPPING_WORKER)
    env = run_sh_env(tmp_path / "bin", 2, RUN_SH_SCRIPT=shlex.quote(str(worker)))
    reports = [tmp_path / "rank.0", tmp_path / "rank.1"]
    with started(["bash", str(REPO / "run.sh")], env=env, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE, text=True, preexec_fn=as_nohup_starts_it) as proc:
        deadline = time.monotonic() + 120
        while not all(report.exists() for report in reports) and time.monotonic() < deadline:
            time.sleep(0.05)
        started_as = [report.read_text().split() for report in reports if report.exists()]
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    # hang-ups stay ignored in the workers; a stop gives them 300 s (torch 2.12 and later read it)
    assert started_as == [["0", "True", "300"], ["1", "True", "300"]], err[-3000:]
    assert "rank 0 stopped by SIGTERM" in err and "rank 1 stopped by SIGTERM" in err, err[-3000:]
    assert proc.returncode != 0


def worker_of_rank(parent, rank):
    """The process id of the torchrun worker of this rank among parent's descendants."""
    children = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True,
                              text=True).stdout.split()
    tree = {int(pid): int(ppid) for pid, ppid in zip(children[::2], children[1::2])}
    for pid in tree:
        ancestor = tree.get(pid)
        while ancestor not in (None, 0, 1, parent):
            ancestor = tree.get(ancestor)
        if ancestor != parent:
            continue
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no worker of rank {rank} under {parent}")


@pytest.mark.slow
@needs_no_gpu
def test_a_rank_killed_mid_run_is_the_first_failure_and_the_survivor_ends_in_seconds(
        markov_shards, tmp_path):
    """run.sh on two stand-in GPUs (gloo on the CPU), rank 1 killed with SIGKILL (the OOM killer,
    a lost node) once step 2 is logged: torchrun's report names it; rank 0 ends within seconds,
    its log's last line its own error or the stop torchrun asked for."""
    env = run_sh_env(tmp_path / "bin", 2)
    options = tiny(markov_shards, tmp_path / "logs", "--num_iterations", "500",
                   "--val_loss_every", "0", "--allow_data_repeat", "true")
    with started(["bash", str(REPO / "run.sh"), *options], env=env, cwd=REPO,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            if line.startswith("step:2/500 train_loss:"):
                break
        os.kill(worker_of_rank(proc.pid, 1), signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=240)
    assert time.monotonic() - killed < 120
    first = root_cause(err)
    assert first["rank"] == "1 (local_rank: 1)" and "SIGKILL" in first["exitcode"], first
    assert proc.returncode == 1
    last = finished_log(tmp_path / "logs").read_text().splitlines()[-1]
    # its own error, or, where torchrun's SIGTERM to the survivor came first (a loaded machine),
    # the stop that signal makes
    stopped = last.startswith("stopped by SIGTERM")
    assert re.match(r"RuntimeError: .* by peer", last) or stopped, last


# a console that goes away -------------------------------------------------------------------------

@pytest.mark.slow
def test_a_console_that_goes_away_does_not_end_the_run(markov_shards, tmp_path, monkeypatch):
    """The trainer, in this process as `python train_gpt.py` runs it, its stdout a pipe whose reader
    is gone (a closed terminal, `| head` that has ended): the run and its log go on to the end."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    console = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", console)
    args = [*TINY_RUN, "--train_files", markov_shards[0], "--val_files", markov_shards[1],
            "--num_layers", "6", "--model_dim", "16", "--num_heads", "1",
            "--log_dir", str(tmp_path)]
    try:
        code = train_gpt.main(args)
    finally:
        monkeypatch.undo()
        console.close()
    assert code == 0
    lines = finished_log(tmp_path).read_text().splitlines()
    assert lines[-1].startswith("peak memory consumption: ") and "step:1/1 val_loss:" in lines[-2]


def test_once_the_console_has_gone_any_later_print_to_it_goes_nowhere():
    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w") as console:
        train_gpt.to_console("the first line that finds no reader", console)
        # anyone's print, not only the trainer's: Python's own flush at exit is one
        print("a later line", file=console, flush=True)


# rank 1 freezes (SIGSTOP) as step 2 begins, as a process that stops answering without dying;
# argv[1]: the collectives' timeout in seconds
FROZEN_RANK_WORKER = """import datetime, os, signal
import train_gpt
train_gpt.COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=float(sys.argv.pop(1)))
agreed = train_gpt.CleanStop.agreed
def frozen_rank_1(self, step):
    if step == 2 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
    return agreed(self, step)
train_gpt.CleanStop.agreed = frozen_rank_1
sys.exit(train_gpt.main())
"""


def frozen_rank_run(markov_shards, tmp_path, timeout):
    """torchrun on 2 processes of FROZEN_RANK_WORKER."""
    worker = tmp_path / "worker.py"
    worker.write_text(with_trainer(FROZEN_RANK_WORKER))
    options = tiny(markov_shards, tmp_path / "logs", "--num_iterations", "20",
                   "--val_loss_every", "0", "--checkpoint_every", "1")
    command = torchrun(2, worker, timeout, *options)
    env = launch_env(OMP_NUM_THREADS="1")
    return started(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                   text=True)


@pytest.mark.slow
def test_a_rank_that_stops_answering_ends_the_run_with_a_line_naming_the_last_checkpoint(
        markov_shards, tmp_path):
    """Rank 1 frozen in step 2: rank 0 waits in its collective for the timeout (2 s here; minutes
    in a real run, not half an hour), then ends with one line, in its log too, that names the
    last checkpoint, step 1's, and the command that goes on from it. (torchrun then takes 30 s to
    kill the frozen rank: not waited for here.)"""
    with frozen_rank_run(markov_shards, tmp_path, timeout=2) as proc:
        for line in proc.stdout:
            if line.startswith("step:2/20 train_loss:"):
                break
        began = time.monotonic()
        for line in proc.stderr:
            if "stopped answering" in line:
                break
        waited = time.monotonic() - began
    checkpoint = next((tmp_path / "logs").glob("*/state_step000001.pt"))
    assert line.startswith("error: another process of the run stopped answering: a "
                           "collective waited 2 s for it during step 2; from step 1, resume with: "
                           "torchrun --standalone --nproc_per_node=2 "), line
    assert line.rstrip().endswith(f" --resume {checkpoint}") and waited < 30, (line, waited)
    last = finished_log(tmp_path / "logs").read_text().splitlines()[-1]
    assert last == line.rstrip()
