"""Text data: a byte-level tokenizer, corpus loading, a held-out split and deterministic batches.

Tokens are bytes (vocabulary 256): no downloads, no vocabulary files, any text works, and loss per
token is loss per byte, so bits per byte is `loss / ln 2` with no tokenizer caveat.

A corpus is a `.txt` or `.txt.gz` file, a directory of them (searched recursively, sorted by
path), or the word `stdlib`: the top-level `.py` files of this Python's standard library, text
that every Python install already has (about 5 MB).

Every file must look like text: a file of which more than `BINARY_FRACTION` (5%) of the first
MiB are control bytes (other than tab, newline, carriage return, form feed) or bytes of no valid
UTF-8 sequence is refused, naming the file and the share, unless `binary_ok` (the `--binary-data`
flag). Executables, images, archives and UTF-16 text all trained to "done" without a word
before, on a corpus that was not what the user meant. A file that cannot be read or
decompressed (a corrupt `.gz`) is one error naming the file, not a traceback.

Held-out split: a directory that holds both training and validation files by name is split by
those names (the layout of `shared/data/text/`). A split name is a file name whose stem (the name
less `.txt` / `.txt.gz`) is `train`, `val`, `valid` or `validation` (any case), alone or followed
by a separator (`-`, `_`, `.`) and anything: `train.txt.gz`, `train-00.txt`, `val_1.txt`,
`validation.part2.txt`. A name that only begins with those letters is no split name:
`trains_of_europe.txt` and `valley_walks.txt` are ordinary text, where matching by prefix once
split them off and dropped every other file without a word (issue 60). Files of a split folder
that are neither (`README.txt`, `test.txt`) are left out, and `Corpus.left_out` names them so
that the training run says so. Otherwise every 50th block of 4 KiB is held out, so the
validation text is spread over the whole corpus rather than taken from its last file; a corpus
under 50 blocks (200 KiB) holds out nothing, which a run that evaluates refuses before training
(`check_evaluable`).

Batches are a pure function of (seed, step, micro-batch): each draws random windows from its own
generator. Every recipe of a comparison therefore sees the same data in the same order, and a
resumed run needs no data-loader state beyond the step it resumes at.
"""

from __future__ import annotations

import gzip
import re
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockscale.train.errors import UsageError

HOLDOUT_BLOCK = 4096
HOLDOUT_EVERY = 50
# A text file has fewer of its first TEXT_PROBE bytes outside printable UTF-8 than this share.
BINARY_FRACTION = 0.05
TEXT_PROBE = 1 << 20
# Decoded with surrogateescape, a byte of no valid UTF-8 sequence is one of U+DC80..U+DCFF.
_NOT_TEXT = re.compile("[\x00-\x08\x0e-\x1f\x7f\udc80-\udcff]")
# A stem that names a split (module docstring): the word, alone or before a separator.
_SPLIT_NAME = re.compile(r"(train|val|valid|validation)(?:[-_.].*)?", re.IGNORECASE)


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _read_bytes(path: Path, binary_ok: bool) -> bytes:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            data = path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        # gzip raises zlib.error for a corrupt stream, BadGzipFile (an OSError) for a bad
        # header and EOFError for a cut one
        raise UsageError(f"cannot read data file {path}: {e}") from None
    if not binary_ok:
        check_text(path, data)
    return data


def not_text_fraction(data: bytes) -> float:
    """The share of the first TEXT_PROBE bytes that are control bytes (tab, newline, carriage
    return, vertical tab and form feed excepted) or belong to no valid UTF-8 sequence."""
    head = data[:TEXT_PROBE]
    if not head:
        return 0.0
    # (a sequence that the probe's end cuts counts as at most 3 bad bytes in a MiB)
    bad = len(_NOT_TEXT.findall(head.decode("utf-8", errors="surrogateescape")))
    return bad / len(head)


def check_text(path: Path, data: bytes) -> None:
    """Refuse a file that does not look like text (module docstring)."""
    share = not_text_fraction(data)
    if share > BINARY_FRACTION:
        raise UsageError(
            f"data file {path} does not look like text: {share:.0%} of its first "
            f"{min(len(data), TEXT_PROBE):,} bytes are control bytes or not UTF-8 (more than "
            f"{BINARY_FRACTION:.0%}); pass --binary-data (binary_data=True) to use it anyway"
        )


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


