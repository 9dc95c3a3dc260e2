"""Crash a run at every write it makes, resume it, and compare with a run never interrupted.

A crash is simulated at each call of each write point (a metrics row, the temporary file of an
atomic write: config.json, summary.json, the resume's truncation of metrics.jsonl and a
checkpoint's manifest; a checkpoint's tensor files; the renames; the folder fsyncs): the call
writes half of its bytes, or none, and raises `Crash`, which nothing in the library catches,
so the run stops with its files exactly as a killed process leaves them. Then the run is
continued the way a user would (`--resume` when config.json exists, else a fresh start) until
it finishes, and its metric rows and final weights must equal those of the uninterrupted run,
bit for bit. One test kills a real process with SIGKILL at a checkpoint write and mid-row.

The run is `tiny` NVFP4 (stochastic rounding draws from the RNG a checkpoint must restore) with
every kind of row and a checkpoint every two steps: about half a second a run, so all crash
points of all writes take well under a minute.
"""

import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from blockscale.train import TrainConfig, UsageError, files, read_metrics, train
from blockscale.train import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]

CFG = TrainConfig(
    recipe="nvfp4",
    steps=6,
    batch_size=2,
    seq_len=32,
    warmup_steps=2,
    log_every=2,
    eval_every=3,
    eval_tokens=1024,
    telemetry_every=3,
    ckpt_every=2,
    max_data_bytes=50_000,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


class Crash(BaseException):
    """A simulated kill: a BaseException, so no `except Exception` in the library stops it."""


def without_clock(run_dir):
    clock = ("tokens_per_s", "time")
    return [{k: v for k, v in r.items() if k not in clock} for r in read_metrics(run_dir)]


def final_weights(run_dir):
    return load_file(ckpt.checkpoint_dirs(run_dir)[-1] / "model.safetensors")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    summary = train(CFG, out, progress=False)
    return out, summary


def assert_same_run(run_dir, reference):
    out, summary = reference
    assert without_clock(run_dir) == without_clock(out)
    got, want = final_weights(run_dir), final_weights(out)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    done = json.loads((run_dir / "summary.json").read_text())
    assert done["status"] == "done" and done["steps"] == summary["steps"]
    assert done["final_loss"] == summary["final_loss"]


def recover(run_dir: Path, cfg: TrainConfig = CFG) -> None:
    """What a user does after a crash: resume if the run has its config, else start again."""
    resume = (run_dir / "config.json").exists()
    summary = train(cfg, run_dir, resume=resume, progress=False)
    assert summary["status"] == "done"


def _half_then_crash(path, data: bytes):
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    raise Crash


def _torn_row(original):
    def append_line(path, line):
        with open(path, "a") as f:
            f.write((line + "\n")[: len(line) // 2])
        raise Crash

    return append_line


def _half_tensor_file(original):
    def save(*args, **kwargs):
        target = Path(args[1])
        original(*args[:1], str(target) + ".whole", *args[2:], **kwargs)
        whole = Path(str(target) + ".whole")
        data = whole.read_bytes()
        whole.unlink()
        _half_then_crash(target, data)

    return save


def _before(original):
    def call(*args, **kwargs):
        raise Crash

    return call


def _after(original):
    def call(*args, **kwargs):
        original(*args, **kwargs)
        raise Crash

    return call


class _RunFileOs:
    """`os` as the run-file modules see it, so that only their renames are counted (a library
    that renames a cache file of its own on some calls would shift the count)."""

    def __getattr__(self, name):
        return getattr(os, name)


# (name, object, attribute, how the k-th call fails)
POINTS = {
    "metrics row": (files, "append_line", _torn_row),
    "atomic write": (files, "write_bytes", lambda original: _half_then_crash),
    "model tensors": (ckpt, "save_model", _half_tensor_file),
    "trainer tensors": (ckpt, "save_file", _half_tensor_file),
    "rename": (_RunFileOs, "replace", _before),
    "folder fsync after rename": (files, "fsync_dir", _after),
}


class Armed:
    """Counts the calls of one write point and fails the `at`-th (0: never), as the point's
    failure does, or as `fail` makes it."""

    def __init__(self, monkeypatch, point: str, at: int = 0, fail=None) -> None:
        owner, name, make = POINTS[point]
        make = fail or make
        original = getattr(os if owner is _RunFileOs else owner, name)
        failing = make(original)
        self.calls = 0

        def call(*args, **kwargs):
            self.calls += 1
            if self.calls == at:
                return failing(*args, **kwargs)
            return original(*args, **kwargs)

        if owner is _RunFileOs:
            run_file_os = _RunFileOs()
            setattr(run_file_os, name, call)
            for module in (files, ckpt):
                monkeypatch.setattr(module, "os", run_file_os)
        else:
            monkeypatch.setattr(owner, name, call)


@pytest.mark.parametrize("point", list(POINTS))
def test_a_crash_at_any_write_resumes_to_the_uninterrupted_run(
    point, reference, tmp_path, monkeypatch
):
    with monkeypatch.context() as m:
        counter = Armed(m, point)
        train(CFG, tmp_path / "count", progress=False)
    assert counter.calls > 0, f"{point}: the run never reached this write"
    for at in range(1, counter.calls + 1):
        run_dir = tmp_path / f"crash{at}"
        with monkeypatch.context() as m:
            Armed(m, point, at)
            with pytest.raises(Crash):
                train(CFG, run_dir, progress=False)
        # What the crash left is readable: a torn row is dropped, config.json is whole.
        read_metrics(run_dir)
        if (run_dir / "config.json").exists():
            assert TrainConfig.load(run_dir / "config.json") == CFG
        recover(run_dir)
        assert_same_run(run_dir, reference)


@pytest.mark.parametrize("point", ["atomic write", "rename", "folder fsync after rename"])
def test_a_crash_while_resuming_truncates_nothing_it_should_keep(
    point, reference, tmp_path, monkeypatch
):
    """The run stops with rows past its last checkpoint (a row at step 6, checkpoint at 4 with
    the last one cut short); the resume that drops them crashes at each of its writes (config,
    the truncation of metrics.jsonl, ...), and the next resume still ends where the
    uninterrupted run did."""
    stopped = tmp_path / "stopped"
    with monkeypatch.context() as m:
        Armed(m, "model tensors", 3)  # the step-6 checkpoint, after step 6's rows
        with pytest.raises(Crash):
            train(CFG, stopped, progress=False)
    assert max(r["step"] for r in read_metrics(stopped)) == 6
    assert ckpt.step_of(ckpt.checkpoint_dirs(stopped)[-1]) == 4
    with monkeypatch.context() as m:
        counter = Armed(m, point)
        shutil.copytree(stopped, tmp_path / "count")
        recover(tmp_path / "count")
    for at in range(1, counter.calls + 1):
        run_dir = tmp_path / f"crash{at}"
        shutil.copytree(stopped, run_dir)
        with monkeypatch.context() as m:
            Armed(m, point, at)
            with pytest.raises(Crash):
                train(CFG, run_dir, resume=True, progress=False)
        # Rows up to the checkpoint survive whatever the crash cut short.
        assert [r for r in read_metrics(run_dir) if r["step"] <= 4] == [
            r for r in read_metrics(stopped) if r["step"] <= 4
        ]
        recover(run_dir)
        assert_same_run(run_dir, reference)


def test_a_torn_last_row_is_dropped_and_a_damaged_middle_row_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "train", "step": 2}\n{"kind": "tr')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "tr\n{"kind": "train", "step": 3}\n')
    with pytest.raises(UsageError, match="metrics.jsonl line 2 is not a JSON object"):
        read_metrics(tmp_path)


def test_run_files_and_checkpoints_are_fsynced(tmp_path, monkeypatch):
    """Every file a run writes whole, and every folder it renames into, reaches the disk
    before the run goes on (a power cut cannot undo a rename the run relied on)."""
    synced = []
    fsync = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    run_dir = (tmp_path / "run").resolve()
    train(dataclasses.replace(CFG, steps=2), run_dir, progress=False)
    root = str(run_dir / "checkpoints")
    tmp = f"{root}/step_000002.tmp"
    for name in ("model.safetensors", "trainer.safetensors", "manifest.json"):
        assert f"{tmp}/{name}" in synced
    assert tmp in synced and root in synced  # the folder, then the rename in its parent
    assert str(run_dir / "metrics.jsonl") in synced  # rows before the checkpoint counting on them
    for name in ("config.json", "summary.json"):
        assert str(run_dir / f".{name}.tmp") in synced
    assert synced.count(str(run_dir)) >= 2  # each rename into place


def cli_flags(run_dir) -> list[str]:
    """`blockscale train` flags for CFG into `run_dir`."""
    flags = ["--quiet", "--out", str(run_dir)]
    for f in dataclasses.fields(CFG):
        value = getattr(CFG, f.name)
        if value != f.default:
            flags += [f"--{f.name.replace('_', '-')}", str(value)]
    return flags


def _disk_full(original):
    def call(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    return call


def _safetensors_disk_full(original):
    """safetensors' own failure on a full disk: half the file written, then its SafetensorError
    (the message as safetensors 0.8 words it), not an OSError."""

    def call(*args, **kwargs):
        original(*args, **kwargs)
        target = Path(args[1])
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    return call


@pytest.mark.parametrize(
    ("point", "at", "fail"),
    [
        ("metrics row", 5, _disk_full),
        ("trainer tensors", 2, _disk_full),
        ("atomic write", 1, _disk_full),
        ("model tensors", 2, _safetensors_disk_full),
        ("trainer tensors", 3, _safetensors_disk_full),
    ],
    ids=["row", "checkpoint", "config", "safetensors-model", "safetensors-trainer"],
)
def test_a_full_disk_ends_in_one_line_and_the_run_resumes(
    point, at, fail, reference, tmp_path, monkeypatch, capsys
):
    """A write that fails (here: no space left) at a metrics row, a checkpoint, config.json:
    one line and status 2 instead of a traceback, and once there is room the run goes on to
    the uninterrupted run's rows and weights. A checkpoint's tensor files are written by
    safetensors, whose full disk was a `SafetensorError (os error 28)` traceback (issue 60)."""
    from blockscale.cli import main

    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        Armed(m, point, at, fail=fail)
        assert main(["train", *cli_flags(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the run in {run_dir}: [Errno 28] No space left on device" in err
    assert err.count("\n") == 1
    resume = ["--resume"] if (run_dir / "config.json").exists() else []
    assert main(["train", *resume, *cli_flags(run_dir)]) == 0
    assert_same_run(run_dir, reference)


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(("point", "at"), [("trainer tensors", 2), ("metrics row", 4)])
def test_sigkill_at_a_write_resumes_from_the_command_line(point, at, reference, tmp_path):
    """A real process killed by SIGKILL at the `at`-th call of a write point (after writing half
    of it), then `blockscale train --resume`: the same rows and weights as never killed."""
    run_dir = tmp_path / "run"
    owner, name = {
        "trainer tensors": ("blockscale.train.checkpoint", "save_file"),
        "metrics row": ("blockscale.train.files", "append_line"),
    }[point]
    driver = f"""
import importlib, os, signal, sys
from pathlib import Path
from blockscale.cli import main
owner = importlib.import_module({owner!r})
original, calls = getattr(owner, {name!r}), [0]
def kill(*args, **kwargs):
    calls[0] += 1
    if calls[0] == {at}:
        path = Path(args[1]) if {name!r} == "save_file" else Path(args[0])
        data = (args[1] + "\\n").encode() if {name!r} == "append_line" else b"x" * 4096
        with open(path, "ab") as f:
            f.write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kwargs)
setattr(owner, {name!r}, kill)
sys.exit(main(sys.argv[1:]))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-c", driver, "train", *cli_flags(run_dir)]
    # Hang guards, not time limits: 41 s measured on one core beside a CPU-bound process.
    killed = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = subprocess.run(
        [sys.executable, "-m", "blockscale", "train", "--resume", "--quiet", "--out", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_same_run(run_dir, reference)


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs Linux /proc")
def test_one_writer_per_run_folder_and_a_killed_writer_does_not_block_its_resume(
    reference, tmp_path
):
    """Two `train` processes on one --out interleaved their rows and overwrote each other's
    checkpoints, both ending "done" (issue 37). Now the second stops with one line naming the
    first's PID (a fresh start and a --resume alike), and once the first is killed by SIGKILL
    the run resumes to the uninterrupted run's rows and weights."""
    run_dir = tmp_path / "run"
    # The writer stops after its first checkpoint, holding the run, until it is killed.
    driver = """
import sys, time
from blockscale.cli import main
from blockscale.train import checkpoint
original = checkpoint.save
def save(*args, **kwargs):
    original(*args, **kwargs)
    print("checkpointed", flush=True)
    time.sleep(300)
checkpoint.save = save
sys.exit(main(sys.argv[1:]))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    writer = subprocess.Popen(
        [sys.executable, "-c", driver, "train", *cli_flags(run_dir)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # (the lines before it: the run's own header)
        if not any(line.strip() == "checkpointed" for line in writer.stdout):
            pytest.fail(f"the writer ended first: {writer.stderr.read()}")
        for resume in ([], ["--resume"]):
            second = subprocess.run(
                [sys.executable, "-m", "blockscale", "train", *resume, *cli_flags(run_dir)],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert second.returncode == 2, second.stderr
            assert second.stderr.count("\n") == 1, second.stderr
            assert f"{run_dir} is being written by another process (PID {writer.pid}" in (
                second.stderr
            )
        writer.kill()
        writer.wait(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert writer.returncode == -signal.SIGKILL
    resumed = subprocess.run(
        [sys.executable, "-m", "blockscale", "train", "--resume", *cli_flags(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_same_run(run_dir, reference)
    assert not (run_dir / files.LOCK_NAME).exists()  # a run that ends leaves no lock file


def test_a_run_folder_held_by_this_process_is_refused_and_freed_after(tmp_path):
    """The library door: train() on a folder whose lock is held raises the same one line; a
    run that fails to start gives the lock back and leaves no folder behind."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = files.RunLock(run_dir)
    lock.acquire()
    try:
        with pytest.raises(UsageError, match=rf"PID {os.getpid()}, holding .*\.lock\); wait"):
            train(dataclasses.replace(CFG, steps=1), run_dir, progress=False)
    finally:
        lock.release()
    fresh = tmp_path / "fresh"
    with pytest.raises(UsageError, match="does not exist"):
        train(dataclasses.replace(CFG, data=str(tmp_path / "none")), fresh, progress=False)
    assert not fresh.exists()
    summary = train(dataclasses.replace(CFG, steps=1, ckpt_every=0), run_dir, progress=False)
    assert summary["status"] == "done" and not (run_dir / files.LOCK_NAME).exists()
