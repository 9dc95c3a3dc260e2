"""torchtitan's gpt-oss under blockscale's converters: what tests/test_torchtitan.py's model
lists cannot say.

0.3.0's gpt-oss debug model is in `MODELS_V0_3` there (converted by the policy, trains, equals
`blockscale.nn.convert`); here, that its attention output projection stays in high precision
with the reason logged. 0.2.2's gpt-oss is another model class (its forward takes the flex
masks, its experts are no `GroupedExperts`), so its tests are here: converted by the policy and
trains, its experts (fused gate / up weight, biases, clamped SwiGLU) equal to blockscale's
grouped GEMM with torchtitan's biases and activation, bit for bit, and kept in BF16 with a
logged reason under expert or tensor parallelism (docs/TORCHTITAN.md).

Attention is not under test: 0.3's varlen attention and 0.2.2's compiled flex attention do not
run backward on the CPU, so both run `dense_attention` (test_torchtitan.py) under the same
masks, gpt-oss's sinks applied to its output as torchtitan applies them.
"""

import logging
import warnings
from types import SimpleNamespace

import pytest
import torch
from test_torchtitan import (
    assert_trains,
    assert_v0_2_linears_by_the_policy,
    block_of,
    build_v0_2,
    dense_attention,
    histc_on_cpu,  # noqa: F401 (a fixture)
    needs_v0_2,
    needs_v0_3,
    train,
)
from torch import nn

import blockscale as bs
import blockscale.nn as bsnn
from blockscale import recipes


@needs_v0_3
def test_v0_3_gpt_oss_attention_output_stays_in_high_precision_saying_why(caplog):
    """gpt-oss's attention output is a `ScaledBiasRowwiseLinear` (its bias divided by the TP
    degree in a forward of its own): the converter keeps it, as `convert` does, and says so;
    the fused qkv beside it is converted."""
    from torchtitan.models.gpt_oss import model_registry

    from blockscale.integrations.titan.v0_3 import BlockscaleConverter, BlockscaleLinear

    converter = BlockscaleConverter.Config(recipe="nvfp4")
    with caplog.at_level(logging.WARNING, logger="blockscale.integrations.titan.v0_3"):
        config = model_registry("debugmodel", converters=[converter]).model
    attention = config.layers[0].attention
    assert isinstance(attention.qkv_linear.wqkv, BlockscaleLinear.Config)
    assert not isinstance(attention.wo, BlockscaleLinear.Config)
    kept = [r.getMessage() for r in caplog.records if "attention.wo" in r.getMessage()]
    assert len(kept) == 3 and "ScaledBiasRowwiseLinear has a forward of its own" in kept[0], kept


class DenseFlexAttentionV0_2(nn.Module):
    """0.2.2's gpt-oss inner attention (`FlexAttentionWrapper`, compiled flex attention) as
    `dense_attention` under the block mask's `mask_mod`: (B, N, L, H) in, the output and, where
    asked, its log-sum-exp out."""

    def forward(self, q, k, v, *, block_mask, scale=None, return_lse=False, **kwargs):
        from torch.nn.attention.flex_attention import create_mask

        length = q.shape[2]
        allowed = create_mask(block_mask.mask_mod, 1, 1, length, length, device=q.device)[0, 0]
        out, lse = dense_attention(q, k, v, allowed, scale)
        return (out, lse) if return_lse else out


