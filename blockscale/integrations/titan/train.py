"""torchtitan's own training entry point (`torchtitan.train`), run where a machine lacks one of
two things torchtitan takes for granted: the `datasets` package, and a GPU.

    torchrun --nproc_per_node=1 -m blockscale.integrations.titan.train <torchtitan's arguments>

takes exactly torchtitan's arguments (0.3.x: `--module ... --config ...`; 0.2.2:
`--job.config_file ...`) and runs its `main` and `Trainer` unchanged. Where `datasets` imports
and a GPU is present, it is `python -m torchtitan.train` and nothing more, but for one torch
function (the last item).

- No `datasets`: both torchtitan versions import it whatever the data, through their
  Hugging Face text datasets: 0.3.0's `torchtitan/trainer.py` (line 30) imports
  `torchtitan.components.validate`, whose line 23 imports `torchtitan.hf_datasets.text_datasets`,
  whose line 14 is `from datasets import Dataset, load_dataset`; 0.2.2's `torchtitan/train.py`
  (line 19) imports `torchtitan.protocols.train_spec`, whose line 21 imports
  `torchtitan.components.validate`, whose line 21 imports `torchtitan.hf_datasets.text_datasets`,
  whose line 13 is the same import (and each model's package imports that module too).
  `datasets` needs pyarrow and pandas (over 50 MB of wheels), which a run on local text never
  uses. Where `import datasets` fails, a stand-in module takes its place: it has the three
  names torchtitan imports, and calling any of them raises an error that says why (a
  Hugging Face dataset needs the real package). Local text (`titan.local_text`) needs none.
- No GPU (tests on the CPU): torchtitan picks its device once, at import, as "cuda" whatever
  the machine (`torchtitan.tools.utils.device_type`, `device_module`, which other modules copy
  when imported). While torchtitan's package is imported, that choice is made the CPU and
  `CPUDevice` below (no memory statistics: torchtitan then logs -1 GiB); torch.distributed
  then picks gloo. And 0.2.2's MoE router counts tokens with `torch.histc` on int64 indices,
  which PyTorch implements on CUDA only: on the CPU the launcher counts them from float
  indices (the same counts, returned as int64 as CUDA returns them). And FSDP2 over gloo:
  both versions turn FSDP's gradient division off after sharding (the loss is divided by the
  global token count instead: `FSDPModule.set_gradient_divide_factor(1.0)` in 0.2.2's
  `models/llama3/infra/parallelize.py` line 284 and 0.3.0's `distributed/fsdp.py` line 41),
  with which torch reduce-scatters the gradients with `ReduceOp.PREMUL_SUM(1.0)`
  (`_get_gradient_divide_factors` in torch's `fsdp/_fully_shard/_fsdp_collectives.py`), an
  op gloo does not implement: the first backward on two CPU ranks failed ("Cannot use
  ReduceOp.PREMUL_SUM with Gloo"). On the CPU a module given a divide factor is also set to
  `set_force_sum_reduction_for_comms(True)`: a SUM, then a division by the factor (none for
  1.0), the values of the sum pre-multiplied by 1.
- torchtitan 0.3.0's trainer calls `torch.distributed.set_timeout` after its first step, a
  function torch 2.13 does not have: where it is missing, the launcher supplies torch's own
  `distributed_c10d._set_pg_timeout`, which takes the same arguments. (0.3.0 needs a torch
  newer than 2.11 anyway: its `distributed/full_dtensor.py` imports
  `torch.distributed.fsdp.DataParallelMeshDims`.)

`JsonlLogger` is the metrics file both versions' registrations (`titan.train_v0_3`,
`titan.train_v0_2`) add to torchtitan's loggers.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

METRICS_FILE = "metrics.jsonl"


class _NoDatasets:
    """Callable stand-in for a `datasets` function: calling it says what is missing."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(
            f"datasets.{self.name}: the `datasets` package is not installed (blockscale's "
            "launcher stood in for it); a Hugging Face dataset needs it, local text does not"
        )


