"""What the machine gave a run: how long its threads waited for a free CPU core.

A speed measured while other processes kept the cores busy is the machine's, not the recipe's.
On a 2-core machine beside a test suite, a comparison's second BF16 seed ran at 0.08x BF16 and
a recipe fell from 35k to 700 tokens/s mid-run, with nothing in the report to say so. Linux
counts, for every thread, the time it ran on a core and the time it waited on a run queue,
ready to run with no core free (`/proc/self/task/*/schedstat`). The share of its ready time a
run's threads spent waiting is what the machine withheld from it: near 0 on an idle machine
whatever the run does (a thread blocked on I/O or on the GPU is not ready, so it does not
count), and large when another process keeps the cores busy. Beside it, for the report's
sentence: the cores other processes kept busy (`/proc/stat`, less this process's own CPU
time) and the load average.

`record(run_dir)` wraps one training segment (a resumed run has several) and appends one JSON
row a segment to `RUN/machine.jsonl`; `withheld(rows)` sums a run's rows and says, in one
sentence, whether its speed is distorted. Where /proc has no such files (not Linux) nothing is
written and the report says the speed was not checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

FILE = "machine.jsonl"
# A run whose threads waited this share of their ready time for a core: its speed is the
# machine's. Measured on 2 cores (docs/LOG.md, 2026-12-05): 0.2-1.8% with nothing beside the
# runs, 37-42% beside one busy loop, 62-72% beside another session's tests.
WAITED_PCT = 10.0


def _thread_times() -> dict[str, tuple[float, float]]:
    """{thread id: (seconds run on a core, seconds waited for one)} of this process."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            ran_ns, waited_ns, _ = (task / "schedstat").read_text().split()
            out[task.name] = (int(ran_ns) / 1e9, int(waited_ns) / 1e9)
    return out


def _busy_cpu_s() -> float:
    """Seconds of CPU time every core of the machine has spent busy since boot (/proc/stat's
    first line: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _snapshot() -> dict | None:
    try:
        threads = _thread_times()
        busy = _busy_cpu_s()
    except (OSError, ValueError, IndexError):
        return None
    if not threads:
        return None
    times = os.times()
    return {
        "wall": time.monotonic(),
        "cpu": times.user + times.system,
        "busy": busy,
        "threads": threads,
    }


def _segment(start: dict, end: dict) -> dict:
    ran = waited = 0.0
    for tid, (r, w) in end["threads"].items():
        r0, w0 = start["threads"].get(tid, (0.0, 0.0))
        ran, waited = ran + r - r0, waited + w - w0
    wall = end["wall"] - start["wall"]
    cpu = end["cpu"] - start["cpu"]
    return {
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "ran_s": round(ran, 3),
        "waited_s": round(waited, 3),
        "others_cores": round(max(end["busy"] - start["busy"] - cpu, 0.0) / max(wall, 1e-9), 3),
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "load_1min": round(os.getloadavg()[0], 2),
    }


@contextlib.contextmanager
def record(run_dir: Path) -> Iterator[None]:
    """Append what the machine gave the code inside (one training segment) to
    `RUN/machine.jsonl`, if the run exists by then (its config.json) and /proc says."""
    start = _snapshot()
    try:
        yield
    finally:
        end = _snapshot()
        if start is not None and end is not None and (Path(run_dir) / "config.json").exists():
            with open(Path(run_dir) / FILE, "a") as f:
                f.write(json.dumps(_segment(start, end)) + "\n")


def read(run_dir: Path) -> list[dict]:
    """A run's segments, oldest first ([] where none was recorded)."""
    path = Path(run_dir) / FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(rows: list[dict]) -> dict | None:
    """A run's segments summed: waited_pct (of its threads' ready time), others_cores (the mean
    cores other processes kept busy), cores, the highest load_1min; None without rows."""
    if not rows:
        return None
    ran, waited = sum(r["ran_s"] for r in rows), sum(r["waited_s"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    return {
        "waited_pct": round(100.0 * waited / max(ran + waited, 1e-9), 1),
        "others_cores": round(
            sum(r["others_cores"] * r["wall_s"] for r in rows) / max(wall, 1e-9), 2
        ),
        "cores": max(r["cores"] for r in rows),
        "load_1min": max(r["load_1min"] for r in rows),
    }


def withheld(summary: dict | None) -> str | None:
    """One sentence on why a run's speed is distorted, or None where the machine gave it what
    it asked for (or nothing was measured)."""
    if summary is None or summary["waited_pct"] < WAITED_PCT:
        return None
    return (
        f"its threads waited for a core {summary['waited_pct']:.0f}% of the time they were "
        f"ready to run (other processes kept {summary['others_cores']:.1f} of "
        f"{summary['cores']} cores busy, load average up to {summary['load_1min']:.1f})"
    )
