"""The grouped rows GEMM's loops as compiled for an H100 / H200 (sm_90), on the CPU: no GPU.

The persistent rows launch (kernels/grouped_gemm.py) asks Triton to fuse its tile loop with
its K loop (`tl.range(..., flatten=True)`), so that the next tile's TMA loads are issued during
this tile's last K steps and its epilogue. Triton's FuseNestedLoops pass does that only when
the K loop's trip count does not depend on the tile, and otherwise leaves the loops nested
without a word: until 2026-12-01 the tiles past offs[-1] ran 0 K steps, and the launch ran
unfused (docs/KERNELS.md, "The rows launch's loops, fused"). This compiles each rows launch a
grouped step makes (the output GEMM with the K-major weight, grad_input with the N-major one,
BF16 outputs, the default tiles) with the specialization Triton's launcher gives it, and
reports per launch how many loops enclose each wgmma in the TTGIR (1: fused; 2: a tile loop
around a K loop), registers, spills and shared memory.

    python benchmarks/research/grouped_gemm_loops_cpu.py [--unfused] [--json out.json]   # (no TRITON_INTERPRET)

`--dense` compiles the dense GEMM's launches instead (kernels/gemm.py): the default one and the
warp-specialized one, with their warps (12: split into a producer and two consumers) and
shared memory (the default's BF16 tile stored in halves).

tests/test_grouped_gemm_loops_cpu.py runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # the jit kernels, not the interpreter's

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's blockscale

from blockscale.kernels import grouped_gemm as gg  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def loop_depths(ttgir: str) -> list[int]:
    """For each wgmma (`ttng.warp_group_dot`) of the TTGIR, the scf.for loops around it."""
    stack: list[str] = []
    depths = []
    for line in ttgir.splitlines():
        s = line.strip()
        if "ttng.warp_group_dot " in s:
            depths.append(stack.count("for"))
        if s.startswith("}"):
            stack.pop()
            if s.endswith("{"):  # `} else {`
                stack.append("if")
        elif s.endswith("{"):
            stack.append("for" if re.search(r"\bscf\.for\b", s) else "other")
    return depths


def compile_launch(kernel: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """One recorded launch compiled for sm_90 as Triton's launcher would specialize it
    (Triton 3.6's binder, so host tensor descriptors get their signature too)."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__
    )
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip

    def resource(key: str) -> int:
        found = re.search(rf"{key}:(\d+)", usage)
        return int(found.group(1)) if found else 0

    return {
        "wgmma_loop_depths": loop_depths(compiled.asm["ttgir"]),
        "warps": compiled.metadata.num_warps,  # (a warp-specialized split adds its partitions')
        "registers": resource("REG"),
        "spill_bytes": resource("STACK") + resource("LOCAL"),
        "shared_bytes": compiled.metadata.shared,
    }


def dense_rows() -> list[dict[str, Any]]:
    """The dense fused GEMM (kernels/gemm.py) at a 1B output shape: the default launch (its
    BF16 tile stored in halves) and the warp-specialized one (WS_DEVICE_DESCRIPTORS), compiled
    as their launches would be; `warps` 12 means Triton split the program into a producer and
    two consumers."""
    from blockscale.kernels import gemm  # noqa: PLC0415

    recorded: list[tuple] = []
    gemm.direct = lambda kernel, grid, *a, **k: recorded.append((kernel, a, k))  # not run
    gemm.interpreting = lambda: False
    a = torch.empty(16384, 2048, dtype=torch.bfloat16)
    b = torch.empty(2048, 2048, dtype=torch.bfloat16)
    amax = torch.ones(())
    ws = (128, 256, 64, 8, 4, 3, 0, gemm.WS_DEVICE_DESCRIPTORS)
    rows = []
    for name, config in (("default", gemm.DEFAULT_CONFIG), ("warp-specialized", ws)):
        recorded.clear()
        gemm.gemm_fused(a, b, (amax, amax), config=config)
        (kernel, kargs, kwargs), *_ = recorded
        flags = {k: kwargs.get(k) for k in ("HALVES", "HW_BF16")}
        row = {"launch": f"dense {name}", "config": list(config), **flags}
        rows.append({**row, **compile_launch(kernel, kargs, dict(kwargs))})
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--unfused", action="store_true",
                        help="with ROWS_FUSED_LOOPS off (0 K steps past offs[-1])")  # fmt: skip
    parser.add_argument("--dense", action="store_true",
                        help="the dense GEMM's launches instead (kernels/gemm.py)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.dense:
        rows = dense_rows()
        for r in rows:
            print(json.dumps(r))
        if args.json:
            Path(args.json).write_text(json.dumps({"target": "sm_90", "rows": rows}, indent=1))
        return rows
    if args.unfused:
        gg.ROWS_FUSED_LOOPS = False
    recorded: list[tuple] = []
    gg.direct = lambda kernel, grid, *a, **k: recorded.append((kernel, a, k))  # record, not run
    gg.interpreting = lambda: False
    E, M, K, N = 16, 4096, 768, 2048
    offs = torch.tensor([M // E] * E).cumsum(0).to(torch.int32)
    a = torch.empty(M, K, dtype=torch.bfloat16)
    amax = (torch.ones(E), torch.ones(E))
    weights = {
        "output (K-major weight)": torch.empty(E, N, K, dtype=torch.bfloat16),
        "grad_input (N-major weight)": torch.empty(E, K, N, dtype=torch.bfloat16).transpose(1, 2),
    }
    rows = []
    for name, b in weights.items():
        recorded.clear()
        gg.grouped_gemm_rows(a, b, offs, amax, torch.bfloat16)
        (kernel, kargs, kwargs), *_ = recorded
        flags = {k: kwargs[k] for k in ("PERSISTENT", "FLATTEN", "FUSED")}
        rows.append({"launch": name, **flags, **compile_launch(kernel, kargs, dict(kwargs))})
    for r in rows:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps({"target": "sm_90", "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
