"""Kernel-by-kernel breakdown of one linear training step (forward + backward) under a recipe.

Each operation the step runs on the GPU (global amax, quantization, dequantization of saved
operands, the GEMMs and their epilogue) is timed by the profiler (the GPU-timeline span of
the kernels it launched, exclusive of the operations nested in it) and reported with what it
moved: bytes read + written as a fraction of the device-to-device copy ceiling, or for the
GEMMs TFLOP/s as a fraction of a BF16 GEMM of the same shape (cuBLAS, BF16 output), both
measured in the same run. "other" is the step time not covered by a timed operation (small
PyTorch ops, and the GPU idling while the host launches).

Timing wraps the library's functions where `ops/`, `gemm/` and `kernels/` call them, so the
step is the library's own code path. "host_us" is the CPU time of each call (Python and
launch); when the host's total per step approaches the step time, the step is launch-bound.
The step's total is measured separately, without wrappers.

    python benchmarks/research/breakdown_linear.py --recipe nvfp4 --shape 16384,4096,4096
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, from anywhere

import harness  # noqa: E402

import blockscale.kernels as bk  # noqa: E402
import blockscale.kernels.gemm as bk_gemm  # noqa: E402
import blockscale.kernels.nvfp4 as bk_nvfp4  # noqa: E402
import blockscale.nn as bsnn  # noqa: E402
from blockscale import recipes  # noqa: E402
from blockscale.gemm import dispatch, emulated  # noqa: E402


def _nbytes(obj: Any) -> int:
    """Bytes of every tensor in a (nested) result: containers, tuples, tensors."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, tuple | list):
        return sum(_nbytes(o) for o in obj)
    fields = ("data", "scale", "dq_bf16")
    return sum(_nbytes(getattr(obj, f, None)) for f in fields)


class Recorder:
    """Per-call timings of wrapped operations, keyed by (phase, operation, shape).

    Two passes over the same steps: `mode = "host"` times each call's host cost with
    perf_counter (exclusive of nested wrapped calls); `mode = "device"` wraps each call in a
    profiler range, and `device_totals(prof)` reads its span on the GPU timeline (CUPTI
    timestamps of its first and last kernel), exclusive of nested ranges. A span holding two
    kernels also holds any idle gap between them."""

    def __init__(self) -> None:
        self.phase = "fwd"
        self.mode: str | None = None
        self.host_stack: list[float] = []
        self.records: dict[str, dict[str, Any]] = {}  # range name -> call record
        self.calls = 0
        self.host: list[dict[str, Any]] = []

    def wrap(self, module: Any, name: str, label: str, work) -> None:
        real = getattr(module, name)

        @functools.wraps(real)
        def timed(*args, **kwargs):
            if self.mode == "device":
                self.calls += 1  # numbered on entry: nested calls get their own names
                range_name = f"bs#{self.calls}"
                with torch.profiler.record_function(range_name):
                    out = real(*args, **kwargs)
                shape, nbytes, flops = work(args, kwargs, out)
                self.records[range_name] = dict(phase=self.phase, op=label, shape=shape,
                                                bytes=nbytes, flops=flops)  # fmt: skip
                return out
            if self.mode == "host":
                self.host_stack.append(0.0)
                t0 = time.perf_counter()
                out = real(*args, **kwargs)
                host = time.perf_counter() - t0
                nested = self.host_stack.pop()
                if self.host_stack:
                    self.host_stack[-1] += host
                shape, _, _ = work(args, kwargs, out)
                self.host.append(dict(phase=self.phase, op=label, shape=shape, s=host - nested))
                return out
            return real(*args, **kwargs)

        setattr(module, name, timed)

    def device_totals(self, prof: Any) -> list[dict[str, Any]]:
        # Each profiler range also appears on the GPU timeline (a user annotation spanning its
        # kernels): its length is the range's GPU time. Nested ranges (the amax pass inside a
        # quantize call) are subtracted from the range that contains them.
        spans = []
        for evt in prof.events():
            if evt.name in self.records and evt.device_type != torch.autograd.DeviceType.CPU:
                spans.append((evt.time_range.start, evt.time_range.end, evt.name))
        rows: dict[tuple, dict[str, Any]] = {}
        for start, end, name in spans:
            inner = sum(e - s for s, e, n in spans if n != name and s >= start and e <= end)
            rec = self.records[name]
            key = (rec["phase"], rec["op"], rec["shape"])
            row = rows.setdefault(key, dict(phase=key[0], op=key[1], shape=key[2], calls=0,
                                            ms=0.0, bytes=0, flops=0, host_ms=0.0))  # fmt: skip
            row["calls"] += 1
            row["ms"] += (end - start - inner) / 1e3
            row["bytes"] += rec["bytes"]
            row["flops"] += rec["flops"]
        for h in self.host:
            row = rows.get((h["phase"], h["op"], h["shape"]))
            if row is not None:
                row["host_ms"] += 1e3 * h["s"]
        return list(rows.values())


