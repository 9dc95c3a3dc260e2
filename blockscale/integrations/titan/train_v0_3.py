"""torchtitan 0.3.x's trainer on local text (`titan.local_text`), with the model sizes issue 61
measures: a config registry for `--module`, and overrides for `--override.imports`.

    torchrun --nproc_per_node=1 -m blockscale.integrations.titan.train \\
        --module blockscale.integrations.titan.train_v0_3 --config deepseek_v3_debugmodel \\
        --hf_assets_path .titan-assets/bpe-2k --dataloader.dataset_path .data/train.txt.gz \\
        --override.imports 'blockscale.integrations.titan.v0_3.blockscale={"recipe": "nvfp4"}' \
        activation-checkpoint:none

(`-m blockscale.integrations.titan.train` is `-m torchtitan.train` where `datasets` or a GPU
is missing; that module's docstring says why. `activation-checkpoint:none`: speed at these
sizes; blockscale's layers also run under torchtitan's selective checkpointing.) What is here:

- `LocalTextDataLoader`: torchtitan's `ParallelAwareDataloader` (a stateful loader, so its
  position goes into checkpoints) over `LocalTextDataset` with positions, as 0.3's models take
  them. Its config's `dataset_path` names the text: a `.txt`/`.txt.gz` file, a folder, or a
  comma list (`--dataloader.dataset_path`).
- `MetricsWithJsonl`: torchtitan's `MetricsProcessor`, which also appends every logged step's
  metrics (loss, tokens/s, peak memory, ...) to `<dump_folder>/metrics.jsonl` on rank 0: the
  numbers torchtitan prints, for a benchmark to read (`benchmarks/bench_titan.py`).
- Config functions (`--config NAME`), each a torchtitan config of that model's own registry
  (its optimizer, schedule, loss) with local text, the metrics above logged every step,
  `hf_assets_path` `.titan-assets/bpe-2k`, checkpoints every 100 steps when enabled
  (`--checkpoint.enable`), and its model spec from `v0_3.with_quantized_all_gather` (under
  FSDP2 the linears `v0_3.blockscale` converts are gathered quantized; `v0_3` says when):
  `deepseek_v3_debugmodel`, `qwen3_debugmodel_moe`, `llama3_debugmodel` (torchtitan's debug
  models, vocabulary 2048), `deepseek_v3_16b_4l` and `deepseek_v3_small` (flavors below).
- Flavors, registered into torchtitan 0.3's DeepSeek-V3 flavor table (`deepseekv3_configs`)
  when this module is imported, under names torchtitan does not use:
  - `16B_4L`: torchtitan's `16B` (dim 2048, 64 routed experts of width 1408, top-6, two shared,
    vocabulary 102400) cut to its first 4 blocks (1 dense, 3 MoE): 2.3B parameters, whose
    FP32 weights, gradients and AdamW state take 36 GB, so it trains on one 80 GB GPU.
  - `small`: DeepSeek-V3's layout (MLA, one dense block then MoE blocks with a shared expert,
    sigmoid router with normalized scores, as V3 671B) at about 200M parameters for
    convergence runs: dim 512, 12 blocks, 8 heads, kv rank 256, 32 routed experts of width
    256, top-4, vocabulary 32768. Built with torchtitan 0.3.0's own layer builder
    (`_build_dsv3_layers`, a private function: this flavor follows 0.3.0).
  On a machine without a GPU they use SDPA in place of FlexAttention, whose backward PyTorch
  implements on GPUs only (the CPU tests; SDPA attends causally across the documents of a row,
  FlexAttention only within each). An override cannot do this: torchtitan refuses two
  overrides of which one claims a node inside the other's (blockscale's claims the whole model).
- Overrides (`--override.imports`, torchtitan's way to swap a config from outside):
  `local_text` puts `LocalTextDataLoader` in place of the trainer's data loader in any
  torchtitan config (`local_text={"path": ".data/train.txt.gz"}`), and `float8_rowwise`
  applies torchtitan's own float8 rowwise converters (torchao's; SM89+) to the linears but the
  output head and router gates, and to every experts module, for a benchmark to compare
  against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader, ParallelAwareDataloader
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import LoggerContainer, MetricsProcessor
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config.override import override
from torchtitan.models import deepseek_v3, llama3, qwen3
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.protocols.model import BaseModel
from torchtitan.trainer import Trainer

from blockscale.integrations.titan.local_text import LocalTextDataset, text_files
from blockscale.integrations.titan.train import METRICS_FILE, JsonlLogger
from blockscale.integrations.titan.v0_3 import with_quantized_all_gather

DEFAULT_ASSETS = ".titan-assets/bpe-2k"


class LocalTextDataLoader(ParallelAwareDataloader):
    """torchtitan's stateful data loader over the documents of local text files (module
    docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "local_text"
        dataset_path: str | None = ".data/train.txt.gz"
        """The text: a .txt/.txt.gz file, a folder of them, or a comma list."""
        infinite: bool = True
        """Start over at the first document when the text runs out."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        if not config.dataset_path:
            raise ValueError("dataloader.dataset_path is empty: name the text files")
        dataset = LocalTextDataset(
            text_files(config.dataset_path),
            tokenizer,
            seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            infinite=config.infinite,
            layout="documents",
        )
        super().__init__(
            dataset,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            num_workers=config.num_workers,
            persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
            batch_size=local_batch_size,
        )


class MetricsWithJsonl(MetricsProcessor):
    """torchtitan's metrics, also written to `<dump_folder>/metrics.jsonl` by rank 0."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        log_freq: int = 1

    def __init__(self, config: Config, *, dump_folder: str = "./outputs", **kwargs: Any):
        super().__init__(config, dump_folder=dump_folder, **kwargs)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            loggers = LoggerContainer()
            loggers.add_logger(self.logger)
            loggers.add_logger(JsonlLogger(Path(dump_folder) / METRICS_FILE))
            self.logger = loggers


