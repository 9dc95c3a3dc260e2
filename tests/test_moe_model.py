"""The MoE model (models/moe.py) and its place in training: sizes, routing against a per-token
reference, the load-balancing loss on a hand case, empty experts, gradients, no host
synchronization, the layer policy, the CLI end to end, the expert telemetry and its report, and
(GPU) a step under CUDA's sync debug mode."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import blockscale.nn as bsnn
from blockscale import recipes
from blockscale.cli import main
from blockscale.models import (
    MOE_SIZES,
    SIZES,
    MoE,
    MoEConfig,
    build_model,
    model_config,
    moe_layers,
)
from blockscale.train import TrainConfig, UsageError, read_metrics, report, telemetry, train
from blockscale.train.build import build_model as build_run_model
from blockscale.train.build import estimate_bytes

# training tests run on one CPU thread (tests/conftest.py says why)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def tiny(**overrides) -> MoEConfig:
    return model_config("moe-tiny", seq_len=32, **overrides)


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax, top-k, renormalize, the weighted sum of the chosen experts'
    SwiGLU outputs, plus the shared expert."""
    out = []
    for token in x.reshape(-1, x.shape[-1]):
        probs = (moe.router.weight @ token).softmax(-1)
        weights, chosen = probs.topk(moe.top_k)
        y = moe.shared_expert(token) if moe.shared_expert is not None else torch.zeros_like(token)
        for w, e in zip(weights / weights.sum(), chosen):
            gate, up = (moe.experts.gate_up_proj[e] @ token).chunk(2)
            y = y + w * (moe.experts.down_proj[e] @ (F.silu(gate) * up))
        out.append(y)
    return torch.stack(out).view(x.shape)


def test_named_sizes_match_the_dense_compute_and_count_their_parameters():
    # moe-small: the active parameters of `small` (51M) in about three times the total.
    small, moe_small = SIZES["small"], MOE_SIZES["moe-small"]
    assert abs(moe_small.active_params() / small.num_params() - 1) < 0.01
    assert 150e6 < moe_small.num_params() < 160e6
    for name, cfg in MOE_SIZES.items():
        active_mlp = cfg.top_k * cfg.ffn_dim + cfg.shared_ffn_dim
        assert active_mlp == SIZES[name.removeprefix("moe-")].ffn_dim
        for dim in (cfg.dim, cfg.ffn_dim, 2 * cfg.ffn_dim, cfg.shared_ffn_dim):
            assert dim % 32 == 0
    model = build_model(tiny())
    assert sum(p.numel() for p in model.parameters()) == tiny().num_params()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match=r"top_k=5 must lie in \[1, n_experts=4\]"):
        tiny(top_k=5)
    with pytest.raises(ValueError, match="shared_ffn_dim=48 is not a multiple of 32"):
        tiny(shared_ffn_dim=48)
    with pytest.raises(TypeError, match="MoETransformer needs a MoEConfig"):
        type(build_model(tiny()))(model_config("tiny"))


def test_stable_names_and_transformers_expert_layout():
    model = build_model(tiny())
    names = dict(model.named_parameters())
    assert names["layers.1.moe.experts.gate_up_proj"].shape == (4, 2 * 64, 64)  # [E, 2*I, H]
    assert names["layers.1.moe.experts.down_proj"].shape == (4, 64, 64)  # [E, H, I]
    for name in ("attn.wqkv", "moe.router", "moe.shared_expert.w13", "moe.shared_expert.w2"):
        assert type(model.get_submodule(f"layers.0.{name}")) is nn.Linear
    assert list(moe_layers(model)) == ["layers.0.moe", "layers.1.moe"]


def test_routing_matches_a_per_token_reference_and_the_model_is_causal():
    torch.manual_seed(0)
    model = build_model(tiny())
    tokens = torch.randint(0, 256, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, 256)
    moe = model.layers[0].moe
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=1e-5, atol=1e-6)
    assert int(moe.tokens_per_expert.sum()) == 2 * 5 * moe.top_k
    # Routing is per token, so changing later tokens leaves earlier logits alone.
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    torch.testing.assert_close(model(changed)[:, :20], logits[:, :20], rtol=0, atol=0)


