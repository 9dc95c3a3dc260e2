"""torchtitan 0.2.2's trainer on local text (`titan.local_text`), with the model sizes issue 61
measures, registered the way 0.2.2 takes outside code: `--experimental.custom_import`.

    torchrun --nproc_per_node=1 -m blockscale.integrations.titan.train \\
        --experimental.custom_import blockscale.integrations.titan.train_v0_2 \\
        --model.name llama4_local_text --model.flavor debugmodel \\
        --model.hf_assets_path .titan-assets/bpe-2k --training.dataset_path .data/train.txt.gz \\
        --model.converters blockscale --activation_checkpoint.mode none

(`-m blockscale.integrations.titan.train` is `-m torchtitan.train` where `datasets` or a GPU
is missing; that module's docstring says why.) Importing this module registers:

- blockscale's converter "blockscale" (it imports `titan.v0_2`; its options come with
  `--job.custom_config_module blockscale.integrations.titan.v0_2`, as without this module);
- a `TrainSpec` for each of 0.2.2's Llama 4, DeepSeek-V3 and Llama 3, named
  `llama4_local_text`, `deepseek_v3_local_text` and `llama3_local_text`: torchtitan's own spec
  of that model (its model, parallelization, optimizer, loss) whose data loader streams the
  text that `--training.dataset_path` names (a `.txt`/`.txt.gz` file, a folder of them, or a
  comma list; `.data/train.txt.gz` when unset) in 0.2.2's own layout (`LocalTextDataset`'s
  "stream"), through torchtitan's stateful `ParallelAwareDataloader` (its position goes into
  checkpoints), and whose metrics also go, every logged step, to
  `<job.dump_folder>/metrics.jsonl` (rank 0; `titan.train.JsonlLogger`). `--training.dataset`
  is not read.
- flavors beside torchtitan's own (torchtitan's flavor tables are shared, so
  `--model.name llama4` sees them too):
  - Llama 4 `17bx16e_2L`: torchtitan's `17bx16e` (dim 5120, 16 routed experts of width 8192
    and a shared one in every block, vocabulary 202048) cut to 2 blocks: 6.5B parameters,
    whose FP32 weights, gradients and AdamW state take 104 GB: an H200, or
    `--training.dtype bfloat16` (52 GB) on an 80 GB GPU.
  - Llama 4 `small`: the 17bx16e layout (every block MoE, 16 experts, top-1 and a shared one)
    at about 200M parameters for convergence runs: dim 512, 8 blocks, 8 heads, 2 KV heads,
    expert width 768, vocabulary 32768.
  - DeepSeek-V3 `16B_4L`: torchtitan's `16B` cut to its first 4 blocks (1 dense, 3 MoE):
    2.3B parameters, 36 GB of FP32 weights, gradients and AdamW state.
  - DeepSeek-V3 `small`: V3's layout (MLA, one dense block, MoE blocks with a shared expert,
    sigmoid router with normalized scores) at about 200M parameters: dim 512, 12 blocks,
    8 heads, kv rank 256, 32 routed experts of width 256, top-4, vocabulary 32768.
"""

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.metrics import LoggerContainer, build_metrics_processor
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.deepseek_v3 import deepseekv3_args
from torchtitan.models.llama4 import llama4_args
from torchtitan.models.llama4.model.args import RoPEScalingArgs, TransformerModelArgs
from torchtitan.models.moe import MoEArgs
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

import blockscale.integrations.titan.v0_2  # noqa: F401 (registers the "blockscale" converter)
from blockscale.integrations.titan.local_text import LocalTextDataset, text_files
from blockscale.integrations.titan.train import METRICS_FILE, JsonlLogger

DEFAULT_DATA = ".data/train.txt.gz"
MODELS = ("llama4", "deepseek_v3", "llama3")
SUFFIX = "_local_text"


def build_local_text_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: BaseTokenizer,
    job_config: Any,
    infinite: bool = True,
) -> ParallelAwareDataloader:
    """0.2.2's `build_dataloader_fn` for local text (module docstring)."""
    training = job_config.training
    dataset = LocalTextDataset(
        text_files(training.dataset_path or DEFAULT_DATA),
        tokenizer,
        training.seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        layout="stream",
    )
    return ParallelAwareDataloader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        **asdict(training.dataloader),
        batch_size=training.local_batch_size,
    )


def build_metrics_with_jsonl(job_config: Any, parallel_dims: Any, model_args: Any = None) -> Any:
    """torchtitan's metrics processor, its metrics also in `<dump_folder>/metrics.jsonl`."""
    metrics = build_metrics_processor(job_config, parallel_dims, model_args)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        loggers = LoggerContainer()
        loggers.add_logger(metrics.logger)
        loggers.add_logger(JsonlLogger(Path(job_config.job.dump_folder) / METRICS_FILE))
        metrics.logger = loggers
    return metrics


FLAVORS = {
    "llama4": {
        "17bx16e_2L": replace(llama4_args["17bx16e"], n_layers=2),
        "small": TransformerModelArgs(
            dim=512,
            n_layers=8,
            n_heads=8,
            n_kv_heads=2,
            vocab_size=32768,
            multiple_of=256,
            rope_theta=500000,
            rope_scaling_args=RoPEScalingArgs(),
            moe_args=MoEArgs(num_experts=16),
            interleave_moe_layer_step=1,
        ),  # fmt: skip
    },
    "deepseek_v3": {
        "16B_4L": replace(deepseekv3_args["16B"], n_layers=4),
        "small": replace(
            deepseekv3_args["debugmodel"],
            vocab_size=32768,
            dim=512,
            inter_dim=2048,
            moe_inter_dim=256,
            n_layers=12,
            n_dense_layers=1,
            n_heads=8,
            kv_lora_rank=256,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            moe_args=MoEArgs(
                num_experts=32,
                num_shared_experts=1,
                top_k=4,
                score_func="sigmoid",
                route_norm=True,
                route_scale=2.5,
                score_before_experts=False,
            ),
        ),  # fmt: skip
    },
}
for _model, _flavors in FLAVORS.items():
    _table = llama4_args if _model == "llama4" else deepseekv3_args
    for _name, _args in _flavors.items():
        _table.setdefault(_name, _args)

for _model in MODELS:
    register_train_spec(
        _model + SUFFIX,
        replace(
            get_train_spec(_model),
            build_dataloader_fn=build_local_text_dataloader,
            build_metrics_processor_fn=build_metrics_with_jsonl,
        ),
    )
