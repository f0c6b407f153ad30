"""data/text_to_shards.py: text files, JSON Lines (plain and gzipped) and Parquet in (the hub's
files: test_fetch.py, beside its stand-in of the hub); shards out, read with the trainer's own
reader and compared with an independent encoding of every document. Most runs are in this process
with a tiny byte-level encoding (one token per UTF-8 byte), so that decoding is plain bytes;
GPT-2's real BPE where its ranks file is at hand (helpers.gpt2_ranks)."""
import gzip
import json
import os
import subprocess
import sys
import zlib

import gpt2_tokenizer
import helpers
import numpy as np
import pytest
import shards
import text_to_shards
import tiktoken
from helpers import REPO
from helpers import finished_log
from tiktoken_ext.openai_public import r50k_pat_str

import train_gpt

RANKS = helpers.RANKS
needs_ranks = helpers.needs_ranks
try:
    import pyarrow
    import pyarrow.parquet
except ImportError:
    pyarrow = None
needs_pyarrow = pytest.mark.skipif(pyarrow is None,
                                   reason=f"needs `pip install {text_to_shards.PYARROW}`")
EOT = 50256

# Documents that trip up a careless reader: non-ASCII text, the special token's text, \r\n kept as
# it is, U+2028 (a line break to str.splitlines, not to JSON Lines), leading and trailing whitespace
TRICKY = ["Windows\r\nline ends,\ttabs and trailing spaces   \n\n",
          "Caf\u00e9 na\u00efve \u2014 \u65e5\u672c\u8a9e, \U0001F600, combining e\u0301.",
          "Text like the special token <|endoftext|> is never the special token.", "Hello world",
          " a leading space", "a line\u2028separator"]
WORDS = ["the", "speedrun", "na\u00efve", "\u65e5\u672c", "token", "shard", "\U0001F680",
         "d\u00e9j\u00e0", "42"]


def corpus(count, seed=0):
    """`count` documents of 0 to 60 words, seeded."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(0, 61))) for _ in range(count)]


def byte_encoding(big_id_for=None):
    """A tiny stand-in for GPT-2's BPE: one token per UTF-8 byte (no merges), EOT at 50256;
    `big_id_for`: a byte given an id that does not fit 16 bits."""
    ranks = {bytes([b]): b for b in range(256)}
    if big_id_for:
        ranks[big_id_for] = 70_000
    return tiktoken.Encoding("bytes", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT})


def json_lines(documents):
    records = ({"id": i, "text": doc} for i, doc in enumerate(documents))
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def write_inputs(folder, documents, formats):
    """The documents, in order, over one file per format (a "txt" file takes one document); their
    paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    shares = np.array_split(np.arange(len(documents)), len(formats))
    for i, (form, share) in enumerate(zip(formats, shares)):
        docs = [documents[j] for j in share]
        path = folder / f"{i:02d}.{form}"
        if form == "txt":
            assert len(docs) == 1
            path.write_bytes(docs[0].encode())
        elif form == "jsonl":
            path.write_bytes(json_lines(docs).encode())
        elif form == "jsonl.gz":
            path.write_bytes(gzip.compress(json_lines(docs).encode()))
        elif form == "parquet":
            table = pyarrow.table({"id": list(range(len(docs))), "text": docs})
            pyarrow.parquet.write_table(table, path, row_group_size=7)
        paths.append(path)
    return paths


def make(paths, out, *options, name="corpus", encoding=None):
    """Run the command line in this process, on one worker unless told; its exit status."""
    workers = [] if "--workers" in options else ["--workers", "1"]
    argv = [*map(str, paths), "--out", str(out), "--name", name, *workers, *map(str, options)]
    return text_to_shards.main(argv, encoding=encoding)


def read_shards(out, name="corpus"):
    """{file name: tokens}, the val shard first, as the trainer reads them (it checks header and
    size)."""
    paths = sorted(out.glob(f"{name}_val_*.bin")) + sorted(out.glob(f"{name}_train_*.bin"))
    return {path.name: train_gpt.load_data_shard(str(path)).numpy().astype(np.int64)
            for path in paths}


def split_documents(tokens):
    """A shard's documents, each without its leading EOT; the shard must start with one."""
    assert tokens[0] == EOT
    starts = list(np.flatnonzero(tokens == EOT)) + [len(tokens)]
    return [tokens[a + 1:b] for a, b in zip(starts, starts[1:])]