def test_load_balancing_loss_on_a_hand_case():
    moe = MoE(tiny())
    # Token i is basis vector e_i, so its router logits are column i of router.weight[:, :4].
    # Probabilities (rows: tokens; columns: experts 0..3) and each token's top 2:
    #   t0 [.4 .3 .2 .1] -> 0, 1    t1 [.1 .2 .3 .4] -> 3, 2
    #   t2 [.4 .1 .3 .2] -> 0, 2    t3 [.4 .3 .2 .1] -> 0, 1
    # f = assignments / 8 = [3, 2, 2, 1] / 8; p = column means = [1.3, .9, 1.0, .8] / 4
    # aux = E * sum f p = 4 * (3*1.3 + 2*.9 + 2*1.0 + 1*.8) / 32 = 1.0625
    probs = torch.tensor([[4, 3, 2, 1], [1, 2, 3, 4], [4, 1, 3, 2], [4, 3, 2, 1]]) / 10
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:, :4] = probs.log().t()
    moe(torch.eye(64)[:4])
    assert moe.tokens_per_expert.tolist() == [3, 2, 2, 1]
    assert moe.aux_loss.item() == pytest.approx(1.0625, rel=1e-6)
    # Uniform routing gives exactly 1.
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(torch.randn(8, 64))
    assert moe.aux_loss.item() == pytest.approx(1.0)


def test_empty_experts_are_normal_input_and_get_no_gradient():
    torch.manual_seed(1)
    moe = MoE(tiny())
    x = torch.randn(1, 64).expand(6, 64).clone()  # six copies of one token: one top-2 pair
    out = moe(x)
    torch.testing.assert_close(out, reference_moe(moe, x), rtol=1e-5, atol=1e-6)
    counts = moe.tokens_per_expert.tolist()
    assert sorted(counts) == [0, 0, 6, 6]
    out.square().sum().backward()
    grads = moe.experts.gate_up_proj.grad.abs().sum((1, 2)), moe.experts.down_proj.grad
    for e, n in enumerate(counts):
        assert (grads[0][e] > 0) == (n > 0) and (grads[1][e].abs().sum() > 0) == (n > 0)


def test_the_gradient_reaches_every_used_expert_the_router_and_the_shared_expert():
    torch.manual_seed(2)
    model = build_model(tiny())
    logits = model(torch.randint(0, 256, (4, 32)))
    (logits.logsumexp(-1).mean() + 0.01 * model.aux_loss).backward()
    for name, moe in moe_layers(model).items():
        used = moe.tokens_per_expert > 0
        assert used.all(), f"{name}: 128 tokens left an expert unused: {moe.tokens_per_expert}"
        for p in (moe.experts.gate_up_proj, moe.experts.down_proj):
            assert (p.grad.flatten(1).abs().sum(1) > 0).all()
        assert moe.router.weight.grad.abs().sum() > 0
        assert moe.shared_expert.w13.weight.grad.abs().sum() > 0


# Ops that read a device value on the host (a CUDA stream sync): `.item()`/`.tolist()`,
# nonzero, a boolean-mask index (a nonzero inside aten::index), and ops whose output size
# depends on the data.
BOOLEAN_INDEX = "aten::index with a boolean mask"
SYNCING = {
    BOOLEAN_INDEX,
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::bincount",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::repeat_interleave",
    "aten::equal",
    "aten::is_nonzero",
}


class OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._schema.name)
        if func._schema.name in ("aten::index", "aten::index_put", "aten::index_put_"):
            masks = [i for i in args[1] if i is not None and i.dtype in (torch.bool, torch.uint8)]
            if masks:
                self.ops.add(BOOLEAN_INDEX)
        return func(*args, **(kwargs or {}))


