"""Data: byte tokenizer, corpus loading and split, deterministic batches, bad input."""

import gzip

import pytest
import torch

from blockscale.train.data import (
    HOLDOUT_BLOCK,
    HOLDOUT_EVERY,
    Batches,
    ByteTokenizer,
    eval_windows,
    load_corpus,
    read_all,
)
from blockscale.train.errors import UsageError


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "naïve café — 東京 🙂\n"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text


def test_directory_with_train_and_val_files_is_split_by_name(tmp_path):
    (tmp_path / "train.txt").write_text("a" * 1000)
    with gzip.open(tmp_path / "val.txt.gz", "wt") as f:
        f.write("b" * 300)
    corpus = load_corpus(str(tmp_path))
    assert corpus.train.numel() == 1000 and corpus.val.numel() == 300
    assert set(corpus.val.tolist()) == {ord("b")}


def test_single_file_holds_out_every_50th_block(tmp_path):
    n = HOLDOUT_BLOCK * HOLDOUT_EVERY * 2 + 123
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(data.tolist()))
    corpus = load_corpus(str(path), binary_ok=True)  # random bytes: not text
    assert corpus.val.numel() == 2 * HOLDOUT_BLOCK
    assert corpus.train.numel() + corpus.val.numel() == n
    first_held = (HOLDOUT_EVERY - 1) * HOLDOUT_BLOCK
    assert torch.equal(corpus.val[:HOLDOUT_BLOCK], data[first_held : first_held + HOLDOUT_BLOCK])
    assert torch.equal(read_all(str(path), binary_ok=True), data)


def test_default_data_is_the_standard_library():
    corpus = load_corpus("stdlib")
    assert corpus.train.numel() > 1_000_000 and corpus.val.numel() > 10_000


def test_batches_are_a_function_of_seed_and_step():
    tokens = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    a, b = Batches(tokens, 64, 4, seed=1), Batches(tokens, 64, 4, seed=1)
    x, y = a.get(7, 1)
    torch.testing.assert_close(b.get(7, 1)[0], x, rtol=0, atol=0)
    assert not torch.equal(a.get(8, 1)[0], x)
    assert not torch.equal(Batches(tokens, 64, 4, seed=2).get(7, 1)[0], x)
    assert not torch.equal(a.get(7, 0)[0], x)
    assert x.shape == y.shape == (4, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_eval_windows_predict_each_byte_once():
    tokens = torch.arange(0, 100, dtype=torch.uint8)
    x, y = eval_windows(tokens, 10)
    assert x.shape == (9, 10)
    assert torch.equal(y.flatten(), torch.arange(1, 91))


def test_bad_data_gets_one_clear_error(tmp_path):
    with pytest.raises(UsageError, match="missing.txt' does not exist"):
        load_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UsageError, match="empty.txt' is empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "notes.csv").write_text("a,b")
    (tmp_path / "empty.txt").unlink()
    with pytest.raises(UsageError, match="holds no .txt or .txt.gz files"):
        load_corpus(str(tmp_path))


def test_text_shorter_than_a_sequence_is_refused(tmp_path):
    with pytest.raises(UsageError, match="seq_len=128 needs at least 130"):
        Batches(torch.zeros(50, dtype=torch.uint8), 128, 2, 0)