def byte_documents(out, name="corpus"):
    """The documents of all shards, in order, decoded as the byte encoding's UTF-8 bytes."""
    made = read_shards(out, name).values()
    return [bytes(doc.tolist()).decode() for tokens in made for doc in split_documents(tokens)]


def file_bytes(out):
    return {path.name: path.read_bytes() for path in sorted(out.iterdir())}


# What the shards hold ----------------------------------------------------------------------------
@needs_ranks
@pytest.mark.slow
def test_every_format_gives_gpt2s_tokens_of_every_document_in_order(tmp_path):
    documents = TRICKY + corpus(40)
    files = [("txt", 1), ("jsonl", 4), ("txt", 1), ("jsonl.gz", 20), ("parquet", 10), ("txt", 1),
             ("jsonl", 9)]
    if pyarrow is None:
        files.remove(("parquet", 10))
        files[-1] = ("jsonl", 19)
    paths = []
    at = 0
    for i, (form, count) in enumerate(files):
        paths += write_inputs(tmp_path / f"in{i}", documents[at:at + count], [form])
        at += count
    assert at == len(documents)
    assert make(paths, tmp_path / "out", "--tokenizer", RANKS, "--val_tokens", "30",
                "--workers", "2") == 0
    encoding = gpt2_tokenizer.gpt2_encoding(RANKS)
    expected = np.concatenate([[EOT] + encoding.encode_ordinary(doc) for doc in documents])
    made = read_shards(tmp_path / "out")
    assert np.array_equal(np.concatenate(list(made.values())), expected)
    decoded = [encoding.decode(doc.tolist())
               for tokens in made.values() for doc in split_documents(tokens)]
    assert decoded == documents


def test_shards_decode_back_to_the_documents_with_a_byte_encoding(tmp_path):
    documents = TRICKY + [""] + corpus(30)  # an empty JSON text is a document too: its EOT alone
    paths = write_inputs(tmp_path / "in", documents[:1], ["txt"])
    formats = ["jsonl", "parquet", "jsonl.gz"] if pyarrow else ["jsonl", "jsonl.gz"]
    paths += write_inputs(tmp_path / "in2", documents[1:], formats)
    assert make(paths, tmp_path / "out", "--val_tokens", "100", "--shard_tokens", "400",
                encoding=byte_encoding()) == 0
    assert byte_documents(tmp_path / "out") == documents


def test_a_folder_is_read_in_path_order_without_hidden_files(tmp_path):
    for path, text in [("b/2.txt", "two"), ("a.txt", "one"), ("b/10.jsonl", json_lines(["ten"])),
                       (".hidden.txt", "not me"), ("c/.git/x.txt", "nor me")]:
        (tmp_path / "in" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / path).write_text(text)
    assert make([tmp_path / "in"], tmp_path / "out", "--val_tokens", "1",
                encoding=byte_encoding()) == 0
    assert byte_documents(tmp_path / "out") == ["one", "ten", "two"]  # a.txt, b/10.jsonl, b/2.txt


def test_val_shard_takes_whole_documents_then_train_shards_fill_up_to_the_limit(tmp_path):
    documents = corpus(120, seed=1)
    paths = write_inputs(tmp_path / "in", documents, ["jsonl", "jsonl.gz"])
    lengths = [1 + len(doc.encode()) for doc in documents]
    # "at least": 7 documents reach it exactly
    val_tokens = sum(lengths[:7])
    shard_tokens = 700
    assert make(paths, tmp_path / "out", "--val_tokens", str(val_tokens), "--shard_tokens",
                str(shard_tokens), encoding=byte_encoding()) == 0
    # the plan, as a plain loop over the documents' token counts
    val = 0
    while sum(lengths[:val]) < val_tokens:
        val += 1
    expected = [sum(lengths[:val])]
    current = 0
    for length in lengths[val:]:
        if current + length > shard_tokens:
            expected.append(current)
            current = 0
        current += length
    expected.append(current)
    assert current >= shard_tokens / 2  # (this corpus's last shard needs no evening out)
    made = read_shards(tmp_path / "out")
    train = [f"corpus_train_{i:06d}.bin" for i in range(1, len(expected))]
    assert list(made) == ["corpus_val_000000.bin"] + train
    assert [len(tokens) for tokens in made.values()] == expected
    assert len(split_documents(made["corpus_val_000000.bin"])) == val == 7


