"""Long runs survive interruption: a run stopped by a signal and resumed from its checkpoint ends
with the val losses of the same run not interrupted (identical on 1 process, within 2e-3 across
process counts), and a checkpoint that cannot continue the run is refused at start-up."""
import hashlib
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO
from helpers import TRAINER
from helpers import finished_log
from helpers import launch_env
from helpers import made_once
from helpers import ranks_of
from helpers import run_process
from helpers import started
from helpers import step_lines
from helpers import tiny
from helpers import torchrun
from helpers import val_losses
from helpers import with_trainer

import train_gpt

# this file's digest, as a checkpoint of it records it
SOURCE_SHA256 = hashlib.sha256(TRAINER.read_bytes()).hexdigest()

# real runs of the trainer, every test
pytestmark = pytest.mark.slow
# steps of one 128-token sequence, validated on one: for the runs that are compared to no other
ONE_MICRO_BATCH = ["--batch_size", "128", "--val_tokens", "128"]


@pytest.fixture(scope="module")
def one_thread():
    """Steps this small gain nothing from a second thread, and lose much when other processes share
    cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def resumed_losses(path, log_dir):
    assert train_gpt.main(["--resume", str(path), "--log_dir", str(log_dir)]) == 0
    return val_losses(finished_log(log_dir))


def stop_at(monkeypatch, at, *signals):
    """Raise these signals in this process just before the stop check after step `at`."""
    agreed = train_gpt.CleanStop.agreed

    def preempted(self, step):
        if step == at:
            for signum in signals:
                signal.raise_signal(signum)
        return agreed(self, step)

    monkeypatch.setattr(train_gpt.CleanStop, "agreed", preempted)


def test_sigterm_on_one_process_stops_after_the_step_and_resumes_to_identical_losses(
        reference, markov_shards, tmp_path, capsys, monkeypatch):
    expected = reference[0]
    # torchrun forwards a second signal: no effect
    stop_at(monkeypatch, 3, signal.SIGTERM, signal.SIGINT)
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    args = tiny(markov_shards, tmp_path / "stopped", "--checkpoint_every", "1")
    assert train_gpt.main(args) == 128 + signal.SIGTERM
    # restored
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
    log = finished_log(tmp_path / "stopped")
    folder = log.parent / log.stem
    last = folder / "state_step000003.pt"
    # the last two kept
    assert sorted(p.name for p in folder.iterdir()) == ["state_step000002.pt", last.name]
    script = os.path.relpath(TRAINER)
    stop_line = f"stopped by SIGTERM after step 3; resume with: python {script} --resume {last}"
    assert capsys.readouterr().err.splitlines()[-1] == stop_line
    text = log.read_text().splitlines()
    assert text[-1] == stop_line and text[-2].startswith("peak memory consumption: ")
    assert re.fullmatch(rf"checkpoint: {re.escape(str(last))}, \d+\.\d MiB in \d+\.\d s", text[-3])
    # the parser takes the other lines
    assert step_lines(log)[0][-1].startswith("step:3/8 train_loss:")
    monkeypatch.undo()
    losses = resumed_losses(last, tmp_path / "resumed")
    assert (
        losses == {step: loss for step, loss in expected.items() if step >= 4} and len(losses) == 3
    )


def test_sigint_without_checkpoint_options_says_how_to_get_one(
    markov_shards, tmp_path, capsys, monkeypatch, one_thread
):
    stop_at(monkeypatch, 1, signal.SIGINT)
    assert (
        train_gpt.main(tiny(markov_shards, tmp_path, "--val_loss_every", "0", *ONE_MICRO_BATCH))
        == 128 + signal.SIGINT
    )
    stop_line = (
        "stopped by SIGINT after step 1; no checkpoint was written (--checkpoint_every N or "
        "--save_checkpoint true write one)"
    )
    assert capsys.readouterr().err.splitlines()[-1] == stop_line
    assert finished_log(tmp_path).read_text().splitlines()[-1] == stop_line
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []  # no checkpoint folder


def test_sighup_stops_like_sigterm_with_a_resume_command_that_works_pasted(
    markov_shards, tmp_path, capsys, monkeypatch, one_thread
):
    """What a closing ssh session sends; the run folder's name needs quoting in the command."""

    def hangup_not_handled(signum, frame):
        raise AssertionError("SIGHUP reached the handler the run started with")

    # the test's handler: by default SIGHUP would end pytest
    previous = signal.signal(signal.SIGHUP, hangup_not_handled)
    try:
        stop_at(monkeypatch, 1, signal.SIGHUP)
        log_dir = tmp_path / "Bob's runs"
        code = train_gpt.main(
            tiny(markov_shards, log_dir, "--checkpoint_every", "4", "--val_loss_every", "0",
                 *ONE_MICRO_BATCH)
        )
    finally:
        restored = signal.signal(signal.SIGHUP, previous)
    assert code == 128 + signal.SIGHUP and restored is hangup_not_handled
    stop_line, _, command = capsys.readouterr().err.splitlines()[-1].partition("; resume with: ")
    assert stop_line == "stopped by SIGHUP after step 1"
    log = finished_log(log_dir)
    checkpoint = log_dir / log.stem / "state_step000001.pt"
    assert checkpoint.is_file()
    script = os.path.relpath(TRAINER)
    assert shlex.split(command) == ["python", script, "--resume", str(checkpoint)]


