"""Run files that survive a crash at any instant: whole-file writes that are atomic and durable.

A process can die between any two instructions (SIGKILL, out of memory, a lost machine), and a
machine can lose power with writes still in its page cache. So a run file is never rewritten in
place: `write_atomic` writes a temporary file beside it, fsyncs it, renames it over the old one
and fsyncs the folder. A reader then sees the old file or the new one, never a mix, and once the
call returns the new one is on disk. `metrics.jsonl` is the one file appended to (one row per
`append_line`); a crash can tear its last line, which the reader drops (loop.read_metrics).

`fsync_dir` makes a rename or a new entry in a folder durable; without it a power loss can undo
a rename that the file system had only in memory.

One writer per run folder: `one_writer` wraps `train` so that it holds an exclusive `flock` on
`DIR/.lock` for the run's life (rank 0 alone under torchrun). Two processes writing the same
folder interleave their metrics rows and overwrite each other's checkpoints without an error;
with the lock the second one stops with one line naming the first one's PID. The kernel drops
the lock when its holder dies, however it dies (SIGKILL included), so a killed run never blocks
its own `--resume`; a run that ends (or fails) removes the file. POSIX only: elsewhere no lock
is taken.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock, no lock
    fcntl = None

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


LOCK_NAME = ".lock"


class RunLock:
    """An exclusive `flock` on `run_dir/.lock`, taken by `acquire` and given back by `release`
    (or by the kernel when the process dies). The file holds the holder's PID, for the message
    that refuses a second writer."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        if fcntl is None:
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode("ascii", "replace").strip()
                os.close(fd)
                raise UsageError(
                    f"{self.run_dir} is being written by another process "
                    f"({f'PID {holder}' if holder else 'its PID not yet written'}, holding "
                    f"{self.path}); wait for it to end, or choose another --out"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            # A holder that ended between our open and our flock removed the file we locked:
            # lock the file that is there now instead.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        # Removed while still held, so no process can lock the file on its way out.
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None


def one_writer(check):
    """Decorate `train(cfg, run_dir, resume=False, ..., fsdp, ep, tp)` to hold `RunLock` on
    `run_dir` while it runs (rank 0 of a torchrun launch alone). A fresh run's folder is made
    here, so the lock exists before anything else: a folder this call made and that holds
    nothing else when it ends is removed again (a start that failed leaves no empty folder).
    `check(run_dir)` runs first, on every rank, and refuses a folder that no run may write
    into (someone else's files) before anything is made or locked in it. Where `train` would
    refuse before writing (no folder to resume, `run_dir` a file) no lock is taken, so its own
    message comes out."""

    def decorate(train):
        return _locked(train, check)

    return decorate


def _locked(train, check):
    signature = inspect.signature(train)

    @functools.wraps(train)
    def locked(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        given = call.arguments
        run_dir = Path(given["run_dir"])
        check(run_dir)
        distributed = given["fsdp"] or given["ep"] or given["tp"]
        rank0 = not distributed or os.environ.get("RANK", "0") == "0"
        if not rank0 or (given["resume"] and not run_dir.is_dir()) or run_dir.is_file():
            return train(*args, **kwargs)
        made = not run_dir.exists()
        lock = RunLock(run_dir)
        with reported(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        try:
            return train(*args, **kwargs)
        finally:
            lock.release()
            if made:
                with contextlib.suppress(OSError):
                    run_dir.rmdir()  # only if empty

    return locked