def test_a_short_last_train_shard_is_evened_out_with_the_one_before(tmp_path):
    documents = [f"document {i:03d} " + "x" * 40 for i in range(13)]  # 54 tokens each, with the EOT
    paths = write_inputs(tmp_path / "in", documents, ["jsonl"])
    # val: 1 document; train: 10 fit in 600 tokens, then 2 (108 < 300): evened out to 6 and 6
    assert make(paths, tmp_path / "out", "--val_tokens", "1", "--shard_tokens", "600",
                encoding=byte_encoding()) == 0
    made = read_shards(tmp_path / "out").values()
    assert [len(split_documents(tokens)) for tokens in made] == [1, 6, 6]
    assert byte_documents(tmp_path / "out") == documents


@pytest.mark.slow
def test_one_and_two_workers_write_the_same_bytes(tmp_path, monkeypatch):
    # many chunks, several in flight at once
    monkeypatch.setattr(text_to_shards, "CHUNK_BYTES", 500)
    paths = write_inputs(tmp_path / "in", corpus(200, seed=2), ["jsonl", "jsonl.gz", "jsonl"])
    for workers in (1, 2):
        assert make(paths, tmp_path / f"out{workers}", "--val_tokens", "300", "--shard_tokens",
                    "2000", "--workers", str(workers), encoding=byte_encoding()) == 0
    one = file_bytes(tmp_path / "out1")
    two = file_bytes(tmp_path / "out2")
    assert len(one) > 4 and one == two


# Interruptions and folders -----------------------------------------------------------------------
@pytest.mark.parametrize("finished", [0, 3])
def test_an_interrupted_run_goes_on_to_the_same_files(tmp_path, monkeypatch, finished):
    paths = write_inputs(tmp_path / "in", corpus(150, seed=3), ["jsonl", "jsonl.gz", "jsonl"])
    options = ["--val_tokens", "300", "--shard_tokens", "2000"]
    assert make(paths, tmp_path / "whole", *options, encoding=byte_encoding()) == 0
    whole = file_bytes(tmp_path / "whole")
    rename = shards.ShardWriter.rename
    renamed = []
    read = []

    def interrupted_rename(writer, shard):
        if len(renamed) == finished:
            raise KeyboardInterrupt
        renamed.append(shard.name)
        rename(writer, shard)

    monkeypatch.setattr(shards.ShardWriter, "rename", interrupted_rename)
    assert make(paths, tmp_path / "out", *options, encoding=byte_encoding()) == 130
    left = file_bytes(tmp_path / "out")
    # no temporary file, no partial shard
    assert sorted(left) == sorted(renamed + [text_to_shards.MANIFEST])
    assert all(left[name] == whole[name] for name in renamed)
    monkeypatch.setattr(shards.ShardWriter, "rename", rename)
    pieces = text_to_shards.pieces

    def counted(*args):
        for piece in pieces(*args):
            # the documents read: the lines with text
            read.append(sum(1 for line in piece[3].split(b"\n") if line.strip()))
            yield piece

    monkeypatch.setattr(text_to_shards, "pieces", counted)
    assert make(paths, tmp_path / "out", *options, encoding=byte_encoding()) == 0
    assert file_bytes(tmp_path / "out") == whole
    recorded = json.loads(whole[text_to_shards.MANIFEST])["shards"]
    # it went on after the finished shards
    assert sum(read) == 150 - sum(shard["documents"] for shard in recorded[:finished])
    read.clear()
    # all there
    assert make(paths, tmp_path / "out", *options, encoding=byte_encoding()) == 0 and not read


def test_changed_input_makes_the_shards_again(tmp_path):
    paths = write_inputs(tmp_path / "in", corpus(60, seed=4), ["jsonl", "jsonl"])
    options = ["--val_tokens", "200", "--shard_tokens", "1000"]
    assert make(paths, tmp_path / "out", *options, encoding=byte_encoding()) == 0
    before = file_bytes(tmp_path / "out")
    paths[1].write_text(json_lines(["short now"]))
    assert make(paths, tmp_path / "out", *options, encoding=byte_encoding()) == 0
    # the old shards beyond the new end are gone
    assert len(file_bytes(tmp_path / "out")) < len(before)
    assert byte_documents(tmp_path / "out") == corpus(60, seed=4)[:30] + ["short now"]


