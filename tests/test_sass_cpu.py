"""benchmarks/sass_cpu.py: every quantization kernel a step runs, compiled for an H100 (sm_90)
on the CPU as the launcher specializes it, with no register spills, and the stochastic
rounding's Philox rounds visible in the machine code. A kernel change that spills (local
memory traffic in a kernel judged by bytes) fails here, before any GPU sees it.

The script runs in a child process without TRITON_INTERPRET: it compiles the jit kernels,
which this test process has replaced with the interpreter's.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sass_cpu.py"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("sass") / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--shape", "256,256", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def test_every_kernel_compiles_for_sm90_without_spills(rows):
    kernels = {r["kernel"] for r in rows}
    assert {"_nvfp4_quantize_kernel", "_mxfp8_quantize_kernel", "_amax_kernel"} <= kernels
    for r in rows:
        assert r["instructions"] > 100 and r["registers"] > 0, r
        assert r["spill_bytes"] == 0, f"{r['case']}: {r['spill_bytes']} bytes of spills"


def test_stochastic_rounding_shows_its_philox_rounds(rows):
    """Philox4x32-7 is 7 rounds of two 32x32->64-bit multiplies: an SR launch has at least one
    draw's 14 more than the same launch rounding to nearest."""
    by_case = {r["case"]: r for r in rows}
    nearest = by_case["nvfp4 1x16 rowwise + dq"]["philox_multiplies"]
    stochastic = by_case["nvfp4 1x16 rowwise SR + dq"]["philox_multiplies"]
    assert stochastic >= nearest + 14
