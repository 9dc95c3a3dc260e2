"""Data that is not readable text (issue 37): a corrupt `.txt.gz` ended `train` and `eval` in a
zlib traceback, and a binary file (an executable) trained to "done" without a word. Now each
is one line naming the file, status 2; `--binary-data` takes a binary file on purpose."""

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
