"""Recipes: which number format each operand of each linear-layer GEMM gets.

A linear layer runs three GEMMs, and every one of them contracts over a different dimension:

```
output      = input       @ weight.T     contracts K (in_features)
grad_input  = grad_output @ weight       contracts N (out_features)
grad_weight = grad_output.T @ input      contracts M (tokens)
```

A block-scaled operand must be quantized along the dimension its GEMM contracts, so one
high-precision tensor is quantized up to twice, each copy with its own treatment. A recipe
writes those six operand treatments out as frozen dataclasses, one `OperandConfig` per operand:

```
recipe.output.input            recipe.output.weight
recipe.grad_input.grad_output  recipe.grad_input.weight
recipe.grad_weight.grad_output_t  recipe.grad_weight.input_t   (`_t`: quantized along tokens)
```

Named recipes come from one registry (`get`, `names`); they are exactly the table in
NUMERICS.md. The rules a recipe must obey are checked when it is built, so an impossible
recipe never reaches a GEMM:

- both operands of a GEMM use the same format (a scaled GEMM multiplies like with like);
- NVFP4 blocks are 1x16, or 16x16 for a weight; MXFP8 blocks are 1x32;
- the Hadamard transform is used on the grad_weight operands only, on both or on neither
  (it cancels in the product only when both operands carry it);
- MXFP8 rounds to nearest (its power-of-two scales leave no room for a stochastic variant in
  `formats/`), BF16 takes no block, rounding or transform;
- a switch (`hadamard`, `weight_2d`, ...) is a bool, Python's or numpy's (`require_bool`, which
  the switches above recipes use too): the string "False" would read as true.

Why dataclasses and not flags: a recipe is compared, hashed, printed in logs and reports, and
passed through `torch.compile` as a constant; a frozen dataclass does all of that for free.
The GEMM backend is a recipe field too (`backend="auto" | "emulated" | "native"`), so the one
object that says what is computed also says where, and there is no global switch.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, StrEnum

from blockscale.gemm.dispatch import Backend

__all__ = [
    "BF16_OPERAND",
    "Backend",
    "Format",
    "GradInputGemm",
    "GradWeightGemm",
    "OperandConfig",
    "OutputGemm",
    "Recipe",
    "Rounding",
    "bf16",
    "get",
    "mxfp8",
    "names",
    "nvfp4",
    "nvfp4_fwd_mxfp8_bwd",
    "require_bool",
    "require_recipe",
]


class Format(StrEnum):
    """A number format. BF16 means "not quantized": the operand stays in high precision.

    >>> bs.recipes.get("nvfp4").output.input.format
    <Format.NVFP4: 'nvfp4'>
    >>> bs.recipes.Format("mxfp8") is bs.recipes.Format.MXFP8
    True
    """

    BF16 = "bf16"
    NVFP4 = "nvfp4"
    MXFP8 = "mxfp8"


class Rounding(StrEnum):
    """How an operand's values round to its format: to the nearest (ties to even), or
    stochastically (unbiased in expectation: NVFP4 gradients).

    >>> bs.recipes.get("nvfp4").grad_input.grad_output.rounding
    <Rounding.STOCHASTIC: 'stochastic'>
    """

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"


# Block shapes each format allows; the first is the format's default.
_BLOCKS: dict[Format, tuple[str | None, ...]] = {
    Format.BF16: (None,),
    Format.NVFP4: ("1x16", "16x16"),
    Format.MXFP8: ("1x32",),
}


def _enum(kind: type[Enum], value: object, what: str) -> Enum:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"{what}={value!r} is not one of {allowed}") from None


def require_bool(name: str, value: object) -> bool:
    """`value` as a Python bool, for the switch `name`; a TypeError for anything else.

    A switch read by truth would take the string "False" (or None, 0, 1, a tensor) for an
    answer nobody gave. numpy's bool (`np.bool_`, what a numpy comparison gives) has only the
    two values and is taken; it comes back as Python's, so recipes compare, hash and print as
    before. A tensor is refused: it may hold many values, or one on a GPU (a host sync).

    >>> bs.recipes.require_bool("weight_2d", "False")
    Traceback (most recent call last):
        ...
    TypeError: weight_2d='False' is a str, not a bool
    """
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"):
        return bool(value)
    raise TypeError(f"{name}={value!r} is a {kind.__name__}, not a bool")


@dataclass(frozen=True)
class OperandConfig:
    """How one GEMM operand is quantized: format, block shape, rounding, Hadamard transform.

    The block always runs along the operand's contraction dimension (for a `_t` operand the
    token dimension); `block` names its shape in the operand's own layout: "1x16" (NVFP4),
    "16x16" (NVFP4 weights only), "1x32" (MXFP8), None (BF16).

    >>> op = bs.recipes.OperandConfig("nvfp4", rounding="stochastic", hadamard=True)
    >>> op.block, op.block_size, op.describe()
    ('1x16', 16, 'nvfp4 1x16, stochastic, hadamard')
    """

    format: Format = Format.BF16
    block: str | None = None
    rounding: Rounding = Rounding.NEAREST
    hadamard: bool = False

    def __post_init__(self) -> None:
        fmt = _enum(Format, self.format, "format")
        rounding = _enum(Rounding, self.rounding, "rounding")
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "rounding", rounding)
        object.__setattr__(self, "hadamard", require_bool("hadamard", self.hadamard))
        block = self.block
        if block is None and fmt is not Format.BF16:
            block = _BLOCKS[fmt][0]
            object.__setattr__(self, "block", block)
        if block not in _BLOCKS[fmt]:
            raise ValueError(
                f"block={block!r} is not allowed for {fmt.value}: use one of {_BLOCKS[fmt]}"
            )
        if fmt is not Format.NVFP4 and rounding is Rounding.STOCHASTIC:
            raise ValueError(f"rounding='stochastic' needs format nvfp4, not {fmt.value}")
        if fmt is not Format.NVFP4 and self.hadamard:
            raise ValueError(f"hadamard=True needs format nvfp4, not {fmt.value}")

    @property
    def quantized(self) -> bool:
        return self.format is not Format.BF16

    @property
    def block_size(self) -> int:
        """Values per block along the contraction dimension (1 for BF16)."""
        return {"1x16": 16, "16x16": 16, "1x32": 32, None: 1}[self.block]

    def describe(self) -> str:
        if not self.quantized:
            return "bf16"
        parts = [f"{self.format.value} {self.block}", self.rounding.value]
        if self.hadamard:
            parts.append("hadamard")
        return ", ".join(parts)


BF16_OPERAND = OperandConfig()


def _same_format(gemm: str, a_name: str, a: OperandConfig, b_name: str, b: OperandConfig) -> None:
    if a.format is not b.format:
        raise ValueError(
            f"{gemm}: {a_name} is {a.format.value} but {b_name} is {b.format.value}; "
            "both operands of a GEMM must use the same format"
        )


def _no_hadamard(gemm: str, **operands: OperandConfig) -> None:
    for name, op in operands.items():
        if op.hadamard:
            raise ValueError(
                f"{gemm}.{name} has hadamard=True; the transform is only used on the "
                "grad_weight operands, where it cancels in the product"
            )


def _no_2d(gemm: str, name: str, op: OperandConfig) -> None:
    if op.block == "16x16":
        raise ValueError(f"{gemm}.{name} has block='16x16'; 2-D blocks are for weights only")


@dataclass(frozen=True)
class OutputGemm:
    """output = input @ weight.T, contracting K.

    >>> bs.recipes.get("nvfp4").output.weight.describe()
    'nvfp4 16x16, nearest'
    """

    input: OperandConfig = BF16_OPERAND
    weight: OperandConfig = BF16_OPERAND

    def __post_init__(self) -> None:
        _same_format("output", "input", self.input, "weight", self.weight)
        _no_hadamard("output", input=self.input, weight=self.weight)
        _no_2d("output", "input", self.input)


@dataclass(frozen=True)
class GradInputGemm:
    """grad_input = grad_output @ weight, contracting N (the weight quantized columnwise).

    >>> bs.recipes.get("nvfp4").grad_input.grad_output.describe()
    'nvfp4 1x16, stochastic'
    """

    grad_output: OperandConfig = BF16_OPERAND
    weight: OperandConfig = BF16_OPERAND

    def __post_init__(self) -> None:
        _same_format("grad_input", "grad_output", self.grad_output, "weight", self.weight)
        _no_hadamard("grad_input", grad_output=self.grad_output, weight=self.weight)
        _no_2d("grad_input", "grad_output", self.grad_output)


@dataclass(frozen=True)
class GradWeightGemm:
    """grad_weight = grad_output_t @ input_t.T, contracting M (both operands along tokens).

    >>> bs.recipes.get("nvfp4").grad_weight.input_t.describe()
    'nvfp4 1x16, nearest, hadamard'
    """

    grad_output_t: OperandConfig = BF16_OPERAND
    input_t: OperandConfig = BF16_OPERAND

    def __post_init__(self) -> None:
        _same_format("grad_weight", "grad_output_t", self.grad_output_t, "input_t", self.input_t)
        if self.grad_output_t.hadamard != self.input_t.hadamard:
            raise ValueError(
                f"grad_weight: grad_output_t.hadamard={self.grad_output_t.hadamard} but "
                f"input_t.hadamard={self.input_t.hadamard}; the transform cancels only when "
                "both operands carry it"
            )
        _no_2d("grad_weight", "grad_output_t", self.grad_output_t)
        _no_2d("grad_weight", "input_t", self.input_t)


@dataclass(frozen=True)
class Recipe:
    """The treatment of all six GEMM operands of a linear layer, plus the GEMM backend.

    >>> nvfp4 = bs.recipes.OperandConfig("nvfp4")
    >>> r = bs.recipes.Recipe("fwd-only", output=bs.recipes.OutputGemm(nvfp4, nvfp4))
    >>> r.quantized, r.grad_input.weight.describe()  # the backward stays in high precision
    (True, 'bf16')
    """

    name: str
    output: OutputGemm = OutputGemm()
    grad_input: GradInputGemm = GradInputGemm()
    grad_weight: GradWeightGemm = GradWeightGemm()
    backend: Backend = Backend.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", _enum(Backend, self.backend, "backend"))
        fwd, bwd = self.output.weight, self.grad_input.weight
        if fwd.block == "16x16" and bwd.format is Format.NVFP4 and bwd != fwd:
            # A 16x16 forward weight already is its own exact columnwise copy; a second,
            # different NVFP4 copy for dgrad would mean two weights that disagree.
            raise ValueError(
                f"output.weight is 16x16 ({fwd.describe()}) but grad_input.weight is "
                f"{bwd.describe()}; an NVFP4 dgrad weight must reuse the 16x16 copy"
            )

    @property
    def quantized(self) -> bool:
        """False when every operand stays in high precision (the layer is a plain F.linear)."""
        return any(op.quantized for _, op in self.operands())

    def operands(self) -> tuple[tuple[str, OperandConfig], ...]:
        """(name, config) for the six operands, named `gemm.operand`."""
        return (
            ("output.input", self.output.input),
            ("output.weight", self.output.weight),
            ("grad_input.grad_output", self.grad_input.grad_output),
            ("grad_input.weight", self.grad_input.weight),
            ("grad_weight.grad_output_t", self.grad_weight.grad_output_t),
            ("grad_weight.input_t", self.grad_weight.input_t),
        )

    def with_backend(self, backend: Backend | str) -> Recipe:
        return dataclasses.replace(self, backend=backend)

    def describe(self) -> str:
        lines = [f"recipe {self.name} (backend {self.backend.value})"]
        lines += [f"  {name:<26} {op.describe()}" for name, op in self.operands()]
        return "\n".join(lines)


def require_recipe(recipe: object) -> Recipe:
    """`recipe`, checked: a TypeError that names what was passed where a Recipe belongs.

    >>> bs.recipes.require_recipe("nvfp4")
    Traceback (most recent call last):
        ...
    TypeError: recipe must be a blockscale Recipe, got str
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a blockscale Recipe, got {type(recipe).__name__}")
    return recipe