@pytest.mark.parametrize("other", ["another name", "another option", "other inputs", "no record"])
def test_a_folder_holding_another_datasets_shards_is_refused(tmp_path, capsys, other):
    paths = write_inputs(tmp_path / "in", corpus(40, seed=5), ["jsonl", "jsonl"])
    options = ["--val_tokens", "200"]
    assert make(paths, tmp_path / "out", *options, encoding=byte_encoding()) == 0
    if other == "no record":
        (tmp_path / "out" / text_to_shards.MANIFEST).unlink()
    before = file_bytes(tmp_path / "out")
    capsys.readouterr()
    if other == "another name":
        status = make(paths, tmp_path / "out", *options, name="other", encoding=byte_encoding())
    elif other == "another option":
        status = make(paths, tmp_path / "out", "--val_tokens", "300", encoding=byte_encoding())
    else:
        status = make(paths[:1], tmp_path / "out", *options, encoding=byte_encoding())
    assert status == 1 and file_bytes(tmp_path / "out") == before
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "\n" not in error and "another --out" in error, error


# Bad input ---------------------------------------------------------------------------------------
CUT_GZIP = gzip.compress(json_lines(corpus(50)).encode())[:900]
# whole lines before the cut
READABLE_LINES = zlib.decompressobj(wbits=31).decompress(CUT_GZIP).count(b"\n")
BAD = {  # file name: (content, what the error line says after "error: FILE: ")
    "empty.txt": (b"", "empty file"),
    "latin1.txt": ("first line\nsecond caf\u00e9\n".encode("latin-1"),
                   "line 2: not UTF-8 (byte 0xe9 at column 11)"),
    "latin1.jsonl": (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "line 2: not UTF-8"),
    "invalid.jsonl": (b'{"text": "ok"}\n\n{"text": "unclosed}\n', "line 3: not valid JSON"),
    "no_field.jsonl": (b'{"text": "ok"}\n{"content": "no text field"}\n',
                       "line 2: no 'text' field"),
    "number.jsonl": (b'{"text": 42}\n', "line 1: the 'text' field is 42, not a string"),
    "list.jsonl": (b'["text"]\n', "line 1: a JSON list, not an object"),
    "blank.jsonl": (b"\n \n", "blank lines only: no documents in it"),
    "empty.txt.gz": (gzip.compress(b""), "empty file: no documents in it"),
    "truncated.jsonl.gz": (CUT_GZIP, f"line {READABLE_LINES + 1}: not a whole gzip file"),
    "big_id.jsonl": (b'{"text": "fine"}\n{"text": "a ~ here"}\n',
                     "line 2: token id 70000 does not fit"),
    "too_long.jsonl": (json_lines(["fine", "x" * 900]).encode(),
                       "line 2: a document of 901 tokens"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_error_line_naming_file_and_line(tmp_path, capsys, name):
    content, message = BAD[name]
    good = tmp_path / "good.jsonl"
    good.write_text(json_lines(corpus(20, seed=6)))
    bad = tmp_path / name
    bad.write_bytes(content)
    status = make([good, bad], tmp_path / "out", "--val_tokens", "100", "--shard_tokens", "800",
                  encoding=byte_encoding(big_id_for=b"~"))
    assert status == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"error: {bad}: {message}"), error
    assert not list((tmp_path / "out").glob(".*.tmp"))


def test_a_missing_file_a_bad_ranks_file_and_input_all_for_val_are_one_line(tmp_path, capsys):
    assert make([tmp_path / "absent.jsonl"], tmp_path / "out", encoding=byte_encoding()) == 1
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'absent.jsonl'}: no such file"
    paths = write_inputs(tmp_path / "in", corpus(5), ["jsonl"])
    assert make(paths, tmp_path / "out", "--tokenizer", tmp_path / "absent.tiktoken") == 1
    assert capsys.readouterr().err.strip().startswith("error: --tokenizer ")
    assert make(paths, tmp_path / "out", "--val_tokens", "10000", encoding=byte_encoding()) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: the inputs hold ") and "none left to train on" in error
    assert not list((tmp_path / "out").glob("*.bin"))


