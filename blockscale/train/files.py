"""Run files that survive a crash at any instant: whole-file writes that are atomic and durable.

A process can die between any two instructions (SIGKILL, out of memory, a lost machine), and a
machine can lose power with writes still in its page cache. So a run file is never rewritten in
place: `write_atomic` writes a temporary file beside it, fsyncs it, renames it over the old one
and fsyncs the folder. A reader then sees the old file or the new one, never a mix, and once the
call returns the new one is on disk. `metrics.jsonl` is the one file appended to (one row per
`append_line`); a crash can tear its last line, which the reader drops (loop.read_metrics).

`fsync_dir` makes a rename or a new entry in a folder durable; without it a power loss can undo
a rename that the file system had only in memory.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from blockscale.train.errors import UsageError


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (renames, new files) to disk. POSIX only: Windows cannot open a
    folder as a file, and NTFS journals renames itself."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a file that another library wrote (safetensors) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it (no rename: for files inside a temporary folder)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a crash leaves the old content or the new, whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    write_bytes(tmp, text.encode("utf-8"))
    os.replace(tmp, path)
    fsync_dir(path.parent)


def append_line(path: Path, line: str) -> None:
    """Append one line; a crash may leave it torn (cut short, no newline) but nothing else."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def write_failure(run_dir: Path, error: OSError) -> UsageError:
    """One line for a failed write into the run (a full disk, a missing or read-only folder)
    that says what to do; the writes above leave the run resumable whenever they fail."""
    return UsageError(
        f"cannot write the run in {run_dir}: {error}; the run's files so far are intact: fix "
        "that and rerun (with --resume once the run has a checkpoint)"
    )


@contextlib.contextmanager
def reported(run_dir: Path):
    """Raise `write_failure` for an OSError in the block."""
    try:
        yield
    except OSError as e:
        raise write_failure(run_dir, e) from None
