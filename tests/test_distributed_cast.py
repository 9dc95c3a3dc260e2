"""cast_master_weights_to_nvfp4: NVFP4 weights cast from ZeRO-sharded FP32 masters.

The flat master buffer (every weight flattened row-major, one after another) is cut at chosen
points; rank r owns [cut[r], cut[r+1]). Whatever the cuts (odd offsets, inside a tile, inside
a byte, slices shorter than a tile, empty slices, cuts on weight boundaries), the NVFP4
weights every rank ends with must equal `formats.nvfp4.quantize(w, block="16x16")` of each
whole weight, bit for bit. The Triton kernels (CUDA weights; here Triton's interpreter) give
each rank's partial tile amaxes and codes of the PyTorch reference bit for bit, on the same
cuts, with zeros, NaN and Inf, through the flat buffer read in place or concatenated. Training: 200 steps of a small MLP whose NVFP4 weights are cast
from masters sharded at an odd offset give exactly the losses of unsharded masters (two
ranks, so the averaged gradient (g0 + g1) / 2 is order-free and exact, as in
test_distributed_fsdp.py).
"""

from __future__ import annotations

import collections
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


# --------------------------------------------------------------------------- kernels

# cols = 16 and a weight of one tile among them; small, for Triton's interpreter
KERNEL_SHAPES = [(32, 48), (16, 16), (48, 16), (16, 208), (64, 32)]


def _kernel_weights(special: str | None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(s, generator=g) * 10 ** torch.randint(-4, 4, (1,), generator=g).item()
               for s in KERNEL_SHAPES]  # fmt: skip
    weights[0][:16, 16:32] = 0.0  # a zero tile: scale 0, multiplier FLT_MAX
    weights[0][5, 40] = -0.0
    weights[3][:, :16] *= 1e-30  # tiles whose scale underflows to 0 beside large ones
    weights[4][20, 3] = 2e4  # one outlier tile
    if special == "nan":  # with a payload: the kernels must not let its bits through
        weights[3][7, 100] = torch.tensor(0x7FC00123, dtype=torch.int32).view(torch.float32)
    elif special == "inf":
        weights[2][30, 9] = float("-inf")
    return weights


def _kernel_cut_sets(sizes: list[int]) -> list[list[int]]:
    """Cut points of a 4-rank partition of the flat buffer (ranks may own nothing)."""
    total = sum(sizes)
    edges = torch.tensor([0, *sizes]).cumsum(0).tolist()
    sets = [
        [1, 2, 3],  # one-element ranks, the second at an odd offset
        [7, 7, total - 1],  # an empty rank, a one-element last rank
        [edges[1], edges[2], edges[3]],  # on weight boundaries
        [edges[1] + 5, edges[1] + 13, edges[3] + 16 * 208 + 101],  # inside a byte, tiles
        [0, 0, total],  # one rank owns everything
    ]
    g = torch.Generator().manual_seed(13)
    sets += [sorted(torch.randint(0, total + 1, (3,), generator=g).tolist()) for _ in range(3)]
    return sets


def _rank_shards(flat, sizes, lo, hi, copy):
    shards, offsets, base = [], [], 0
    for n in sizes:
        a, b = max(lo, base), min(hi, base + n)
        shard = flat[a:b].clone() if copy else flat[a:b]
        shards.append(shard if b > a else (None if a % 2 else flat[:0]))  # None and empty
        offsets.append(max(a - base, 0))
        base += n
    return shards, offsets


