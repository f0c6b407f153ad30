"""The trainer starts without triton, and every input it cannot use ends in one `error:` line before
step 1: token ids beyond the vocabulary, a shard in both train and val, a place it cannot write, a
GPU that the installed torch cannot use."""
import glob
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import LN_VOCAB
from helpers import TINY_MODEL
from helpers import TINY_RUN
from helpers import TRAINER
from helpers import finished_log
from helpers import launch_env
from helpers import run_main
from helpers import run_process

import train_gpt
from train_gpt import UserError
from train_gpt import load_data_shard
from train_gpt import markov_stream
from train_gpt import write_data_shard

# `python TRAINER ARGV` for each ARGV in turn, in one process where `import triton` fails (as on
# macOS and Windows); each run's exit code printed
WITHOUT_TRITON = """import runpy, sys
sys.modules["triton"] = None
for argv in {runs!r}:
    sys.argv = [{trainer!r}, *argv]
    try:
        runpy.run_path({trainer!r}, run_name="__main__")
    except SystemExit as stop:
        print("exit code", stop.code, flush=True)
"""


@pytest.mark.slow
def test_without_triton_the_trainer_trains_and_refuses_only_the_fused_head_loss(markov_shards,
                                                                                  tmp_path):
    """In a process where `import triton` fails: the trainer refuses --fused_head_loss true before
    any step, then trains a step in that same process."""
    refused = tmp_path / "refused"
    data = ["--train_files", markov_shards[0], "--val_files", markov_shards[1]]
    runs = [[*TINY_RUN, "--fused_head_loss", "true", "--log_dir", str(refused)],
            [*TINY_RUN, *TINY_MODEL, *data, "--log_dir", str(tmp_path / "trained")]]
    code = WITHOUT_TRITON.format(runs=runs, trainer=str(TRAINER))
    result = run_process([sys.executable, "-c", code], 300, env=launch_env(OMP_NUM_THREADS="1"))
    out = result.stdout
    tail = out[-3000:] + result.stderr[-3000:]
    assert re.findall(r"^exit code (\S+)$", out, re.M) == ["1", "0"], tail
    # refused before any step
    assert out.index("exit code 1") < out.index("step:")
    # it trained: below the step-0 loss
    assert float(out.split("step:1/1 val_loss:")[1].split()[0]) < LN_VOCAB
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert (
        errors[0].startswith("error: --fused_head_loss must be auto or false: triton")
        and "Linux only" in errors[0]
    )
    assert not refused.exists()
    finished_log(tmp_path / "trained")


def test_a_token_id_outside_the_vocabulary_is_named_with_its_shard_and_position(tmp_path):
    tokens = np.arange(1000) % 300
    tokens[[637, 900]] = 50304, 65535  # the first bad one is reported
    path = tmp_path / "bad_000001.bin"
    write_data_shard(path, tokens)
    # loaded unchecked; the vocabulary is checked as the trainer opens each shard
    assert load_data_shard(path).tolist() == tokens.tolist()
    assert train_gpt.read_checked_shard(path, 65536).tolist() == tokens.tolist()
    with pytest.raises(UserError) as info:
        train_gpt.read_checked_shard(path, 50304)
    assert str(info.value).startswith(
        f"{path}: token id 50304 at position 637 is not below --vocab_size 50304"
    )
    assert "another tokenizer" in str(info.value) and "corrupt" in str(info.value)


def tiny_shards(folder, split, bad_shard, bad_at=4321):
    """Two 5,000-token shards of the Markov stream; shard bad_shard (1 or 2) holds id 50304 at
    bad_at."""
    for k in (1, 2):
        tokens = markov_stream(5000, seed=k)
        if k == bad_shard:
            tokens[bad_at] = 50304
        write_data_shard(folder / f"t_{split}_{k:06d}.bin", tokens)
    return str(folder / f"t_{split}_*.bin")


# the val loader reads only its first shard here (128 tokens): its second is checked all the same
@pytest.mark.parametrize("split,bad_shard", [("train", 1), ("val", 2)])
def test_a_bad_token_id_in_the_first_train_shard_or_any_val_shard_stops_before_step_one(
    tmp_path, capsys, markov_shards, split, bad_shard
):
    files = {
        "train": markov_shards[0],
        "val": markov_shards[1],
        split: tiny_shards(tmp_path, split, bad_shard),
    }
    err = run_main(
        capsys,
        *TINY_RUN,
        "--train_files",
        files["train"],
        "--val_files",
        files["val"],
        "--log_dir",
        str(tmp_path / "logs"),
    )
    assert (
        err.count("\n") == 1
        and f"t_{split}_{bad_shard:06d}.bin: token id 50304 at position 4,321" in err
    )
    assert not (tmp_path / "logs").exists()  # nothing written, nothing trained


