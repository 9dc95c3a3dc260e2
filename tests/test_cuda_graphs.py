"""`torch.compile(model, mode="reduce-overhead")` on converted models: the whole training
step's kernels captured as CUDA graphs and replayed, which is what makes small per-GPU batches
(a few thousand tokens a step) run near BF16's speed when eager and plain compile are bound by
the host (docs/MODELS.md, "Small batches as CUDA graphs"). A graph is captured only where the
compiled code has no host sync, no CPU tensor and no input mutation Inductor cannot replay;
otherwise Inductor skips the graphs silently (a log line, a counter) and the step runs as
plain compile. So these tests check the counter, not only the losses.

GPU only: on the CPU the mode compiles as the default one.
"""

import pytest
import torch
import torch.nn.functional as F
from test_convert_experts import hf_model
from test_hf_llama import exact, tiny_llama
from torch._dynamo.utils import counters

import blockscale.nn as bsnn
from blockscale import recipes

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU"),
]


BUILDERS = {"llama": lambda: tiny_llama(layers=3), "qwen3_moe": lambda: hf_model("qwen3_moe")}


def train(kind: str, recipe: recipes.Recipe, mode: str | None, steps: int = 4) -> torch.Tensor:
    """The README's call (default layer_policy), FP32 masters under BF16 autocast, fused
    AdamW, compiled with `mode`: the step losses."""
    torch._dynamo.reset()
    model = BUILDERS[kind]().cuda()
    bsnn.convert(model, recipe, module_filter_fn=bsnn.layer_policy(model))
    forward = torch.compile(model, mode=mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    losses = []
    # one batch at every step, which a few steps learn (random batches of uniform tokens have
    # nothing to learn, and their losses need not fall: seen on the CPU)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 65), generator=gen).cuda()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())  # a replay reuses its outputs' memory
    torch._dynamo.reset()
    return torch.stack(losses)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_gpu_reduce_overhead_captures_and_equals_plain_compile(kind, name):
    """Every compiled graph of the step is captured (no skip), and the replayed steps give the
    plain compiled steps' losses bit for bit (the same kernels; stochastic rounding off, since
    a replay draws its own noise)."""
    recipe = exact(name)
    plain = train(kind, recipe, None)
    counters.clear()
    graphs = train(kind, recipe, "reduce-overhead")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert torch.isfinite(graphs).all() and graphs[-1] < graphs[0], graphs
    torch.testing.assert_close(graphs, plain, atol=0, rtol=0)


def test_gpu_reduce_overhead_with_stochastic_rounding_trains():
    """The default nvfp4 recipe (stochastic rounding of the gradients) replays without a skip
    and trains: its noise is drawn inside the graph (tests/test_linear.py checks the draws)."""
    counters.clear()
    losses = train("llama", recipes.get("nvfp4"), "reduce-overhead", steps=6)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert torch.isfinite(losses).all() and losses[-1] < losses[0], losses
