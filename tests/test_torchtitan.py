"""blockscale's torchtitan converters (blockscale/integrations/titan/) on torchtitan's own debug
models, built as its trainer builds them (meta device, then `to_empty` and its weight init):
torchtitan 0.3.x (DeepSeek-V3, Qwen3 MoE, Llama 3, gpt-oss) through `v0_3`, 0.2.2 (Llama 4,
DeepSeek-V3; gpt-oss in tests/test_titan_gpt_oss.py) through `v0_2`. One torchtitan is
installed at a time, so each version's tests skip, saying why, under the other (.ci/run
installs each in turn; docs/TORCHTITAN.md).

Exact comparisons are against `blockscale.nn.convert` (or blockscale's ops) on the same weights:
MXFP8, whose rounding is always to nearest, forward and gradients; NVFP4's forward (its default
recipe rounds gradients stochastically).
"""

import functools
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import pytest
import torch
import torch.nn.functional as F

import blockscale as bs
import blockscale.nn as bsnn
from blockscale import recipes

try:
    TITAN = version("torchtitan") if importlib.util.find_spec("torchtitan") else None
except PackageNotFoundError:  # importable from a source tree without its metadata
    TITAN = None
TITAN_MINOR = tuple(int(part) for part in TITAN.split(".")[:2]) if TITAN else None

needs_v0_3 = pytest.mark.skipif(
    TITAN_MINOR is None or TITAN_MINOR < (0, 3),
    reason=f"the torchtitan 0.3.x converter needs torchtitan 0.3.x (installed: {TITAN})",
)
needs_v0_2 = pytest.mark.skipif(
    TITAN_MINOR != (0, 2),
    reason=f"the torchtitan 0.2.2 converter needs torchtitan 0.2.x (installed: {TITAN})",
)
VOCAB = 2048  # every debug model's
STEPS = 4


def batch(seed=0, length=65):
    tokens = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def train(model, steps=STEPS, lr=8e-4):
    """A few AdamW steps on one batch (the debug configs' learning rate): the losses."""
    inputs, labels = batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def assert_trains(losses):
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.05, losses