@pytest.mark.slow
def test_the_script_reports_bad_input_without_a_traceback(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    command = [sys.executable, str(REPO / "data" / "text_to_shards.py"), str(empty), "--name", "x"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == f"error: {empty}: empty file: no documents in it; leave it out\n"


@pytest.mark.parametrize("args", [[], ["--hub", "a/b", "x.txt"], ["x.txt", "--name", "a*b"],
                                  ["x.txt", "--shard_tokens", "0"], ["x.txt", "--workers", "0"],
                                  ["x.txt", "--hub_config", "c"]])
def test_bad_command_line_exits_2(args, capsys):
    argv = args if "--name" in args else [*args, "--name", "x"]
    with pytest.raises(SystemExit) as stop:
        text_to_shards.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error:") and err.count("\n") == 1, err


def test_more_workers_than_two_per_core_are_refused_in_one_line(capsys):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    most = 2 * cores
    assert text_to_shards.parse_args(["x.txt", "--name", "x", "--workers", str(most)]).workers == most
    with pytest.raises(SystemExit) as stop:
        text_to_shards.main(["x.txt", "--name", "x", "--workers", str(most + 1)])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (f"error: --workers must be between 1 and {most} (2 per core: "
                                       "more workers than cores add processes, not speed); got "
                                       f"{most + 1}; see --help\n")


@needs_pyarrow
def test_parquet_text_column_and_nulls(tmp_path, capsys):
    path = tmp_path / "data.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"body": ["one", "two", None]}), path)
    assert make([path], tmp_path / "out", "--val_tokens", "1", encoding=byte_encoding()) == 1
    no_column = "no column 'text' (it has body); name the text column with --text_field"
    assert no_column in capsys.readouterr().err
    assert make([path], tmp_path / "out", "--val_tokens", "1", "--text_field", "body",
                encoding=byte_encoding()) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"error: {path}: row 3: the 'body' column is empty (null)"), error


def test_parquet_without_pyarrow_names_the_install_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1 not really")
    assert make([path], tmp_path / "out", encoding=byte_encoding()) == 1
    install = f"pip install {text_to_shards.PYARROW}"
    assert capsys.readouterr().err.strip() == f"error: reading Parquet needs pyarrow: `{install}`"
    assert install in (REPO / "README.md").read_text()  # the version the README names


# The trainer on the shards -----------------------------------------------------------------------
@pytest.mark.slow
def test_the_smoke_model_trains_on_the_shards(tmp_path):
    """Shards of a small corpus (GPT-2's encoding where present, else bytes): the trainer lists
    both train shards and validates before and after a step on them. Run in this process as
    `python train_gpt.py` runs it, on 6 blocks of width 16 and one 128-token sequence (the size
    of the model is not what is checked)."""
    paths = write_inputs(tmp_path / "in", corpus(300, seed=8), ["jsonl", "jsonl.gz"])
    inputs = text_to_shards.local_inputs(paths, tmp_path / "out")
    encoding = gpt2_tokenizer.gpt2_encoding(RANKS) if RANKS else byte_encoding()
    text_to_shards.convert(inputs, tmp_path / "out", "mine", encoding, val_tokens=300,
                           shard_tokens=1500)
    args = ["--preset", "smoke", "--train_files", str(tmp_path / "out" / "mine_train_*.bin"),
            "--val_files", str(tmp_path / "out" / "mine_val_*.bin"), "--num_iterations", "1",
            "--val_loss_every", "1", "--batch_size", "128", "--max_device_batch_size", "128",
            "--val_tokens", "128", "--num_layers", "6", "--model_dim", "16", "--num_heads", "1",
            "--log_dir", str(tmp_path / "logs")]
    assert train_gpt.main(args) == 0
    log = finished_log(tmp_path / "logs").read_text()
    assert "mine_train_000001.bin" in log and "mine_train_000002.bin" in log
    steps = [line for line in log.splitlines() if line.startswith("step:") and "val_loss:" in line]
    val_losses = [float(line.split("val_loss:")[1].split()[0]) for line in steps]
    assert len(val_losses) == 2 and all(np.isfinite(val_losses))