def test_under_nohup_a_hang_up_does_not_stop_the_run(
    markov_shards, tmp_path, monkeypatch, one_thread
):
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        stop_at(monkeypatch, 1, signal.SIGHUP)
        code = train_gpt.main(
            tiny(markov_shards, tmp_path, "--num_iterations", "2", "--val_loss_every", "0",
                 *ONE_MICRO_BATCH)
        )
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert code == 0 and sorted(val_losses(finished_log(tmp_path))) == [2]


@pytest.fixture(scope="session")
def reference(markov_shards, tmp_path_factory):
    """The run not interrupted, made once per session: its val losses and its checkpoints (every 4
    steps)."""
    def run(folder):
        assert train_gpt.main(tiny(markov_shards, folder, "--checkpoint_every", "4")) == 0
        return list(val_losses(finished_log(folder)).items())
    folder, losses = made_once(tmp_path_factory, "resume_reference", run)
    return dict(losses), sorted(folder.glob("*/state_step*.pt"))


# a rank of the trainer where, at step 6, rank 0 sends SIGTERM to torchrun's agent (which forwards
# it to every worker: a preemption) and goes on once its own handler has had it; the ranks exchange
# the stop flag at every step. By step 6 every rank has ended the resumed run's first step (rank 0
# could not end step 5 without rank 1's gradients): before, a stop has nothing to save and ends a
# rank at once.
PREEMPTED_AT_STEP_6 = """import os
import signal
import time
import train_gpt
agreed = train_gpt.CleanStop.agreed
received = []


def preempted_at_step_6(self, step):
    if step == 6 and os.environ["RANK"] == "0":
        handler = signal.getsignal(signal.SIGTERM)

        def noted(signum, frame):
            received.append(signum)
            handler(signum, frame)
        signal.signal(signal.SIGTERM, noted)
        os.kill(os.getppid(), signal.SIGTERM)
        while not received:
            time.sleep(0.01)
    return agreed(self, step)


train_gpt.CleanStop.agreed = preempted_at_step_6
train_gpt.STOP_CHECK_EVERY = 1
sys.exit(train_gpt.main(sys.argv[1:]))
"""