def assert_same_training_step(model, reference):
    """The same logits and gradients bit for bit, computed on one intra-op
    thread: with two, torchtitan 0.3.0's own unconverted Qwen3 MoE debug model gave other
    gradient bits on one backward in four of the same inputs (CPU, torch 2.13), and the test
    failed one run in two; on one thread six backwards were equal."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _same_training_step(model, reference)
    finally:
        torch.set_num_threads(threads)


def _same_training_step(model, reference):
    inputs, _ = batch(seed=1)
    out, expected = model(inputs), reference(inputs)
    assert torch.equal(out, expected)
    out.float().square().mean().backward()
    expected.float().square().mean().backward()
    theirs = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None or theirs[name].grad is not None:
            assert torch.equal(p.grad, theirs[name].grad), name


def dense_attention(q, k, v, allowed, scale=None):
    """Softmax attention in FP32 on (B, N, L, H) queries and keys / values of N or fewer heads
    (grouped-query: each key / value head repeated), each query attending to the keys that
    `allowed` [L, L] marks: the output in the queries' dtype and its log-sum-exp [B, N, L].
    gpt-oss's stand-in for its varlen / flex attention (`dense_attention_v0_3`,
    `DenseFlexAttentionV0_2`): attention is not under test, its sinks are (they rescale the
    output by the log-sum-exp)."""
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ v.float()).to(q.dtype), scores.logsumexp(-1)


def window_mask(length, window_size):
    """[L, L]: which keys each query attends to under a varlen `window_size` (left, right),
    -1 for no bound."""
    offset = torch.arange(length)[:, None] - torch.arange(length)[None, :]  # query - key
    left, right = window_size
    allowed = torch.ones(length, length, dtype=torch.bool)
    if left >= 0:
        allowed &= offset <= left
    if right >= 0:
        allowed &= offset >= -right
    return allowed


def test_importing_blockscale_and_the_policy_imports_no_torchtitan():
    """The integration is optional: blockscale and the version-free policy import without
    torchtitan; only a version's module imports it."""
    code = (
        "import sys, blockscale, blockscale.nn, blockscale.integrations.titan; "
        "assert 'torchtitan' not in sys.modules, 'torchtitan imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_titan_policy_names():
    from blockscale.integrations.titan import titan_policy

    policy = titan_policy([str(i) for i in range(6)])  # 15% of 6 rounds to 1: layers.5
    assert policy(None, "layers.0.attention.wq") and policy(None, "layers.4.moe.experts")
    assert not policy(None, "layers.5.feed_forward.w1") and not policy(None, "layers.5.moe")
    assert not policy(None, "layers.1.moe.router.gate")
    assert not policy(None, "output") and not policy(None, "lm_head")
    only = titan_policy([str(i) for i in range(6)], fqns=["layers"], bf16_fqns=["wkv_b"])
    assert only(None, "layers.5.attention.wq")  # an explicit list replaces the tail rule
    assert not only(None, "layers.0.attention.wkv_b") and not only(None, "output")
    assert not only(None, "layers.2.moe.router.gate")  # routers stay BF16 whatever the list


# torchtitan 0.3.x: the converter on the model config, before the meta build.

MODELS_V0_3 = [
    ("deepseek_v3", "debugmodel"),
    ("qwen3", "debugmodel_moe"),
    ("llama3", "debugmodel"),
    ("gpt_oss", "debugmodel"),
]


# torchtitan 0.3.0's gpt-oss experts return BF16 whatever their input (torchtitan's own
# `GroupedExperts` return the input's dtype), which its token combine scatters into a tensor of
# the input's dtype: with FP32 activations torchtitan's own model fails there ("scatter():
# Expected self.dtype to be equal to src.dtype"). Built with BF16 weights, as under FSDP2's
# BF16 mixed precision.
BF16_WEIGHTS_V0_3 = {"gpt_oss"}


@functools.cache
def dense_attention_v0_3():
    """A torchtitan 0.3 inner attention computing `dense_attention` under a varlen config's
    causal window, its output through the caller's `out_transform` (gpt-oss's sinks), as
    `VarlenAttention` gives it: gpt-oss's stand-in for varlen attention, which PyTorch runs
    on CUDA only, from metadata the trainer builds (a model called on tokens alone has none)."""
    from torchtitan.protocols.module import Module

    class DenseAttention(Module):
        @dataclass(kw_only=True, slots=True)
        class Config(Module.Config):
            window_size: tuple[int, int] = (-1, 0)

        def __init__(self, config):
            super().__init__()
            self.window_size = config.window_size

        def forward(self, q, k, v, *, scale=None, out_transform=None, **kwargs):
            allowed = window_mask(q.shape[1], self.window_size)
            qkv = (t.transpose(1, 2) for t in (q, k, v))  # (B, L, N, H) -> (B, N, L, H)
            out, lse = dense_attention(*qkv, allowed, scale)
            out, lse = out.transpose(1, 2), lse.transpose(1, 2)
            return out if out_transform is None else out_transform(out, lse)

    return DenseAttention


def build_v0_3(name, flavor, converter=None, seed=0, parallelism=None, parallelize=None):
    """torchtitan's model, built as its trainer builds it, with SDPA in place of FlexAttention
    (whose backward PyTorch does not implement on the CPU) and `dense_attention_v0_3` in place
    of varlen attention (gpt-oss's; CUDA only): attention is not under test.
    As the trainer, where given: the model config's `update_from_config` with `parallelism` (a
    `ParallelismConfig`; it sets the modules' sharding configs), and `parallelize(model)` on
    the meta model (the distributed tests)."""
    import importlib
    from types import SimpleNamespace

    from torchtitan.models.common.attention import (
        FlexAttention,
        ScaledDotProductAttention,
        VarlenAttention,
    )

    registry = importlib.import_module(f"torchtitan.models.{name}").model_registry
    config = registry(flavor, converters=None if converter is None else [converter]).model
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    for _, cfg, parent, attr in list(config.traverse(VarlenAttention.Config)):
        setattr(parent, attr, dense_attention_v0_3().Config(window_size=cfg.window_size))
    if parallelism is not None:
        config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = config.build()
    model.verify_module_protocol()  # what the trainer checks of every submodule
    if parallelize is not None:
        model = parallelize(model)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    if name in BF16_WEIGHTS_V0_3:
        model.to(torch.bfloat16)
    return model


@needs_v0_3
@pytest.mark.parametrize(("name", "flavor"), MODELS_V0_3)
def test_v0_3_converter_converts_by_the_policy_and_trains(name, flavor):
    from torchtitan.models.common.linear import Linear, ScaledBiasRowwiseLinear
    from torchtitan.models.common.moe import GroupedExperts

    from blockscale.integrations.titan.v0_3 import BlockscaleConverter, BlockscaleLinear

    model = build_v0_3(name, flavor, BlockscaleConverter.Config(recipe="nvfp4"))
    tail = str(len(model.layers) - 1)  # every debug model here: 15% of its blocks is one
    for fqn, module in model.named_modules():
        block = fqn.split(".")[1] if fqn.startswith("layers.") else None
        if isinstance(module, Linear | BlockscaleLinear):
            quantized = block not in (None, tail) and not fqn.endswith("router.gate")
            # gpt-oss's attention output: a forward of its own (a bias scaled by the TP degree)
            quantized &= not isinstance(module, ScaledBiasRowwiseLinear)
            assert isinstance(module, BlockscaleLinear) == quantized, fqn
            assert not quantized or module.recipe.name == "nvfp4"
        if isinstance(module, GroupedExperts):
            assert type(module).__name__.startswith("Blockscale") == (block != tail), fqn
    # at the least, gpt-oss's: one fused qkv in each of the 3 blocks converted
    assert sum(isinstance(m, BlockscaleLinear) for m in model.modules()) >= 3
    assert_trains(train(model))


@needs_v0_3
@pytest.mark.parametrize(("name", "flavor"), MODELS_V0_3)
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_v0_3_converted_model_equals_blockscale_convert(name, flavor, recipe):
    """The config converter's layers compute what `blockscale.nn.convert` makes of torchtitan's
    own model with the same policy and weights: the same bits."""
    from blockscale.integrations.titan import titan_policy
    from blockscale.integrations.titan.v0_3 import BlockscaleConverter

    model = build_v0_3(name, flavor, BlockscaleConverter.Config(recipe=recipe))
    reference = build_v0_3(name, flavor, seed=1)
    reference.load_state_dict(model.state_dict())
    policy = titan_policy(list(reference.layers.keys()))
    bsnn.convert(reference, recipes.get(recipe), module_filter_fn=policy)
    if recipe == "mxfp8":
        assert_same_training_step(model, reference)
    else:
        inputs, _ = batch(seed=1)
        assert torch.equal(model(inputs), reference(inputs))


@needs_v0_3
def test_v0_3_override_import_converts_a_trainer_config():
    """`--override.imports blockscale.integrations.titan.v0_3.blockscale={...}` on torchtitan's
    own DeepSeek-V3 debug config: what the trainer's `apply_overrides` does with it."""
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    from blockscale.integrations.titan.v0_3 import BlockscaleLinear

    config = deepseek_v3_debugmodel()
    options = {"recipe": "mxfp8", "bf16_fqns": ["wkv_b"]}
    target = "blockscale.integrations.titan.v0_3.blockscale"
    apply_overrides(OverrideConfig(imports=[(target, options)]), config)
    model_config = config.model_spec.model
    linears = dict((fqn, cfg) for fqn, cfg, _, _ in model_config.traverse(Linear.Config))
    assert isinstance(linears["layers.0.attention.wq"], BlockscaleLinear.Config)
    assert linears["layers.0.attention.wq"].recipe == "mxfp8"
    assert not isinstance(linears["layers.0.attention.wkv_b"], BlockscaleLinear.Config)
    assert not isinstance(linears["lm_head"], BlockscaleLinear.Config)
    experts = [type(cfg) for _, cfg, _, _ in model_config.traverse(GroupedExperts.Config)]
    assert [t is GroupedExperts.Config for t in experts] == [False] * (len(experts) - 1) + [True]


@needs_v0_3
def test_v0_3_compiled_block_equals_eager():
    """torchtitan compiles each block with fullgraph=True: a converted DeepSeek-V3 MoE block
    (quantized linears and experts) compiles so on the CPU (aot_eager) and gives eager's
    output and gradients, stochastic rounding included (the same seed)."""
    from blockscale.integrations.titan.v0_3 import BlockscaleConverter

    model = build_v0_3("deepseek_v3", "debugmodel", BlockscaleConverter.Config(recipe="nvfp4"))
    block = model.layers["1"]
    assert type(block.moe.routed_experts.inner_experts).__name__ == "BlockscaleGroupedExperts"
    x = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    results = []
    for run in (block, compiled):
        torch.manual_seed(1)
        out = run(x, None, None)
        params = [p for p in block.parameters() if p.requires_grad]
        grads = torch.autograd.grad(out.square().mean(), params, allow_unused=True)
        results.append((out, grads))
    (eager, eager_grads), (out, grads) = results
    assert torch.equal(out, eager)
    for got, expected in zip(grads, eager_grads, strict=True):
        assert (got is None and expected is None) or torch.equal(got, expected)


@needs_v0_3
def test_v0_3_per_block_compile_compiles_each_kind_of_block_once():
    """torchtitan compiles block by block: converted blocks of one kind share one compiled
    graph, so a model of many blocks compiles no more than its kinds of block (the DeepSeek-V3
    debug model: a dense block, quantized MoE blocks, the BF16 tail's MoE block). A guard bound
    to each block (a recompile per block) would compile one graph per block and, past torch's
    recompile limit of 8, leave the rest of a deep model eager."""
    from torch._dynamo.utils import counters

    from blockscale.integrations.titan.v0_3 import BlockscaleConverter

    model = build_v0_3("deepseek_v3", "debugmodel", BlockscaleConverter.Config(recipe="mxfp8"))
    kinds = {tuple(type(m).__name__ for m in block.modules()) for block in model.layers.values()}
    assert len(model.layers) == 6 and len(kinds) == 3, kinds
    torch._dynamo.reset()
    counters.clear()
    for block in model.layers.values():
        block.compile(fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    model(tokens).float().square().mean().backward()
    assert counters["stats"]["unique_graphs"] == len(kinds)


# torchtitan 0.2.2: the registered ModelConverter on the built (meta) model.

MODELS_V0_2 = ["llama4", "deepseek_v3"]


@pytest.fixture
def histc_on_cpu(monkeypatch):
    """torchtitan 0.2.2's MoE router counts tokens with torch.histc on int64 expert indices,
    which PyTorch implements on CUDA only: counted from float indices here (the same counts)."""
    histc = torch.histc

    def counted(input, *args, **kwargs):
        return histc(input if input.is_floating_point() else input.float(), *args, **kwargs)

    monkeypatch.setattr(torch, "histc", counted)


def build_v0_2(name, args=(), seed=0, convert=True):
    """torchtitan 0.2.2's debug model with the converters its job config names, as its trainer
    builds it: on the meta device, converted, then `to_empty` and its weight init."""
    from torchtitan.config import ConfigManager

    import blockscale.integrations.titan.v0_2  # noqa: F401 (registers "blockscale")

    spec = importlib.import_module(f"torchtitan.models.{name}").get_train_spec()
    job_config = ConfigManager().parse_args(["--model.converters", "blockscale", *args])
    return build_v0_2_from(spec, job_config, seed=seed, convert=convert)


def unwrapped(name: str) -> str:
    """A parameter's name without activation checkpointing's wrapper (in parallelized models)."""
    return name.replace("._checkpoint_wrapped_module", "")


def copy_whole_into(parallel, reference) -> None:
    """The one-process `reference`'s weights into the parallelized `parallel`, each DTensor
    given its shard: torchtitan's init of a DTensor on CPU ranks draws each shard from the same
    seed, which would make the shards (and their amaxes) equal."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, p in parallel.named_parameters():
            whole = reference.get_parameter(unwrapped(name))
            if isinstance(p, DTensor):
                whole = distribute_tensor(whole, p.device_mesh, p.placements)
            p.copy_(whole)


def build_v0_2_from(
    spec, job_config, parallel_dims=None, seed=0, convert=True, configure=None, converters=None
):
    """`build_v0_2` on a train spec and job config already made, as the distributed tests
    need them: parallelized by torchtitan's own `parallelize_fn` where `parallel_dims` are
    given. `configure(model_args)` edits the debug config, `converters(built)` the built
    converters before they convert; `seed=None` leaves the random state as it is."""
    from torchtitan.protocols.model_converter import build_model_converters

    model_args = spec.model_args["debugmodel"]
    model_args.update_from_config(job_config)
    # which turns torch's grouped GEMM off without an SM90 GPU (the experts then loop in
    # Python, a path no converter reaches); blockscale's grouped GEMM runs on the CPU
    model_args.moe_args.use_grouped_mm = True
    if configure is not None:
        configure(model_args)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    if convert:
        built = build_model_converters(job_config, parallel_dims)
        if converters is not None:
            converters(built)
        built.convert(model)
    if parallel_dims is not None:
        model = spec.parallelize_fn(model, parallel_dims, job_config)
    model.to_empty(device="cpu")
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def block_of(fqn):
    """The block index of a torchtitan module name (`layers.<n>....`), or None outside them."""
    return fqn.split(".")[1] if fqn.startswith("layers.") else None


def assert_v0_2_linears_by_the_policy(model):
    """Every `nn.Linear` of a converted 0.2.2 model is a blockscale Linear where the policy
    converts (the blocks but the last, not the router gates) and only there; returns the last
    block's index."""
    from torch import nn

    tail = str(len(model.layers) - 1)
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear):
            quantized = block_of(fqn) not in (None, tail) and not fqn.endswith("router.gate")
            assert isinstance(module, bsnn.Linear) == quantized, fqn
    return tail


@needs_v0_2
@pytest.mark.usefixtures("histc_on_cpu")
@pytest.mark.parametrize("name", MODELS_V0_2)
def test_v0_2_converter_converts_by_the_policy_and_trains(name):
    from blockscale.integrations.titan.v0_2 import UnpaddedGroupedExperts

    model = build_v0_2(name)
    tail = assert_v0_2_linears_by_the_policy(model)
    for fqn, module in model.named_modules():
        if isinstance(module, UnpaddedGroupedExperts):
            recipes_of = {m.recipe.name for m in module.grouped_mms.values()}
            assert recipes_of == ({"bf16"} if block_of(fqn) == tail else {"nvfp4"}), fqn
    assert any(isinstance(m, UnpaddedGroupedExperts) for m in model.modules())
    assert_trains(train(model))


@needs_v0_2
@pytest.mark.usefixtures("histc_on_cpu")
@pytest.mark.parametrize("name", MODELS_V0_2)
def test_v0_2_converted_layers_equal_blockscale_ops(name):
    """Options from the job config's [blockscale] section (the custom config module), and the
    converted experts and linears computing blockscale's ops on the same weights, bit for bit:
    the experts without torchtitan's token-group padding."""
    from blockscale.integrations.titan.v0_2 import UnpaddedGroupedExperts

    args = ["--job.custom_config_module", "blockscale.integrations.titan.v0_2"]
    model = build_v0_2(name, [*args, "--blockscale.recipe", "mxfp8"])
    recipe = recipes.get("mxfp8")
    experts = next(m for m in model.modules() if isinstance(m, UnpaddedGroupedExperts))
    e, _, dim = experts.w1.shape
    counts = torch.tensor([5, 0, 17, 3] + [9] * (e - 4), dtype=torch.int64)[:e]
    x = torch.randn(int(counts.sum()), dim, generator=torch.Generator().manual_seed(0))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)

    def grouped(a, w):
        return bs.grouped_mm(a, w.bfloat16().transpose(-2, -1), offs, recipe)

    h = F.silu(grouped(x.bfloat16(), experts.w1)) * grouped(x.bfloat16(), experts.w3)
    assert torch.equal(experts(x, counts), grouped(h, experts.w2).type_as(x))
    linear = model.layers["0"].attention.wq
    assert isinstance(linear, bsnn.Linear) and linear.recipe.name == "mxfp8"
    x = torch.randn(8, linear.in_features)
    assert torch.equal(linear(x), bs.linear(x, linear.weight, linear.bias, recipe))


