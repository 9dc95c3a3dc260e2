#!/usr/bin/env bash
# The wheels torchtitan's trainer needs on a GPU machine that has Python 3.12 with torch, numpy
# and transformers but no network (docs/TORCHTITAN.md, "On a machine without a network"):
# downloaded here, once, from the repository root, into .titan-wheels/ (ignored), to be carried
# there and installed with scripts/titan_install.sh.
#
#   scripts/titan_wheels.sh
#
# common/: what both versions' trainers import (with blockscale's launcher standing in for
#   `datasets`, so no datasets, pyarrow or pandas): torchdata (the stateful data loader), tyro,
#   docstring_parser and typeguard (the command line), tensorboard, protobuf and absl-py
#   (torchtitan's metrics import torch.utils.tensorboard whether it logs there or not);
# 0.2.2/ and 0.3.0/: torchtitan itself (0.3.0 with spmd_types);
# optional-0.2.2/ and optional-0.3.0/: torchao, for torchtitan's own float8 rows of
#   benchmarks/bench_titan.py, one release per torchtitan version: 0.2.2's grouped-GEMM float8
#   converter imports `MoETrainingConfig`, which torchao 0.17.0 renamed (a GPU run of 2026-12-06
#   stopped on that import), so 0.2.2 takes 0.16.0, the last release that has it; 0.3.0's
#   converter imports 0.17.0's `Float8TrainingOpConfig`. Both are of torch 2.10-2.11's time;
#   their compiled kernels are unverified against 2.11.
set -euo pipefail
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d ".titan-wheels/$1" "${@:2}"
}
get common torchdata==0.11.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 \
  tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1
get 0.2.2 torchtitan==0.2.2
get 0.3.0 torchtitan==0.3.0 spmd_types==0.2.3
get optional-0.2.2 torchao==0.16.0
get optional-0.3.0 torchao==0.17.0
du -sh .titan-wheels/*
