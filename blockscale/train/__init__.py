"""Training: data, the loop, evaluation, numerics telemetry, comparisons and reports.

    from blockscale.train import TrainConfig, train
    train(TrainConfig(model="tiny", recipe="nvfp4", steps=200), "runs/tiny-nvfp4")

The CLI (`blockscale train | compare | eval`) is a thin layer over these functions.
"""

from blockscale.train.config import TrainConfig
from blockscale.train.errors import UsageError
from blockscale.train.evaluate import eval_run, evaluate
from blockscale.train.loop import read_metrics, train

__all__ = ["TrainConfig", "UsageError", "eval_run", "evaluate", "read_metrics", "train"]
