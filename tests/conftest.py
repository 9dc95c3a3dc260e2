"""Test-wide setup: the two tiers, and Triton's interpreter on a machine without a GPU.

Two tiers, so that a user learns in minutes that the install works, and CI still runs every
test. `python -m pytest -q` (the README's command: no test path named, so pytest collects
`testpaths`) runs the fast tier: the install and the core numerics, FAST_FILES whole and the
FAST_TESTS functions of files whose other tests are Triton-interpreter kernel sweeps or compile
tests. `python -m pytest -q --tier rest` runs every other test (kernel sweeps, compile tests,
research tools, distributed on gloo, the CLI's robustness), and `.ci/run` runs it after the
fast tier, so together they run every test once; `--tier all` runs both in one process.
Naming files, folders or node ids runs what they hold, whatever its tier. The tests the
chosen tier leaves out are deselected, never skipped, and the summary says how to run them.
tests/test_tiers.py checks that every name below still names a test.

Without a GPU the Triton kernels run in Triton's interpreter; the switch is read when a
kernel is defined, so it has to be set here, before any test imports blockscale.kernels.
"""

import os

# AOTAutograd's check that a library op's output is not one of its inputs only warns unless
# the variable CI is set, where it raises: make every run (and the ranks the distributed tests
# spawn, which inherit the environment) as strict as CI's. It is read when torch is imported.
os.environ.setdefault("TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fold_along_axis(self, input):
    """Triton's interpreter reduces with a custom combine function (the kernels' max_keep_nan)
    one element at a time in Python: most of the interpreted kernel tests' time. A combine
    function is elementwise, so the same left fold, acc = combine(acc, x[i]) for i = 1, 2, ...,
    applied to whole slices along the axis gives the same values in the same order; this is
    `ReduceOps.generic_reduce` (Triton 3.6) with that loop vectorized."""
    import numpy as np
    import triton.language as tl

    if any(arg.handle.data.size == 0 for arg in input):
        return _generic_reduce(self, input)
    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    input_data = [arg.handle.data for arg in input]
    input_shape = input_data[0].shape
    acc = [np.asarray(np.take(d, 0, axis=axis)) for d in input_data]
    for i in range(1, input_shape[axis]):
        acc_tuple = tuple(self.to_tensor(a, arg.dtype) for a, arg in zip(acc, input))
        input_tuple = tuple(
            self.to_tensor(np.take(d, i, axis=axis), arg.dtype) for d, arg in zip(input_data, input)
        )
        ret = self.combine_fn.fn(*acc_tuple, *input_tuple)
        ret = ret if isinstance(ret, tuple) else (ret,)
        acc = [
            _like(r.handle.data if isinstance(r, tl.core.tensor) else r, a)
            for r, a in zip(ret, acc)
        ]
    out = []
    for data, arg in zip(acc, input):
        data = np.asarray(data)
        if self.keep_dims:
            if original_axis is not None:
                data = np.expand_dims(data, axis)
            else:
                for _ in range(len(input_shape)):
                    data = np.expand_dims(data, 0)
        elif original_axis is None:
            data = data.item()
        out.append(self.to_tensor(data, arg.dtype))
    return out


def _like(value, acc):
    """`value` (a combine function's result) as an array of acc's shape and dtype, as the
    original's store into its output array casts it."""
    import numpy as np

    value = np.asarray(value)
    if value.size != acc.size:
        value = np.broadcast_to(value, acc.shape)
    return value.reshape(acc.shape).astype(acc.dtype)


# The language modules each running interpreted launch has patched (a stack: None until the
# launch's own patch is in place).
_launch_langs: list[frozenset | None] = []


def _langs(fn) -> frozenset:
    """What `_patch_lang(fn)` patches: the triton.language modules fn's globals name."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def _patch_lang_once(fn):
    """Triton's interpreter patches triton.language again on every device-function call
    (`InterpretedFunction.__call__`), though the launch around it has patched the same modules:
    each builtin it finds is already replaced and left alone, the rest is set to equal
    closures, and its scope is never restored. Inside a launch that already covers fn's
    modules it is skipped; anywhere else it runs as before."""
    if _launch_langs and _launch_langs[-1] is not None and _langs(fn) <= _launch_langs[-1]:
        return _interpreter._LangPatchScope()
    scope = _patch_lang(fn)
    if _launch_langs and _launch_langs[-1] is None:
        _launch_langs[-1] = _langs(fn)
    return scope


def _launch(self, *args, **kwargs):
    _launch_langs.append(None)
    try:
        return _grid_call(self, *args, **kwargs)
    finally:
        _launch_langs.pop()


_generic_reduce = _patch_lang = _grid_call = None
if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        from triton.runtime import interpreter as _interpreter
    except ImportError:
        pass
    else:
        # checked against this version's interpreter (pyproject.toml pins it for the tests)
        if triton.__version__ == "3.6.0":
            _generic_reduce = _interpreter.ReduceOps.generic_reduce
            _interpreter.ReduceOps.generic_reduce = _fold_along_axis
            _patch_lang = _interpreter._patch_lang
            _interpreter._patch_lang = _patch_lang_once
            _grid_call = _interpreter.GridExecutor.__call__
            _interpreter.GridExecutor.__call__ = _launch


# The fast tier, by file: the formats bit for bit, the linear layer's autograd, convert, the
# recipes and models, a tiny CLI and training run, and the docs' snippets.
FAST_FILES = frozenset(
    {
        "test_e2m1.py",
        "test_nvfp4.py",
        "test_mxfp8.py",
        "test_swizzle.py",
        "test_native_layout.py",
        "test_emulated_gemm.py",
        "test_properties.py",
        "test_linear.py",
        "test_recipes.py",
        "test_convert.py",
        "test_models.py",
        "test_import_layers.py",
        "test_data.py",
        "test_train.py",
        "test_cli.py",
        "test_docs.py",
        "test_doctests.py",
        "test_robust_readme.py",
        "test_code_size.py",
    }
)
# The fast tier's functions (every parametrization) of files whose other tests are kernel
# sweeps in the interpreter or compile tests: the grouped GEMM's autograd on the reference
# path, and convert on transformers models (dense Llama, MoE experts) that then train.
FAST_TESTS = {
    "test_grouped_mm.py": frozenset(
        {
            "test_bf16_recipe_is_torch_grouped_mm",
            "test_reference_path_equals_loop_of_linear",
            "test_nvfp4_output_is_a_quantization_of_the_bf16_product",
            "test_saves_only_packed_operands",
            "test_create_graph_keeps_the_first_derivatives_bit_for_bit",
            "test_second_derivatives_that_cannot_be_given_raise",
            "test_group_amax_propagates_nan_and_inf_per_group",
        }
    ),
    "test_convert_experts.py": frozenset(
        {
            "test_convert_routes_experts_and_leaves_parameters_alone",
            "test_converted_experts_equal_blockscale_grouped_mm_by_hand",
            "test_layer_policy_keeps_the_tail_blocks_experts_bf16",
            "test_unrouted_weights_warn_and_unsupported_calls_raise",
            "test_hf_experts_are_quantized_and_routers_untouched",
            "test_hf_set_precision_false_is_the_unconverted_model",
            "test_hf_trains_with_adamw",
        }
    ),
    "test_hf_llama.py": frozenset(
        {
            "test_layer_policy_keeps_head_embeddings_and_tail_block_bf16",
            "test_converted_llama_trains",
            "test_converted_linears_save_only_packed_operands",
        }
    ),
    "test_tiers.py": frozenset({"test_every_fast_tier_name_names_a_test"}),
}
TIERS = ("fast", "rest", "all")
_deselected = pytest.StashKey[int]()


def in_fast_tier(item) -> bool:
    name = item.path.name
    return name in FAST_FILES or item.originalname in FAST_TESTS.get(name, ())


def tier(config) -> str:
    """The tier to run: --tier, else the fast one when no test path was named."""
    chosen = config.getoption("tier")
    if chosen is not None:
        return chosen
    return "fast" if config.args_source == pytest.Config.ArgsSource.TESTPATHS else "all"


def pytest_addoption(parser):
    parser.addoption(
        "--tier",
        choices=TIERS,
        default=None,
        help="fast: the README's tests, the default when no test path is named; rest: every "
        "other test (.ci/run runs it after the fast tier); all: both",
    )


def pytest_collection_modifyitems(config, items):
    chosen = tier(config)
    if chosen != "all":
        keep = [item for item in items if in_fast_tier(item) == (chosen == "fast")]
        dropped = [item for item in items if in_fast_tier(item) != (chosen == "fast")]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
        config.stash[_deselected] = len(dropped)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu); run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, config):
    dropped = config.stash.get(_deselected, 0)
    if dropped:
        other = "rest" if tier(config) == "fast" else "fast"
        terminalreporter.write_line(
            f"{tier(config)} tier: the other {dropped} tests run with "
            f"`python -m pytest -q --tier {other}` (.ci/run runs both)"
        )


@pytest.fixture(scope="module")
def one_cpu_thread():
    """tiny's matrices are too small to gain from a second thread, and two OpenMP threads slow
    down several times over when another process shares the cores: train on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
