"""Every hyperparameter is a command-line option, and every option is checked at start-up: a value
that parses but cannot work ends in one line `error: --NAME must be ...; got VALUE`, exit code 1,
before any file is written or any step runs."""
from dataclasses import fields

import pytest
import torch

import train_gpt
from train_gpt import PRESETS
from train_gpt import Hyperparameters
from train_gpt import check_hyperparameters
from train_gpt import get_sliding_window_blocks
from train_gpt import parse_args

# option: values that parse but cannot work ({file} and {folder}: an existing file and folder)
BAD = {
    "train_files": [""],
    "val_files": [""],
    "val_tokens": ["0", "-65536", "100"],  # 100: not whole max_device_batch_size sequences
    "batch_size": ["0", "-1024", "1000"],  # 0: a ZeroDivisionError once
    "max_device_batch_size": ["0", "100", "131072"],  # 131072: longer than the rotary table
    "num_iterations": ["0", "-5"],  # 0: once blamed the synthetic shard for holding 2 tokens
    "cooldown_frac": ["2", "-0.1", "nan"],  # 2: once silently accepted
    "window_start": ["0", "127"],  # 127 // 128 = 0 blocks at step 0
    # 10**14: an int32 overflow mid-run once (longer than any sequence: no use)
    "window_end": ["64", "100000000000000"],
    # 100: an IndexError deep in the embedding once; 50256 has no room for EOT
    "vocab_size": ["100", "50256"],
    "num_layers": ["0", "4", "7"],
    "num_heads": ["0", "-2"],
    "model_dim": ["0", "770", "780"],  # 6 heads: 770 does not split, 780 splits into heads of 130
    "attention_free_layer": ["-1"],
    "embed_lr": ["-0.1", "nan", "inf"],  # negative: once silently accepted
    "head_lr": ["-1"],
    "scalar_lr": ["inf"],
    "muon_lr": ["nan"],
    "adam_beta1": ["1.5", "1", "-0.1"],  # 1.5: a ValueError from torch once
    "adam_beta2": ["1"],
    "adam_eps": ["0", "-1e-08", "inf"],
    "muon_momentum_start": ["1"],
    "muon_momentum": ["-0.5", "1"],
    "muon_momentum_warmup_steps": ["-1"],
    "val_loss_every": ["-1"],
    "log_dir": ["", "{file}"],
    "compile": ["fast", "True"],
    "fused_head_loss": ["yes", "1"],
    "head_chunk_rows": ["-1"],
    "compile_cache": ["{folder}"],
    "seed": ["-1", str(2 ** 64)],  # -1: a ValueError from numpy once
    "checkpoint_every": ["-1"],
    # a folder without checkpoints, an empty file, no file
    "resume": ["{folder}", "{file}", "missing.pt"],
    "hellaswag_data": ["{folder}", "missing.jsonl"],
    "tokenizer": ["{folder}", "missing.tiktoken"],
}
# the bad values of the rules that options share (train_gpt.option): an option with one of them
# needs no row in BAD
SHARED_BAD = {
    train_gpt.AT_LEAST_0: ["-1"],
    train_gpt.AT_LEAST_1: ["0"],
    train_gpt.SHARDS: [""],
    train_gpt.WINDOW: ["127"],
    train_gpt.LEARNING_RATE: ["-1", "nan"],
    train_gpt.BELOW_1: ["1", "-0.1"],
    train_gpt.FILE: ["{folder}"],
    train_gpt.AUTO: ["fast"],
}


def bad_values(name):
    """BAD's values for an option, then those of the shared rules among its facts."""
    rules = Hyperparameters.__dataclass_fields__[name].metadata.get("rules", ())
    shared = [value for rule in rules for value in SHARED_BAD.get(rule, [])]
    return BAD.get(name, []) + [value for value in shared if value not in BAD.get(name, [])]

# edge values that must pass, so that the checks are not too strict
GOOD = {
    "cooldown_frac": ["0", "1"],
    "adam_beta1": ["0"],
    "adam_beta2": ["0.999"],
    "muon_momentum_start": ["0"],
    "muon_momentum": ["0"],
    "embed_lr": ["0"],
    "head_lr": ["0"],
    "scalar_lr": ["0"],
    "muon_lr": ["0"],
    "adam_eps": ["1e-30"],
    "val_loss_every": ["0"],
    "muon_momentum_warmup_steps": ["0"],
    "attention_free_layer": ["0", "100"],
    "window_start": ["128", "5000"],
    "window_end": ["128"],
    "vocab_size": ["50257"],
    "num_layers": ["6"],
    "num_heads": ["1", "192"],
    "model_dim": ["24"],
    "batch_size": ["128"],
    "max_device_batch_size": ["128", "65536"],
    "num_iterations": ["1"],
    "val_tokens": ["65536"],
    "seed": [str(2**64 - 1)],
    "compile": ["auto", "true", "false"],
    # true needs triton
    "fused_head_loss": ["auto", "false"] + ["true"] * (train_gpt.triton is not None),
    "head_chunk_rows": ["0", "1"],
    "compile_cache": ["", "cache.bin"],
    "log_dir": ["new/folder"],
    "hellaswag_data": [""],
    "tokenizer": [""],
}