def test_forward_and_backward_call_no_op_that_synchronizes_with_the_host():
    with OpRecorder() as control:  # the recorder sees what a sync would be
        a = torch.tensor([1.0, 0.0])
        a[a > 0].sum().item()
    assert {BOOLEAN_INDEX, "aten::_local_scalar_dense"} <= control.ops
    model = build_model(tiny())
    with OpRecorder() as seen:
        logits = model(torch.randint(0, 256, (2, 32)))
        (logits.float().logsumexp(-1).mean() + model.aux_loss).backward()
    assert "aten::_grouped_mm" in seen.ops and not seen.ops & SYNCING


def test_the_moe_layer_compiles_as_one_graph():
    # fullgraph=True fails on any graph break, and a host read (.item(), nonzero, a boolean
    # mask) is one. Compiled F.grouped_mm takes BF16 operands only, hence the BF16 layer.
    torch.manual_seed(3)
    moe = MoE(tiny()).to(torch.bfloat16)
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.float().square().sum().backward()
    torch.testing.assert_close(out, moe(x), rtol=0, atol=0)
    assert moe.experts.gate_up_proj.grad is not None and x.grad is not None


def test_the_layer_policy_finds_the_blocks_and_keeps_routers_in_bf16():
    model = build_model(tiny())
    policy = bsnn.layer_policy(model)
    assert policy.blocks == "layers" and policy.bf16_blocks == {1}
    assert not policy(model.layers[0].moe.router, "layers.0.moe.router")
    assert policy(model.layers[0].moe.experts, "layers.0.moe.experts")
    assert not policy(model.layers[1].moe.experts, "layers.1.moe.experts")
    bsnn.convert(model, recipes.get("nvfp4"), module_filter_fn=policy)
    converted = {
        n
        for n, m in model.named_modules()
        if isinstance(m, bsnn.Linear | bsnn.GroupedMM) and m.recipe.quantized
    }
    # the tail block's experts are routed unquantized (nn/convert.py)
    routed = {m.recipe.name for m in model.layers[1].moe.experts.grouped_mms.values()}
    assert routed == {"bf16"}
    assert converted == {
        "layers.0.attn.wqkv",
        "layers.0.attn.wo",
        "layers.0.moe.shared_expert.w13",
        "layers.0.moe.shared_expert.w2",
        "layers.0.moe.experts.grouped_mms.gate_up_proj",
        "layers.0.moe.experts.grouped_mms.down_proj",
    }


def test_memory_estimate_counts_the_experts_and_compile_needs_cuda():
    cfg = TrainConfig(model="moe-small", batch_size=8)
    cpu = torch.device("cpu")
    dense = estimate_bytes(SIZES["small"], cfg, cpu)
    assert estimate_bytes(MOE_SIZES["moe-small"], cfg, cpu) > dense + 16 * 100e6
    with pytest.raises(UsageError, match="--compile with model 'moe-tiny' needs a CUDA device"):
        build_run_model(TrainConfig(model="moe-tiny", compile=True), cpu)


FAST = [
    "--model",
    "moe-tiny",
    "--batch-size",
    "4",
    "--seq-len",
    "64",
    "--warmup-steps",
    "2",
    "--eval-tokens",
    "2048",
    "--max-data-bytes",
    "100000",
    "--quiet",
]


