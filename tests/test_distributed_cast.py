"""cast_master_weights_to_nvfp4: NVFP4 weights cast from ZeRO-sharded FP32 masters.

The flat master buffer (every weight flattened row-major, one after another) is cut at chosen
points; rank r owns [cut[r], cut[r+1]). Whatever the cuts (odd offsets, inside a tile, inside
a byte, slices shorter than a tile, empty slices, cuts on weight boundaries), the NVFP4
weights every rank ends with must equal `formats.nvfp4.quantize(w, block="16x16")` of each
whole weight, bit for bit. Training: 200 steps of a small MLP whose NVFP4 weights are cast
from masters sharded at an odd offset give exactly the losses of unsharded masters (two
ranks, so the averaged gradient (g0 + g1) / 2 is order-free and exact, as in
test_distributed_fsdp.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import blockscale as bs
from blockscale.distributed import (
    QuantizedWeight,
    cast_master_weights_to_nvfp4,
    to_nvfp4_primary_weights,
)
from blockscale.distributed.launch import run_local
from blockscale.formats import nvfp4

SHAPES = [(32, 48), (16, 16), (64, 32), (48, 80), (16, 208)]


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _slices(sizes: list[int], lo: int, hi: int) -> tuple[list[tuple[int, int]], list[int]]:
    """This rank's [lo, hi) of the flat buffer as (flat start, length) and in-weight offsets."""
    spans, offsets, base = [], [], 0
    for n in sizes:
        a, b = max(lo, base), min(hi, base + n)
        spans.append((a, max(b - a, 0)))
        offsets.append(max(a - base, 0))
        base += n
    return spans, offsets


def _cast_slices(weights, flat, cuts, rank, group=None):
    bounds = [0, *cuts, flat.numel()]
    spans, offsets = _slices([math.prod(w.shape) for w in weights], bounds[rank], bounds[rank + 1])
    shards = [flat[a : a + n] if n else None for a, n in spans]
    cast_master_weights_to_nvfp4(weights, shards, offsets, group)


