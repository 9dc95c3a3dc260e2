"""torch.compile(fullgraph=True) of a converted MLP gives the eager results bit for bit.

Everything linear() runs is plain PyTorch that Dynamo traces (formats/ quantizers, the
autograd Function, the dispatch), so there is no graph break to hide. Stochastic rounding is
off here: under Inductor the random draws come from Inductor's own generator, which is
reproducible under a seed but not equal to eager's draws.

The CPU test compiles with Inductor, so it also checks that Inductor's fused elementwise code
reproduces the reference rounding decisions exactly. It is kept small (one MLP, one shape) to
stay inside the CI time budget.

Inductor relaxes by default what the quantizers rely on (Triton's FP32 `/` is approximate,
BF16 round trips between fused ops are dropped, `a * b + c` may become an FMA);
`blockscale.ops.EXACT_INDUCTOR_OPTIONS` restores eager's behaviour for that CPU reference path.
The Triton kernel path (CUDA) needs no options: its quantizers and GEMM epilogues are opaque
library ops that Inductor calls as they are (blockscale/_registry.py), which the kernel-path
tests here check in Triton's interpreter and the GPU tests check under plain torch.compile.
"""

import pytest
import torch
from torch import nn

import blockscale.nn as bsnn
from blockscale import recipes
from blockscale.ops import EXACT_INDUCTOR_OPTIONS


class MLP(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=True)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ReLU is exact in eager and in Inductor alike (SiLU's exp is not, on the GPU), so any
        # difference between the two runs comes from the quantized linears.
        return self.down(torch.relu(self.up(x)))


def eager_and_compiled(recipe, device="cpu", options=EXACT_INDUCTOR_OPTIONS):
    torch.manual_seed(0)
    model = bsnn.convert(MLP().to(device), recipe)
    assert isinstance(model.up, bsnn.Linear) and isinstance(model.down, bsnn.Linear)
    x = torch.randn(4, 32, 64, device=device)
    go = torch.randn(4, 32, 64, device=device)
    results = []
    for fn in (
        model,
        torch.compile(model, fullgraph=True, options=options),
    ):
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        y.backward(go)
        results.append(
            [y, xi.grad, model.up.weight.grad, model.down.weight.grad, model.up.bias.grad]
        )
    return results


def assert_identical(eager, compiled):
    names = ["output", "grad_input", "up.grad_weight", "down.grad_weight"]
    for name, e, c in zip(names, eager, compiled):
        assert torch.equal(e, c), f"{name} differs: max {(e - c).abs().max().item():.3g}"
    # grad_bias is a plain sum over tokens, which Inductor may reorder: FP32-close only.
    torch.testing.assert_close(compiled[4], eager[4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [EXACT_INDUCTOR_OPTIONS, None], ids=["exact", "plain"])
def test_compiled_nvfp4_mlp_equals_eager(options):
    """Plain torch.compile too: Inductor's C++ on the CPU divides in IEEE and keeps the
    reference's roundings, so the options only matter to Triton code generation."""
    torch._dynamo.reset()
    recipe = recipes.get("nvfp4", stochastic_rounding=False)
    eager, compiled = eager_and_compiled(recipe, options=options)
    assert_identical(eager, compiled)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_fwd_mxfp8_bwd", "mxfp8"])
@pytest.mark.parametrize("options", [EXACT_INDUCTOR_OPTIONS, None], ids=["exact", "plain"])
def test_gpu_compiled_mlp_equals_eager(name, options):
    """Also under plain torch.compile: on CUDA every quantizer and epilogue is an opaque op."""
    torch._dynamo.reset()
    switches = {"stochastic_rounding": False} if name == "nvfp4" else {}
    eager, compiled = eager_and_compiled(recipes.get(name, **switches), "cuda", options)
    assert_identical(eager, compiled)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_stochastic_rounding_is_reproducible_under_a_seed():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = bsnn.convert(MLP().cuda(), recipes.get("nvfp4"))
    compiled = torch.compile(model, fullgraph=True, options=EXACT_INDUCTOR_OPTIONS)
    x = torch.randn(4, 32, 64, device="cuda")
    grads = []
    for seed in (5, 5, 6):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        compiled(x).square().sum().backward()
        grads.append(model.up.weight.grad.clone())
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])