def _nvfp4_op(
    block: str = "1x16", stochastic: bool = False, hadamard: bool = False
) -> OperandConfig:
    rounding = Rounding.STOCHASTIC if stochastic else Rounding.NEAREST
    return OperandConfig(Format.NVFP4, block, rounding, hadamard)


_MXFP8 = OperandConfig(Format.MXFP8, "1x32")


def bf16() -> Recipe:
    """No quantization: every GEMM in the input's precision (plain F.linear).

    >>> bs.recipes.bf16().quantized
    False
    """
    return Recipe("bf16")


def nvfp4(
    hadamard: bool = True, stochastic_rounding: bool = True, weight_2d: bool = True
) -> Recipe:
    """The NVFP4 pretraining recipe (arXiv 2509.25149), every GEMM in NVFP4.

    - output:      input 1x16 nearest; weight 16x16 nearest (1x16 with weight_2d=False).
    - grad_input:  grad_output 1x16, stochastic; weight the same 16x16 copy (its transpose is
                   exact), or with weight_2d=False a 1x16 copy quantized along N.
    - grad_weight: grad_output_t and input_t 1x16 along tokens, both with the random Hadamard
                   transform; grad_output_t stochastic.

    Switches: `hadamard` (the wgrad transform), `stochastic_rounding` (on both grad_output
    copies), `weight_2d` (16x16 weight blocks).

    >>> r = bs.recipes.nvfp4(hadamard=False)
    >>> r.grad_weight.input_t.describe()
    'nvfp4 1x16, nearest'
    """
    hadamard = require_bool("hadamard", hadamard)
    stochastic_rounding = require_bool("stochastic_rounding", stochastic_rounding)
    wblock = "16x16" if require_bool("weight_2d", weight_2d) else "1x16"
    return Recipe(
        "nvfp4",
        OutputGemm(input=_nvfp4_op(), weight=_nvfp4_op(wblock)),
        GradInputGemm(
            grad_output=_nvfp4_op(stochastic=stochastic_rounding), weight=_nvfp4_op(wblock)
        ),
        GradWeightGemm(
            grad_output_t=_nvfp4_op(stochastic=stochastic_rounding, hadamard=hadamard),
            input_t=_nvfp4_op(hadamard=hadamard),
        ),
    )


