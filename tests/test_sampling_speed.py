"""records/sampling_speed.py: options that would time nothing, or nothing right, are one line.

    python -m pytest tests/test_sampling_speed.py -q
"""

import pytest
import torch
from helpers import load_records_script

sampling_speed = load_records_script("sampling_speed")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--new_tokens", "-1"], "--new_tokens must be at least 1; got -1"),
        (["--new_tokens", "0"], "--new_tokens must be at least 1; got 0"),
        (["--prompt_tokens", "-1"], "--prompt_tokens must be at least 0; got -1"),
        (["--device", "foo"], "--device foo is not one this tool times; give cpu, or cuda on a GPU "
         "machine"),
        (["--device", "meta"], "--device meta is not one this tool times; give cpu, or cuda on a "
         "GPU machine"),
    ],
)
def test_bad_options_are_one_line_before_any_model(argv, message, capsys):
    assert sampling_speed.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {message}\n" and captured.out == ""


def test_cuda_without_a_gpu_is_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert sampling_speed.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda cannot be used (") and err.count("\n") == 1