def _shape(t: torch.Tensor) -> str:
    return "x".join(str(d) for d in t.shape)


def install(rec: Recorder) -> None:
    def read_input(args, kwargs, out):
        return _shape(args[0]), _nbytes(args[0]), 0

    def quantize(args, kwargs, out):
        return _shape(args[0]), _nbytes(args[0]) + _nbytes(out), 0

    def dequantize(args, kwargs, out):
        q = args[0]
        return "x".join(map(str, q.shape)), _nbytes(q.data) + _nbytes(q.scale) + _nbytes(out), 0

    def gemm(args, kwargs, out):
        a, b = args[0], args[1]
        m, k, n = a.shape[0], a.shape[1], b.shape[0]
        return f"{m}x{k}x{n}", 0, 2 * m * n * k

    def epilogue(args, kwargs, out):
        acc = args[0]
        written = kwargs.get("out")
        same = written is not None and written.data_ptr() == acc.data_ptr()
        return _shape(acc), _nbytes(acc) + (_nbytes(acc) if same else _nbytes(out)), 0

    rec.wrap(bk_nvfp4, "amax_fused", "amax (fused, rows + Hadamard columns)", read_input)
    rec.wrap(bk_nvfp4, "amax_of_copy", "amax", read_input)
    for name in ("nvfp4_quantize", "nvfp4_quantize_both", "mxfp8_quantize", "mxfp8_quantize_both"):
        rec.wrap(bk, name, name.replace("_", " "), quantize)
    for name in ("nvfp4_dequantize_dq", "mxfp8_dequantize_dq"):
        rec.wrap(bk, name, f"{name.split('_')[0]} dequantize (saved operand)", dequantize)
    rec.wrap(emulated, "mm_fp32_accumulate", "GEMM (cuBLAS, FP32 out)", gemm)
    rec.wrap(bk, "gemm_epilogue", "GEMM epilogue (alpha, bias, cast)", epilogue)
    rec.wrap(bk_gemm, "gemm_fused", "GEMM + epilogue (Triton, one kernel)", gemm)