def nvfp4_fwd_mxfp8_bwd(weight_2d: bool = True) -> Recipe:
    """NVFP4 forward (input 1x16, weight 16x16, nearest), MXFP8 1x32 for both backward GEMMs.

    The weight is quantized twice: NVFP4 along K for the forward, MXFP8 along N for dgrad.

    >>> r = bs.recipes.nvfp4_fwd_mxfp8_bwd()
    >>> r.output.weight.describe(), r.grad_input.weight.describe()
    ('nvfp4 16x16, nearest', 'mxfp8 1x32, nearest')
    """
    wblock = "16x16" if require_bool("weight_2d", weight_2d) else "1x16"
    return Recipe(
        "nvfp4_fwd_mxfp8_bwd",
        OutputGemm(input=_nvfp4_op(), weight=_nvfp4_op(wblock)),
        GradInputGemm(grad_output=_MXFP8, weight=_MXFP8),
        GradWeightGemm(grad_output_t=_MXFP8, input_t=_MXFP8),
    )


def mxfp8() -> Recipe:
    """MXFP8 (E4M3 values, E8M0 scales per 32) for every operand, each along its contraction.

    >>> bs.recipes.mxfp8().output.input.block
    '1x32'
    """
    return Recipe(
        "mxfp8",
        OutputGemm(input=_MXFP8, weight=_MXFP8),
        GradInputGemm(grad_output=_MXFP8, weight=_MXFP8),
        GradWeightGemm(grad_output_t=_MXFP8, input_t=_MXFP8),
    )


_REGISTRY: dict[str, Callable[..., Recipe]] = {
    "bf16": bf16,
    "nvfp4": nvfp4,
    "nvfp4_fwd_mxfp8_bwd": nvfp4_fwd_mxfp8_bwd,
    "mxfp8": mxfp8,
}


def names() -> list[str]:
    """The names `get` accepts.

    >>> sorted(bs.recipes.names())
    ['bf16', 'mxfp8', 'nvfp4', 'nvfp4_fwd_mxfp8_bwd']
    """
    return list(_REGISTRY)


def get(name: str, **switches: bool) -> Recipe:
    """The named recipe with its switches set, e.g. `get("nvfp4", hadamard=False)`.

    >>> bs.recipes.get("nvfp4", stochastic_rounding=False).grad_input.grad_output.rounding
    <Rounding.NEAREST: 'nearest'>
    """
    try:
        build = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(names())}") from None
    allowed = list(inspect.signature(build).parameters)
    unknown = sorted(set(switches) - set(allowed))
    if unknown:
        raise ValueError(
            f"recipe {name!r} has no switch {', '.join(unknown)}; "
            f"its switches: {', '.join(allowed) if allowed else 'none'}"
        )
    return build(**switches)
