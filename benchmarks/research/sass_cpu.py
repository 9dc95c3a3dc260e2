"""The quantization kernels' machine code for an H100 (sm_90), compiled on the CPU: no GPU.

For each kernel bench_quantize.py times (and each per-group kernel bench_grouped_mm.py
times, on 8 uneven experts), this runs the public function on CPU tensors with
every launch recorded instead of run, compiles each recorded launch for sm_90 with the
specialization Triton's launcher would give it (an int equal to 1 becomes a constant; ints and
pointers divisible by 16 are marked so), disassembles the cubin with the nvdisasm Triton ships,
and reports per launch: SASS instructions (and by opcode), registers, spills, shared memory,
the 32x32 -> 64-bit multiplies, the stochastic rounding hash's multiplies (by mix32's
constants, two a hashed word), and whether the code loops. `--replaced NAME` compiles code
that was replaced (benchmarks/replaced.py: the Philox draw, the integer MXFP8 dq), for
before/after counts; `--tiles TABLE.KEY=BM,BK,WARPS[,MAXNREG]` (benchmarks/tiles.py) compiles
other tiles or a register cap.

The "programs an SM" figure is only what registers and shared memory allow; the estimates below
cannot see how much more warps an SM buy. Measured on the H100 (2026-11-25 night), kernels
that went from 2 to 3 or 3 to 4 programs an SM ran 22-29% faster for 9-14% fewer instructions
(docs/KERNELS.md).

Why: the columnwise, Hadamard and stochastic-rounding kernels are bound by instruction issue,
not by bytes (docs/KERNELS.md). With no loop, a program runs its code once, so
`warps * instructions / values` is the warp instructions a value costs, and

    issue-bound time  = values * (warp instructions a value) / (SMs * 4 schedulers * clock)
    byte-bound time   = bytes / copy bandwidth

The larger is the kernel's floor. The constants are the H100's (132 SMs, 1.755 GHz boost,
3.0 TB/s measured copy): an estimate to compare variants by before a GPU is at hand, not a
measurement; a layout change can still behave differently on the device (docs/LOG.md).

    python benchmarks/research/sass_cpu.py [--only nvfp4] [--json out.json]   # (no TRITON_INTERPRET)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

# The jit kernels, not the interpreter's: bench_quantize turns the interpreter on without a GPU
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, from anywhere

import replaced  # noqa: E402
import tiles  # noqa: E402
from bench_grouped_mm import kernel_cases  # noqa: E402
from bench_quantize import cases, make_input  # noqa: E402

import blockscale  # noqa: E402
from blockscale.kernels import _launch  # noqa: E402
from blockscale.kernels.nvfp4 import MIX32  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# The sm_90 pipe an opcode issues to (Nsight Compute's pipe names), for the three that bound
# the quantize kernels: the ALU pipe (bit operations, shifts, integer adds, every compare,
# select, min/max and PRMT) takes two cycles a warp instruction, the FMA pipe (float
# multiply-adds and every IMAD form) one, the XU (conversions, MUFU) eight. Measured on the H100
# (docs/archive/KERNELS-2026-11.md, "2026-11-26 (later)"): the ALU pipe was 74-88% busy, so
# its count, not the instruction count, is what these kernels are bound by.
PIPES = {
    "alu": {"LOP3", "SHF", "IADD3", "ISETP", "FSETP", "FMNMX", "SEL", "FSEL", "PRMT", "VIMNMX",
            "SGXT", "LEA", "P2R", "R2P", "I2FP", "F2FP", "IABS", "VIADD", "VIADDMNMX", "BMSK",
            "FCHK"},
    "fma": {"FFMA", "FMUL", "FADD", "IMAD", "HFMA2", "HMUL2", "HADD2"},
    "xu": {"MUFU", "I2F", "F2I", "FRND", "F2F"},
}  # fmt: skip
PIPE_CYCLES = {"alu": 2, "fma": 1, "xu": 8}
SMS, SCHEDULERS, CLOCK_HZ, COPY_BYTES_S = 132, 4, 1.755e9, 3.0e12
# An H100 SM's limits on resident programs: registers (allocated 256 a warp at a time),
# warps, shared memory (228 KiB an SM, 1 KiB of it reserved a program) and programs.
SM_REGISTERS, SM_WARPS, SM_SHARED, SM_PROGRAMS = 65536, 64, 228 * 1024, 32


def programs_per_sm(registers: int, warps: int, shared: int) -> int:
    """How many programs of a launch fit on one SM at once (occupancy)."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM_REGISTERS // max(per_warp * warps, 1)
    by_shared = SM_SHARED // (shared + 1024)
    return min(by_registers, SM_WARPS // warps, by_shared, SM_PROGRAMS)


_DTYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
    torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv", torch.float8_e8m0fnu: "u8",
}  # fmt: skip


class _Recorder:
    """Stands in for `torch.library.wrap_triton`: records each launch, runs nothing."""

    launches: list[tuple[Any, tuple, dict, tuple]] = []

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kwargs: Any) -> None:
            g = grid(kwargs) if callable(grid) else grid
            self.launches.append((self.kernel, args, kwargs, tuple(g)))

        return launch


