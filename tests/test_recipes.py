"""Recipes: the named table of NUMERICS.md, switches, and the rules checked at construction."""

import dataclasses
import re

import pytest

from blockscale import recipes
from blockscale.recipes import Backend, Format, OperandConfig, Recipe, Rounding


def ops(recipe: Recipe) -> dict[str, str]:
    return {name: op.describe() for name, op in recipe.operands()}


def test_names_and_unknown_name_lists_them():
    assert recipes.names() == ["bf16", "nvfp4", "nvfp4_fwd_mxfp8_bwd", "mxfp8"]
    with pytest.raises(ValueError, match="known recipes: bf16, nvfp4, nvfp4_fwd_mxfp8_bwd, mxfp8"):
        recipes.get("fp4")


def test_nvfp4_default_is_the_paper_table():
    assert ops(recipes.get("nvfp4")) == {
        "output.input": "nvfp4 1x16, nearest",
        "output.weight": "nvfp4 16x16, nearest",
        "grad_input.grad_output": "nvfp4 1x16, stochastic",
        "grad_input.weight": "nvfp4 16x16, nearest",
        "grad_weight.grad_output_t": "nvfp4 1x16, stochastic, hadamard",
        "grad_weight.input_t": "nvfp4 1x16, nearest, hadamard",
    }


def test_nvfp4_switches():
    r = recipes.get("nvfp4", hadamard=False, stochastic_rounding=False, weight_2d=False)
    assert all(op.format is Format.NVFP4 for _, op in r.operands())
    assert all(op.block == "1x16" for _, op in r.operands())
    assert all(op.rounding is Rounding.NEAREST for _, op in r.operands())
    assert not any(op.hadamard for _, op in r.operands())
    only_sr_off = recipes.get("nvfp4", stochastic_rounding=False)
    assert only_sr_off.grad_weight.grad_output_t.hadamard
    assert only_sr_off.grad_input.grad_output.rounding is Rounding.NEAREST


def test_mixed_and_mxfp8_tables():
    mixed = ops(recipes.get("nvfp4_fwd_mxfp8_bwd"))
    assert mixed["output.input"] == "nvfp4 1x16, nearest"
    assert mixed["output.weight"] == "nvfp4 16x16, nearest"
    for name in ("grad_input.grad_output", "grad_input.weight", "grad_weight.grad_output_t"):
        assert mixed[name] == "mxfp8 1x32, nearest"
    assert set(ops(recipes.get("mxfp8")).values()) == {"mxfp8 1x32, nearest"}
    bf16 = recipes.get("bf16")
    assert not bf16.quantized and set(ops(bf16).values()) == {"bf16"}


def test_unknown_switch_names_the_allowed_ones():
    with pytest.raises(ValueError, match="no switch hadamard; its switches: none"):
        recipes.get("mxfp8", hadamard=True)
    with pytest.raises(ValueError, match="weight_2d"):
        recipes.get("nvfp4", weight2d=True)


def test_recipes_are_frozen_and_hashable():
    r = recipes.get("nvfp4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "x"  # type: ignore[misc]
    assert hash(r) == hash(recipes.get("nvfp4")) and r == recipes.get("nvfp4")
    assert r != recipes.get("nvfp4", hadamard=False)


def test_backend_field():
    assert recipes.get("nvfp4").backend is Backend.AUTO
    assert recipes.get("nvfp4").with_backend("emulated").backend is Backend.EMULATED
    with pytest.raises(ValueError, match="backend='cpu' is not one of"):
        recipes.get("nvfp4").with_backend("cpu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"format": "fp4"}, "format='fp4' is not one of"),
        ({"format": "nvfp4", "block": "1x32"}, r"block='1x32' is not allowed for nvfp4"),
        ({"format": "mxfp8", "block": "1x16"}, r"block='1x16' is not allowed for mxfp8"),
        ({"format": "bf16", "block": "1x16"}, r"block='1x16' is not allowed for bf16"),
        ({"format": "mxfp8", "rounding": "stochastic"}, "stochastic.*needs format nvfp4"),
        ({"format": "mxfp8", "hadamard": True}, "hadamard=True needs format nvfp4"),
        ({"format": "nvfp4", "rounding": "up"}, "rounding='up' is not one of"),
    ],
)
def test_operand_rules(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OperandConfig(**kwargs)


def test_operand_defaults_to_the_format_block():
    assert OperandConfig("nvfp4").block == "1x16"
    assert OperandConfig("mxfp8").block_size == 32
    assert OperandConfig().block is None and not OperandConfig().quantized


NV = OperandConfig("nvfp4")
NV_H = OperandConfig("nvfp4", hadamard=True)
NV_2D = OperandConfig("nvfp4", "16x16")
MX = OperandConfig("mxfp8")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: recipes.OutputGemm(NV, MX), "input is nvfp4 but weight is mxfp8"),
        (lambda: recipes.OutputGemm(NV_H, NV_H), r"output.input has hadamard=True"),
        (lambda: recipes.OutputGemm(NV_2D, NV_2D), "2-D blocks are for weights only"),
        (lambda: recipes.GradInputGemm(MX, NV), "grad_output is mxfp8 but weight is nvfp4"),
        (lambda: recipes.GradWeightGemm(NV_H, NV), "transform cancels only when both"),
        (lambda: recipes.GradWeightGemm(NV_2D, NV_2D), "2-D blocks are for weights only"),
        (
            lambda: Recipe("x", recipes.OutputGemm(NV, NV_2D), recipes.GradInputGemm(NV, NV)),
            "must reuse the 16x16 copy",
        ),
    ],
)
def test_gemm_rules(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_custom_recipe_with_bf16_backward_is_valid():
    r = Recipe("fwd_only", recipes.OutputGemm(NV, NV_2D))
    assert r.quantized and not r.grad_input.grad_output.quantized


@pytest.mark.parametrize(
    ("name", "switch"),
    [
        ("nvfp4", "hadamard"),
        ("nvfp4", "stochastic_rounding"),
        ("nvfp4", "weight_2d"),
        ("nvfp4_fwd_mxfp8_bwd", "weight_2d"),
    ],
)
@pytest.mark.parametrize("value", ["False", None, 0, 1])
def test_recipe_switches_must_be_bools(name, switch, value):
    """weight_2d="False" is a truthy string: it built the 16x16 recipe (issue 60, case 5)."""
    message = re.escape(f"{switch}={value!r} is a {type(value).__name__}, not a bool")
    with pytest.raises(TypeError, match=message):
        recipes.get(name, **{switch: value})
    with pytest.raises(TypeError, match=message):
        getattr(recipes, name)(**{switch: value})


def test_operand_hadamard_must_be_a_bool():
    with pytest.raises(TypeError, match="hadamard='False' is a str, not a bool"):
        OperandConfig("nvfp4", hadamard="False")


def test_numpy_bools_are_switches_and_come_back_as_python_bools():
    """A numpy comparison gives np.bool_: two values, no other reading."""
    np = pytest.importorskip("numpy")
    r = recipes.get("nvfp4", hadamard=np.False_, weight_2d=np.bool_(False))
    assert r == recipes.get("nvfp4", hadamard=False, weight_2d=False)
    operand = OperandConfig("nvfp4", hadamard=np.True_)
    assert type(operand.hadamard) is bool and operand == OperandConfig("nvfp4", hadamard=True)
    assert recipes.require_bool("x", np.True_) is True
