"""benchmarks/research/grouped_gemm_loops_cpu.py: the persistent rows GEMM launches compiled for
sm_90 on the CPU have their tile loop and K loop fused into one (every wgmma inside exactly
one loop), with no spills. Triton leaves the loops nested without a word when the K loop's
trip count depends on the tile, as it did until 2026-12-01 (docs/KERNELS.md, "The rows
launch's loops, fused"); only the compiled code shows it, so this test does.

The script runs in a child process without TRITON_INTERPRET (it compiles the jit kernels).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = (
    Path(__file__).resolve().parents[1] / "benchmarks" / "research" / "grouped_gemm_loops_cpu.py"
)


def compiled_rows(out: Path, *args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(SCRIPT), "--json", str(out), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def test_persistent_rows_launches_fuse_their_tile_and_k_loops(tmp_path):
    rows = compiled_rows(tmp_path / "loops.json")
    assert {r["launch"].split()[0] for r in rows} == {"output", "grad_input"}
    for r in rows:
        assert r["PERSISTENT"] and r["FLATTEN"] and r["FUSED"], r
        assert r["wgmma_loop_depths"] and set(r["wgmma_loop_depths"]) == {1}, r
        assert r["spill_bytes"] == 0, r


def test_the_check_sees_loops_left_nested(tmp_path):
    """With ROWS_FUSED_LOOPS off (the K loop's trip count 0 for the tiles past offs[-1], as
    before), `flatten=True` is still asked for and the wgmma sits in two loops: what the first
    test would catch."""
    rows = compiled_rows(tmp_path / "nested.json", "--unfused")
    for r in rows:
        assert r["FLATTEN"] and not r["FUSED"], r
        assert set(r["wgmma_loop_depths"]) == {2}, r


def test_dense_gemm_launches_compile_as_measured(tmp_path):
    """The dense GEMM (`--dense`): the default launch fuses its loops and stores its BF16 tile in
    halves (180 KiB of shared memory, three stages of 128x256x64 plus half the output tile);
    the warp-specialized launch is split by Triton into 12 warps (a producer warpgroup and two
    consumers), which it silently is not with host-made descriptors or a flattened loop
    (docs/KERNELS.md, "The dense GEMM warp-specialized")."""
    rows = {r["launch"]: r for r in compiled_rows(tmp_path / "dense.json", "--dense")}
    default, ws = rows["dense default"], rows["dense warp-specialized"]
    assert default["HALVES"] and default["HW_BF16"], default
    assert default["warps"] == 8 and set(default["wgmma_loop_depths"]) == {1}, default
    assert default["shared_bytes"] < 3 * (128 + 256) * 64 * 2 + 128 * 256 * 2, default
    assert ws["warps"] == 12, ws
    assert default["spill_bytes"] == 0 and ws["spill_bytes"] == 0
