"""One benchmark harness for every script in benchmarks/ (see ../docs and BENCHMARKS.md).

What a script gets from here:

- `banner()`: device, compute capability, memory, L2 size, torch / CUDA / Triton versions and
  the date, printed and returned for the JSON record.
- `time_fn(fn, inputs)`: the median (and 20th/80th percentiles) of many timed calls after a
  warm-up. On CUDA each call is timed with its own pair of CUDA events; on the CPU with
  `time.perf_counter`. `inputs` is a list of argument tuples that the calls cycle through:
  `rotating_inputs` builds enough copies that one cycle touches more than twice the L2 cache,
  so no call finds its operands already cached.
- `time_host_and_device(fn)`: for launch-bound code, the host's time to issue a call (the
  device idle at its start) and, on CUDA, the device's time to run it with every launch
  already queued (behind a spin kernel), so neither hides the other.
- `peak_memory(fn)`: the peak bytes allocated during one call above what was allocated before
  (CUDA caching allocator statistics; None on the CPU).
- Ceilings measured in the same run, so ratios compare like with like: `copy_bandwidth()`
  (bytes read + written per second of a device-to-device copy) and `gemm_tflops(m, n, k)`
  (a BF16 GEMM of that shape).
- `print_table(rows, columns)` and `write_json(path, record)`; `add_common_args(parser)` adds
  the flags every script shares (`--json`, `--quick`, `--warmup`, `--reps`, `--device`).
- `row_alone(script, argv, timeout)`: a whole-model script's one row from a process of its own
  (peak memory of one recipe alone: a recipe run after others in one process inherits their
  allocator's cached blocks and fragmentation); `take_peaks_alone(rows, run)` fills rows' peaks
  from such processes.

Scripts report ratios measured side by side (ours / BF16, achieved / ceiling), never absolute
numbers alone: the absolute numbers move from machine to machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_L2_BYTES = 50 * 2**20  # H100; used when the device does not report its L2 size


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int


def pick_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def l2_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return (
            int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
            or DEFAULT_L2_BYTES
        )
    return DEFAULT_L2_BYTES


def banner(device: torch.device) -> dict[str, Any]:
    """Print and return what a result needs to be reproduced: device and software versions."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_mib=round(l2_bytes(device) / 2**20, 1),
            sms=props.multi_processor_count,
        )
    else:
        info.update(
            name=platform.processor() or platform.machine(), threads=torch.get_num_threads()
        )
    print(" | ".join(f"{k}={v}" for k, v in info.items() if v is not None))
    return info


def rotating_inputs(
    make: Callable[[], tuple[Any, ...]], bytes_per_set: int, device: torch.device, max_sets: int = 8
) -> list[tuple[Any, ...]]:
    """Enough input sets (from `make`) that one pass over them exceeds twice the L2 cache."""
    sets = min(max_sets, max(1, math.ceil(2 * l2_bytes(device) / max(1, bytes_per_set))))
    return [make() for _ in range(sets)]


def time_fn(
    fn: Callable[..., Any],
    inputs: Sequence[tuple[Any, ...]] = ((),),
    warmup: int = 5,
    reps: int = 50,
    device: torch.device | None = None,
) -> Timing:
    """Median time of `fn(*inputs[i % len(inputs)])` over `reps` calls, after `warmup` calls."""
    device = device or pick_device()
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    synchronize(device)
    times: list[float] = []
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)
        ]
        for i, (start, end) in enumerate(events):
            args = inputs[i % len(inputs)]
            start.record()
            fn(*args)
            end.record()
        synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for i in range(reps):
            args = inputs[i % len(inputs)]
            t0 = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else [times[0]] * 4
    return Timing(statistics.median(times), q[0], q[3], reps)


_SPIN_CYCLES_PER_MS: dict[torch.device, float] = {}


def _spin_cycles_per_ms(device: torch.device) -> float:
    """Clock cycles of `torch.cuda._sleep` per millisecond on `device`, measured once."""
    if device not in _SPIN_CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        synchronize(device)
        _SPIN_CYCLES_PER_MS[device] = 10_000_000 / start.elapsed_time(end)
    return _SPIN_CYCLES_PER_MS[device]


