"""Text data: a byte-level tokenizer, corpus loading, a held-out split and deterministic batches.

Tokens are bytes (vocabulary 256): no downloads, no vocabulary files, any text works, and loss per
token is loss per byte, so bits per byte is `loss / ln 2` with no tokenizer caveat.

A corpus is a `.txt` or `.txt.gz` file, a directory of them (searched recursively, sorted by
path), or the word `stdlib`: the top-level `.py` files of this Python's standard library, text
that every Python install already has (about 5 MB).

Held-out split: a directory whose file names start with `train` and `val` is split by those names
(the layout of `shared/data/text/`). Otherwise every 50th block of 4 KiB is held out, so the
validation text is spread over the whole corpus rather than taken from its last file.

Batches are a pure function of (seed, step, micro-batch): each draws random windows from its own
generator. Every recipe of a comparison therefore sees the same data in the same order, and a
resumed run needs no data-loader state beyond the step it resumes at.
"""

from __future__ import annotations

import gzip
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from blockscale.train.errors import UsageError

HOLDOUT_BLOCK = 4096
HOLDOUT_EVERY = 50


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _read_bytes(path: Path) -> bytes:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError) as e:
        raise UsageError(f"cannot read data file {path}: {e}") from None


def text_files(spec: str) -> list[Path]:
    """The files a corpus spec names, sorted by path."""
    if spec == "stdlib":
        return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    path = Path(spec)
    if not path.exists():
        raise UsageError(
            f"data path {spec!r} does not exist (want a .txt/.txt.gz file, a directory of them, or 'stdlib')"
        )
    if path.is_file():
        return [path]
    files = sorted(
        p for p in path.rglob("*") if p.is_file() and p.name.endswith((".txt", ".txt.gz"))
    )
    if not files:
        raise UsageError(f"data directory {spec!r} holds no .txt or .txt.gz files")
    return files


def _concat(files: list[Path]) -> torch.Tensor:
    # Files are joined by a blank line, the document separator of shared/data/text.
    data = b"\n\n".join(_read_bytes(f) for f in files)
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def read_all(spec: str) -> torch.Tensor:
    """All the bytes of a corpus, unsplit (what `eval` scores)."""
    tokens = _concat(text_files(spec))
    if tokens.numel() == 0:
        raise UsageError(f"data {spec!r} is empty: it holds no text")
    return tokens


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 [N]
    val: torch.Tensor  # uint8 [M]
    source: str


def load_corpus(spec: str, max_bytes: int = 0) -> Corpus:
    """Read a corpus and split it; `max_bytes` > 0 keeps only that many bytes of training text."""
    files = text_files(spec)
    train_files = [f for f in files if f.name.startswith("train")]
    val_files = [f for f in files if f.name.startswith("val")]
    if len(files) > 1 and train_files and val_files:
        train, val = _concat(train_files), _concat(val_files)
    else:
        tokens = _concat(files)
        n_blocks = -(-tokens.numel() // HOLDOUT_BLOCK)
        held = torch.zeros(n_blocks, dtype=torch.bool)
        held[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY] = True
        mask = held.repeat_interleave(HOLDOUT_BLOCK)[: tokens.numel()]
        train, val = tokens[~mask], tokens[mask]
    if train.numel() == 0:
        raise UsageError(f"data {spec!r} is empty: its {len(files)} file(s) hold no text")
    if max_bytes > 0:
        train = train[:max_bytes]
    return Corpus(train=train, val=val, source=spec)


def batch_seed(*values: int) -> int:
    """Mix integers into one 32-bit seed. The CPU generator (mt19937) keeps only the low 32 bits
    of a seed, so packing values into high bits would give every run seed the same batches."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ v) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0xFFFFFFFF


class Batches:
    """Random windows of `seq_len + 1` bytes; `get(step, micro)` is deterministic."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        if tokens.numel() < seq_len + 2:
            raise UsageError(
                f"training text has {tokens.numel()} bytes; seq_len={seq_len} needs at least {seq_len + 2}"
            )
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.offsets = torch.arange(seq_len + 1)

    def get(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(batch_seed(self.seed, step, micro))
        starts = torch.randint(
            0, self.tokens.numel() - self.seq_len - 1, (self.batch_size,), generator=g
        )
        window = self.tokens[starts[:, None] + self.offsets].long()
        return window[:, :-1], window[:, 1:]


def eval_windows(tokens: torch.Tensor, seq_len: int, max_tokens: int = 0):
    """Consecutive non-overlapping windows (a final partial window is dropped)."""
    if max_tokens > 0:
        tokens = tokens[: max_tokens + 1]
    n = (tokens.numel() - 1) // seq_len
    if n == 0:
        raise UsageError(
            f"evaluation text has {tokens.numel()} bytes; seq_len={seq_len} needs at least {seq_len + 1}"
        )
    x = tokens[: n * seq_len].view(n, seq_len).long()
    y = tokens[1 : n * seq_len + 1].view(n, seq_len).long()
    return x, y
