"""Data that is not readable text (issue 37): a corrupt `.txt.gz` ended `train` and `eval` in a
zlib traceback, and a binary file (an executable) trained to "done" without a word. Now each
is one line naming the file, status 2; `--binary-data` takes a binary file on purpose.

Issue 60: a folder whose file names only began with `train` and `val` was split by name and
every other file dropped without a word; text too short to hold any out trained every step and
then failed at the final evaluation."""

import gzip
import os

import pytest

from blockscale.cli import main
from blockscale.train.data import (
    BINARY_FRACTION,
    HOLDOUT_BLOCK,
    HOLDOUT_EVERY,
    load_corpus,
    not_text_fraction,
    split_of,
)

FAST = ["--quiet", "--steps", "1", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0"]
FAST += ["--telemetry-every", "0", "--warmup-steps", "0"]


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished one-step run, for `eval`."""
    out = tmp_path_factory.mktemp("data") / "run"
    assert main(["train", "--out", str(out), "--max-data-bytes", "20000", *FAST]) == 0
    return out


def corrupt_gz(folder):
    path = folder / "corrupt.txt.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00garbage" * 100)  # a gzip header, then no deflate stream
    return path


def binary(folder):
    path = folder / "program.txt"
    # an executable's share of non-text bytes, or more; enough for a held-out 4 KiB block
    path.write_bytes(os.urandom(HOLDOUT_BLOCK * HOLDOUT_EVERY + 100))
    return path


@pytest.mark.parametrize("make", [corrupt_gz, binary], ids=["corrupt-gz", "binary"])
def test_train_refuses_unreadable_data_in_one_line(make, tmp_path, capsys):
    path = make(tmp_path)
    assert main(["train", "--out", str(tmp_path / "r"), "--data", str(path), *FAST]) == 2
    err = one_line(capsys)
    assert f"data file {path}" in err
    if make is binary:
        assert "does not look like text" in err and "pass --binary-data" in err
    else:
        assert "cannot read data file" in err and "while decompressing data" in err


@pytest.mark.parametrize("make", [corrupt_gz, binary], ids=["corrupt-gz", "binary"])
def test_eval_refuses_unreadable_data_in_one_line(make, run, tmp_path, capsys):
    path = make(tmp_path)
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--data", str(path), "--quiet"]) == 2
    err = one_line(capsys)
    assert f"data file {path}" in err
    assert ("pass --binary-data" if make is binary else "while decompressing data") in err


def test_binary_data_is_taken_when_asked(run, tmp_path, capsys):
    path = binary(tmp_path)
    out = tmp_path / "r"
    assert main(["train", "--out", str(out), "--data", str(path), "--binary-data", *FAST]) == 0
    args = ["eval", "--run", str(run), "--data", str(path), "--binary-data", "--quiet"]
    assert main(args) == 0
    assert "bits/byte over" in capsys.readouterr().out
    # the run's own data is read as the run read it: its held-out part, binary as well
    assert main(["eval", "--run", str(out), "--quiet"]) == 0


def test_text_passes_and_the_threshold_sits_between_text_and_binary(tmp_path):
    """UTF-8 prose, code and a gzip of them are text; bytes in UTF-16, or random, are not."""
    text = "Grüße, naïve café: x = {'a': 1}\t# done\r\n" * 500
    assert not_text_fraction(text.encode()) == 0
    assert not_text_fraction(text.encode("utf-16")) > 0.3
    assert not_text_fraction(os.urandom(10_000)) > 0.5
    # a few stray Latin-1 bytes in a long UTF-8 file pass
    assert not_text_fraction(text.encode() + "é".encode("latin-1") * 50) < BINARY_FRACTION
    with gzip.open(tmp_path / "train.txt.gz", "wt") as f:
        f.write(text)
    (tmp_path / "val.txt").write_text(text)
    assert load_corpus(str(tmp_path)).train.numel() == len(text.encode())


def test_eval_of_a_run_with_no_held_out_text_is_one_line(tmp_path, capsys):
    """A corpus shorter than 50 blocks of 4 KiB holds nothing out: `eval` of its run ended in a
    ZeroDivisionError, now one line."""
    short = tmp_path / "short.txt"
    short.write_text("a few words of text\n" * 500)
    out = tmp_path / "r"
    assert main(["train", "--out", str(out), "--data", str(short), *FAST]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(out), "--quiet"]) == 2
    assert "evaluation text has 0 bytes; seq_len=" in one_line(capsys)


def test_names_that_only_begin_with_train_or_val_split_nothing(tmp_path):
    """`trains_of_europe.txt` and `valley_walks.txt` beside other text: the split by name took
    the first as training text and the second as held out, and read no other file (10 KB of
    615 KB). Now no split name is there, so every byte is read and every 50th block held out."""
    sizes = {"trains_of_europe.txt": 3_000, "valley_walks.txt": 4_000, "essays.txt": 250_000}
    for name, size in sizes.items():
        (tmp_path / name).write_text("x" * size)
    corpus = load_corpus(str(tmp_path))
    separators = 2 * (len(sizes) - 1)  # files are joined by a blank line
    assert corpus.train.numel() + corpus.val.numel() == sum(sizes.values()) + separators
    assert corpus.val.numel() == HOLDOUT_BLOCK and corpus.left_out == []


@pytest.mark.parametrize(
    ("name", "split"),
    [
        ("train.txt", "train"),
        ("train.txt.gz", "train"),
        ("Train-00.txt", "train"),
        ("train_1.txt", "train"),
        ("train.en.txt", "train"),
        ("val.txt", "val"),
        ("val_1.txt.gz", "val"),
        ("valid.txt", "val"),
        ("validation-part2.txt", "val"),
        ("trains_of_europe.txt", None),
        ("training.txt", None),
        ("valley_walks.txt", None),
        ("values.txt", None),
        ("test.txt", None),
        ("validation.py", None),  # not a text file of a corpus
    ],
)
def test_the_split_names(name, split, tmp_path):
    assert split_of(tmp_path / name) == split


def test_a_split_by_name_says_which_files_it_leaves_out(tmp_path, capsys):
    """A real split (train-00.txt, val.txt) beside other text: those files are not read, and
    the run now says which, before it trains."""
    (tmp_path / "train-00.txt").write_text("a" * 30_000)
    (tmp_path / "val.txt").write_text("b" * 5_000)
    (tmp_path / "README.txt").write_text("about this folder\n")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "test.txt").write_text("c" * 100)
    corpus = load_corpus(str(tmp_path))
    assert corpus.train.numel() == 30_000 and corpus.val.numel() == 5_000
    assert [p.name for p in corpus.left_out] == ["README.txt", "test.txt"]
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--data", str(tmp_path), *FAST]) == 0
    said = capsys.readouterr().out.splitlines()[0]
    assert said == (
        f"data {tmp_path} is split by file name into train and val files, so 2 other file(s) "
        "are not read: README.txt, notes/test.txt (name them train-*.txt or val-*.txt to use "
        "them, or move them out of the folder)"
    )


def test_text_with_nothing_held_out_is_refused_before_a_run_that_evaluates(tmp_path, capsys):
    """Under 200 KiB holds out nothing: a run that evaluates trained every step, then failed at
    its final evaluation (`evaluation text has 0 bytes`) with no checkpoint written. Now it is
    refused before anything is trained or written, and says how to go on."""
    notes = tmp_path / "notes.txt"
    notes.write_text("a few words of text\n" * 5_000)  # 100 KB
    out = tmp_path / "r"
    args = ["train", "--out", str(out), "--data", str(notes), *FAST, "--eval-every", "1"]
    assert main(args) == 2
    err = one_line(capsys)
    assert f"data {str(notes)!r} holds out 0 bytes for evaluation and seq_len=32" in err
    assert "pass --eval-every 0 to train without evaluating" in err
    assert not out.exists()
    # an --eval-tokens too small for one window is the same failure, refused the same way
    args = ["train", "--out", str(out), *FAST, "--eval-every", "1", "--eval-tokens", "16"]
    assert main(args) == 2
    assert "eval_tokens=16 is shorter than one evaluation window: seq_len=32" in one_line(capsys)
    assert not out.exists()
    # without evaluation it trains, as before
    assert main(["train", "--out", str(out), "--data", str(notes), *FAST]) == 0
