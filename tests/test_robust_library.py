"""Library inputs that were accepted with a wrong result or failed deep inside now raise an
error that names the rule (issue 18); and two failures of the training path: the telemetry
probe on a step whose token count is not a multiple of 16, and CUDA silently running the
reference path when the kernels cannot load."""

import warnings

import pytest
import torch

from blockscale import gemm, mxfp8, nvfp4, recipes
from blockscale.formats import e2m1, grouped
from blockscale.gemm import emulated
from blockscale.gemm import grouped as gemm_grouped
from blockscale.nn import convert as bs_convert
from blockscale.train import TrainConfig, build, read_metrics, train


def operands(hadamard_a: bool, hadamard_b: bool):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    return nvfp4.quantize(a, hadamard=hadamard_a), nvfp4.quantize(b, hadamard=hadamard_b)


def exact_product():
    """a @ b.T of `operands`' inputs before quantization."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    return a @ b.T


# NVFP4 round-to-nearest leaves a relative RMS error of about 0.09 on Gaussian values, so a
# product of two quantized operands is off by about sqrt(2) * 0.09 = 0.13 (0.13 measured here,
# with and without the transform); one transformed operand alone is off by about 1.5.
PRODUCT_TOLERANCE = 0.2


# the public dispatch (every backend) and the emulated GEMM called directly
SCALED_MMS = {"dispatch": gemm.scaled_mm, "emulated": emulated.scaled_mm}
ONE_HADAMARD = "a Hadamard-transformed operand pairs only with another"


@pytest.mark.parametrize("entry", list(SCALED_MMS))
@pytest.mark.parametrize(("ha", "hb"), [(True, False), (False, True)])
def test_scaled_mm_refuses_one_hadamard_operand(entry, ha, hb):
    """(A H) B^T is not A B^T: the product came out with a relative error of 1.5, no error."""
    a, b = operands(ha, hb)
    with pytest.raises(ValueError, match=f"{ONE_HADAMARD} one: a has hadamard={ha}, b has"):
        SCALED_MMS[entry](a, b)


@pytest.mark.parametrize("entry", list(SCALED_MMS))
def test_scaled_mm_with_two_hadamard_operands_is_the_plain_product(entry):
    exact = exact_product()
    out = SCALED_MMS[entry](*operands(True, True))
    assert (out - exact).norm() / exact.norm() < PRODUCT_TOLERANCE


def grouped_token_operands(hadamard_a: bool, hadamard_b: bool):
    """The grad_weight operands of 3 experts (17, 0 and 40 tokens): grad_output [N=32, P] and
    input [K=48, P] in the token layout, quantized along the tokens (the contraction); and
    the exact per-expert product grad_output[rows of e].T @ input[rows of e]."""
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([17, 17, 57], dtype=torch.int32)
    go, x = torch.randn(57, 32, generator=g), torch.randn(57, 48, generator=g)
    a = grouped.nvfp4_quantize_tokens(go, offs, hadamard=hadamard_a)
    b = grouped.nvfp4_quantize_tokens(x, offs, hadamard=hadamard_b)
    exact = torch.stack([go[:17].T @ x[:17], torch.zeros(32, 48), go[17:].T @ x[17:]])
    return a, b, offs, grouped.token_layout(offs, 57).seg_ends, exact


@pytest.mark.parametrize(("ha", "hb"), [(True, False), (False, True)])
def test_grouped_gemms_refuse_one_hadamard_operand(ha, hb):
    a, b, offs, seg_ends, _ = grouped_token_operands(ha, hb)
    with pytest.raises(ValueError, match=f"{ONE_HADAMARD} one: a has hadamard={ha}, b has"):
        gemm_grouped.grouped_mm_tokens(a, b, offs, seg_ends, 16)
    # the rows GEMM (output, grad_input): a Hadamard row operand against plain expert weights
    rows = nvfp4.quantize(torch.randn(57, 64), hadamard=True)
    experts = grouped.nvfp4_quantize_experts(torch.randn(3, 32, 64))
    with pytest.raises(ValueError, match=f"{ONE_HADAMARD} one: a has hadamard=True, b has"):
        gemm_grouped.grouped_mm_rows(rows, experts, offs)


def test_grouped_gemm_with_two_hadamard_operands_is_the_plain_product():
    a, b, offs, seg_ends, exact = grouped_token_operands(True, True)
    out = gemm_grouped.grouped_mm_tokens(a, b, offs, seg_ends, 16)
    assert out.shape == (3, 32, 48) and (out[1] == 0).all()  # expert 1 has no tokens
    assert (out - exact).norm() / exact.norm() < PRODUCT_TOLERANCE


def test_a_hadamard_tensor_cannot_stand_for_its_transpose():
    w = nvfp4.quantize(torch.randn(32, 32), block="16x16", hadamard=True)
    with pytest.raises(
        ValueError, match="Hadamard-transformed NVFP4 tensor has no exact transpose"
    ):
        gemm.Transposed(w)


@pytest.mark.parametrize("shape", [(49,), (1, 48), (32, 48), (), (47,)])
def test_scaled_mm_refuses_a_bias_of_another_shape(shape):
    a, b = operands(False, False)
    with pytest.raises(ValueError, match=r"bias shape .* is not \(48,\): one value per output"):
        gemm.scaled_mm(a, b, bias=torch.zeros(shape))
    out = gemm.scaled_mm(a, b, bias=torch.ones(48))
    torch.testing.assert_close(out, gemm.scaled_mm(a, b) + 1, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("amax", "error", "message"),
    [
        (-1.0, TypeError, "amax must be a float32 torch.Tensor holding one value, got float"),
        (3, TypeError, "got int"),
        (torch.tensor(-1.0), ValueError, r"amax=-1.0 is negative"),
        (torch.tensor(-float("inf")), ValueError, r"amax=-inf is negative"),
        (torch.tensor([1.0, 2.0]), ValueError, r"amax must hold one value .* shape \(2,\)"),
        (torch.ones(2, 2), ValueError, r"shape \(2, 2\)"),
        (torch.tensor(2.0, dtype=torch.float64), ValueError, "amax dtype torch.float64 is not"),
        (torch.tensor(2, dtype=torch.int32), ValueError, "amax dtype torch.int32 is not"),
        (torch.tensor(2.0, dtype=torch.bfloat16), ValueError, "torch.bfloat16 is not float32"),
    ],
)
def test_nvfp4_quantize_checks_a_given_amax(amax, error, message):
    with pytest.raises(error, match=message):
        nvfp4.quantize(torch.randn(4, 32), amax=amax)


def test_nvfp4_quantize_accepts_the_amaxes_it_should():
    x = torch.randn(4, 32)
    for amax in (torch.tensor(5.0), torch.tensor([5.0]), torch.tensor(0.0)):
        nvfp4.quantize(x, amax=amax)
    # Non-finite amax marks non-finite input: everything dequantizes to NaN.
    assert nvfp4.quantize(x, amax=torch.tensor(float("nan"))).dequantize().isnan().all()


@pytest.mark.parametrize("bad", [16, 17, 255])
def test_e2m1_pack_refuses_codes_above_15(bad):
    codes = torch.tensor([[1, 2, bad, 3]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"E2M1 code {bad} is above 15"):
        e2m1.pack(codes)


def test_e2m1_pack_refuses_codes_that_are_not_uint8():
    with pytest.raises(ValueError, match="E2M1 codes must be uint8, got torch.int64"):
        e2m1.pack(torch.tensor([[1, 2]]))
    assert e2m1.pack(torch.tensor([[15, 15]], dtype=torch.uint8)).item() == 0xFF


@pytest.mark.usefixtures("one_cpu_thread")
def test_telemetry_probes_a_step_whose_tokens_are_not_a_multiple_of_16(tmp_path):
    """3 x 101 = 303 tokens: the probe's token-dim operands are padded as training pads them
    (it crashed with 'last dim (303,) is not a multiple of 16' and left only config.json)."""
    cfg = TrainConfig(
        recipe="nvfp4",
        batch_size=3,
        seq_len=101,
        steps=2,
        eval_every=0,
        telemetry_every=1,
        max_data_bytes=50_000,
    )
    assert train(cfg, tmp_path, progress=False)["status"] == "done"
    probes = [r for r in read_metrics(tmp_path) if r["kind"] == "telemetry"]
    assert [r["step"] for r in probes] == [0, 1, 2]
    operands = probes[0]["layers"]["layers.0.attn.wqkv"]
    assert "grad_weight.input_t" in operands and "grad_weight.grad_output_t" in operands


def test_cuda_without_kernels_warns_once(monkeypatch):
    monkeypatch.setattr(build._library, "kernels", lambda: None)
    build._library.warn_reference_path.cache_clear()
    nvfp4_recipe, bf16 = recipes.get("nvfp4"), recipes.get("bf16")
    cuda = torch.device("cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.warn_if_reference_path(cuda, nvfp4_recipe)
        assert build.warn_if_reference_path(cuda, nvfp4_recipe)
        assert not build.warn_if_reference_path(cuda, bf16)  # nothing quantized: no kernels
        assert not build.warn_if_reference_path(torch.device("cpu"), nvfp4_recipe)
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
    assert "Triton is not installed" in str(caught[0].message)
    build._library.warn_reference_path.cache_clear()


@pytest.mark.parametrize(
    ("quantize", "flag"),
    [(nvfp4.quantize, "hadamard"), (nvfp4.quantize, "transpose"), (mxfp8.quantize, "transpose")],
)
def test_quantize_switches_must_be_bools(quantize, flag):
    """transpose="False" is a truthy string: it transposed without a word."""
    with pytest.raises(TypeError, match=f"{flag}='False' is not True or False"):
        quantize(torch.randn(32, 32), **{flag: "False"})


@pytest.mark.parametrize(("ha", "hb"), [(True, False), (False, True)])
def test_native_scaled_mm_called_directly_refuses_one_hadamard_operand(ha, hb):
    """gemm.native.scaled_mm reached without the dispatch (its arguments are built on any
    device, so the check runs on the CPU as it would before a Blackwell GEMM)."""
    from blockscale.gemm import native

    a, b = operands(ha, hb)
    with pytest.raises(ValueError, match=f"{ONE_HADAMARD} one: a has hadamard={ha}, b has"):
        native.scaled_mm_args(a, b)
    native.scaled_mm_args(*operands(True, True))  # a pair is accepted


# ---------------------------------------------------------------- issue 37: convert, meta


def three_layers():
    return torch.nn.Sequential(
        torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
    )


def kinds(model):
    return [type(m).__module__.split(".")[0] for m in model]


def test_a_filter_that_raises_leaves_the_model_unchanged():
    """It left layer 0 converted and layer 2 not: every module is decided before any swap."""
    model = three_layers()

    def filter_fn(module, fqn):
        if fqn == "2":
            raise RuntimeError("my filter's own bug")
        return True

    with pytest.raises(RuntimeError, match="my filter's own bug"):
        bs_convert(model, recipes.get("nvfp4"), filter_fn)
    assert kinds(model) == ["torch"] * 4
    # an already converted model keeps its recipe as well
    bs_convert(model, recipes.get("mxfp8"))
    with pytest.raises(RuntimeError):
        bs_convert(model, recipes.get("nvfp4"), filter_fn)
    assert [m.recipe.name for m in model if hasattr(m, "recipe")] == ["mxfp8"] * 3


@pytest.mark.parametrize("answer", ["False", None, 1, 0, torch.tensor(True)])
def test_a_filter_must_answer_a_bool(answer):
    """The string "False" is truthy: it converted the layer without a word."""
    model = three_layers()
    with pytest.raises(TypeError, match=r"module_filter_fn returned .* for 0 \(Linear\): it must"):
        bs_convert(model, recipes.get("nvfp4"), lambda module, fqn: answer)
    assert kinds(model) == ["torch"] * 4


def test_a_numpy_bool_is_a_bool():
    np = pytest.importorskip("numpy")
    model = three_layers()
    bs_convert(model, recipes.get("nvfp4"), lambda module, fqn: np.bool_(fqn != "2"))
    assert kinds(model) == ["blockscale", "torch", "torch", "blockscale"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp8"])
def test_a_converted_model_runs_on_the_meta_device(recipe, dtype):
    """Meta forwards are how tools count shapes and FLOPs: a converted Linear's raised
    `unknown device type for autocast` (ops/linear.py) where a plain one ran."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(32, 64, dtype=dtype), torch.nn.Linear(64, 96))
    bs_convert(model, recipes.get(recipe))
    assert kinds(model) == ["blockscale"] * 2
    x = torch.empty(2, 5, 32, device="meta", dtype=dtype, requires_grad=True)
    hidden = model[0](x)
    assert (hidden.shape, hidden.dtype, hidden.device.type) == ((2, 5, 64), dtype, "meta")
    out = model[1](hidden.float())
    assert (out.shape, out.dtype) == ((2, 5, 96), torch.float32)
    out.sum().backward()
    assert x.grad.shape == x.shape and model[0].weight.grad.shape == (64, 32)


class _MetaExperts(torch.nn.Module):
    """Experts as transformers 5.x keeps them: 3D weights through F.grouped_mm."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.empty(4, 64, 32))
        self.down_proj = torch.nn.Parameter(torch.empty(4, 32, 32))

    def forward(self, x, offs):
        w1, w2 = self.gate_up_proj.to(x.dtype), self.down_proj.to(x.dtype)
        h = torch.nn.functional.grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        return torch.nn.functional.grouped_mm(h[:, :32], w2.transpose(-2, -1), offs=offs)


def test_converted_experts_run_on_the_meta_device():
    with torch.device("meta"):
        experts = _MetaExperts()
    bs_convert(experts, recipes.get("nvfp4"))
    assert set(experts.grouped_mms) == {"gate_up_proj", "down_proj"}
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    out = experts(torch.empty(40, 32, device="meta", dtype=torch.bfloat16), offs)
    assert (out.shape, out.dtype, out.device.type) == ((40, 32), torch.bfloat16, "meta")