class _Launch:
    """Stands in for torch.library.wrap_triton on the CPU, where it refuses interpreted kernels
    under tracing: real tensors launch the kernel in the interpreter; a direct launch
    (wrap_triton disabled, as the library's eager route does) of traced tensors fails as it
    does on the GPU; under a trace the launch
    is skipped (the kernel HOP's fake impl does nothing), except that a functional trace reads
    every traced argument, as the functional HOP does (real tensors are constants it captures
    as they are)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        from torch._library.triton import is_wrap_triton_enabled
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor

        def launch(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            traced = any(isinstance(t, (FakeTensor, FunctionalTensor)) for t in tensors)
            if traced and not is_wrap_triton_enabled():
                # the direct launch the library's eager route asks for: on the GPU it needs
                # real data pointers and fails on traced tensors the same way
                raise RuntimeError("Cannot access data pointer of Tensor (e.g. FakeTensor)")
            if not traced:
                return self.kernel[grid](*args, **kwargs)
            if any(isinstance(t, FunctionalTensor) for t in tensors):
                for t in tensors:
                    if isinstance(t, (FakeTensor, FunctionalTensor)):
                        t.sum()

        return launch


@pytest.fixture
def kernel_path_on_cpu(monkeypatch):
    """linear() on the Triton kernel path with CPU tensors (Triton's interpreter)."""
    pytest.importorskip("triton")
    from blockscale import _library
    from blockscale.kernels import _common

    monkeypatch.setattr(torch.library, "wrap_triton", _Launch)
    monkeypatch.setattr(_library, "use_kernels", lambda t: True)
    _common.hadamard_matrix.cache_clear()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_library_ops_under_a_fake_trace_outside_dynamo_take_the_op_route(
    kernel_path_on_cpu, monkeypatch
):
    """torch 2.11 runs a nonstrict_trace body (a converted experts' call) under FakeTensorMode
    with torch.compiler.is_compiling() False; the library's eager route then launched the
    kernel directly on fake tensors and Dynamo reported "Unsupported output type for
    nonstrict_trace-ed function" on an H100. Any active trace mode must select the op (whose
    fake impl only allocates). is_compiling is pinned False here, as torch 2.11 had it."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from blockscale import kernels

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(64, 64))
        a = kernels.amax(x)
        q = kernels.nvfp4_quantize(x, amax=a)
    assert isinstance(a, FakeTensor) and a.shape == ()
    assert isinstance(q.data, FakeTensor) and q.data.shape == (64, 32)
    real = torch.randn(64, 64)
    assert torch.equal(kernels.amax(real), real.abs().amax())  # eager: still launches


def test_compile_first_kernel_path_caches_no_fake_hadamard(kernel_path_on_cpu):
    """Compiling before any eager call must not leave a fake tensor in a cache that a later
    trace captures as a constant (seen on the GPU: "Unexpected fake buffer _tensor_constant0",
    from the RHT matrix cached under Dynamo's FakeTensorMode by the op's fake impl)."""
    from blockscale.kernels import _common

    torch.manual_seed(0)
    model = bsnn.convert(MLP(), recipes.get("nvfp4", stochastic_rounding=False))
    compiled = torch.compile(model, fullgraph=True, options=EXACT_INDUCTOR_OPTIONS)
    compiled(torch.randn(4, 32, 64, requires_grad=True)).square().sum().backward()
    assert model.up.weight.grad is not None
    assert type(_common.hadamard_matrix(torch.device("cpu"))) is torch.Tensor


@pytest.mark.parametrize("fused_gemm", [True, False], ids=["fused", "epilogue_in_place"])
def test_kernel_path_compiles_to_opaque_ops_with_eager_bits(
    kernel_path_on_cpu, fused_gemm, monkeypatch
):
    """Under torch.compile every Triton-backed op stays one opaque op (docs in _registry.py):
    AOTAutograd does not decompose it into kernel launches, which cost Triton-IR analysis per
    call and per-call-site kernel compiles (the GPU compile of a 16-block Llama stalled on
    them). The compiled step then runs eager's kernels, so it gives eager's bits under plain
    torch.compile, with no Inductor options. Runs the kernels in Triton's interpreter."""
    from torch._inductor import config as inductor_config

    from blockscale.gemm import dispatch

    targets: list[str] = []

    def record(graph: torch.fx.Graph) -> None:  # the post-grad graphs Inductor lowers
        targets.extend(str(n.target) for n in graph.nodes if n.op == "call_function")

    recipe = recipes.get("nvfp4", stochastic_rounding=False)
    # Fused or not, the GEMMs are opaque emulated_gemm ops (an FP32 output, grad_weight of the
    # FP32 weights, is cuBLAS's accumulator scaled in place inside the op).
    monkeypatch.setattr(dispatch, "FUSED_GEMM", fused_gemm)
    torch.manual_seed(0)
    model = bsnn.convert(MLP(), recipe)
    x = torch.randn(2, 32, 64)
    go = torch.randn(2, 32, 64)
    results = []
    with inductor_config.patch(post_grad_custom_post_pass=record):
        for fn in (model, torch.compile(model, fullgraph=True)):
            model.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            y = fn(xi)
            y.backward(go)
            results.append([y, xi.grad, model.up.weight.grad, model.down.weight.grad])
    assert any("blockscale.nvfp4_quantize_2d" in t for t in targets), targets
    assert not [t for t in targets if "triton_kernel_wrapper" in t], targets
    for name, e, c in zip(["output", "grad_input", "up.grad_weight", "down.grad_weight"],
                          results[0], results[1]):  # fmt: skip
        assert torch.equal(e, c), f"{name} differs: max {(e - c).abs().max().item():.3g}"


def test_kernel_path_stores_an_activation_the_amax_and_quantize_ops_share_once(
    kernel_path_on_cpu,
):
    """amax_2d and nvfp4_quantize_2d read the same activation; where it is a cheap pointwise
    node (a cast), Inductor stored one copy for each op while they required the traced
    strides: the backward cast of the FP32 residual gradient to a BF16 grad_output was written
    twice, on an H100 once by a kernel of its own (blockscale/_registry.py, "Input layouts").
    Both ops must read one buffer: here the forward's `x * 2` and, under BF16 autocast, the
    backward's cast of the FP32 residual gradient."""
    import re

    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = bsnn.convert(
        nn.Sequential(nn.Linear(64, 64, bias=False)),
        recipes.get("nvfp4", stochastic_rounding=False),
    )
    compiled = torch.compile(lambda x: x + model(x * 2), fullgraph=True)

    def step():
        x = torch.randn(2, 32, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = compiled(x)
        y.float().square().sum().backward()

    # Inductor's FX graph cache does not key on the ops' tags: a graph cached before they
    # changed would come back with its old code
    with inductor_config.patch(force_disable_caches=True):
        _, codes = run_and_get_code(step)
    assert len(codes) == 2, len(codes)  # forward and backward
    for code in codes:
        calls = re.findall(
            r"blockscale\.(amax_2d|nvfp4_quantize_2d)\.default\((?:reinterpret_tensor\()?(\w+)",
            code,
        )
        activations = [
            arg for op, arg in calls if op == "amax_2d" and not arg.startswith("primals")
        ]
        quantized = {arg for op, arg in calls if op == "nvfp4_quantize_2d"}
        assert activations, calls
        assert set(activations) <= quantized, calls


def _strides_in_code(code: str, name: str) -> tuple[int, ...]:
    """The strides the generated wrapper `code` gives buffer `name`: where it is allocated,
    asserted after an extern call, or taken over from another buffer (`# reuse`)."""
    import re

    n = re.escape(name)
    for pattern in (
        rf"\b{n} = empty_strided_\w+\(\([\d, ]*\), \(([\d, ]*)\)",
        rf"assert_size_stride\({n}, \([\d, ]*\), \(([\d, ]*)\)",
        rf"\b{n} = reinterpret_tensor\(\w+, \([\d, ]*\), \(([\d, ]*)\)",
    ):
        found = re.search(pattern, code)
        if found:
            return tuple(int(s) for s in found.group(1).replace(" ", "").split(",") if s)
    found = re.search(rf"\b{n} = (\w+); del \1  # reuse", code)
    assert found, f"no layout for {name}"
    return _strides_in_code(code, found.group(1))


def test_kernel_path_moe_layer_reads_each_grouped_input_once_row_major(kernel_path_on_cpu):
    """The grouped amax and quantize ops read the same input: the gathered tokens (a gather
    and a cast), the SwiGLU output, grad_output, and the experts' weights cast to BF16 under
    autocast. Untagged, Inductor stored the tokens and each cast weight once per op; tagged
    `flexible_layout` while models/moe.py cast the transposed weight view, it stored that cast
    [E, K, N]-major and handed both ops [E*N, K] weight rows with strides (1, E*N), which the
    kernels read along K (a transposed copy, three stores; slower on an H100: docs/LOG.md).
    Every grouped op must read one buffer per input, with its last stride 1."""
    import re

    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from blockscale.models.moe import MoE, MoEConfig

    cfg = MoEConfig(dim=64, n_layers=1, n_heads=1, ffn_dim=64, seq_len=32, n_experts=4, top_k=2)
    torch.manual_seed(0)
    layer = bsnn.convert(MoE(cfg), recipes.get("nvfp4", stochastic_rounding=False))
    compiled = torch.compile(layer)

    def step():
        x = torch.randn(32, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = compiled(x)
        y.float().square().sum().backward()

    with inductor_config.patch(force_disable_caches=True):  # the FX cache ignores op tags
        _, codes = run_and_get_code(step)
    assert len(codes) == 2, len(codes)  # forward and backward
    arg = r"(?:reinterpret_tensor\((\w+), \([\d, ]*\), \(([\d, ]*)\), \d+\)|(\w+))"
    weights_seen = 0
    for code in codes:
        calls = re.findall(
            rf"blockscale\.(group_amax_2d|nvfp4_quantize_grouped_2d)\.default\({arg}, (\w+)",
            code,
        )
        amax_inputs = [(view or buf) for op, view, _, buf, _ in calls if op == "group_amax_2d"]
        quantized = {(view or buf) for op, view, _, buf, _ in calls if op != "group_amax_2d"}
        assert amax_inputs, calls
        assert set(amax_inputs) <= quantized, calls  # one buffer for both ops
        for _, view, strides, buf, source in calls:
            last = int(strides.split(",")[-1]) if view else _strides_in_code(code, buf)[-1]
            assert last == 1, (view or buf, strides, calls)
            weights_seen += source == "None"  # expert weight rows: no token layout
    assert weights_seen >= 4, weights_seen  # gate_up and down, amax and quantize


def test_tracing_the_kernel_lookup_does_not_trace_a_cache_wrapper(kernel_path_on_cpu):
    """`_library.kernels()` is called inside traced code on the kernel path; a functools.cache
    there made Dynamo warn that it traces through the wrapper, on every compile."""
    import warnings

    model = bsnn.convert(MLP(), recipes.get("mxfp8"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, fullgraph=True, backend="eager")(torch.randn(2, 32, 64))
    assert not [w for w in caught if "lru_cache" in str(w.message)]


TRACE_WITH_JIT_KERNELS = """
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import blockscale.nn as bsnn
from blockscale import _library, recipes
from blockscale.models.moe import MoE, MoEConfig

_library.use_kernels = lambda t: True
assert type(_library.kernels().nvfp4._nvfp4_quantize_kernel).__name__ == "JITFunction"
counts = []


def record(gm, example_inputs):
    counts.append(sum("blockscale." in str(n.target) for n in gm.graph.nodes))
    raise RuntimeError("traced")


layers = {
    "mlp": nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)),
    "moe": MoE(MoEConfig(dim=64, n_layers=1, n_heads=1, ffn_dim=64, seq_len=32, n_experts=4,
                         top_k=2)),
}
for name, layer in layers.items():
    torch._dynamo.reset()
    bsnn.convert(layer, recipes.get("nvfp4", stochastic_rounding=False))
    try:
        torch.compile(layer, fullgraph=True, backend=aot_autograd(fw_compiler=record))(
            torch.randn(64, 64, requires_grad=True)
        )
    except Exception as e:
        if "traced" not in str(e):
            raise
    print(name, counts[-1])
"""


def test_kernel_path_traces_with_triton_jit_kernels():
    """What the GPU traces, traced on the CPU: Dynamo and AOTAutograd over a converted MLP and
    a converted MoE layer (experts through their nonstrict_trace call) on the kernel path,
    with the real wrap_triton and jit (not interpreted) kernels, up to the compiler, which
    stops there (nothing runs). Catches what only a GPU compile would show, e.g. a real
    tensor a kernel wrapper passes to its launch under FakeTensorMode (the Hadamard matrix:
    "Please convert all Tensors to FakeTensors first" on torch 2.13, in Dynamo for the dense
    layers and in AOTAutograd for the experts). A subprocess: this session's kernels are
    interpreted ones, which wrap_triton refuses."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", TRACE_WITH_JIT_KERNELS],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = dict(line.split() for line in done.stdout.splitlines())
    assert int(counts["mlp"]) > 0 and int(counts["moe"]) > 0, done.stdout


def test_library_ops_dispatch_without_python_wrappers():
    """A compiled step calls blockscale's ops through the dispatcher ~900 times (a 1B Llama).
    custom_op and triton_op put Python kernels in that path (Autograd, and ADInplaceOrView for
    ops that write an argument): 20-40 us a call on an H100 host. Each op is registered with
    one CompositeExplicitAutograd kernel and a fake impl, nothing else."""
    import blockscale.gemm.dispatch  # noqa: F401  (modules that register ops on import)
    import blockscale.kernels.gemm  # noqa: F401
    import blockscale.kernels.grouped_gemm  # noqa: F401
    import blockscale.kernels.master_cast  # noqa: F401

    has = torch._C._dispatch_has_kernel_for_dispatch_key
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("blockscale::")]
    # The unquantized experts' grouped GEMM under a trace (nn/experts.py,
    # `_high_precision_grouped_mm`) is a custom_op with its own autograd formula on purpose:
    # autograd must see it, and it runs only where nothing is quantized, not in the kernels'
    # ~900 calls a step that this test is about.
    high_precision = "blockscale::grouped_mm_high_precision"
    assert high_precision in names, names
    names = [n for n in names if not n.startswith(high_precision)]
    assert {"blockscale::nvfp4_quantize_2d", "blockscale::gemm_fused"} <= set(names), names
    for name in names:
        assert has(name, "CompositeExplicitAutograd"), name
        assert not has(name, "Autograd") and not has(name, "ADInplaceOrView"), name


def _dynamo_graphs(model, x):
    """The FX graphs Dynamo hands its backend (before AOTAutograd), from one compiled step."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, fullgraph=True, backend=backend)(x).square().sum().backward()
    return graphs


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_dynamo_does_not_trace_into_converted_linears(kernel_path_on_cpu, name):
    """A converted nn.Linear is one opaque nonstrict_trace call in Dynamo's graph, so Dynamo
    interprets none of the quantization's Python per layer: that was ~7,000 bytecode
    instructions per NVFP4 layer, most of a converted Llama's extra compile time (docs/LOG.md,
    2026-11-25). Caught here by what Dynamo's graph holds: one flat_apply per converted layer
    and none of blockscale's ops (they appear in AOTAutograd's graph, see
    test_kernel_path_traces_with_triton_jit_kernels), in one graph with no recompile."""
    from torch._dynamo.utils import counters

    counters.clear()
    model = bsnn.convert(MLP(), recipes.get(name))
    graphs = _dynamo_graphs(model, torch.randn(2, 32, 64, requires_grad=True))
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("flat_apply" in t for t in targets) == 2, targets
    assert not [t for t in targets if "blockscale" in t], targets
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_linear_follows_a_new_recipe():
    """The recipe reaches the opaque call as a constant that Dynamo does not look into;
    assigning another recipe must recompile rather than replay the old one."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = bsnn.convert(MLP(), recipes.get("nvfp4", stochastic_rounding=False))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 32, 64)
    assert torch.equal(compiled(x), model(x))
    for layer in (model.up, model.down):
        layer.recipe = recipes.get("mxfp8")
    expected = model(x)
    assert torch.equal(compiled(x), expected)
    torch._dynamo.reset()


def test_kernel_path_graph_has_no_functionalized_mutation(kernel_path_on_cpu):
    """Every op a converted linear puts into AOTAutograd's graph is functional (the default
    fused GEMM included): an op that writes into an argument comes out wrapped in
    auto_functionalized, which Inductor then reinplaces and decomposes, at a compile-time
    cost per call (docs/LOG.md, 2026-11-25)."""
    from torch._dynamo.backends.common import aot_autograd

    targets: list[str] = []

    def record(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    model = bsnn.convert(MLP(), recipes.get("nvfp4", stochastic_rounding=False))
    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    torch.compile(model, fullgraph=True, backend=backend)(
        torch.randn(2, 32, 64, requires_grad=True)
    ).square().sum().backward()
    assert any("blockscale.emulated_gemm" in t for t in targets), targets
    assert not [t for t in targets if "auto_functionalized" in t], targets


@pytest.mark.parametrize("recompute", [True, False], ids=["weight-recomputed", "weight-saved"])
def test_compiled_backward_rebuilds_the_weight_operand(kernel_path_on_cpu, recompute, monkeypatch):
    """ops/linear.py, "Memory": what a compiled step keeps for its backward is what
    AOTAutograd's partitioner (Inductor's, here) chooses. The weights are graph inputs, so
    taking them into the backward costs nothing: its graph quantizes each weight again and
    takes no packed weight copy, only the inputs' token copies. With RECOMPUTE_WEIGHT off it
    takes the 16x16 weight codes instead."""
    import importlib

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    monkeypatch.setattr(importlib.import_module("blockscale.ops.linear"), "RECOMPUTE_WEIGHT",
                        recompute)  # fmt: skip
    inputs: set[tuple[torch.dtype, tuple[int, ...]]] = set()

    def record(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "placeholder" and isinstance(v := n.meta.get("val"), torch.Tensor):
                inputs.add((v.dtype, tuple(v.shape)))
        return gm

    model = bsnn.convert(MLP(), recipes.get("nvfp4", stochastic_rounding=False))
    backend = aot_autograd(
        fw_compiler=lambda gm, _: gm,
        bw_compiler=record,
        partition_fn=min_cut_rematerialization_partition,
    )
    # 96 tokens: the token copies' codes ([64, 48], [128, 48]) and the 16x16 weights' codes
    # ([128, 32], [64, 64]) differ in shape
    torch.compile(model, fullgraph=True, backend=backend)(
        torch.randn(3, 32, 64, requires_grad=True)
    ).square().sum().backward()
    weights = {(torch.float32, (128, 64)), (torch.float32, (64, 128))}
    weight_codes = {(torch.uint8, (128, 32)), (torch.uint8, (64, 64))}
    assert {(torch.uint8, (64, 48)), (torch.uint8, (128, 48))} <= inputs, inputs
    if recompute:
        assert weights <= inputs and not weight_codes & inputs, inputs
    else:
        assert weight_codes <= inputs and not weights & inputs, inputs


def test_inductor_backward_rebuilds_the_weight_dq_instead_of_keeping_the_forwards(
    kernel_path_on_cpu,
):
    """What users compile: FP32 masters under BF16 autocast, plain torch.compile (Inductor).
    Inductor's joint-graph passes drop the detach on the saved amax, so a backward rebuild
    that were the forward's own call again (same op, weight, amax and flags) would be merged
    with it by the partitioner's CSE, and the compiled step would keep each weight's BF16
    `_dq` from forward to backward: on an H200 all 98 of llama-1b's, 1.18 GiB at the peak
    (docs/MODELS.md). The rebuild writes the `_dq` alone, a call of its own: the backward
    quantizes each weight again, nothing of the weight's shape is saved, and the bits are
    eager's."""
    from torch._inductor import config as inductor_config

    weight_shapes = {(128, 64), (64, 128)}
    saved: list[tuple[torch.dtype, tuple[int, ...]]] = []
    rebuilds: list[tuple[int, ...]] = []

    def record(graph: torch.fx.Graph) -> None:  # the post-grad graphs Inductor lowers
        names = [n.name for n in graph.nodes if n.op == "placeholder"]
        if not any(name.startswith("tangents") for name in names):
            return  # the forward
        for n in graph.nodes:
            if n.op == "call_function" and "nvfp4_quantize_2d" in str(n.target):
                rebuilds.append(tuple(n.args[0].meta["val"].shape))

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.dtype, tuple(t.shape)))
        return t

    torch.manual_seed(0)
    # (round-to-nearest throughout: eager and compiled draw no rounding noise to compare)
    model = bsnn.convert(MLP(), recipes.get("nvfp4", stochastic_rounding=False))
    x = torch.randn(3, 32, 64)
    results = []
    with inductor_config.patch(post_grad_custom_post_pass=record):
        for fn in (model, torch.compile(model, fullgraph=True)):
            model.zero_grad(set_to_none=True)
            saved.clear()
            xi = x.clone().requires_grad_(True)
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
                y = fn(xi)
            y.float().square().sum().backward()
            results.append([y, xi.grad, model.up.weight.grad, model.down.weight.grad])
    # (the backward also quantizes the two grad_outputs, [96, 64] and [96, 128])
    assert sorted(s for s in rebuilds if s in weight_shapes) == sorted(weight_shapes), rebuilds
    kept = [(d, s) for d, s in saved if s in weight_shapes or s[::-1] in weight_shapes]
    assert all(d == torch.float32 for d, _ in kept), kept  # the parameters, nothing cast
    for name, e, c in zip(["output", "grad_input", "up.grad_weight", "down.grad_weight"],
                          *results):  # fmt: skip
        assert torch.equal(e, c), name


def test_dynamic_shapes_compile_gives_eager_bits():
    """dynamic=True: token counts that are and are not a multiple of the block, each with
    eager's bits. Dynamo's own trace of the autograd.Function failed here on torch 2.13
    (AssertionError: lift_tracked_freevar_to_input should not be called on root
    SubgraphTracer); AOTAutograd traces it with symbolic shapes through the nonstrict call."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = bsnn.convert(MLP(), recipes.get("nvfp4", stochastic_rounding=False))
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    for tokens in (32, 40, 7):
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
        results = []
        for fn in (model, compiled):
            model.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            y = fn(xi)
            y.square().sum().backward()
            results.append([y, xi.grad, model.up.weight.grad, model.down.weight.grad])
        for e, c in zip(*results):
            assert torch.equal(e, c), tokens
    torch._dynamo.reset()
