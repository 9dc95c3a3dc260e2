"""Expert parallel (blockscale.distributed.ep) on 2 gloo ranks, against one process that runs
the ranks' batches concatenated (rank 0's sequences, then rank 1's).

CPU: gloo, one process per rank; every check runs inside the workers (an assertion there fails
the spawn with its traceback). GPU (marker gpu): the host-sync count under CUDA's sync debug
mode, over NCCL on 2 GPUs (or 1, a group of one).

Exactness arguments the assertions rest on:
- A value that is a function of one token comes out as the same bits. The dense layers compute
  each row alone, and stay unquantized here: a quantized dense layer's per-tensor amax spans one
  rank's batch under data parallel and both batches in the one-process run (a data-parallel
  matter, which tests/test_distributed_fsdp.py handles with a reference run per micro-batch).
  Each expert receives exactly the rows the one process gives it, in the same order (ep.py's
  docstring), so its amaxes, 16-token Hadamard blocks and GEMMs are the same.
- So are the load-balancing loss (counts summed as integers, probabilities gathered in rank order
  and averaged as one process averages them) and each rank's loss: cross entropy over its tokens
  plus AUX times that loss; the reference takes the same per-rank cross entropies of its logits.
- The objective is the mean of the ranks' losses (what data parallel's gradient averaging
  optimizes), and the reference backpropagates exactly that. An expert's owner gets every
  rank's per-token terms, grouped and ordered as the one process has them, each scaled by W=2
  (a rank's loss counts with weight 1, in the mean with 1/2), and ep.py halves the sum: exact.
  Gathered over the ranks, expert gradients equal the reference bit for bit.
- A non-expert gradient sums per-token terms over the batch: data parallel sums each rank's and
  then the two sums, the reference sums all of them in one GEMM. Same terms, another order of
  FP32 additions: they agree to within NONEXPERT_RTOL of the gradient's largest entry (FP32's
  2^-24 relative rounding, times the ~100 additions of the longest sum, with room; measured
  under 6e-7).
- The dispatch order matters: putting each expert's rows in (source rank descending) order
  instead changed nvfp4 expert gradients by up to 5e-4 (the 16-token Hadamard blocks of the
  wgrad operands) and bf16 ones in their last bits (checked by hand), while every output stayed
  equal; so the bitwise expert-gradient checks are what pins the order down.
"""

from __future__ import annotations

import collections
import functools
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import blockscale as bs
from blockscale.distributed import enable_expert_parallel
from blockscale.distributed.launch import run_local
from blockscale.models import MoE, build_model, model_config, moe_layers

WORLD = 2
SEQ = 32
BATCHES = (3, 1)  # sequences per rank: uneven, so ranks send and receive different row counts
AUX = 0.1  # load-balancing coefficient, large enough that its gradient matters
NONEXPERT_RTOL = 1e-5
RECIPES = {
    "bf16": None,
    "nvfp4": bs.recipes.nvfp4(stochastic_rounding=False),
    "mxfp8": bs.recipes.mxfp8(),
    "nvfp4_fwd_mxfp8_bwd": bs.recipes.nvfp4_fwd_mxfp8_bwd(),
}


def _model(recipe, device: str = "cpu", **overrides):
    torch.manual_seed(0)
    model = build_model(model_config("moe-tiny", seq_len=SEQ, **overrides)).to(device)
    if recipe is not None:
        bs.convert(model, recipe, module_filter_fn=lambda module, name: name.endswith("experts"))
    return model


def _rank_rows(rank: int) -> slice:
    start = sum(BATCHES[:rank])
    return slice(start, start + BATCHES[rank])


def _ce(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def _averaged(tensor: torch.Tensor) -> torch.Tensor:
    total = tensor.clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _assert_nonexpert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=NONEXPERT_RTOL * scale, msg=what)


# --------------------------------------------------------------------------- one step