def _specialize(kernel: Any, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ASTSource, by the launcher's rules."""
    names = kernel.arg_names
    constexpr_names = {names[i] for i in kernel.constexprs}
    values = dict(zip(names, args, strict=False)) | kwargs
    signature: dict[str, str] = {}
    constexprs: dict[tuple, Any] = {}
    attrs: dict[tuple, list] = {}
    for i, name in enumerate(names):
        v = values.get(name)
        if name in constexpr_names or v is None or isinstance(v, bool):
            signature[name] = "constexpr"
            constexprs[(i,)] = v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _DTYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, int):
            if v == 1:
                signature[name] = "constexpr"
                constexprs[(i,)] = 1
                continue
            signature[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot specialize {name}={type(v).__name__}")
    return signature, constexprs, attrs


_PTX_INEXACT = re.compile(r"\b[a-z0-9]+(?:\.[a-z0-9]+)*\.(?:ftz|approx)\b(?:\.[a-z0-9]+)*")


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


# One SASS instruction of nvdisasm's output: its address and its text up to the semicolon.
_INSTRUCTION = r"/\*([0-9a-f]{4,})\*/\s+(\S.*?);"
# With -g, a line marker before the instructions compiled from that source line.
_LINE_OR_INSTRUCTION = re.compile(r'//## File "([^"]+)", line (\d+)|' + _INSTRUCTION)


# The packages whose files a kernel's line markers name, by the folder each was imported from.
PACKAGES = {
    name: Path(module.__file__).resolve().parent
    for name, module in (("blockscale", blockscale), ("triton", triton))
}


def _source_file(path: str) -> str:
    """A line marker's file relative to the folder above its package
    ("blockscale/kernels/nvfp4.py", "triton/language/standard.py"), whatever the folders above
    are named (a clone is often a folder named blockscale too). A file of neither package as
    imported here keeps its whole path: Triton's cache keys a kernel by its source, not by its
    file, so a kernel compiled by another checkout names that checkout's file."""
    resolved = Path(path).resolve()
    for name, root in PACKAGES.items():
        if resolved.is_relative_to(root):
            return f"{name}/{resolved.relative_to(root).as_posix()}"
    return path


def _source_lines(sass: str) -> list[str]:
    """The source line ("file:line", `_source_file`) of each instruction of `nvdisasm -g`
    output, in order ("?" before the first line marker)."""
    where, out = "?", []
    for m in _LINE_OR_INSTRUCTION.finditer(sass):
        if m.group(1):
            where = f"{_source_file(m.group(1))}:{m.group(2)}"
        else:
            out.append(where)
    return out


def compile_launch(kernel: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """SASS statistics of one recorded launch compiled for sm_90."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    signature, constexprs, attrs = _specialize(kernel, args, kwargs)
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([_tool("nvdisasm"), "-c", "-g", f.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    lines = [m for m in re.finditer(_INSTRUCTION, sass)]
    ops = [re.sub(r"^@!?U?P\w+\s+", "", m.group(2)).split()[0] for m in lines]
    source_lines = _source_lines(sass)
    to_exit = next((i for i, op in enumerate(ops) if op == "EXIT"), len(ops))
    branches_back = 0
    for m, op in zip(lines, ops, strict=True):
        if op.startswith("BRA"):
            target = re.search(r"0x([0-9a-f]+)", m.group(2))
            branches_back += bool(target and int(target.group(1), 16) < int(m.group(1), 16))

    def resource(key: str) -> int:
        found = re.search(rf"{key}:(\d+)", usage)
        return int(found.group(1)) if found else 0

    return {
        "kernel": kernel.fn.__name__,
        "num_warps": compiled.metadata.num_warps,
        "instructions": len(ops),
        # 32x32 -> 64-bit multiplies (addresses; 14 a Philox draw, --replaced sr-philox)
        "wide_multiplies": sum(op in ("IMAD.WIDE.U32", "IMAD.HI.U32") for op in ops),
        # stochastic rounding's hash: the multiplies by mix32's two constants (two a word)
        "hash_multiplies": sum(any(f"0x{c:x}" in m.group(2).lower() for c in MIX32) for m in lines),
        "loops": branches_back > 0,
        "registers": resource("REG"),
        # a kernel's stack frame is its spilled registers (LOCAL reports only local arrays)
        "spill_bytes": resource("STACK") + resource("LOCAL"),
        # a register cap the launch asked for (0: none); spills under a cap are chosen
        "maxnreg": options.get("maxnreg", 0),
        "shared_bytes": compiled.metadata.shared,
        # PTX float instructions that flush subnormals or approximate (cvt.rpi.ftz, ex2.approx,
        # ...): the quantization must round every input as the reference does, subnormals too
        "ptx_inexact": dict(Counter(_PTX_INEXACT.findall(compiled.asm["ptx"]))),
        # by opcode without modifiers (IMAD.WIDE.U32 -> IMAD): the mix of pipes a variant uses
        "opcodes": dict(Counter(op.split(".")[0] for op in ops).most_common()),
        # the instructions up to the first EXIT: what a program of a loop-free kernel runs,
        # without the out-of-line code placed after it (the IEEE divisions' slow paths)
        "instructions_to_exit": to_exit,
        # those instructions by the source line they came from ("file:line", nvdisasm -g),
        # most first
        "by_line": dict(Counter(source_lines[:to_exit]).most_common()),
        # instructions a program issues to each bounding pipe (PIPES)
        "pipes": {
            pipe: sum(op.split(".")[0] in names for op in ops) for pipe, names in PIPES.items()
        },
    }


def _source_text(where: str) -> str:
    """The stripped source of a "file:line" of `_source_lines`, or ""."""
    file, _, line = where.rpartition(":")
    package, _, rest = file.partition("/")
    path = PACKAGES[package] / rest if package in PACKAGES else Path(file)
    if not line.isdigit() or not path.is_file():
        return ""
    text = path.read_text().splitlines()
    return text[int(line) - 1].strip()[:90] if int(line) <= len(text) else ""


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma list of substrings of case names")
    parser.add_argument("--shape", default="16384,8192", help="rows,cols of the BF16 input")
    parser.add_argument("--json", default="")
    parser.add_argument("--ops", type=int, default=0, help="print each launch's N top opcodes")
    parser.add_argument("--lines", type=int, default=0,
                        help="print each launch's N source lines with the most instructions")  # fmt: skip
    replaced.add_arg(parser)
    tiles.add_arg(parser)
    args = parser.parse_args(argv)
    replaced.apply(args)
    tiles.apply(args)
    rows_n, cols_n = (int(v) for v in args.shape.split(","))
    torch.library.wrap_triton = _Recorder  # every launcher looks it up at call time
    _launch.FAST_LAUNCH = False  # so that every launch goes through it
    x = make_input((rows_n, cols_n), torch.device("cpu"))
    wanted = [w for w in args.only.split(",") if w]
    results = []
    # the dense kernels (bench_quantize.py) and the grouped ones of a mixture-of-experts step
    # (bench_grouped_mm.py), the rows of x over 8 experts, uneven, one empty
    grouped = [(f"grouped {n}", "-", fn, b) for n, (fn, b) in kernel_cases(x, 8).items()]
    for name, _family, fn, nbytes in cases(x) + grouped:
        if wanted and not any(w in name for w in wanted):
            continue
        _Recorder.launches = []
        fn()
        for kernel, kargs, kwargs, grid in _Recorder.launches:
            stats = compile_launch(kernel, kargs, dict(kwargs))
            programs = max(1, math.prod(grid))
            warp_instr = stats["instructions"] * stats["num_warps"] * programs
            issue_s = warp_instr / (SMS * SCHEDULERS * CLOCK_HZ)
            byte_s = nbytes / COPY_BYTES_S
            resident = programs_per_sm(
                stats["registers"], stats["num_warps"], stats["shared_bytes"]
            )
            # a pipe's busy time: its warp instructions times its cycles each, over the schedulers
            pipe_s = max(
                n * stats["num_warps"] * programs * PIPE_CYCLES[pipe]
                for pipe, n in stats["pipes"].items()
            ) / (SMS * SCHEDULERS * CLOCK_HZ)
            row = {"case": name, "programs": programs, **stats, "programs_per_sm": resident,
                   "values_per_thread": x.numel() / (programs * stats["num_warps"] * 32),
                   "warp_instr_per_value": warp_instr / x.numel(),
                   "alu_warp_instr_per_value":
                       stats["pipes"]["alu"] * stats["num_warps"] * programs / x.numel(),
                   "issue_bound_us": issue_s * 1e6, "pipe_bound_us": pipe_s * 1e6,
                   "byte_bound_us": byte_s * 1e6}  # fmt: skip
            results.append(row)
            print(
                f"{name[:40]:40s} {stats['kernel'][:28]:28s} sass {stats['instructions']:5d} "
                f"regs {stats['registers']:3d} ({resident}/SM) spill {stats['spill_bytes']:4d} "
                f"hash-mul {stats['hash_multiplies']:3d}{' loop' if stats['loops'] else ''}"
                f"  {row['warp_instr_per_value']:.2f} warp-instr/value "
                f"({row['alu_warp_instr_per_value']:.2f} ALU): issue "
                f"{row['issue_bound_us']:.0f} us, pipes {row['pipe_bound_us']:.0f} us, bytes "
                f"{row['byte_bound_us']:.0f} us",
                flush=True,
            )
            if args.lines:
                print(f"    {stats['instructions_to_exit']} instructions to the first EXIT")
                for where, n in list(stats["by_line"].items())[: args.lines]:
                    print(f"    {n:5d}  {where}  {_source_text(where)}")
            if args.ops:
                top = list(stats["opcodes"].items())[: args.ops]
                print("    " + " ".join(f"{op} {n}" for op, n in top), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"target": "sm_90", "rows": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
