"""Run a function on N local ranks: gloo on the CPU, NCCL on CUDA (one GPU per rank).

For tests, benchmarks and quick experiments on one machine; real jobs use torchrun. The
function is called as `fn(rank, world_size, *args)` with the default process group initialized
(and, on CUDA, the rank's GPU made current); an exception on any rank fails the call with
that rank's traceback.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    rank: int,
    world_size: int,
    store: str,
    device: str,
    threads: int,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world_size
    )
    fn(rank, world_size, *args)
    # Every rank done before any tears its connections down: a gloo rank whose peer closed
    # first can abort at exit ("terminate called without an active exception"). A rank that
    # raised skips this; the spawn then stops the others.
    dist.barrier()
    dist.destroy_process_group()
    # And then leave without running the interpreter's and C++'s exit-time destructors: under
    # load, a gloo transport thread still joinable when they ran aborted the process now and
    # then (SIGABRT after all its work had passed). Everything the rank had to do is done;
    # os._exit skips only that teardown (stdio is flushed first).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    device: str = "cpu",
    threads: int = 1,
) -> None:
    """Spawn `world_size` processes running `fn(rank, world_size, *args)` and wait for them.

    device: "cpu" (gloo) or "cuda" (NCCL; needs world_size GPUs). threads: intra-op CPU
    threads per rank (one keeps N ranks on N cores from slowing each other down)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not 'cpu' or 'cuda'")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"world_size={world_size} needs {world_size} GPUs, found {torch.cuda.device_count()}"
        )
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # A file store in a fresh directory rather than a TCP port: concurrent runs cannot collide.
    folder = tempfile.mkdtemp(prefix="blockscale-ranks-")
    try:
        mp.spawn(
            _entry,
            args=(world_size, os.path.join(folder, "store"), device, threads, fn, args),
            nprocs=world_size,
            join=True,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