def test_every_option_has_bad_values_in_the_table():
    for f in fields(Hyperparameters):
        rules = f.metadata.get("rules", ())
        assert bad_values(f.name) or not rules, f"--{f.name}: a rule of its own needs a row in BAD"
        # booleans: no value both parses and fails; parse_bool refuses all but true/false words
        assert not (f.type is bool and rules), f"--{f.name}"


@pytest.mark.parametrize(
    "name,value", [(f.name, value) for f in fields(Hyperparameters) for value in bad_values(f.name)]
)
def test_a_value_that_cannot_work_is_one_error_line_naming_the_option(
    tmp_path, capsys, monkeypatch, name, value
):
    # no data here: were a check missing, the run would still stop before a step
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_folder").mkdir()
    value = value.format(file="a_file", folder="a_folder")
    # the later --log_dir wins; = lets "-1e-08" through
    argv = ["--log_dir", "logs", f"--{name}={value}"]
    given = getattr(parse_args(argv), name)
    assert train_gpt.main(argv) == 1
    out, err = capsys.readouterr()
    assert err.startswith(f"error: --{name} ") and err.count("\n") == 1 and err.endswith("\n"), err
    # the value given; no step ran
    assert repr(given) in err and "Traceback" not in err and out == ""
    # no log folder, no shard
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "a_folder"]


def test_defaults_presets_and_edge_values_pass():
    check_hyperparameters(Hyperparameters())
    for preset in PRESETS:
        check_hyperparameters(parse_args(["--preset", preset]))
    for name, values in GOOD.items():
        for value in values:
            check_hyperparameters(parse_args([f"--{name}", value]))
    with pytest.raises(SystemExit) as info:  # a boolean that is not a true/false word never parses
        parse_args(["--bf16_embeds", "maybe"])
    assert info.value.code == 2


def test_smoke_preset_uses_every_part_and_fits_1_2_4_or_8_processes():
    """Small and short, but not so small that a part of the model or of the loop goes unused."""
    args = parse_args(["--preset", "smoke"])
    with torch.device("meta"):
        model = train_gpt.GPT.from_args(args)
    # the attention-free block
    assert [block.attn is None for block in model.blocks].count(True) == 1
    ve = model.value_embeds(torch.zeros(128, dtype=torch.int64, device="meta"))
    with_value_embeds = [i for i in range(len(model.blocks)) if ve[i] is not None]
    # U-net skips
    assert 0 < len(with_value_embeds) < len(model.blocks) and len(model.skip_weights) >= 3
    for world_size in (1, 2, 4, 8):
        micro, accum_steps, _ = train_gpt.micro_batch_plan(args, world_size)
        assert micro * accum_steps * world_size == args.batch_size
        assert accum_steps >= 2 or world_size > 1  # gradient accumulation on 1 process
    # the window grows through several block counts while training, to the whole sequence at the end
    windows = [get_sliding_window_blocks(step, args) for step in range(args.num_iterations + 1)]
    assert windows == sorted(windows) and len(set(windows[:-1])) >= 3
    assert windows[-1] * train_gpt.BLOCK_SIZE >= args.max_device_batch_size


@pytest.mark.parametrize("start,end", [(128, 128), (128, 1856), (1856, 128), (200, 300)])
def test_windows_that_pass_the_check_hold_a_block_at_every_step(start, end):
    args = parse_args(
        ["--window_start", str(start), "--window_end", str(end), "--num_iterations", "1390"]
    )
    check_hyperparameters(args)
    assert min(get_sliding_window_blocks(step, args) for step in range(args.num_iterations + 1)) >= 1


# process-count checks (micro_batch_plan): the values pass check_hyperparameters, the process count
# does not
@pytest.mark.parametrize(
    "world_size,argv,words",
    [
        ("3", ["--batch_size", "1024"], "does not divide among 3 processes"),
        ("2", ["--max_device_batch_size", "384", "--val_tokens", "3072"], "micro-batches"),
        (
            "2",
            ["--val_tokens", "4608"],
            "--val_tokens",
        ),  # whole 512-token sequences, but not 2 x 512
    ],
)
def test_batch_sizes_that_do_not_divide_among_the_processes_are_refused(
    tmp_path, capsys, torchrun_worker, world_size, argv, words
):
    torchrun_worker(WORLD_SIZE=world_size)
    argv = ["--preset", "smoke", "--log_dir", str(tmp_path / "logs"), *argv]
    check_hyperparameters(parse_args(argv))
    assert train_gpt.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err
    assert not (tmp_path / "logs").exists()


@pytest.mark.record18
def test_every_hyperparameter_is_a_command_line_option(capsys):
    args = parse_args(["--num_iterations", "20", "--bf16_embeds", "false",
                       "--cooldown_frac", "0.5"])
    assert (args.num_iterations, args.bf16_embeds, args.cooldown_frac) == (20, False, 0.5)
    # explicit options beat the preset
    smoke = parse_args(["--preset", "smoke", "--num_layers", "6"])
    assert smoke.num_layers == 6 and smoke.model_dim == PRESETS["smoke"]["model_dim"]
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = capsys.readouterr().out
    for field in fields(Hyperparameters):
        assert f"--{field.name}" in help_text
    assert "default: 1390" in help_text