def test_cli_trains_moe_tiny_logging_aux_loss_and_tokens_per_expert(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--recipe", "nvfp4", "--steps", "6", "--log-every", "3"]
    assert (
        main([*args, "--eval-every", "6", "--telemetry-every", "3", "--out", str(out), *FAST]) == 0
    )
    rows = read_metrics(out)
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [3, 6]
    for r in train_rows:
        assert 0.9 < r["aux_loss"] < 4.0  # about 1 when balanced, E = 4 when collapsed
        assert list(r["expert_tokens"]) == ["layers.0.moe", "layers.1.moe"]
        # 3 steps x 4 sequences x 64 tokens, 2 experts each
        assert all(sum(c) == 3 * 4 * 64 * 2 for c in r["expert_tokens"].values())
    assert math.isfinite(train_rows[-1]["loss"])
    probe = [r for r in rows if r["kind"] == "telemetry"][-1]
    assert "layers.0.moe.shared_expert.w13" in probe["layers"]
    assert "layers.0.moe.router" not in probe["layers"]
    # Block 0's experts are converted (block 1 is the BF16 tail): one entry per grouped GEMM,
    # with the probe batch's 4 x 64 tokens x 2 experts each.
    grouped = [f"layers.0.moe.experts.grouped_mms.{w}" for w in ("gate_up_proj", "down_proj")]
    assert sorted(probe["experts"]) == sorted(grouped) and set(grouped) <= set(probe["layers"])
    for entry in probe["experts"].values():
        assert sum(entry["tokens"]) == 4 * 64 * 2 and len(entry["output.weight"]["sqnr_db"]) == 4


def test_resuming_an_moe_run_carries_its_aux_loss_and_expert_counts(tmp_path):
    args = ["train", "--steps", "4", "--log-every", "3", "--eval-every", "0", *FAST]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    paused = [*args, "--out", str(tmp_path / "paused")]
    assert main([*paused, "--max-minutes", "1e-9"]) == 3  # stops after step 1: mid-row
    assert main([*paused, "--resume", "--max-minutes", "0"]) == 0

    def rows(run):
        clock = ("tokens_per_s", "time")
        metrics = read_metrics(tmp_path / run)
        return [{k: v for k, v in r.items() if k not in clock} for r in metrics]

    assert rows("paused") == rows("whole") and "expert_tokens" in rows("whole")[0]


def test_compare_reports_tokens_per_expert(tmp_path, capsys):
    args = ["compare", "--recipes", "bf16,nvfp4", "--no-noise-floor", "--out", str(tmp_path)]
    fast = ["--steps", "4", "--log-every", "2", "--eval-every", "4", "--telemetry-every", "4"]
    assert main([*args, *fast, *FAST]) == 0
    text = (tmp_path / "report.md").read_text()
    section = text.split("## Mixture of experts")[1].split("\n## ")[0]
    assert section.count("### ") == 2 and "| layers.1.moe |" in section
    assert "Load-balancing loss:" in section
    # nvfp4's worst experts: block 0's grouped GEMMs (block 1 is the BF16 tail).
    assert "| layers.0.moe.experts.grouped_mms." in section.split("### nvfp4")[1]


class OneGroupedGemm(nn.Module):
    """A 'model' whose logits are one grouped GEMM over fixed groups."""

    def __init__(self, recipe, offs) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.randn(len(offs), 64, 64) * 0.1)
        self.gemm = bsnn.GroupedMM(recipe)
        self.offs = torch.tensor(offs, dtype=torch.int32)

    def forward(self, x):
        return self.gemm(x[0], self.weight_t, offs=self.offs).unsqueeze(0)


@pytest.fixture
def grouped_probe():
    """Telemetry of one grouped GEMM with groups of 20, 0, 25 and 19 rows under NVFP4."""
    torch.manual_seed(4)
    recipe = recipes.get("nvfp4")
    model = OneGroupedGemm(recipe, [20, 20, 45, 64])
    x = torch.randn(1, 64, 64)
    found = telemetry.probe(model, x, torch.randint(0, 64, (1, 64)))
    return recipe, model, x, found