def _concat(files: list[Path], binary_ok: bool) -> torch.Tensor:
    # Files are joined by a blank line, the document separator of shared/data/text.
    data = b"\n\n".join(_read_bytes(f, binary_ok) for f in files)
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def read_all(spec: str, binary_ok: bool = False) -> torch.Tensor:
    """All the bytes of a corpus, unsplit (what `eval` scores); `binary_ok`: accept files that
    do not look like text."""
    tokens = _concat(text_files(spec), binary_ok)
    if tokens.numel() == 0:
        raise UsageError(f"data {spec!r} is empty: it holds no text")
    return tokens


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 [N]
    val: torch.Tensor  # uint8 [M]
    source: str
    left_out: list[Path] = field(default_factory=list)  # files a split by name does not read


def split_of(path: Path) -> str | None:
    """The split a text file's name names (module docstring): "train", "val", or None."""
    if not path.name.endswith((".txt", ".txt.gz")):
        return None
    found = _SPLIT_NAME.fullmatch(path.name.removesuffix(".gz").removesuffix(".txt"))
    if found is None:
        return None
    return "train" if found.group(1).lower() == "train" else "val"


def load_corpus(spec: str, max_bytes: int = 0, binary_ok: bool = False) -> Corpus:
    """Read a corpus and split it; `max_bytes` > 0 keeps only that many bytes of training text;
    `binary_ok`: accept files that do not look like text."""
    files = text_files(spec)
    train_files = [f for f in files if split_of(f) == "train"]
    val_files = [f for f in files if split_of(f) == "val"]
    left_out: list[Path] = []
    if len(files) > 1 and train_files and val_files:
        train, val = _concat(train_files, binary_ok), _concat(val_files, binary_ok)
        left_out = [f for f in files if split_of(f) is None]
    else:
        tokens = _concat(files, binary_ok)
        n_blocks = -(-tokens.numel() // HOLDOUT_BLOCK)
        held = torch.zeros(n_blocks, dtype=torch.bool)
        held[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY] = True
        mask = held.repeat_interleave(HOLDOUT_BLOCK)[: tokens.numel()]
        train, val = tokens[~mask], tokens[mask]
    if train.numel() == 0:
        raise UsageError(f"data {spec!r} is empty: its {len(files)} file(s) hold no text")
    if max_bytes > 0:
        train = train[:max_bytes]
    return Corpus(train=train, val=val, source=spec, left_out=left_out)


def left_out_notice(corpus: Corpus) -> str | None:
    """The line a training run prints when a split by name leaves files out, else None."""
    if not corpus.left_out:
        return None
    names = [str(f.relative_to(corpus.source)) for f in corpus.left_out]
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return (
        f"data {corpus.source} is split by file name into train and val files, so "
        f"{len(names)} other file(s) are not read: {', '.join(names[:3])}{more} (name them "
        "train-*.txt or val-*.txt to use them, or move them out of the folder)"
    )


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


def check_evaluable(corpus: Corpus, seq_len: int, max_tokens: int = 0) -> None:
    """Refuse, before a run that evaluates trains a step, held-out text too short for one
    evaluation window (what `eval_windows` needs). Text under 50 blocks of 4 KiB holds out
    nothing: such a run trained every step and then failed at its final evaluation, before its
    last checkpoint (issue 60)."""
    held = corpus.val.numel()
    usable = held if max_tokens <= 0 else min(held, max_tokens + 1)
    if usable >= seq_len + 1:
        return
    if held >= seq_len + 1:
        raise UsageError(
            f"eval_tokens={max_tokens} is shorter than one evaluation window: seq_len={seq_len} "
            f"needs at least {seq_len}; raise --eval-tokens (0: all held-out text)"
        )
    raise UsageError(
        f"data {corpus.source!r} holds out {held:,} bytes for evaluation and seq_len={seq_len} "
        f"needs at least {seq_len + 1} (without a val file every {HOLDOUT_EVERY}th block of "
        f"{HOLDOUT_BLOCK:,} bytes is held out: text under {HOLDOUT_EVERY * HOLDOUT_BLOCK // 1024} "
        "KiB holds out none); "
        "give more text or a val file (docs/TRAINING.md, Data), or pass --eval-every 0 to "
        "train without evaluating"
    )


def eval_windows(tokens: torch.Tensor, seq_len: int, max_tokens: int = 0):
    """Consecutive non-overlapping windows (a final partial window is dropped)."""
    if max_tokens > 0:
        tokens = tokens[: max_tokens + 1]
    n = (tokens.numel() - 1) // seq_len
    if n < 1:  # (no text at all gives -1)
        raise UsageError(
            f"evaluation text has {tokens.numel()} bytes; seq_len={seq_len} needs at least {seq_len + 1}"
        )
    x = tokens[: n * seq_len].view(n, seq_len).long()
    y = tokens[1 : n * seq_len + 1].view(n, seq_len).long()
    return x, y