def _equal_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (sum(BATCHES), SEQ))
    mine = _rank_rows(rank)
    for name, recipe in RECIPES.items():
        ref = _model(recipe)
        ref_logits = ref(tokens)
        ref_ces = [_ce(ref_logits[_rank_rows(r)], tokens[_rank_rows(r)]) for r in range(WORLD)]
        (sum(ref_ces) / WORLD + AUX * ref.aux_loss).backward()

        model = _model(recipe)
        assert enable_expert_parallel(model) == 2
        logits = model(tokens[mine])
        loss = _ce(logits, tokens[mine]) + AUX * model.aux_loss
        loss.backward()

        assert torch.equal(logits, ref_logits[mine]), f"{name}: logits"
        assert torch.equal(model.aux_loss, ref.aux_loss), f"{name}: load-balancing loss"
        assert torch.equal(loss, ref_ces[rank] + AUX * ref.aux_loss), f"{name}: loss"
        for layer, ref_layer in zip(moe_layers(model).values(), moe_layers(ref).values()):
            assert torch.equal(layer.tokens_per_expert, ref_layer.tokens_per_expert)
            assert layer.experts.gate_up_proj.shape[0] == 2  # experts [2r, 2r+2)
            assert (recipe is None) == (not hasattr(layer.experts, "grouped_mms")), name
        ref_params = dict(ref.named_parameters())
        for pname, param in model.named_parameters():
            want = ref_params[pname].grad
            if param.dim() == 3:  # an expert weight: this rank's slice of the experts
                assert torch.equal(_gathered(param.grad), want), f"{name}: {pname}.grad"
            else:
                _assert_nonexpert_close(_averaged(param.grad), want, f"{name}: {pname}.grad")


def test_outputs_loss_and_gradients_equal_one_process_on_the_concatenated_batch():
    run_local(_equal_worker, WORLD)


# --------------------------------------------------------------------------- empty ranks


def _empty_rank_worker(rank: int, world_size: int) -> None:
    # Every token's top 2 are experts 0 and 1 (positive inputs, router rows 1 and 0.5): rank 1
    # holds experts 2 and 3, receives no row and runs its experts on an empty input.
    cfg = model_config("moe-tiny", seq_len=SEQ)
    torch.manual_seed(2)
    x = torch.randn(sum(BATCHES) * 8, cfg.dim).abs()
    rows = [slice(sum(BATCHES[:r]) * 8, sum(BATCHES[: r + 1]) * 8) for r in range(WORLD)]
    for name in ("bf16", "nvfp4"):
        layers = []
        for _ in range(2):
            torch.manual_seed(0)
            layer = MoE(cfg)
            with torch.no_grad():
                layer.router.weight.zero_()
                layer.router.weight[0] = 1.0
                layer.router.weight[1] = 0.5
            if RECIPES[name] is not None:
                bs.convert(layer, RECIPES[name], module_filter_fn=lambda m, n: n == "experts")
            layers.append(layer)
        ref, layer = layers
        ref_out = ref(x)
        ref_losses = [ref_out[r].square().mean() for r in rows]
        (sum(ref_losses) / WORLD + AUX * ref.aux_loss).backward()

        enable_expert_parallel(layer)
        out = layer(x[rows[rank]])
        (out.square().mean() + AUX * layer.aux_loss).backward()
        assert layer.tokens_per_expert.tolist() == [x.shape[0], x.shape[0], 0, 0]
        assert torch.equal(out, ref_out[rows[rank]]), name
        assert torch.equal(layer.aux_loss, ref.aux_loss), name
        for pname in ("gate_up_proj", "down_proj"):
            grad = getattr(layer.experts, pname).grad
            assert (grad.abs().sum() == 0) == (rank == 1), f"{name}: {pname} on rank {rank}"
            assert torch.equal(_gathered(grad), getattr(ref.experts, pname).grad), name


def test_a_rank_whose_experts_receive_no_token():
    run_local(_empty_rank_worker, WORLD)


# --------------------------------------------------------------------------- host syncs

# Tensor methods that copy device data to the host (a stream synchronization on CUDA).
HOST_READS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")
# Aten ops that read device data on the host or size their output from it.
SYNCING_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::bincount",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::repeat_interleave",
    "aten::is_nonzero",
}


@contextmanager
def _counting_host_reads() -> Iterator[collections.Counter]:
    """Counts calls of HOST_READS by (method, file of the caller), forward and backward alike
    (a TorchFunctionMode would miss the backward: autograd runs it outside the mode)."""
    calls: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name, method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            calls[name, Path(sys._getframe(1).f_code.co_filename).name] += 1
            return method(self, *args, **kwargs)

        return wrapper

    for name, method in originals.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        yield calls
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