def _garbage_targets(shapes, device) -> list[nvfp4.NVFP4Tensor]:
    """16x16 NVFP4 containers full of stale bits: the cast must overwrite all of them."""
    g = torch.Generator().manual_seed(99)
    out = []
    for rows, cols in shapes:
        data = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
        scale = torch.rand(rows, cols // 16, generator=g).to(torch.float8_e4m3fn)
        amax = torch.tensor(123.0)
        out.append(
            nvfp4.NVFP4Tensor(
                data.to(device),
                scale.to(device),
                amax.to(device),
                torch.Size((rows, cols)),
                "16x16",
            )
        )
    return out


def _assert_equal_bits(got: nvfp4.NVFP4Tensor, want: nvfp4.NVFP4Tensor, what: str) -> None:
    assert torch.equal(got.data.cpu(), want.data.cpu()), f"{what}: codes differ"
    assert torch.equal(got.scale.view(torch.uint8).cpu(), want.scale.view(torch.uint8).cpu()), (
        f"{what}: scales differ"
    )
    assert torch.equal(got.amax.cpu(), want.amax.cpu()), f"{what}: amax differs"


def _partition_worker(rank: int, world_size: int) -> None:
    device = _device()
    g = torch.Generator().manual_seed(7)
    # Magnitudes spread over decades so tile scales differ; outliers in single tiles.
    weights = [torch.randn(s, generator=g) * 10 ** torch.randint(-3, 3, (1,), generator=g).item()
               for s in SHAPES]  # fmt: skip
    weights[3][17, 33] = 900.0
    weights = [w.to(device) for w in weights]
    flat = torch.cat([w.reshape(-1) for w in weights])
    total = flat.numel()
    want = [nvfp4.quantize(w, block="16x16") for w in weights]
    sizes = [w.numel() for w in weights]
    edges = torch.tensor([0, *sizes]).cumsum(0).tolist()
    cut_sets = [
        [1, 2, 3],  # ranks 0-2 own one element each (an odd one among them)
        [1, 3, 5],  # every cut odd, inside the first byte row of the first tile
        [edges[1], edges[2], edges[3]],  # cuts on weight boundaries
        [edges[1] + 7, edges[1] + 7, total - 1],  # an empty rank, a one-element last rank
        [0, 0, total],  # one rank owns everything
        [edges[3] + 16 * 80 * 1 + 5, edges[3] + 16 * 80 + 6, edges[3] + 16 * 80 + 255],
    ]
    cg = torch.Generator().manual_seed(11)  # the same cuts on every rank
    for _ in range(20):
        cuts = sorted(torch.randint(0, total + 1, (world_size - 1,), generator=cg).tolist())
        cut_sets.append(cuts)
    for cuts in cut_sets:
        targets = _garbage_targets(SHAPES, device)
        _cast_slices(targets, flat, cuts[: world_size - 1], rank)
        for i, (got, ref) in enumerate(zip(targets, want, strict=True)):
            _assert_equal_bits(got, ref, f"weight {i} {SHAPES[i]}, cuts {cuts}")

    # A NaN in one rank's slice makes every rank's weight NaN, as on one device.
    weights[1][3, 5] = float("nan")
    flat = torch.cat([w.reshape(-1) for w in weights])
    targets = _garbage_targets(SHAPES, device)
    _cast_slices(targets, flat, [edges[1] + 50, edges[1] + 51, edges[4]][: world_size - 1], rank)
    assert torch.isnan(targets[1].amax)
    assert torch.isnan(targets[1].dequantize()).all()
    assert torch.isnan(nvfp4.quantize(weights[1], block="16x16").dequantize()).all()
    for i in (0, 2, 3, 4):
        _assert_equal_bits(targets[i], want[i], f"weight {i} beside a NaN weight")


def test_partial_cast_equals_full_cast_for_any_cuts():
    run_local(_partition_worker, 4)


def test_bad_slices_raise():
    q = _garbage_targets([(16, 16)], torch.device("cpu"))
    with pytest.raises(ValueError, match=r"slice \[250, 260\) is outside its 256 elements"):
        cast_master_weights_to_nvfp4(q, [torch.zeros(10)], [250])
    with pytest.raises(ValueError, match="need one of each per weight"):
        cast_master_weights_to_nvfp4(q, [], [])


# --------------------------------------------------------------------------- training

STEPS = 200


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
    bs.convert(model, bs.recipes.nvfp4(stochastic_rounding=False))
    return model


def _train_worker(rank: int, world_size: int, cut: int) -> None:
    device = _device()
    lr = 3e-3
    g = torch.Generator().manual_seed(5)
    data = torch.randn(STEPS, world_size, 16, 32, generator=g).to(device)
    teacher = torch.randn(32, 32, generator=g) / 32**0.5  # a target the MLP can learn
    target = (data.cpu() @ teacher).to(device)

    # Unsharded masters: one process runs both ranks' micro-batches and casts whole weights.
    ref = _mlp().to(device)
    ref_masters = to_nvfp4_primary_weights(ref)
    ref_weights = [ref.get_parameter(n) for n in ref_masters]
    ref_flat = nn.Parameter(torch.cat([m.reshape(-1) for m in ref_masters.values()]))
    ref_opt = torch.optim.AdamW([ref_flat], lr=lr)

    # ZeRO: rank r owns [bounds[r], bounds[r+1]) of the flat masters and its AdamW state.
    model = _mlp().to(device)
    masters = to_nvfp4_primary_weights(model)
    weights = [model.get_parameter(n) for n in masters]
    flat = torch.cat([m.reshape(-1) for m in masters.values()])
    bounds = [0, cut, flat.numel()]
    lo, hi = bounds[rank], bounds[rank + 1]
    mine = nn.Parameter(flat[lo:hi].clone())
    opt = torch.optim.AdamW([mine], lr=lr)
    spans, offsets = _slices([w.numel() for w in weights], lo, hi)

    losses, ref_losses = [], []
    for step in range(STEPS):
        acc = None
        for r in range(world_size):
            loss = F.mse_loss(ref(data[step, r]), target[step, r])
            loss.backward()
            grad = torch.cat([w.grad.reshape(-1) for w in ref_weights])
            acc = grad if acc is None else acc + grad
            ref.zero_grad()
            if r == rank:
                ref_losses.append(loss.item())
        ref_flat.grad = acc * 0.5
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for w, piece in zip(ref_weights, ref_flat.split([w.numel() for w in ref_weights])):
                q = nvfp4.quantize(piece.view(w.shape), block="16x16")
                w.update_(QuantizedWeight(w.shape, w.dtype, (w.rowwise_config, q)))

        loss = F.mse_loss(model(data[step, rank]), target[step, rank])
        loss.backward()
        losses.append(loss.item())
        grad = torch.cat([w.grad.reshape(-1) for w in weights])
        model.zero_grad()
        dist.all_reduce(grad)
        mine.grad = grad[lo:hi] * 0.5
        opt.step()
        opt.zero_grad()
        shards = [mine.detach()[a - lo : a - lo + n] if n else None for a, n in spans]
        cast_master_weights_to_nvfp4(weights, shards, offsets)

    assert losses == ref_losses, next(
        (i, a, b) for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)) if a != b
    )
    assert losses[-1] < 0.9 * losses[0]  # it trained
    for w, ref_w in zip(weights, ref_weights, strict=True):
        _assert_equal_bits(w.rowwise, ref_w.rowwise, "weights after training")


def test_training_with_zero_sharded_masters_equals_unsharded():
    # Rank 0 owns an odd number of elements, ending inside a byte and a tile of the first
    # weight (64 x 32: 2048 elements).
    run_local(_train_worker, 2, 1001)


@pytest.mark.gpu
def test_partial_cast_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_local(_partition_worker, 2, device="cuda")
    run_local(_train_worker, 2, 1001, device="cuda")