def _deepseek_v3_16b_4l(**kwargs: Any) -> Any:
    config = deepseek_v3.deepseekv3_configs["16B"](**kwargs)
    config.layers = config.layers[:4]
    return config


def _deepseek_v3_small(
    attn_backend: str,
    moe_comm_backend: str,
    non_blocking_capacity_factor: float | None = None,
    num_mtp_layers: int = 0,
) -> Any:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: PLC0415

    dim, vocab, rope_dim = 512, 32768, 32
    layers = deepseek_v3._build_dsv3_layers(
        n_layers=12, n_dense_layers=1, dim=dim, n_heads=8, q_lora_rank=0, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=rope_dim, v_head_dim=64, mscale=0.70,
        dense_hidden_dim=2048, moe_hidden_dim=256, num_experts=32, num_shared_experts=1,
        router_top_k=4, router_score_func="sigmoid", router_route_norm=True,
        router_route_scale=2.5, attn_backend=attn_backend, moe_comm_backend=moe_comm_backend,
        non_blocking_capacity_factor=non_blocking_capacity_factor,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=4096 * 4, theta=10000.0,
                                scaling="yarn", rope_factor=40.0, beta_fast=32.0,
                                beta_slow=1.0, original_seq_len=4096),
    )  # fmt: skip
    return deepseek_v3.DeepSeekV3Model.Config(
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=deepseek_v3._EMBEDDING_INIT
        ),  # fmt: skip
        norm=RMSNorm.Config(normalized_shape=dim, param_init=deepseek_v3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=deepseek_v3._output_linear_init(dim)
        ),  # fmt: skip
        layers=layers,
        mtp_layers=deepseek_v3._build_mtp_layers(
            layers[-1], dim=dim, num_mtp_layers=num_mtp_layers
        ),  # fmt: skip
    )


FLAVORS = {"16B_4L": _deepseek_v3_16b_4l, "small": _deepseek_v3_small}
for _name, _flavor in FLAVORS.items():
    deepseek_v3.deepseekv3_configs.setdefault(_name, _flavor)


