"""The host path of a quantized linear layer (and of a whole FSDP2 step), timed on a CPU alone.

The quantized FSDP2 step is host-bound (docs/DISTRIBUTED.md): what sets its pace is the Python
and the torch calls between a layer and its kernel launches, and that path can be timed
without a GPU. Here the kernel path runs on CPU tensors (`_library.use_kernels` answers True,
as the kernel tests do under the interpreter) with every Triton launch replaced by a counter:
each call does all the host work of the CUDA path (checks, containers, allocations, views,
dispatch, autograd) except the launches themselves and what CUDA adds to each torch call.
The emulated GEMM reads BF16 operands, as on CUDA (not the CPU's FP32 ones), and cuBLAS's FP32
product (MXFP8's grad_weight of an FP32 master) is counted as a launch, not multiplied on the
CPU (until 2026-12-05 it was, inside the mxfp8 rows' figures). BF16's `F.linear` row does run
its three GEMMs on the CPU: at the default shape most of its figure is that arithmetic, so it
is an upper bound on BF16's host time, not a measure of it. Torch's CPU ops run in one thread
(`stub_launches`, with the reason).

This CPU host is a shared VM whose speed drifts within a run, so each figure is the fastest of
many short blocks, divided by the fastest block of a fixed calibration loop (ten reshapes,
views and small allocations) timed between them, and reported in units where that loop takes
30 us: differences of 5% between two versions of the code show up the same from run to run,
where raw timings moved 2x. The figures are for comparing code, not hosts: a GPU host spends
2-4x these on the same path (CUDA's allocator and launches, a slower interpreter); the
measured ones are host_linear.py's, on the GPU machines.

    python benchmarks/research/host_cpu.py                      # per layer, nvfp4 and mxfp8
    python benchmarks/research/host_cpu.py --profile --top 30   # with a cProfile per case
    python benchmarks/research/host_cpu.py --fsdp-step          # a whole FSDP2 step, 1 rank

`--fsdp-step`: transformers Llama with the 8B shape's layer count at tiny widths (8 layers,
hidden 256), the user's FSDP2 setup of bench_distributed.py on one gloo rank, ms per step
(its BF16 attention and norms do run, on the CPU).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # the compiled kernels' launch path, never interpreted

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

from blockscale import _library  # noqa: E402
from blockscale.gemm import dispatch, emulated  # noqa: E402

KERNEL_MODULES = ("amax", "epilogue", "gemm", "grouped", "grouped_gemm", "master_cast", "mxfp8",
                  "nvfp4", "swizzle", "transpose")  # fmt: skip
LAUNCHES = {"n": 0}


def stub_launches() -> None:
    """Every kernel launch counted instead of run; the kernel path taken on CPU tensors."""

    def counted(kernel, grid, *args, **kwargs) -> None:
        LAUNCHES["n"] += 1

    for name in KERNEL_MODULES:
        module = importlib.import_module(f"blockscale.kernels.{name}")
        for attr in ("launch", "direct"):
            if hasattr(module, attr):
                setattr(module, attr, counted)

    def fp32_product(a_dq: torch.Tensor, b_dq: torch.Tensor) -> torch.Tensor:
        LAUNCHES["n"] += 1  # cuBLAS's FP32 product on CUDA: a launch, not a CPU GEMM
        return torch.empty(a_dq.shape[0], b_dq.shape[0])

    _library.use_kernels = lambda t: True
    dispatch._device = lambda op: torch.device("cuda")  # BF16 `_dq` operands, as on CUDA
    # The stubs leave the kernels' outputs unwritten: where that memory held denormals, the
    # autograd engine's gradient accumulation (real CPU arithmetic) ran up to 100x slower, at
    # random from one version of the code (its allocation order) to the next. Denormals are
    # flushed in this thread only, so torch's CPU ops run in it alone.
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    emulated.mm_fp32_accumulate = fp32_product


_SCRATCH = torch.empty(64, 64)


def _calibration() -> None:
    for _ in range(10):
        _SCRATCH.reshape(4096).view(64, 64)
        torch.empty(8)


def normalized_us(fn, blocks: int, reps: int) -> float:
    """fn's host time in units where `_calibration` takes 30 us (module docstring)."""
    for _ in range(3):
        fn()
    best = best_cal = float("inf")
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
        start = time.perf_counter()
        for _ in range(reps):
            _calibration()
        best_cal = min(best_cal, (time.perf_counter() - start) / reps)
    return best / best_cal * 30.0


def layer_cases(recipes: list[str], shape: tuple[int, int, int]) -> dict:
    import host_linear  # noqa: PLC0415 (its cases, on the CPU)

    cases = {}
    for name in recipes:
        cases.update(host_linear.linear_cases(name, *shape, torch.device("cpu")))
    return cases


def fsdp_step_cases(recipes: list[str]) -> dict:
    import bench_distributed as bd  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    bd.HF_SHAPES["host-cpu"] = dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512,
    )  # fmt: skip
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    mesh = init_device_mesh("cpu", (1,))
    config, tokens = bd.hf_tokens("host-cpu", 1, 64, 0, torch.device("cpu"))
    cases = {}
    for name in recipes:
        model, opt, _ = bd.hf_llama_under_fsdp(config, name, False, mesh, torch.device("cpu"))
        cases[f"{name} FSDP2 step, 8 layers"] = lambda model=model, opt=opt: bd.hf_step(
            model, opt, tokens
        )
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", default="nvfp4,mxfp8")
    parser.add_argument("--shape", default="64,256,256", help="M,K,N (small: host time only)")
    parser.add_argument("--fsdp-step", action="store_true", help="a whole FSDP2 step instead")
    parser.add_argument("--blocks", type=int, default=40, help="timed blocks (the fastest counts)")
    parser.add_argument("--profile", action="store_true", help="cProfile each case")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    stub_launches()
    recipes = args.recipes.split(",")
    if args.fsdp_step:
        cases, reps = fsdp_step_cases(recipes), 2
    else:
        shape = tuple(int(v) for v in args.shape.split(","))
        cases, reps = layer_cases(recipes, shape), 20  # type: ignore[arg-type]
    for name, fn in cases.items():
        LAUNCHES["n"] = 0
        us = normalized_us(fn, args.blocks, reps)
        launches = LAUNCHES["n"] / ((args.blocks * reps) + 3)
        print(f"{name:48s} {us:10.1f} us (normalized)  {launches:5.1f} launches a call")
        if args.profile:
            import host_linear  # noqa: PLC0415

            print(host_linear.profiled(fn, 3 * reps, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
