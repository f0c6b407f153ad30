"""Long runs survive interruption: a run stopped by a signal and resumed from its checkpoint ends
with the val losses of the same run not interrupted (identical on 1 process, within 2e-3 across
process counts), and a checkpoint that cannot continue the run is refused at start-up."""
import hashlib
import os
import re
import shlex
import signal

import pytest
import torch
from helpers import REPO
from helpers import TRAINER
from helpers import finished_log
from helpers import launch_env
from helpers import made_once
from helpers import run_process
from helpers import step_lines
from helpers import tiny
from helpers import torchrun
from helpers import val_losses
from helpers import with_trainer

import train_gpt

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


# a rank of the trainer where, at step 5, rank 0 sends SIGTERM to torchrun's agent (which forwards
# it to every worker: a preemption) and goes on once its own handler has had it; the ranks exchange
# the stop flag at every step
PREEMPTED_AT_STEP_5 = """import os
import signal
import time
import train_gpt
agreed = train_gpt.CleanStop.agreed
received = []


def preempted_at_step_5(self, step):
    if step == 5 and os.environ["RANK"] == "0":
        handler = signal.getsignal(signal.SIGTERM)

        def noted(signum, frame):
            received.append(signum)
            handler(signum, frame)
        signal.signal(signal.SIGTERM, noted)
        os.kill(os.getppid(), signal.SIGTERM)
        while not received:
            time.sleep(0.01)
    return agreed(self, step)


train_gpt.CleanStop.agreed = preempted_at_step_5
train_gpt.STOP_CHECK_EVERY = 1
sys.exit(train_gpt.main(sys.argv[1:]))
"""


def test_sigterm_under_torchrun_stops_every_rank_after_one_step_and_resumes_across_process_counts(
        reference, tmp_path, one_thread):
    """1 -> 2 -> 1 processes: the reference's step-4 checkpoint resumed on 2 processes under
    torchrun, preempted at step 5: all stop after step 6; then that checkpoint resumed on 1 process
    (here) to the end."""
    expected, checkpoints = reference
    rank = tmp_path / "rank.py"
    rank.write_text(with_trainer(PREEMPTED_AT_STEP_5))
    log_dir = tmp_path / "stopped"
    launch = torchrun(2, rank, "--resume", checkpoints[0], "--log_dir", log_dir)
    result = run_process(launch, 300, cwd=REPO, env=launch_env(OMP_NUM_THREADS="1"))
    # torchrun itself ends with its own traceback (SignalException) and exit code 1; the workers,
    # without one
    assert result.returncode == 1, result.stderr[-3000:]
    assert "SignalException: Process" in result.stderr, result.stderr[-3000:]
    assert f'{TRAINER.name}", line' not in result.stderr
    log = finished_log(log_dir)
    stopped = log.parent / log.stem / "state_step000006.pt"
    stop_line = (
        "stopped by SIGTERM after step 6; resume with: torchrun --standalone --nproc_per_node=2 "
        f"{os.path.relpath(TRAINER, REPO)} --resume {stopped}"
    )
    assert log.read_text().splitlines()[-1] == stop_line and stop_line in result.stderr.splitlines()
    # validation at the step resumed from; none at the stop
    assert val_losses(log) == {4: expected[4]}
    # every Muon matrix's momentum, gathered from the rank that holds it
    momenta = torch.load(stopped)["muon"]
    with torch.device("meta"):
        model = train_gpt.GPT(50304, 6, 1, 16)
    assert set(momenta) == {
        name for name, p in model.blocks.named_parameters(prefix="blocks") if p.ndim == 2
    }
    losses = resumed_losses(stopped, tmp_path / "1")
    assert sorted(losses) == [6, 8]
    # the order of float sums differs with the process count
    for step, loss in losses.items():
        assert abs(loss - expected[step]) < 2e-3, (step, loss, expected[step])
    # not equal because nothing moved
    assert losses[8] < expected[4] - 0.5


def test_a_changed_source_is_a_warning_and_changed_options_are_named(reference, tmp_path):
    """The final checkpoint, as if written by another version of the script: resumed, it only
    validates."""
    expected, checkpoints = reference
    state = torch.load(checkpoints[-1])
    assert (
        state["step"] == 8
        and state["source_sha256"] == hashlib.sha256(TRAINER.read_bytes()).hexdigest()
    )
    torch.save(dict(state, source_sha256="0" * 64), tmp_path / "forked.pt")
    assert (
        train_gpt.main(
            [
                "--resume",
                str(tmp_path / "forked.pt"),
                "--log_dir",
                str(tmp_path / "logs"),
                "--val_loss_every",
                "4",
            ]
        )
        == 0
    )
    log = finished_log(tmp_path / "logs")
    lines = log.read_text().splitlines()
    assert (
        f"resumed from {tmp_path / 'forked.pt'} at step 8; options changed: "
        "--val_loss_every 2 -> 4, "
        f"--log_dir '{checkpoints[-1].parent.parent}' -> '{tmp_path / 'logs'}'" in lines
    )
    assert (
        "warning: resumed by another train_gpt.py than the one that wrote the checkpoint" in lines
    )
    assert val_losses(log) == {8: expected[8]}


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
        (lambda path, tmp_path: tmp_path / "missing.pt", [], "(FileNotFoundError: "),
        (
            lambda path, tmp_path: tmp_path,
            [],
            "(IsADirectoryError: ",
        ),  # a folder without checkpoints
        # the run's log
        (lambda path, tmp_path: next(path.parent.parent.glob("*.txt")), [], "(BadZipFile: "),
        (other_dict, [], "(KeyError: 'args')"),
    ],
)
def test_a_checkpoint_that_cannot_continue_the_run_is_one_error_line(
    reference, markov_shards, tmp_path, capsys, make_path, extra, words
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