@pytest.mark.parametrize("special", [None, "nan", "inf"])
def test_kernel_steps_equal_reference_on_every_rank(special):
    """Each rank's local steps, kernels against the reference, then combined as the two
    all-reduces combine them (max of the amax bits, sum of the bytes) against quantize."""
    from blockscale.distributed import master_cast as mc  # noqa: PLC0415
    from blockscale.distributed._collectives import amax_bits  # noqa: PLC0415
    from blockscale.kernels import master_cast as km  # noqa: PLC0415

    device = torch.device("cpu")
    weights = _kernel_weights(special)
    sizes = [w.numel() for w in weights]
    flat = torch.cat([w.reshape(-1) for w in weights])
    want = [nvfp4.quantize(w, block="16x16") for w in weights]
    for n_set, cuts in enumerate(_kernel_cut_sets(sizes)):
        bounds = [0, *cuts, flat.numel()]
        ranks = []
        for r in range(4):
            # odd cut sets read the flat masters in place, even ones concatenate copies
            shards, offsets = _rank_shards(flat, sizes, bounds[r], bounds[r + 1], n_set % 2 == 0)
            ref = mc.rank_slices(KERNEL_SHAPES, shards, offsets, device, use_kernels=False)
            ker = mc.rank_slices(KERNEL_SHAPES, shards, offsets, device, use_kernels=True)
            in_place = ker.kernels.flat.data_ptr() == flat.data_ptr() + 4 * bounds[r]
            assert in_place == (n_set % 2 == 1 and bounds[r] < bounds[r + 1]), (cuts, r)
            amax_ref = amax_bits(mc.partial_tile_amax(ref, device))
            amax_ker = mc.partial_tile_amax(ker, device).view(torch.int32)
            assert torch.equal(amax_ker, amax_ref), f"tile amaxes, cuts {cuts}, rank {r}"
            ranks.append((ref, ker, amax_ker))
        bits = torch.stack([a for _, _, a in ranks]).amax(0)
        amax, scale, enc = mc.scales_and_multipliers(ker, bits, device)
        codes = torch.zeros(ref.byte_base[-1], dtype=torch.int32)
        for r, (ref, ker, _) in enumerate(ranks):
            codes_ref = mc.owned_codes(ref, enc, device)
            codes_ker = mc.owned_codes(ker, enc, device)
            assert torch.equal(codes_ker, codes_ref), f"codes, cuts {cuts}, rank {r}"
            codes += codes_ker
        assert int(codes.max()) <= 255  # every nibble had one writer
        rows = km.expand_tile_scales(ker.kernels, scale)
        for i, q in enumerate(want):
            what = f"weight {i} {KERNEL_SHAPES[i]}, cuts {cuts}"
            a, b = ref.byte_base[i], ref.byte_base[i + 1]
            assert torch.equal(codes[a:b].to(torch.uint8), q.data.reshape(-1)), what
            s = rows[16 * ref.tile_base[i] : 16 * ref.tile_base[i + 1]]
            assert torch.equal(s, q.scale.view(torch.uint8).reshape(-1)), what
            assert torch.equal(amax_bits(amax[i]), amax_bits(q.amax)), what