def test_a_later_train_shard_with_a_bad_token_id_fails_when_the_loader_reaches_it(
    tmp_path, capsys, markov_shards
):
    # two batches of 128 in each shard: the second shard opens at step 3 (the run's third step)
    for k in (1, 2):
        tokens = markov_stream(300, seed=k)
        if k == 2:
            tokens[5] = 50304
        write_data_shard(tmp_path / f"t_train_{k:06d}.bin", tokens)
    log_dir = tmp_path / "logs"
    err = run_main(capsys, *TINY_RUN, "--num_iterations", "3", "--train_files",
                   str(tmp_path / "t_train_*.bin"), "--val_files", markov_shards[1],
                   "--log_dir", str(log_dir))
    assert err.count("\n") == 1
    assert "t_train_000002.bin: token id 50304 at position 5 is not below" in err
    log = next(log_dir.glob("*.txt")).read_text()
    # two steps trained, the third refused, and the log ends with the same line
    assert "step:2/3 train_loss:" in log and "step:3/3 train_loss:" not in log
    assert log.rstrip().endswith(err.strip())


def test_a_shard_matched_by_both_train_and_val_files_is_refused(tmp_path, capsys, markov_shards):
    train_shard = sorted(glob.glob(markov_shards[0]))[0]
    (tmp_path / "v_val_000000.bin").symlink_to(train_shard)  # another name, the same file
    err = run_main(
        capsys,
        *TINY_RUN,
        "--train_files",
        markov_shards[0],
        "--val_files",
        str(tmp_path / "v_val_*.bin"),
        "--log_dir",
        str(tmp_path / "logs"),
    )
    assert err.startswith(f"error: {train_shard} is the val shard {tmp_path / 'v_val_000000.bin'}, ")
    assert not (tmp_path / "logs").exists()


# {file}: an existing file, in the way of a folder; /proc refuses new folders even to root
@pytest.mark.parametrize(
    "option,place,data",
    [
        ("--log_dir", "{file}/logs", "shards"),
        ("--log_dir", "{file}/logs", "synthetic"),
        ("--log_dir", "/proc/no_such_dir/logs", "shards"),
        ("--compile_cache", "{file}/cache.bin", "shards"),
        ("--compile_cache", "/proc/no_such_dir/cache.bin", "shards"),
    ],
)
def test_a_place_that_cannot_be_written_is_one_line_before_the_model_is_built(
    tmp_path, capsys, monkeypatch, markov_shards, option, place, data
):
    if place.startswith("/proc") and not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux's")
    (tmp_path / "a_file").write_text("")
    file_in_the_way = "{file}" in place
    place = place.format(file=tmp_path / "a_file")
    monkeypatch.setattr(train_gpt, "build_model", lambda *args: pytest.fail("the model was built"))
    shards = []
    if data == "shards":
        shards = ["--train_files", markov_shards[0], "--val_files", markov_shards[1]]
    # the cache is only used when compiling
    compile_on = []
    if option == "--compile_cache":
        compile_on = ["--compile", "true"]
    err = run_main(
        capsys, *TINY_RUN, *shards, *compile_on, "--log_dir", str(tmp_path / "logs"), option, place
    )
    assert err.startswith(f"error: {option}: cannot make or write to ") and err.count("\n") == 1
    if file_in_the_way:
        # the system's words for it
        assert "(File exists)" in err or "(Not a directory)" in err


def test_a_gpu_this_torch_cannot_use_is_one_line_with_the_fix_not_a_cpu_run(
    capsys, monkeypatch, markov_shards
):
    def nvidia_smi(command, **kwargs):
        assert command == ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        listed = "NVIDIA H100 80GB HBM3, 535.104.05\n" * 2
        return subprocess.CompletedProcess(command, 0, stdout=listed, stderr="")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(subprocess, "run", nvidia_smi)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    err = run_main(
        capsys, *TINY_RUN, "--train_files", markov_shards[0], "--val_files", markov_shards[1]
    )
    assert (
        err.count("\n") == 1 and "2 x NVIDIA H100 80GB HBM3" in err and "(driver 535.104.05)" in err
    )
    assert f"torch {torch.__version__} (CUDA {torch.version.cuda};" in err
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126" in err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU on purpose
    assert train_gpt.setup_device()[2] == torch.device("cpu")


@pytest.mark.parametrize(
    "failure",
    [
        FileNotFoundError("nvidia-smi"),
        subprocess.CalledProcessError(9, "nvidia-smi"),
        subprocess.TimeoutExpired("nvidia-smi", 60),
    ],
)
def test_no_nvidia_smi_or_no_answer_from_it_means_no_gpu(monkeypatch, failure):
    def nvidia_smi(command, **kwargs):
        raise failure

    monkeypatch.setattr(subprocess, "run", nvidia_smi)
    assert not train_gpt.nvidia_smi_gpus()