def test_sigterm_under_torchrun_stops_every_rank_after_one_step_and_resumes_across_process_counts(
        reference, tmp_path, one_thread):
    """1 -> 2 -> 1 processes: the reference's step-4 checkpoint resumed on 2 processes under
    torchrun, preempted at step 6: all stop after step 7; then that checkpoint resumed on 1 process
    (here) to the end."""
    expected, checkpoints = reference
    rank = tmp_path / "rank.py"
    rank.write_text(with_trainer(PREEMPTED_AT_STEP_6))
    log_dir = tmp_path / "stopped"
    launch = torchrun(2, rank, "--resume", checkpoints[0], "--log_dir", log_dir)
    result = run_process(launch, 300, cwd=REPO, env=launch_env(OMP_NUM_THREADS="1"))
    # torchrun itself ends with its own traceback (SignalException) and exit code 1; the workers,
    # without one
    assert result.returncode == 1, result.stderr[-3000:]
    assert "SignalException: Process" in result.stderr, result.stderr[-3000:]
    assert f'{TRAINER.name}", line' not in result.stderr
    log = finished_log(log_dir)
    stopped = log.parent / log.stem / "state_step000007.pt"
    stop_line = (
        "stopped by SIGTERM after step 7; resume with: torchrun --standalone --nproc_per_node=2 "
        f"{os.path.relpath(TRAINER, REPO)} --resume {stopped}"
    )
    assert log.read_text().splitlines()[-1] == stop_line and stop_line in result.stderr.splitlines()
    # validation at the step resumed from and at step 6; none at the stop
    validated = val_losses(log)
    assert sorted(validated) == [4, 6] and validated[4] == expected[4]
    assert abs(validated[6] - expected[6]) < 2e-3
    # every Muon matrix's momentum, gathered from the rank that holds it (none left at zero)
    momenta = torch.load(stopped, weights_only=True)["optimizers"][1]["state"]
    with torch.device("meta"):
        model = train_gpt.GPT(50304, 6, 1, 16)
    matrices = [p for p in model.blocks.parameters() if p.ndim == 2]
    assert sorted(momenta) == list(range(len(matrices)))
    assert all(state["momentum_buffer"].abs().sum() > 0 for state in momenta.values())
    losses = resumed_losses(stopped, tmp_path / "1")
    assert sorted(losses) == [8]
    # the order of float sums differs with the process count
    for step, loss in losses.items():
        assert abs(loss - expected[step]) < 2e-3, (step, loss, expected[step])
    # not equal because nothing moved
    assert losses[8] < expected[4] - 0.5


def test_a_checkpoint_of_this_trainers_older_format_is_one_line(reference, tmp_path, capsys):
    """The step-4 checkpoint as the trainer wrote them before Muon had a state_dict (Adam's state
    under "adam", Muon's momenta by name under "muon"), accepted as another script's: refused in
    one line, as optimiser states that do not fit, that says which script resumes it."""
    state = torch.load(reference[1][0], weights_only=True)
    adam, muon = state.pop("optimizers")
    torch.save(dict(state, adam=adam, muon={}, source_sha256="0" * 64), tmp_path / "before.pt")
    argv = ["--resume", str(tmp_path / "before.pt"), "--accept_other_script", "true",
            "--log_dir", str(tmp_path / "logs")]
    assert train_gpt.main(argv) == 1
    assert capsys.readouterr().err == (
        f"error: --resume {str(tmp_path / 'before.pt')!r}: its optimiser states do not fit this "
        "script's optimisers ('optimizers'): resume with the script that wrote it\n")


