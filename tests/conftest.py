"""pytest's configuration of the suite: the trainer under test (--trainer), one torch thread per
process (xdist runs a process per core), the session's shards and the smoke runs that several tests
read. What the tests share is in tests/helpers.py."""
import contextlib
import io
import signal
from pathlib import Path

import helpers
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--trainer", default=str(helpers.REPO / "train_gpt.py"), metavar="FILE",
                     help="the trainer to test (a copy of train_gpt.py): every test that imports "
                          "train_gpt gets its module, every process a test starts runs it")


def stop_as_on_ctrl_c(signum, frame):
    """SIGTERM (from `timeout`, say) ends the session as Ctrl-C does: through its teardown, then
    the exit that kills the processes the tests started."""
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def pytest_configure(config):
    """The trainer under test imported as `train_gpt`, before any test module imports it."""
    trainer = Path(config.invocation_params.dir, config.getoption("trainer")).resolve()
    if not trainer.is_file():
        raise pytest.UsageError(f"--trainer {config.getoption('trainer')}: no such file")
    # absolute for xdist's workers, which get this option
    config.option.trainer = str(trainer)
    train_gpt = helpers.use_trainer(trainer)
    train_gpt.torch.set_num_threads(1)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, stop_as_on_ctrl_c)


@pytest.fixture(scope="session")
def markov_shards(tmp_path_factory):
    """Two train shards and one val shard of the trainer's synthetic Markov stream (a chain of 4
    successors per token: learnable to about ln 4 = 1.39 nats, far below its unigram entropy of
    about 5.5); gives (train glob, val glob, val tokens)."""
    import train_gpt
    folder = tmp_path_factory.mktemp("markov")
    for k in (1, 2):
        tokens = train_gpt.markov_stream(60_000, seed=k)
        train_gpt.write_data_shard(folder / f"markov_train_{k:06d}.bin", tokens)
    val = train_gpt.markov_stream(20_000, seed=0)
    train_gpt.write_data_shard(folder / "markov_val_000000.bin", val)
    return str(folder / "markov_train_*.bin"), str(folder / "markov_val_*.bin"), val


class SmokeRuns:
    """Smoke-preset runs that several tests read, each made once per session (made_once): short(1)
    and short(2), one short run as 1 and as 2 processes, and full()."""

    def __init__(self, markov_shards, tmp_path_factory):
        self.shards = markov_shards
        self.factory = tmp_path_factory

    def options(self, folder):
        """helpers.tiny()'s run for 4 steps, logging into folder/logs."""
        return helpers.tiny(self.shards, folder / "logs", "--num_iterations", "4")

    def short(self, nproc):
        """The short run's log: on 1 process, here, through records/profile_run.py (its last step
        profiled, which does not change the maths) with a checkpoint at the end; on 2, under
        torchrun."""
        make = self.profiled_short_run if nproc == 1 else self.short_run_on_2_processes
        folder, _ = helpers.made_once(self.factory, f"short_{nproc}proc", make)
        return helpers.finished_log(folder / "logs")

    def profiled(self):
        """Of short(1): what records/profile_run.py printed ("stdout") and the tokens of each
        forward the model trained on ("trained": a forward with gradients)."""
        return helpers.made_once(self.factory, "short_1proc", self.profiled_short_run)[1]

    def profiled_short_run(self, folder):
        import train_gpt
        profile_run = helpers.load_records_script("profile_run")
        trained = []

        def record(module, inputs):
            if isinstance(module, train_gpt.GPT) and torch.is_grad_enabled():
                trained.append(inputs[0].tolist())
        hook = torch.nn.modules.module.register_module_forward_pre_hook(record)
        with hook, contextlib.redirect_stdout(io.StringIO()) as stdout:
            code = profile_run.main(["--steps", "1", *self.options(folder), "--save_checkpoint",
                                     "true"])
        assert code == 0, stdout.getvalue()[-3000:]
        return dict(stdout=stdout.getvalue(), trained=trained)

    def short_run_on_2_processes(self, folder):
        launch = helpers.torchrun(2, helpers.TRAINER, *self.options(folder))
        env = helpers.launch_env(OMP_NUM_THREADS="1")
        result = helpers.run_process(launch, 300, cwd=helpers.REPO, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        (folder / "stderr.txt").write_text(result.stderr)

    def full(self):
        """The whole smoke preset's training, here, with no data named (its built-in synthetic
        stream) as `python train_gpt.py --preset smoke` runs it; validation on 1 sequence, not 8."""
        folder, _ = helpers.made_once(self.factory, "full_1proc", self.full_run)
        return helpers.finished_log(folder / "logs")

    def full_run(self, folder):
        import train_gpt
        options = ["--preset", "smoke", "--val_tokens", "512", "--log_dir", str(folder / "logs")]
        with contextlib.redirect_stdout(io.StringIO()):
            assert train_gpt.main(options) == 0


@pytest.fixture(scope="session")
def smoke_runs(markov_shards, tmp_path_factory):
    return SmokeRuns(markov_shards, tmp_path_factory)


@pytest.fixture
def no_hang():
    """A test that would block (opening a pipe, say) fails after 60 s instead."""
    def timed_out(signum, frame):
        raise TimeoutError("the run blocked")
    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def torchrun_worker(monkeypatch):
    """Makes this process look like a worker torchrun started: every variable torchrun gives one,
    those of a 1-process launch with the given ones (RANK=1, say) over them."""
    def launched(**variables):
        torchrun = dict(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1,
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=29500, GROUP_RANK=0, ROLE_RANK=0,
                        ROLE_NAME="default", GROUP_WORLD_SIZE=1, ROLE_WORLD_SIZE=1,
                        TORCHELASTIC_RUN_ID="test", TORCHELASTIC_RESTART_COUNT=0,
                        TORCHELASTIC_MAX_RESTARTS=0, TORCHELASTIC_USE_AGENT_STORE="True")
        for name, value in dict(torchrun, **variables).items():
            monkeypatch.setenv(name, str(value))
    return launched