@pytest.fixture
def one_rank_group():
    """The default process group of this process alone (gloo, in memory)."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in the test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_kernel_cast_on_one_rank_equals_full_cast(one_rank_group, monkeypatch):
    """cast_master_weights_to_nvfp4 through the kernels (as for CUDA weights) on a 1-rank
    group, over stale target bytes: the one-rank quantization, scales and amax included."""
    from blockscale import _library  # noqa: PLC0415

    weights = _kernel_weights("nan")
    flat = torch.cat([w.reshape(-1) for w in weights])
    shards = list(flat.split([w.numel() for w in weights]))
    want = [nvfp4.quantize(w, block="16x16") for w in weights]
    for use_kernels in (True, False):
        monkeypatch.setattr(_library, "use_kernels", lambda t, on=use_kernels: on)
        targets = _garbage_targets(KERNEL_SHAPES, torch.device("cpu"))
        cast_master_weights_to_nvfp4(targets, shards, [0] * len(shards))
        for i, (got, ref) in enumerate(zip(targets, want, strict=True)):
            what = f"weight {i}, kernels={use_kernels}"
            assert torch.equal(got.data, ref.data), what
            assert torch.equal(got.scale.view(torch.uint8), ref.scale.view(torch.uint8)), what
            torch.testing.assert_close(got.amax, ref.amax, atol=0, rtol=0, equal_nan=True)
    assert torch.isnan(targets[3].amax)


# ops that launch no kernel (views and aliases)
_VIEW_OPS = {"view", "_unsafe_view", "reshape", "split", "split_with_sizes", "unbind", "slice",
             "select", "expand", "as_strided", "alias", "detach", "lift_fresh"}  # fmt: skip


def test_kernel_cast_ops_do_not_grow_with_weights(one_rank_group, monkeypatch):
    """The kernel path runs the same PyTorch ops (and Triton launches) for 2 weights as for 8:
    nothing in it is a loop of device work over the weights."""
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    from blockscale import _library  # noqa: PLC0415

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in _VIEW_OPS:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(_library, "use_kernels", lambda t: True)
    counts = []
    for n in (2, 8):
        flat = torch.randn(n * 32 * 48)
        targets = _garbage_targets([(32, 48)] * n, torch.device("cpu"))
        with Count() as count:
            cast_master_weights_to_nvfp4(targets, list(flat.split(32 * 48)), [0] * n)
        counts.append(count.ops)
    assert counts[0] == counts[1]
    assert counts[0]["_foreach_copy_"] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_steps_equal_reference_on_gpu():
    """Llama-1B-like weight shapes on the GPU, 8 ranks cut at odd offsets: the kernels' local
    steps equal the reference's (PyTorch ops on the same CUDA tensors) on every rank, and the
    combined result equals quantize."""
    from blockscale.distributed import master_cast as mc  # noqa: PLC0415
    from blockscale.distributed._collectives import amax_bits  # noqa: PLC0415
    from blockscale.kernels import master_cast as km  # noqa: PLC0415

    device = torch.device("cuda")
    shapes = [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (16, 16), (48, 16)]
    g = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(s, generator=g, device=device) * 10.0 ** (i % 5 - 2)
               for i, s in enumerate(shapes)]  # fmt: skip
    weights[2][100:116, 32:48] = 0.0
    weights[5][40, 3] = float("nan")  # (the GPU's NaN differs from the interpreter's)
    sizes = [w.numel() for w in weights]
    flat = torch.cat([w.reshape(-1) for w in weights])
    total = flat.numel()
    bounds = [0, *[min(total, r * (total // 8) + 2 * r + 1) for r in range(1, 8)], total]
    ranks = []
    for r in range(8):
        shards, offsets = _rank_shards(flat, sizes, bounds[r], bounds[r + 1], copy=r % 2 == 0)
        ref = mc.rank_slices(shapes, shards, offsets, device, use_kernels=False)
        ker = mc.rank_slices(shapes, shards, offsets, device, use_kernels=True)
        amax_ker = mc.partial_tile_amax(ker, device).view(torch.int32)
        assert torch.equal(amax_ker, amax_bits(mc.partial_tile_amax(ref, device))), r
        ranks.append((ref, ker, amax_ker))
    bits = torch.stack([a for _, _, a in ranks]).amax(0)
    amax, scale, enc = mc.scales_and_multipliers(ker, bits, device)
    codes = torch.zeros(ref.byte_base[-1], dtype=torch.int32, device=device)
    for r, (ref, ker, _) in enumerate(ranks):
        codes_ker = mc.owned_codes(ker, enc, device)
        assert torch.equal(codes_ker, mc.owned_codes(ref, enc, device)), r
        codes += codes_ker
    rows = km.expand_tile_scales(ker.kernels, scale)
    for i, w in enumerate(weights):
        q = nvfp4.quantize(w, block="16x16")
        a, b = ref.byte_base[i], ref.byte_base[i + 1]
        assert torch.equal(codes[a:b].to(torch.uint8), q.data.reshape(-1)), i
        s = rows[16 * ref.tile_base[i] : 16 * ref.tile_base[i + 1]]
        assert torch.equal(s, q.scale.view(torch.uint8).reshape(-1)), i
        torch.testing.assert_close(amax[i], q.amax, atol=0, rtol=0, equal_nan=True)