@needs_v0_2
@pytest.mark.usefixtures("histc_on_cpu")
def test_v0_2_no_weight_cache_holds_no_expert_copy_between_forward_and_backward():
    """BF16 weights (`--training.dtype bfloat16`), nvfp4: by default each converted experts
    weight's cache keeps its 16x16 copy from the second step's forward to its backward (the
    backward's rebuild counts as the copy made twice); `--blockscale.no_weight_cache` holds
    none, with the same losses (the bits do not depend on the cache)."""
    from blockscale.integrations.titan.v0_2 import HELD_AT

    def run(args):
        model = build_v0_2("llama4", ["--job.custom_config_module",
                                      "blockscale.integrations.titan.v0_2", *args])  # fmt: skip
        model.to(torch.bfloat16)
        gmms = [g for g in getattr(model, HELD_AT).modules() if isinstance(g, bsnn.GroupedMM)]
        held = []

        def forward_hook(module, args, output):
            held.append(sum(g.weight_cache.held_bytes() for g in gmms if g.weight_cache))

        handle = model.norm.register_forward_hook(forward_hook)  # after the last block
        losses = train(model, steps=2)
        handle.remove()
        return gmms, held, losses

    cached, held, losses = run([])
    assert all(g.weight_cache is not None for g in cached) and len(cached) == 9
    # kept from the second step: the packed copies of the 6 quantized weights (2 blocks' w1,
    # w2, w3 of 8 x 512 x 256: 4-bit codes, an E4M3 scale per 16 values, an FP32 amax an expert)
    values = 8 * 512 * 256
    assert held == [0, 6 * (values // 2 + values // 16 + 4 * 8)], held
    uncached, held_none, losses_none = run(["--blockscale.no_weight_cache"])
    assert all(g.weight_cache is None for g in uncached) and held_none == [0, 0]
    assert losses_none == losses


@needs_v0_2
@pytest.mark.usefixtures("histc_on_cpu")
def test_v0_2_converted_model_converts_again():
    """The converter keeps the experts' GroupedMMs on the model root (v0_2's
    `hold_grouped_mms_at_root`); `convert` on the converted model then sets the new recipe on
    those same modules, as on any converted model, and the model trains."""
    from blockscale.integrations.titan.v0_2 import HELD_AT

    model = build_v0_2("llama4")
    held = list(getattr(model, HELD_AT).modules())
    bs.convert(model, recipes.get("mxfp8"), module_filter_fn=bs.nn.layer_policy(model))
    gmms = [m for m in model.modules() if isinstance(m, bsnn.GroupedMM)]
    assert gmms and all(g in held for g in gmms)
    assert {g.recipe.name for g in gmms if g.recipe.quantized} == {"mxfp8"}
    assert_trains(train(model))


@needs_v0_2
def test_v0_2_converter_is_registered_under_its_name():
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    import blockscale.integrations.titan.v0_2 as v0_2

    assert _registry_model_converter_cls["blockscale"] is v0_2.BlockscaleConverter