class GptOssV0_2(nn.Module):
    """0.2.2's gpt-oss called on tokens alone, as the tests' `train` calls a model: its forward
    also takes the flex masks, which torchtitan builds with a compiled `create_block_mask`;
    built here eagerly from torchtitan's own mask functions (a causal mask, and a causal
    sliding window for the even blocks). In BF16: torchtitan 0.2.2's gpt-oss builds its blocks
    in BF16 and its embeddings and output in FP32, which its own router gate (a BF16 linear on
    the FP32 activations) refuses without FSDP2's BF16 mixed precision. Its router gates'
    biases zeroed: torchtitan 0.2.2 never initializes them (`TokenChoiceTopKRouter.init_weights`
    draws the gate's weight only), so after `to_empty` they held whatever memory was there
    (measured up to 3e38, and NaN losses)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model.to(torch.bfloat16)
        for block in model.layers.values():
            block.attention.inner_attention = DenseFlexAttentionV0_2()
            with torch.no_grad():
                block.moe.router.gate.bias.zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import and_masks, create_block_mask
        from torchtitan.models.attention import get_causal_mask_mod, get_sliding_window_mask_mod

        length = tokens.shape[1]
        causal = get_causal_mask_mod()
        window = get_sliding_window_mask_mod(self.model.model_args.sliding_window_size)
        masks = {
            "basic_mask": create_block_mask(causal, 1, None, length, length, device="cpu"),
            "sliding_window_mask": create_block_mask(
                and_masks(causal, window), 1, None, length, length, device="cpu"
            ),
        }
        return self.model(tokens, masks)


@needs_v0_2
@pytest.mark.usefixtures("histc_on_cpu")
def test_v0_2_gpt_oss_converter_converts_by_the_policy_and_trains():
    from blockscale.integrations.titan.v0_2 import UnpaddedGptOssGroupedExperts

    model = build_v0_2("gpt_oss")
    tail = assert_v0_2_linears_by_the_policy(model)
    for fqn, module in model.named_modules():
        if fqn.endswith("moe.experts"):
            assert isinstance(module, UnpaddedGptOssGroupedExperts), fqn
            recipes_of = {name: m.recipe.name for name, m in module.grouped_mms.items()}
            expected = "bf16" if block_of(fqn) == tail else "nvfp4"
            assert recipes_of == {"mlp1_weight": expected, "mlp2_weight": expected}, fqn
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert_trains(train(GptOssV0_2(model)))
    # every expert weight went through blockscale's grouped GEMM, quantized or BF16
    assert not [w for w in warned if "not consumed" in str(w.message)]


@needs_v0_2
@pytest.mark.usefixtures("histc_on_cpu")
def test_v0_2_gpt_oss_experts_equal_blockscale_grouped_mm_with_their_biases():
    """mxfp8 (rounding to nearest both ways): the converted experts' output and the gradients
    of their weights and biases are blockscale's grouped GEMMs of the same weights with
    torchtitan's biases and clamped SwiGLU between, bit for bit, on token groups of any size
    (one empty) without torchtitan's padding."""
    from torchtitan.models.gpt_oss.model.moe import swiglu

    from blockscale.integrations.titan.v0_2 import UnpaddedGptOssGroupedExperts

    args = ["--job.custom_config_module", "blockscale.integrations.titan.v0_2"]
    model = build_v0_2("gpt_oss", [*args, "--blockscale.recipe", "mxfp8"])
    experts = model.layers["0"].moe.experts
    assert isinstance(experts, UnpaddedGptOssGroupedExperts)
    recipe = recipes.get("mxfp8")
    e, _, dim = experts.mlp1_weight.shape
    counts = torch.tensor([5, 0, 17, 3] + [9] * (e - 4), dtype=torch.int64)[:e]
    x = torch.randn(int(counts.sum()), dim, generator=torch.Generator().manual_seed(0))
    x = x.bfloat16()
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    params = dict(experts.named_parameters())
    reference = {name: p.detach().clone().requires_grad_() for name, p in params.items()}

    def grouped(a, w):
        return bs.grouped_mm(a, w.bfloat16().transpose(-2, -1), offs, recipe)

    def per_token(bias):
        return bias.repeat_interleave(counts, dim=0)

    h = grouped(x, reference["mlp1_weight"])
    h = swiglu(h + per_token(reference["mlp1_bias"]).to(h.dtype), limit=experts.swiglu_limit)
    h = grouped(h, reference["mlp2_weight"])
    expected = h + per_token(reference["mlp2_bias"]).to(h.dtype)
    out = experts(x, counts)
    assert torch.equal(out, expected)
    out.float().square().mean().backward()
    expected.float().square().mean().backward()
    for name, p in params.items():
        assert torch.equal(p.grad, reference[name].grad), name


@needs_v0_2
@pytest.mark.parametrize("parallel", ["ep", "tp"])
def test_v0_2_gpt_oss_experts_stay_bf16_under_expert_or_tensor_parallel(parallel, caplog):
    """The converter's parallel dims with EP or TP on: gpt-oss's experts are routed in BF16
    (their GroupedMMs held on the model root, where torchtitan's experts partition functions
    do not look), the reason logged; the linears are converted as without."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.gpt_oss import get_train_spec

    from blockscale.integrations.titan.v0_2 import HELD_AT, BlockscaleConverter

    spec = get_train_spec()
    with torch.device("meta"):
        model = spec.model_cls(spec.model_args["debugmodel"])
    dims = SimpleNamespace(
        ep_enabled=parallel == "ep", tp_enabled=parallel == "tp",
        fsdp_enabled=False, pp_enabled=False,
    )  # fmt: skip
    job_config = ConfigManager().parse_args([])
    with caplog.at_level(logging.WARNING, logger="blockscale.integrations.titan.v0_2"):
        BlockscaleConverter(job_config, dims).convert(model)
    kept = [r.getMessage() for r in caplog.records if "moe.experts stays" in r.getMessage()]
    assert len(kept) == len(model.layers) - 1, kept  # the BF16 tail's experts are not logged
    assert "expert or tensor parallelism" in kept[0]
    gmms = [m for m in getattr(model, HELD_AT).modules() if isinstance(m, bsnn.GroupedMM)]
    assert len(gmms) == 2 * len(model.layers) and {g.recipe.name for g in gmms} == {"bf16"}
    for block in model.layers.values():
        assert "grouped_mms" not in block.moe.experts._modules
    assert isinstance(model.layers["0"].attention.wq, bsnn.Linear)