def test_another_scripts_checkpoint_is_refused_naming_both_and_resumed_when_accepted(
        reference, tmp_path, capsys):
    """The final checkpoint, as a fork would have written it: refused in one line naming both
    scripts; with --accept_other_script, resumed (it only validates), the log saying so and naming
    the files and folders the checkpoint's options bring."""
    expected, checkpoints = reference
    state = torch.load(checkpoints[-1], weights_only=True)
    assert state["step"] == 8 and state["source_sha256"] == SOURCE_SHA256
    forked = tmp_path / "forked.pt"
    # the fork's own option, which no trainer under test has a field for
    fork_args = dict(state["args"], their_ratio=8)
    torch.save(dict(state, args=fork_args, source_sha256="0" * 64,
                    script="/elsewhere/their_fork.py"), forked)
    argv = ["--resume", str(forked), "--log_dir", str(tmp_path / "logs"), "--val_loss_every", "4"]
    assert train_gpt.main(argv) == 1
    err = capsys.readouterr().err
    assert err == (f"error: --resume {str(forked)!r} was written by their_fork.py (sha256 "
                   f"000000000000), not by this script, {TRAINER.name} (sha256 "
                   f"{SOURCE_SHA256[:12]}): resume with the script that wrote it, or pass "
                   "--accept_other_script true to go on\n")
    assert not (tmp_path / "logs").exists()
    assert train_gpt.main([*argv, "--accept_other_script", "true"]) == 0
    log = finished_log(tmp_path / "logs")
    lines = log.read_text().splitlines()
    # the run that wrote it named by its id, its log's and checkpoint folder's name
    run_id = checkpoints[-1].parent.name
    assert (f"resumed from {forked} at step 8 of run {run_id}, its last step: nothing to train, "
            "its val loss again, written by their_fork.py (sha256 000000000000): "
            "another script, accepted (--accept_other_script); its options this script lacks, "
            "not applied: --their_ratio 8; options changed: "
            "--val_loss_every 2 -> 4, "
            f"--log_dir '{checkpoints[-1].parent.parent}' -> '{tmp_path / 'logs'}'" in lines)
    # the checkpoint's shards, which the command line did not name
    train, val = state["args"]["train_files"], state["args"]["val_files"]
    assert (f"data: train {train}, val {val}; 2,048 train tokens read, 0.02 passes over the train "
            "shards" in lines)
    assert "  accept_other_script = True" in lines
    assert val_losses(log) == {8: expected[8]}


def test_weights_that_do_not_fit_the_model_are_one_line(reference, tmp_path, capsys):
    """A fork's checkpoint whose MLP is twice as wide (--mlp_ratio 8, say): one line, nothing
    written."""
    state = torch.load(reference[1][-1], weights_only=True)
    model = dict(state["model"])
    model["blocks.0.mlp.c_fc.weight"] = torch.zeros(128, 16)
    torch.save(dict(state, model=model), tmp_path / "wide.pt")
    argv = ["--resume", str(tmp_path / "wide.pt"), "--log_dir", str(tmp_path / "logs")]
    assert train_gpt.main(argv) == 1
    err = capsys.readouterr().err
    assert err == (f"error: --resume {str(tmp_path / 'wide.pt')!r}: its weights do not fit this "
                   "model (blocks.0.mlp.c_fc.weight is [128, 16] in it, [64, 16] in this model): "
                   "resume with the script and options that wrote it\n")


def flipped_byte(path, tmp_path):
    """One bit flipped in the middle of the file: tensor data (the embedding tables are most of
    it)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "flipped.pt").write_bytes(data)
    return tmp_path / "flipped.pt"


def truncated(path, tmp_path):
    (tmp_path / "truncated.pt").write_bytes(path.read_bytes()[:-1000])
    return tmp_path / "truncated.pt"


def named_pipe(path, tmp_path):
    os.mkfifo(tmp_path / "pipe.pt")
    return tmp_path / "pipe.pt"


class WritesAFile:
    """Unpickled, it writes the file `payload_ran` in the working directory."""

    def __reduce__(self):
        return (Path("payload_ran").write_text, ("ran",))


def pickle_payload(path, tmp_path):
    """The checkpoint with an object whose unpickling runs code (writes a file)."""
    state = torch.load(path, weights_only=True)
    torch.save(dict(state, payload=WritesAFile()), tmp_path / "payload.pt")
    return tmp_path / "payload.pt"


def test_a_pickle_payload_runs_not_even_with_torchs_escape_set(reference, tmp_path, capsys,
                                                               monkeypatch):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (torch's escape for old files, often set globally) does
    not reopen unpickling: the payload never runs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    path = pickle_payload(reference[1][0], tmp_path)
    assert train_gpt.main(["--resume", str(path), "--log_dir", str(tmp_path / "logs")]) == 1
    assert "refused: unpickling it could run code" in capsys.readouterr().err
    assert not (tmp_path / "payload_ran").exists()


def other_dict(path, tmp_path):
    """torch.save's, but not a checkpoint of this trainer."""
    torch.save(dict(model=torch.load(path)["model"]), tmp_path / "weights.pt")
    return tmp_path / "weights.pt"