class _SyncingOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in SYNCING_OPS:
            self.seen.add(func._schema.name)
        return func(*args, **(kwargs or {}))


def _step_host_reads(model, tokens: torch.Tensor):
    """Host reads of one forward and of its backward, and the syncing aten ops of both."""
    with _SyncingOps() as ops:
        with _counting_host_reads() as forward:
            loss = _ce(model(tokens), tokens) + AUX * model.aux_loss
        with _counting_host_reads() as backward:
            loss.backward()
    return forward, backward, ops.seen


def _sync_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (sum(BATCHES), SEQ))[_rank_rows(rank)]
    with _counting_host_reads() as control:
        torch.ones(2).sum().item()
    assert control == {("item", Path(__file__).name): 1}

    # bf16 experts: the one-process step reads nothing on the host; expert parallel adds one
    # read per MoE layer in the forward (its counts table) and none in the backward.
    forward, backward, ops = _step_host_reads(_model(None), tokens)
    assert not forward and not backward and not ops, (forward, backward, ops)
    model = _model(None)
    n_layers = enable_expert_parallel(model)
    forward, backward, ops = _step_host_reads(model, tokens)
    assert forward == {("tolist", "ep.py"): n_layers}, forward
    assert not backward and not ops, (backward, ops)

    # Converted experts: the CPU reference of grouped_mm reads the offsets on the host (its
    # CUDA path does not); the reads of the expert-parallel path itself stay one per layer.
    model = _model(RECIPES["nvfp4"])
    enable_expert_parallel(model)
    forward, backward, _ = _step_host_reads(model, tokens)
    ep_reads = lambda calls: {k: n for k, n in calls.items() if k[1] == "ep.py"}
    assert ep_reads(forward) == {("tolist", "ep.py"): n_layers} and not ep_reads(backward)


def test_one_host_sync_per_moe_layer_in_the_forward_and_none_in_the_backward():
    run_local(_sync_worker, WORLD)


# --------------------------------------------------------------------------- errors


def _error_worker(rank: int, world_size: int) -> None:
    model = _model(None, n_experts=3)
    with pytest.raises(ValueError, match=r"n_experts=3, not divisible by the expert-parallel "):
        enable_expert_parallel(model)
    assert model.layers[0].moe.experts.gate_up_proj.shape[0] == 3  # nothing was changed
    with pytest.raises(ValueError, match="found no MoE layer"):
        enable_expert_parallel(build_model(model_config("tiny")))
    model = _model(None)
    enable_expert_parallel(model)
    with pytest.raises(ValueError, match="already expert-parallel"):
        enable_expert_parallel(model)


def test_bad_expert_counts_and_models_raise():
    run_local(_error_worker, WORLD)


# --------------------------------------------------------------------------- GPU


def _cuda_sync_worker(rank: int, world_size: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model = _model(RECIPES["nvfp4"], device="cuda")
    n_layers = enable_expert_parallel(model)
    torch.manual_seed(1 + rank)
    tokens = torch.randint(0, 256, (4, SEQ), device=device)
    # The embedding's CUDA backward synchronizes, and is not expert parallel's: start after it.
    x = model.tok_embeddings(tokens).detach().requires_grad_()

    def step() -> tuple[int, int]:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as forward:
                warnings.simplefilter("always")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    h = x
                    for layer in model.layers:
                        h = layer(h, model.rope_cos, model.rope_sin)
                    logits = model.lm_head(model.norm(h))
                aux = torch.stack([layer.moe.aux_loss for layer in model.layers]).mean()
                loss = _ce(logits.float(), tokens) + AUX * aux
            with warnings.catch_warnings(record=True) as backward:
                warnings.simplefilter("always")
                loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [
            sum("synchronizing" in str(w.message) for w in caught) for caught in (forward, backward)
        ]
        return syncs[0], syncs[1]

    step()  # the first step loads kernels; count the second
    assert step() == (n_layers, 0)


@pytest.mark.gpu
def test_cuda_step_synchronizes_once_per_moe_layer():
    run_local(_cuda_sync_worker, min(WORLD, torch.cuda.device_count()), device="cuda")