def test_telemetry_records_each_experts_operands_and_tokens(grouped_probe):
    recipe, model, x, found = grouped_probe
    layer = found["experts"]["gemm"]
    assert layer["tokens"] == [20, 0, 25, 19]
    # Each expert's slice quantized on its own; the empty expert has no activation values.
    inputs = layer["output.input"]["sqnr_db"]
    assert inputs[1] is None
    for e, rows in ((0, slice(0, 20)), (2, slice(20, 45)), (3, slice(45, 64))):
        expected = telemetry.operand_stats(x[0, rows], recipe.output.input, False)
        assert inputs[e] == pytest.approx(expected["sqnr_db"])
        # 25 and 19 tokens: the token-dim copy pads to a multiple of 16, as the GEMM does.
        expected_t = telemetry.operand_stats(x[0, rows], recipe.grad_weight.input_t, True)
        assert layer["grad_weight.input_t"]["sqnr_db"][e] == pytest.approx(expected_t["sqnr_db"])
    weights = layer["output.weight"]["sqnr_db"]
    assert all(12 < v < 30 for v in weights)  # every expert's weight, used or not
    assert all(
        v is None or 12 < v < 30 for v in layer["grad_weight.grad_output_t"]["sqnr_db"]
    )  # grad_input.weight is output.weight's exact transpose (16x16) and is skipped
    assert "grad_input.weight" not in layer
    # The layer's entry is the whole operand's: signal and noise summed over experts.
    sums = [
        telemetry.operand_sums(model.weight_t[e].t(), recipe.output.weight, False) for e in range(4)
    ]
    whole = telemetry.stats_of(torch.stack(sums).sum(0).tolist())
    assert found["layers"]["gemm"]["output.weight"]["sqnr_db"] == pytest.approx(whole["sqnr_db"])


def test_report_shows_tokens_per_expert_and_the_worst_experts(grouped_probe):
    _, _, _, found = grouped_probe
    rows = [
        {"kind": "train", "step": 2, "aux_loss": 1.5, "expert_tokens": {"l0": [6, 0, 1, 1]}},
        {"kind": "train", "step": 4, "aux_loss": 1.1, "expert_tokens": {"l0": [2, 2, 2, 2]}},
        {"kind": "telemetry", "step": 4, **json.loads(json.dumps(found))},
    ]
    run = {"name": "nvfp4", "rows": rows}
    # Whole run: 8, 2, 3, 3 of 16 -> max/mean 8 * 4 / 16 = 2.00; last interval balanced.
    assert report.expert_load(run) == [["l0", "50.0 12.5 18.8 18.8", "2.00", "1.00"]]
    worst = report.worst_experts(run, count=3)
    assert len(worst) == 3 and all(line[0] == "gemm" and line[2] != "1" for line in worst)
    assert [float(line[3]) for line in worst] == sorted(float(line[3]) for line in worst)
    section = "\n".join(report._moe_section([run]))
    assert "1.5000 in the first logged interval, 1.1000 in the last" in section


@pytest.mark.gpu
def test_cuda_step_never_synchronizes_with_the_host():
    torch.manual_seed(0)
    model = build_model(model_config("moe-tiny")).cuda()
    tokens = torch.randint(0, 256, (4, 128), device="cuda")
    # The embedding's CUDA backward is not this model's code: start from its output.
    x = model.tok_embeddings(tokens).detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = x
            for layer in model.layers:
                h = layer(h, model.rope_cos, model.rope_sin)
            logits = model.lm_head(model.norm(h))
        aux = torch.stack([layer.moe.aux_loss for layer in model.layers]).mean()
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()) + 0.01 * aux
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    for moe in moe_layers(model).values():
        used = (moe.tokens_per_expert > 0).cpu()
        grad = moe.experts.gate_up_proj.grad.flatten(1).abs().sum(1).cpu()
        assert ((grad > 0) == used).all()


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_trains_moe_tiny_under_bf16_autocast(tmp_path, compile):
    cfg = TrainConfig(
        model="moe-tiny",
        recipe="nvfp4",
        device="cuda",
        compile=compile,
        steps=12,
        batch_size=4,
        seq_len=64,
        log_every=4,
        eval_every=12,
        eval_tokens=4096,
        telemetry_every=6,
        max_data_bytes=200_000,
    )
    summary = train(cfg, tmp_path / "run", progress=False)
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert summary["status"] == "done" and rows[-1]["loss"] < rows[0]["loss"]
    assert all(0.9 < r["aux_loss"] < 4.0 for r in rows)
    probes = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "telemetry"]
    sqnr = [
        v
        for r in probes
        for entry in r["experts"].values()
        for operand, stats in entry.items()
        if operand != "tokens"
        for v in stats["sqnr_db"]
        if v is not None
    ]
    assert sqnr and all(12 < v < 30 for v in sqnr)  # NVFP4: about 17-21 dB
