"""benchmarks/research/op_launches.py: a step's blockscale ops grouped by op, shapes and
constant arguments, with their kernels' device time."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "research"))

op_launches = pytest.importorskip("op_launches")


def _event(name, shapes, constants, *durations):
    kernels = [SimpleNamespace(name=f"k{i}", duration=d) for i, d in enumerate(durations)]
    return SimpleNamespace(
        name=name, input_shapes=shapes, concrete_inputs=constants, kernels=kernels
    )


def test_groups_by_op_shapes_and_constants_and_sums_kernel_time():
    events = [
        _event("blockscale::nvfp4_quantize_2d", [[8, 16]], [True], 10.0),
        _event("blockscale::nvfp4_quantize_2d", [[8, 16]], [True], 30.0),
        _event("blockscale::nvfp4_quantize_2d", [[8, 16]], [False], 5.0),  # other flags
        _event("blockscale::amax_2d", [[8, 16]], [True], 1.0, 2.0),  # two kernels
        _event("aten::mm", [[8, 16]], [], 100.0),  # not ours
    ]
    rows = op_launches.op_rows(events)
    assert [(r["op"], r["constants"], r["count"], r["ms"]) for r in rows] == [
        ("blockscale::nvfp4_quantize_2d", "[True]", 2, 0.04),
        ("blockscale::nvfp4_quantize_2d", "[False]", 1, 0.005),
        ("blockscale::amax_2d", "[True]", 1, 0.003),
    ]
    assert rows[0]["us_per_launch"] == 20.0
    assert rows[2]["kernels"] == "k0,k1"


def test_runs_a_compiled_step_on_the_cpu():
    pytest.importorskip("transformers")
    rows = op_launches.main(["--quick", "--warmup", "1"])
    assert any(r["op"] == "blockscale::mm_fp32_accumulate" for r in rows), rows