@pytest.mark.parametrize(
    "make_path,extra,words",
    [
        (
            None,
            ["--num_layers", "8", "--model_dim", "32"],
            "--num_layers 6 -> 8, --model_dim 16 -> 32 would",
        ),
        (None, ["--batch_size", "512"], "--batch_size 256 -> 512 would change"),
        (None, ["--num_iterations", "10"], "--num_iterations 8 -> 10 would change"),
        (
            None,
            ["--train_files", "{shard}"],  # one of the two shards
            "train shards (name:tokens) ['markov_train_000001.bin:60000', "
            "'markov_train_000002.bin:60000'] -> "
            "['markov_train_000001.bin:60000']",
        ),
        (flipped_byte, [], " fails its CRC check)"),
        (truncated, [], "(BadZipFile: File is not a zip file)"),
        (lambda path, tmp_path: tmp_path / "missing.pt", [], ": cannot read it (No such file"),
        # a folder without checkpoints, a named pipe (which would wait for a writer), a device
        (lambda path, tmp_path: tmp_path, [], "(a folder, a pipe or a device, not a checkpoint"),
        (named_pipe, [], "(a folder, a pipe or a device, not a checkpoint file)"),
        (lambda path, tmp_path: Path("/dev/zero"), [], "(a folder, a pipe or a device, not a "),
        (pickle_payload, [], ": refused: unpickling it could run code, which no checkpoint"),
        # the run's log
        (lambda path, tmp_path: next(path.parent.parent.glob("*.txt")), [], "(BadZipFile: "),
        (other_dict, [], "(KeyError: 'args')"),
    ],
)
def test_a_checkpoint_that_cannot_continue_the_run_is_one_error_line(
    reference, markov_shards, tmp_path, capsys, make_path, extra, words, no_hang
):
    checkpoint = reference[1][0]
    path = make_path(checkpoint, tmp_path) if make_path else checkpoint
    extra = [arg.format(shard=markov_shards[0].replace("*", "000001")) for arg in extra]
    assert train_gpt.main(["--resume", str(path), "--log_dir", str(tmp_path / "logs"), *extra]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: --resume {str(path)!r}") and err.count("\n") == 1 and words in err
    ), err
    assert not (tmp_path / "logs").exists()  # refused before anything is written


def test_a_resumed_runs_first_step_is_untimed_and_its_line_says_so(markov_shards, tmp_path,
                                                                   monkeypatch, one_thread):
    """As a new run's first steps: no step_avg (a resumed run's first step compiles)."""
    monkeypatch.setattr(train_gpt, "UNTIMED_STEPS", 2)
    options = tiny(markov_shards, tmp_path / "first", "--num_iterations", "6", "--checkpoint_every",
                   "4", "--val_loss_every", "0", *ONE_MICRO_BATCH)
    assert train_gpt.main(options) == 0
    (checkpoint,) = (tmp_path / "first").glob("*/state_step000004.pt")
    assert train_gpt.main(["--resume", str(checkpoint), "--log_dir", str(tmp_path / "again")]) == 0
    text = finished_log(tmp_path / "again").read_text()
    lines = re.findall(r"^step:\d+/6 train_loss:.*$", text, re.MULTILINE)
    assert [line.split()[0] for line in lines] == ["step:5/6", "step:6/6"]
    assert lines[0].endswith(" step_avg:nanms") and not lines[1].endswith(" step_avg:nanms")


def test_a_checkpoint_past_the_runs_last_step_is_one_line(tmp_path):
    saved = train_gpt.Hyperparameters(train_files="synthetic", num_iterations=4)
    path = tmp_path / "state.pt"
    torch.save(dict(args=train_gpt.asdict(saved), train_shards=[], step=5, optimizers=[],
                    source_sha256=train_gpt.SOURCE_SHA256), path)
    with pytest.raises(train_gpt.UserError, match=r"is at step 5, past its --num_iterations 4: "):
        train_gpt.load_checkpoint(["--resume", str(path)], str(path))