def install_datasets_stand_in() -> bool:
    """Put the stand-in in `sys.modules` where `import datasets` fails; True if it did."""
    try:
        importlib.import_module("datasets")
        return False
    except ImportError:
        pass
    module = types.ModuleType("datasets", "blockscale's stand-in: `datasets` is not installed")
    module.Dataset = type("Dataset", (), {"__doc__": "never instantiated: no `datasets`"})
    module.load_dataset = _NoDatasets("load_dataset")
    distributed = types.ModuleType("datasets.distributed")
    distributed.split_dataset_by_node = _NoDatasets("distributed.split_dataset_by_node")
    module.distributed = distributed
    sys.modules["datasets"] = module
    sys.modules["datasets.distributed"] = distributed
    return True


class CPUDevice:
    """torchtitan's `device_module` on a machine without a GPU: one device, no streams to set
    and no memory statistics."""

    class _Properties:
        total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @staticmethod
    def set_device(device: Any) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "CPU"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return CPUDevice._Properties()

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass


def _histc_of_float(histc: Any) -> Any:
    def counted(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input.device.type == "cpu" and not input.is_floating_point():
            return histc(input.float(), *args, **kwargs).to(input.dtype)  # CUDA's dtype
        return histc(input, *args, **kwargs)

    return counted


def _with_sum_reductions(set_gradient_divide_factor: Any) -> Any:
    """`FSDPModule.set_gradient_divide_factor` that also asks for SUM reductions, which gloo
    implements (module docstring)."""

    @functools.wraps(set_gradient_divide_factor)
    def set_factor(module: FSDPModule, factor: float) -> None:
        set_gradient_divide_factor(module, factor)
        module.set_force_sum_reduction_for_comms(True)

    return set_factor


def run_torchtitan_on_cpu() -> None:
    """Make torchtitan pick the CPU and `CPUDevice` (module docstring): torchtitan's package
    imports `torchtitan.tools.utils`, which picks the device when imported from torch's
    `_get_available_device_type` and `_get_device_module`, and other modules copy its choice
    when they are imported; so those two answer for the CPU while the package is imported,
    before any torchtitan module is. Then the router's `histc` and FSDP2's reductions."""
    if "torchtitan" in sys.modules:
        raise RuntimeError("torchtitan was imported before its device could be set to the CPU")
    saved = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type="cpu": CPUDevice
    try:
        importlib.import_module("torchtitan.tools.utils")
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = saved
    torch.histc = _histc_of_float(torch.histc)
    FSDPModule.set_gradient_divide_factor = _with_sum_reductions(
        FSDPModule.set_gradient_divide_factor
    )


class JsonlLogger:
    """A torchtitan metrics logger (both versions' `BaseLogger` protocol) that appends
    `{"step": ..., metric: value, ...}` lines to a file, so a resumed run goes on in it: the
    numbers torchtitan prints, for a benchmark to read (`titan.train_v0_3`, `titan.train_v0_2`
    put it beside torchtitan's own loggers as `<dump_folder>/metrics.jsonl`)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def main() -> None:
    """torchtitan's `main`, with the stand-ins this machine needs (module docstring)."""
    if "torchtitan.train" in sys.modules or "torchtitan.trainer" in sys.modules:
        raise RuntimeError("torchtitan's trainer was imported before the launcher ran")
    if install_datasets_stand_in():
        print("blockscale: no `datasets` package: a stand-in takes its place", file=sys.stderr)
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout
    if not torch.cuda.is_available():
        run_torchtitan_on_cpu()
    train = importlib.import_module("torchtitan.train")
    if "trainer_class" in inspect.signature(train.main).parameters:  # 0.2.x
        train.main(train.Trainer)
    else:
        train.main()


if __name__ == "__main__":
    main()
