"""The portable compile cache: what one process compiled, another with empty local caches reuses; a
file it did not write is never replaced."""
import dataclasses
import os
import platform
import sys

import pytest
import torch
from helpers import launch_env
from helpers import run_process
from helpers import with_trainer

import train_gpt

STAMP = "train_gpt compile cache: torch test"

# compile one small function with this process's (empty) local caches, around the trainer's load and
# save; a graph of one library call: no C++ kernel to build, so it is quick
COMPILE = f"""import sys
import torch
import train_gpt
print(train_gpt.load_compile_cache(sys.argv[1], {STAMP!r}))
f = torch.compile(lambda x: x @ x.T)
f(torch.randn(8, 8))
counts = torch._dynamo.utils.counters["inductor"]
print(counts["fxgraph_cache_hit"], counts["fxgraph_cache_miss"])
print(train_gpt.save_compile_cache(sys.argv[1], {STAMP!r}))
"""


def compile_in_fresh_process(cache, tmp_path, name):
    env = launch_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"{name}_inductor"),
                     TRITON_CACHE_DIR=str(tmp_path / f"{name}_triton"), OMP_NUM_THREADS="1")
    result = run_process([sys.executable, "-c", with_trainer(COMPILE), str(cache)], 300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    # its own local cache, not the session's
    own = tmp_path / f"{name}_inductor"
    assert own.is_dir() and any(own.iterdir()), f"nothing in the process's own cache {own}"
    return result.stdout.splitlines()[-3:]


@pytest.mark.slow
def test_second_process_with_empty_local_caches_compiles_from_the_saved_cache(tmp_path):
    cache = tmp_path / "compile.cache"
    loaded, counts, saved = compile_in_fresh_process(cache, tmp_path, "first")
    temp_files = list(tmp_path.glob("*.tmp"))
    second = compile_in_fresh_process(cache, tmp_path, "second")
    assert loaded.startswith("not found") and counts == "0 1" and saved.startswith("saved")
    assert not temp_files  # the temp file was renamed into place
    loaded, counts, _ = second
    # inductor's own count: a hit, no new code
    assert loaded.startswith("loaded") and counts == "1 0"


def test_foreign_or_corrupt_cache_is_reported_and_ignored(tmp_path):
    path = tmp_path / "compile.cache"
    assert train_gpt.load_compile_cache(str(path), STAMP).startswith("not found")
    other = "train_gpt compile cache: torch 0.1, triton none, Other GPU"
    path.write_bytes(f"{other} sha256={'0' * 64}\npayload".encode())
    note = train_gpt.load_compile_cache(str(path), STAMP)
    made_for = "rejected: made for torch 0.1, triton none, Other GPU; "
    assert note.startswith(made_for)
    path.write_bytes(f"{STAMP} sha256={'0' * 64}\n".encode() + b"payload")
    assert train_gpt.load_compile_cache(str(path), STAMP).startswith("rejected: corrupt")
    path.write_bytes(bytes(range(256)) * 8)
    assert train_gpt.load_compile_cache(str(path), STAMP).startswith("rejected")


# a smoke run's stamp and a cache file of it read; with a second argument, a graph of one library
# call compiled and the file written: with this process's CPU capability
ACROSS_CPUS = """import sys
import torch
import train_gpt
stamp = train_gpt.compile_cache_stamp(train_gpt.parse_args(["--preset", "smoke"]), 1,
                                      torch.device("cpu"))
print(train_gpt.load_compile_cache(sys.argv[1], stamp))
if sys.argv[2:]:
    torch.compile(lambda x: x @ x.T)(torch.randn(8, 8))
    print(train_gpt.save_compile_cache(sys.argv[1], stamp))
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or
                    torch.backends.cpu.get_cpu_capability() == "DEFAULT", reason="no AVX2")
def test_a_cache_made_for_other_vector_instructions_is_rejected_not_run(tmp_path):
    """Inductor builds a CPU's kernels for its vector instructions (torch's CPU capability): seen
    here, an AVX-512 cache loaded under AVX2 computed NaN, and an AVX2 one under none failed to
    build. Such a cache is rejected, naming both."""
    cache = str(tmp_path / "compile.cache")

    def run_with(capability, *save):
        env = launch_env(ATEN_CPU_CAPABILITY=capability, OMP_NUM_THREADS="1",
                         TORCHINDUCTOR_CACHE_DIR=str(tmp_path / capability))
        result = run_process([sys.executable, "-c", with_trainer(ACROSS_CPUS), cache, *save], 120,
                             env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout.splitlines()
    loaded, saved = run_with("avx2", "save")
    assert loaded.startswith("not found") and saved.startswith("saved")
    [loaded] = run_with("default")
    assert loaded.startswith("rejected: made for cpu AVX2; ")


@pytest.mark.parametrize("contents", [b"my notes\n", b"", b"PK\x03\x04 a checkpoint, say",
                                      b"train_gpt compile cache: but no digest\n"])
def test_an_existing_file_that_is_not_a_cache_is_refused_at_start_up_and_left_as_it_is(
        tmp_path, capsys, markov_shards, contents):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(contents)
    before = os.stat(notes)
    code = train_gpt.main(["--preset", "smoke", "--train_files", markov_shards[0],
                           "--val_files", markov_shards[1], "--compile", "true",
                           "--compile_cache", str(notes), "--log_dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: --compile_cache must be ")
    assert repr(str(notes)) in err and "not a compile cache" in err
    assert notes.read_bytes() == contents and os.stat(notes).st_mtime_ns == before.st_mtime_ns
    assert not (tmp_path / "logs").exists()  # refused before anything is written


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
@pytest.mark.parametrize("kind", ["device", "named pipe"])
def test_a_device_or_a_pipe_is_refused_without_waiting_for_it(tmp_path, capsys, kind, no_hang):
    """Replaced, /dev/null would become a plain file (as root, which CI runs as); a pipe's reader
    waits for a writer."""
    path = os.devnull
    if kind == "named pipe":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    assert train_gpt.main(["--preset", "smoke", "--compile_cache", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --compile_cache must be a new file or a compile cache")


def test_saving_replaces_a_cache_of_another_stamp_but_never_another_file(tmp_path):
    path = tmp_path / "compile.cache"
    path.write_bytes(b"my notes\n")
    assert train_gpt.save_compile_cache(str(path), STAMP).startswith("not saved: ")
    assert path.read_bytes() == b"my notes\n" and not list(tmp_path.glob("*.tmp"))
    other = f"train_gpt compile cache: torch 0.1 sha256={'0' * 64}\n"
    path.write_bytes(other.encode() + b"payload")
    assert train_gpt.save_compile_cache(str(path), STAMP).startswith("saved")
    assert path.read_bytes().startswith(f"{STAMP} sha256=".encode())


def stamp_of(world_size=1, **changes):
    args = dataclasses.replace(train_gpt.parse_args(["--preset", "smoke"]), **changes)
    return train_gpt.compile_cache_stamp(args, world_size, torch.device("cpu"))


# what the compiled graphs depend on (the model's shapes and forms, the micro-batch, the process
# count) and what they do not (the data, the schedules, the learning rates, the batch when its
# micro-batches stay the same); 8 processes of batches of 4,096 tokens have the micro-batches of 512
# of the preset's 1 process
GRAPH_CHANGES = [dict(world_size=8, batch_size=4096), dict(world_size=8),
                 dict(regional_compile=True), dict(fused_head_loss="true"),
                 dict(max_device_batch_size=256), dict(vocab_size=50432), dict(num_layers=10),
                 dict(num_heads=4), dict(model_dim=128), dict(attention_free_layer=2),
                 dict(bf16_embeds=False), dict(head_chunk_rows=64), dict(compile_tuning=True)]
SAME_GRAPHS = [dict(seed=1), dict(num_iterations=99), dict(muon_lr=0.1), dict(head_lr=0.1),
               dict(window_end=1024), dict(batch_size=2048), dict(val_tokens=8192),
               dict(checkpoint_every=5), dict(log_dir="elsewhere")]


@pytest.mark.parametrize("changes", GRAPH_CHANGES + SAME_GRAPHS, ids=lambda changes: str(changes))
def test_the_stamp_changes_exactly_with_what_the_compiled_graphs_depend_on(changes):
    assert (stamp_of(**changes) != stamp_of()) == (changes in GRAPH_CHANGES)


def test_a_cache_of_another_process_count_is_rejected_naming_the_difference(tmp_path):
    path = tmp_path / "compile.cache"
    # batches of 4,096 tokens: micro-batches of 512 on 1 process and on 8
    path.write_bytes(f"{stamp_of(world_size=1, batch_size=4096)} sha256={'0' * 64}\n".encode())
    note = train_gpt.load_compile_cache(str(path), stamp_of(world_size=8, batch_size=4096))
    assert note.startswith("rejected: made for 1 process; ")
    assert "replaces it" in note