def test_fewer_steps_than_a_checkpoint_has_run_are_refused_as_a_fixed_option(tmp_path):
    """The checkpoint's own --num_iterations is 12: a resume asking for 6 changes a fixed option,
    and is refused as such, not as a checkpoint past its last step."""
    saved = train_gpt.Hyperparameters(train_files="synthetic", num_iterations=12)
    path = tmp_path / "state.pt"
    torch.save(dict(args=train_gpt.asdict(saved), train_shards=[], step=8, optimizers=[],
                    source_sha256=train_gpt.SOURCE_SHA256), path)
    with pytest.raises(train_gpt.UserError, match=r"--num_iterations 12 -> 6 would change the model"):
        train_gpt.load_checkpoint(["--resume", str(path), "--num_iterations", "6"], str(path))


def test_another_seed_is_refused_where_it_draws_the_train_stream(tmp_path):
    saved = train_gpt.Hyperparameters(train_files="synthetic", val_files="synthetic", seed=0)
    path = tmp_path / "state.pt"
    torch.save(dict(args=train_gpt.asdict(saved), train_shards=[], step=2, optimizers=[],
                    source_sha256=train_gpt.SOURCE_SHA256), path)
    with pytest.raises(train_gpt.UserError, match=r"--seed 0 -> 5 \(the synthetic train stream\)"):
        train_gpt.load_checkpoint(["--resume", str(path), "--seed", "5"], str(path))
    # the same seed: taken
    args, _ = train_gpt.load_checkpoint(["--resume", str(path)], str(path))
    assert args.seed == 0


# --- a stop before step 1: nothing to save, so no wait for the first step's compile --------------

def a_compile_that_never_ends(signum):
    """evaluate() at step 0 as a compile that takes minutes: it receives `signum` as it starts."""
    def compiling(*args, **kwargs):
        signal.raise_signal(signum)
        time.sleep(30)
    return compiling


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_before_step_one_ends_at_once_with_its_line(markov_shards, tmp_path, capsys,
                                                          monkeypatch, signum):
    monkeypatch.setattr(train_gpt, "evaluate", a_compile_that_never_ends(signum))
    started = time.monotonic()
    assert train_gpt.main(tiny(markov_shards, tmp_path / "logs")) == 128 + signum
    assert time.monotonic() - started < 15
    line = (f"stopped by {signal.Signals(signum).name} before the first step ended: nothing to "
            "save")
    assert capsys.readouterr().err == f"{line}\n"
    assert finished_log(tmp_path / "logs").read_text().splitlines()[-1] == line


# each rank's first step as a compile that takes minutes: rank.RANK written as it starts
SLOW_FIRST_STEP = """import os
import time
from pathlib import Path
import train_gpt
def compiling(*args, **kwargs):
    Path(os.environ["READY"], "rank." + os.environ["RANK"]).touch()
    time.sleep(60)
train_gpt.evaluate = compiling
helpers.exit_as_a_rank(train_gpt.main(sys.argv[1:]))
"""


def test_a_stop_before_step_one_under_torchrun_ends_every_rank_in_seconds(markov_shards, tmp_path):
    """SIGTERM to torchrun while both ranks compile their first step: both end in seconds with
    128 + SIGTERM (torchrun's report), rank 0's log with the stop line, no error line."""
    worker = tmp_path / "worker.py"
    worker.write_text(with_trainer(SLOW_FIRST_STEP))
    launch = torchrun(2, "--log-dir", tmp_path / "ranks", "--redirects", "3", worker,
                      *tiny(markov_shards, tmp_path / "logs"))
    env = launch_env(OMP_NUM_THREADS="1", READY=str(tmp_path))
    with started(launch, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True) as proc:
        while len(list(tmp_path.glob("rank.*"))) < 2:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        waited = time.monotonic() - signalled
    line = "stopped by SIGTERM before the first step ended: nothing to save"
    assert waited < 20, waited
    ranks = ranks_of(tmp_path / "ranks")
    assert [rank["code"] for rank in ranks] == [128 + signal.SIGTERM] * 2
    assert [rank["last_line"] for rank in ranks] == [line, line]
    assert finished_log(tmp_path / "logs").read_text().splitlines()[-1] == line
    assert "error: " not in stderr
