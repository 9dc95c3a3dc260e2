"""benchmarks/research/switch_ab.py: a module switch A/B in one process."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "research"))

switch_ab = pytest.importorskip("switch_ab")


def test_a_switch_must_name_a_boolean_of_a_module():
    module, attr = switch_ab.parse_switch("blockscale.ops.linear:CAST_INPUT_UNDER_AUTOCAST")
    assert attr == "CAST_INPUT_UNDER_AUTOCAST" and module.__name__ == "blockscale.ops.linear"
    for bad in ("blockscale.ops.linear", "blockscale.ops.linear:linear", "blockscale.ops:nope"):
        with pytest.raises(SystemExit):
            switch_ab.parse_switch(bad)


def test_times_bf16_and_both_settings_and_restores_the_switch():
    pytest.importorskip("transformers")
    from blockscale.ops import linear as _  # noqa: F401

    module = sys.modules["blockscale.ops.linear"]
    rows = switch_ab.main(["--quick", "--switch", "blockscale.ops.linear:SHARE_INPUT_QUANTIZATION"])
    assert [r["variant"] for r in rows] == [
        "bf16",
        "nvfp4 SHARE_INPUT_QUANTIZATION=True",
        "nvfp4 SHARE_INPUT_QUANTIZATION=False",
    ]
    assert all(len(r["rounds_ms"]) == 2 and r["median_ms"] > 0 for r in rows)
    assert module.SHARE_INPUT_QUANTIZATION is True
