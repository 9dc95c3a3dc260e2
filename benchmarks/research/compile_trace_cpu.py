"""Dynamo + AOTAutograd time of a converted transformers Llama, on the CPU, on the kernel path.

What a GPU compile traces, timed without a GPU: `use_kernels` is forced on, so linears take
the Triton-kernel route with the real `wrap_triton` and jit (not interpreted) kernels; the
first call of `torch.compile(model)` runs Dynamo and AOTAutograd (forward and backward,
`force_non_lazy_backward_lowering`), and the backward compiler stops the run, so no kernel
runs and Inductor is not timed. Prints the first call's seconds, the node counts of the
forward and backward graphs and torch._dynamo's compile_times(). --profile FILE: cProfile.

    python benchmarks/research/compile_trace_cpu.py --recipe nvfp4 --layers 8   # (no TRITON_INTERPRET)
"""

import argparse
import cProfile
import time

import torch
import torch._functorch.config as functorch_config
import transformers
from torch._dynamo.backends.common import aot_autograd

import blockscale.nn as bsnn
from blockscale import _library, recipes


class _Stop(Exception):
    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="nvfp4")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--profile", default="")
    args = parser.parse_args()

    _library.use_kernels = lambda t: True
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    converted = 0
    if args.recipe != "bf16":
        bsnn.convert(model, recipes.get(args.recipe), module_filter_fn=bsnn.layer_policy(model))
        converted = sum(isinstance(m, bsnn.Linear) for m in model.modules())

    nodes = {}

    def forward_compiler(gm, example_inputs):
        nodes["forward"] = len(gm.graph.nodes)
        return gm

    def backward_compiler(gm, example_inputs):
        nodes["backward"] = len(gm.graph.nodes)
        raise _Stop

    functorch_config.force_non_lazy_backward_lowering = True
    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, 128, (2, 32))
    profile = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profile:
        profile.enable()
    try:
        compiled(ids).logits.float().square().mean().backward()
    except Exception as e:  # Dynamo wraps the backend's exception
        if "_Stop" not in repr(e) and not isinstance(e.__cause__, _Stop):
            raise
    if profile:
        profile.disable()
        profile.dump_stats(args.profile)
    seconds = time.perf_counter() - start
    print(
        f"recipe={args.recipe} layers={args.layers} hidden={args.hidden} converted={converted} "
        f"first_call_s={seconds:.2f} forward_nodes={nodes.get('forward')} "
        f"backward_nodes={nodes.get('backward')}"
    )
    print(torch._dynamo.utils.compile_times())


if __name__ == "__main__":
    main()
