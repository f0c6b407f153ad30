"""GPT-2's encoding built from a local ranks file, as the offline tools build it.

    python -m pytest tests/test_tokenizer.py -q"""
import base64
import os
import sys
from pathlib import Path

import gpt2_tokenizer
import helpers
import pytest
from helpers import launch_env
from helpers import run_process

REPO = Path(__file__).resolve().parent.parent
RANKS = helpers.RANKS
needs_ranks = helpers.needs_ranks


@needs_ranks
def test_ranks_file_gives_gpt2_ids():
    # the ids GPT-2's published encoder gives these strings
    enc = gpt2_tokenizer.gpt2_encoding(RANKS)
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary("The quick brown fox jumps over the lazy dog.") == [
        464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]
    assert enc.encode_ordinary("<|endoftext|>") != [50256]  # text is never the special token


def test_missing_or_foreign_ranks_file_is_one_clear_error(tmp_path):
    with pytest.raises(gpt2_tokenizer.TokenizerError, match="absent.tiktoken: no such file"):
        gpt2_tokenizer.gpt2_encoding(tmp_path / "absent.tiktoken")
    small = tmp_path / "small.tiktoken"
    small.write_text("YQ== 0\nYg== 1\n")  # two ranks: some other, tiny BPE
    with pytest.raises(gpt2_tokenizer.TokenizerError, match="not GPT-2's"):
        gpt2_tokenizer.gpt2_encoding(small)
    garbage = tmp_path / "garbage.tiktoken"
    garbage.write_text("this is not a ranks file\n")
    with pytest.raises(gpt2_tokenizer.TokenizerError, match="not a tiktoken ranks file"):
        gpt2_tokenizer.gpt2_encoding(garbage)
    # a JSON Lines file given by mistake: its long line is not quoted
    jsonl = tmp_path / "given_by_mistake.jsonl"
    jsonl.write_text('{"text":"' + "word" * 1000 + '"}\n')
    with pytest.raises(gpt2_tokenizer.TokenizerError, match="not a tiktoken ranks file") as error:
        gpt2_tokenizer.gpt2_encoding(jsonl)
    assert len(str(error.value)) < 300 and "\n" not in str(error.value)


def test_a_ranks_file_changed_in_place_is_read_again(tmp_path):
    ranks = tmp_path / "mine.tiktoken"
    for count in (1, 2):
        write_ranks(ranks, {bytes([i]): i for i in range(count)})
        with pytest.raises(gpt2_tokenizer.TokenizerError, match=f": {count} ranks, not GPT-2's"):
            gpt2_tokenizer.gpt2_encoding(ranks)


def write_ranks(path, ranks):
    """A tiktoken ranks file: each token's bytes in base64, then its rank."""
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n"
                            for token, rank in ranks.items()))


def test_a_ranks_file_of_gpt2s_size_but_another_bpe_is_refused(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"merge%d" % i: 256 + i for i in range(gpt2_tokenizer.GPT2_RANKS - 256)})
    other = tmp_path / "other.tiktoken"
    write_ranks(other, ranks)
    with pytest.raises(gpt2_tokenizer.TokenizerError, match="its ranks are not GPT-2's"):
        gpt2_tokenizer.gpt2_encoding(other)


@needs_ranks
def test_gpt2s_ranks_with_two_ids_swapped_are_refused(tmp_path):
    import tiktoken.load

    ranks = tiktoken.load.load_tiktoken_bpe(str(RANKS))
    ranks[b" the"], ranks[b" a"] = ranks[b" a"], ranks[b" the"]
    swapped = tmp_path / "swapped.tiktoken"
    write_ranks(swapped, ranks)
    with pytest.raises(gpt2_tokenizer.TokenizerError, match="its ranks are not GPT-2's"):
        gpt2_tokenizer.gpt2_encoding(swapped)
    assert gpt2_tokenizer.fingerprint(gpt2_tokenizer.gpt2_encoding(RANKS)) == "gpt2 7fc8d184b157a4e0"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_as_ranks_file_is_one_clear_error_without_waiting_on_it(tmp_path):
    """In a process of its own: opening the pipe would wait for a writer forever."""
    pipe = tmp_path / "gpt2.tiktoken"
    os.mkfifo(pipe)
    code = ("import sys, gpt2_tokenizer\n"
            "try:\n"
            "    gpt2_tokenizer.gpt2_encoding(sys.argv[1])\n"
            "except gpt2_tokenizer.TokenizerError as e:\n"
            "    print(e)\n")
    result = run_process([sys.executable, "-c", code, str(pipe)], 30,
                         env=launch_env(PYTHONPATH=str(REPO / "data")))
    assert result.stdout == f"--tokenizer {pipe}: a pipe, not a regular file\n", result.stderr