def main(argv: list[str] | None = None) -> int:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--recipe", default="nvfp4", choices=recipes.names())
    parser.add_argument("--shape", default="16384,4096,4096", help="M,K,N")
    parser.add_argument("--acc-chunk-mib", type=float, default=None,
                        help="rows of the FP32 accumulator per GEMM call, in MiB (0: whole)")  # fmt: skip
    parser.add_argument("--gemm", choices=["fused", "cublas"], default="fused",
                        help="emulated GEMMs as one Triton kernel with the epilogue, or cuBLAS "
                        "(FP32 out) + the epilogue kernel")  # fmt: skip
    parser.add_argument("--profile-host", action="store_true",
                        help="also print the Python functions that take the host's time")  # fmt: skip
    args = parser.parse_args(argv)
    device = harness.pick_device(args.device)
    if device.type != "cuda":
        print("breakdown_linear needs a CUDA device (it reads GPU kernel times)")
        return 1
    dispatch.FUSED_GEMM = args.gemm == "fused"
    if args.acc_chunk_mib is not None:
        dispatch.ACC_CHUNK_BYTES = int(args.acc_chunk_mib * 2**20)
    reps = args.reps or 10
    m, k, n = (int(v) for v in args.shape.split(","))
    info = harness.banner(device)
    copy = harness.copy_bandwidth(device, 2**30, reps=20)
    print(f"copy ceiling: {copy / 1e12:.3g} TB/s; recipe {args.recipe}; M,K,N = {m},{k},{n}")

    bf = torch.bfloat16
    weight = torch.nn.Parameter(torch.randn(n, k, device=device, dtype=bf) / k**0.5)
    x = torch.randn(m, k, device=device, dtype=bf, requires_grad=True)
    go = torch.randn(m, n, device=device, dtype=bf)
    layer = bsnn.Linear(k, n, bias=False, device="meta", recipe=recipes.get(args.recipe))
    layer.weight = weight
    bf16_layer = bsnn.Linear(k, n, bias=False, device="meta", recipe=recipes.get("bf16"))
    bf16_layer.weight = weight

    def step(lyr, rec=None):
        lyr.weight.grad = None
        x.grad = None
        if rec:
            rec.phase = "fwd"
        y = lyr(x)
        if rec:
            rec.phase = "bwd"
        y.backward(go)

    step_ms = harness.time_fn(lambda: step(layer), warmup=3, reps=reps, device=device).median_ms
    # Host time of a step: the Python and launch cost, without waiting for the GPU. When it
    # approaches the GPU time the step is launch-bound (the GPU idles between launches).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step(layer)
    host_ms = 1e3 * (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    bf16_ms = harness.time_fn(lambda: step(bf16_layer), warmup=3, reps=reps, device=device)
    bf16_ms = bf16_ms.median_ms

    if args.profile_host:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.runcall(lambda: [step(layer) for _ in range(reps)])
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)

    rec = Recorder()
    install(rec)
    rec.mode = "host"
    for _ in range(reps):
        step(layer, rec)
    torch.cuda.synchronize()
    rec.mode = "device"
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(reps):
            step(layer, rec)
        torch.cuda.synchronize()
    rec.mode = None
    rows = rec.device_totals(prof)
    if not rows:
        print("the profiler attributed no kernel to the wrapped operations")
        return 1
    gemm_ceiling: dict[str, float] = {}
    for r in rows:
        r["calls"] //= reps
        r["us"] = 1e3 * r["ms"] / reps
        r["host_us"] = 1e3 * r["host_ms"] / reps
        seconds = max(r["ms"], 1e-9) * 1e-3
        if r["flops"]:
            gm, gk, gn = (int(v) for v in r["shape"].split("x"))
            if r["shape"] not in gemm_ceiling:
                gemm_ceiling[r["shape"]] = harness.gemm_tflops(gm, gn, gk, device)
            r["tflops"] = r["flops"] / seconds / 1e12
            r["pct_ceiling"] = 100 * r["tflops"] / gemm_ceiling[r["shape"]]
        else:
            r["gbps"] = r["bytes"] / seconds / 1e9
            r["pct_ceiling"] = 100 * r["bytes"] / seconds / copy
    covered = sum(r["us"] for r in rows)
    rows.append(dict(phase="", op="other (untimed ops, gaps)", us=1e3 * step_ms - covered))
    print(
        f"step {step_ms:.3f} ms (BF16 {bf16_ms:.3f} ms, {step_ms / bf16_ms:.2f}x); "
        f"host {host_ms:.3f} ms per step"
    )
    columns = ["phase", "op", "shape", "calls", "us", "host_us", "gbps", "tflops", "pct_ceiling"]
    harness.print_table(rows, columns)
    if args.json:
        clean = [{c: r.get(c) for c in columns + ["bytes", "flops"]} for r in rows]
        harness.write_json(args.json, dict(benchmark="breakdown_linear", banner=info,
                                           recipe=args.recipe, shape=[m, k, n],
                                           copy_tbps=copy / 1e12, step_ms=step_ms,
                                           host_ms=host_ms,
                                           bf16_step_ms=bf16_ms, gemm_ceiling_tflops=gemm_ceiling,
                                           acc_chunk_bytes=dispatch.ACC_CHUNK_BYTES,
                                           gemm=args.gemm, rows=clean))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