def host_us(fn: Callable[[], Any], reps: int, device: torch.device, warmup: int = 3) -> float:
    """Microseconds of host time per call of `fn`, over `reps` back-to-back calls with no
    synchronization between them: where `fn`'s GPU work is small, what the host spends
    issuing it (launch overhead, the Python around the launches)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    us = 1e6 * (time.perf_counter() - start) / reps
    synchronize(device)
    return us


def time_host_and_device(
    fn: Callable[[], Any],
    warmup: int = 3,
    reps: int = 20,
    device: torch.device | None = None,
    before: Callable[[], Any] | None = None,
) -> tuple[Timing, Timing | None]:
    """(host, device) timings of `fn()`, each the median of `reps` calls after `warmup`.

    host: from the call to its return, the device idle at the start (`before()`, e.g. a
    barrier of ranks, runs first, untimed): the time the caller's thread spends issuing the
    work, host synchronizations inside `fn` included. On the CPU it is the whole call.
    device (CUDA only, else None): from the first to the last of `fn`'s GPU work, with a spin
    kernel queued first that outlasts the host's issuing (twice the host median), so the GPU
    finds every launch queued and the span holds no launch gaps. A synchronization inside
    `fn` defeats the spin: the span then includes the host time after it."""
    device = device or pick_device()
    for _ in range(warmup):
        if before:
            before()
        fn()
    synchronize(device)
    host: list[float] = []
    for _ in range(reps):
        if before:
            before()
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    synchronize(device)
    q = statistics.quantiles(host, n=5) if len(host) >= 2 else [host[0]] * 4
    host_t = Timing(statistics.median(host), q[0], q[3], reps)
    if device.type != "cuda":
        return host_t, None
    spin = int(2 * host_t.p80_ms * _spin_cycles_per_ms(device)) + 1000
    span: list[float] = []
    for _ in range(reps):
        if before:
            before()
        synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin)
        start.record()
        fn()
        end.record()
        synchronize(device)
        span.append(start.elapsed_time(end))
    q = statistics.quantiles(span, n=5) if len(span) >= 2 else [span[0]] * 4
    return host_t, Timing(statistics.median(span), q[0], q[3], reps)


def peak_memory(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Peak bytes allocated during one `fn()` above the bytes allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, reps: int = 20) -> float:
    """Device-to-device copy ceiling, bytes read + written per second."""
    n = nbytes // 2
    src = [torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(2)]
    dst = torch.empty_like(src[0])
    timing = time_fn(
        lambda s: dst.copy_(s), [(s,) for s in src], warmup=3, reps=reps, device=device
    )
    return 2 * nbytes / (timing.median_ms * 1e-3)


def gemm_tflops(m: int, n: int, k: int, device: torch.device, reps: int = 20) -> float:
    """BF16 GEMM ceiling for out[m, n] = a[m, k] @ b[n, k].T, in TFLOP/s."""
    per_set = 2 * (m * k + n * k + m * n)
    sets = rotating_inputs(
        lambda: (
            torch.randn(m, k, device=device, dtype=torch.bfloat16),
            torch.randn(n, k, device=device, dtype=torch.bfloat16),
        ),
        per_set,
        device,
        max_sets=4,
    )
    timing = time_fn(lambda a, b: a @ b.t(), sets, warmup=3, reps=reps, device=device)
    return 2 * m * n * k / (timing.median_ms * 1e-3) / 1e12


def fmt(value: Any, spec: str | None = None) -> str:
    """A table cell: `spec` (a format spec such as ".4f") for a float where given, else three
    significant digits."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if spec is not None:
            return format(value, spec)
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def print_table(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    formats: dict[str, str] | None = None,
) -> None:
    """A fixed-width table of `columns` from `rows` (markdown-compatible); `formats`: a format
    spec by column, for the columns whose differences hide in three significant digits."""
    formats = formats or {}
    cells = [[fmt(row.get(c), formats.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths)) + " |"
    print(line(list(columns)))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print(line(r))


def write_json(path: str | Path, record: dict[str, Any]) -> None:
    def default(obj: Any) -> Any:
        if isinstance(obj, Timing):
            return asdict(obj)
        return str(obj)

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2, default=default) + "\n")
    print(f"wrote {path}")


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes, few reps (CPU smoke test)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first")
    parser.add_argument("--reps", type=int, default=None, help="timed calls (median reported)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    return parser


def row_alone(script: str | Path, argv: list[str], timeout: float) -> dict[str, Any]:
    """Run `script` with `argv` and `--child-json PATH` in a process of its own and return the
    first row it wrote there, or {"status": why not} where it ran past `timeout` seconds or
    exited without one (the last line it printed)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        command = [sys.executable, str(Path(script).resolve()), *argv, "--child-json", str(out)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"status": f"process ran past {timeout:.0f} s"}
        rows = json.loads(out.read_text())["rows"] if out.exists() else []
        if done.returncode != 0 or not rows:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
            return {"status": f"process exited {done.returncode}: {tail[0][:200]}"}
        return rows[0]


def take_peaks_alone(rows: list[dict[str, Any]], run: Callable[[str], dict[str, Any]]) -> None:
    """Each row's (one model and mode, a recipe each) peak_gib from `run(recipe)`, a row from a
    process of its own (`row_alone`), and its memory_status where that process gave none;
    printed as they come."""
    for row in rows:
        found = run(row["recipe"])
        row["peak_gib"] = found.get("peak_gib")
        if found["status"] != "ok":
            row["memory_status"] = found["status"]
        print(f"  {row['model']} {row['mode']} {row['recipe']} alone: "
              f"peak_gib={fmt(row['peak_gib'])} [{found['status']}]", flush=True)  # fmt: skip