def _on_local_text(config: Trainer.Config, model_spec: Any) -> Trainer.Config:
    """`config` (a torchtitan registry's) with `model_spec` (its parallelize function turning
    on FSDP2's quantized all-gather of blockscale's converted linears), local text and the
    metrics file; SDPA in place of FlexAttention where there is no GPU (module docstring)."""
    if not torch.cuda.is_available():
        for _, _, parent, attr in list(model_spec.model.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    config.model_spec = with_quantized_all_gather(model_spec)
    vocab = model_spec.model.vocab_size
    for _, loss, _, _ in config.loss.traverse(CrossEntropyLoss.Config):
        loss.global_vocab_size = vocab
    config.hf_assets_path = DEFAULT_ASSETS
    config.dataloader = LocalTextDataLoader.Config()
    config.metrics = MetricsWithJsonl.Config()
    config.checkpoint = CheckpointManager.Config(interval=100, last_save_model_only=False)
    return config


def deepseek_v3_debugmodel() -> Trainer.Config:
    from torchtitan.models.deepseek_v3 import config_registry  # noqa: PLC0415

    return _on_local_text(
        config_registry.deepseek_v3_debugmodel(), deepseek_v3.model_registry("debugmodel")
    )


def deepseek_v3_16b_4l() -> Trainer.Config:
    from torchtitan.models.deepseek_v3 import config_registry  # noqa: PLC0415

    return _on_local_text(
        config_registry.deepseek_v3_debugmodel(), deepseek_v3.model_registry("16B_4L")
    )


def deepseek_v3_small() -> Trainer.Config:
    from torchtitan.models.deepseek_v3 import config_registry  # noqa: PLC0415

    return _on_local_text(
        config_registry.deepseek_v3_debugmodel(), deepseek_v3.model_registry("small")
    )


def qwen3_debugmodel_moe() -> Trainer.Config:
    from torchtitan.models.qwen3 import config_registry  # noqa: PLC0415

    return _on_local_text(config_registry.qwen3_moe_debug(), qwen3.model_registry("debugmodel_moe"))


def llama3_debugmodel() -> Trainer.Config:
    from torchtitan.models.llama3 import config_registry  # noqa: PLC0415

    return _on_local_text(config_registry.llama3_debugmodel(), llama3.model_registry("debugmodel"))


@override(target=BaseDataLoader.Config, fqns=["dataloader"], description="local text files")
def local_text(config: Any, path: str | None = None, num_workers: int | None = None) -> Any:
    """`--override.imports 'blockscale.integrations.titan.train_v0_3.local_text={"path": ...}'`:
    the trainer's data loader replaced by `LocalTextDataLoader` on `path` (default: the
    replaced config's `dataset_path`, else `.data/train.txt.gz`)."""
    new = LocalTextDataLoader.Config()
    new = replace(new, dataset_path=path or config.dataset_path or new.dataset_path)
    if num_workers is not None:
        new = replace(new, num_workers=num_workers)
    return new


@override(target=BaseModel.Config, description="torchtitan's float8 rowwise converters")
def float8_rowwise(model_config: Any, compile: bool = False) -> Any:
    """`--override.imports 'blockscale.integrations.titan.train_v0_3.float8_rowwise={"compile":
    true}'` (module docstring); `compile` says the model is compiled, as torchtitan's converters
    are told."""
    from torchtitan.components.quantization import (  # noqa: PLC0415 (needs torchao)
        Float8GroupedExpertsConverter,
        Float8LinearConverter,
    )

    linears = Float8LinearConverter.Config(
        recipe_name="rowwise", filter_fqns=["lm_head", "router.gate"],
        model_compile_enabled=compile,
    )  # fmt: skip
    model_config = linears.build().convert(model_config)
    if any(True for _ in model_config.traverse(GroupedExperts.Config)):
        experts = Float8GroupedExpertsConverter.Config(model_compile_enabled=compile)
        model_config = experts.build().convert(model_config)
    return model_config
