#!/usr/bin/env bash
# Issue 61's convergence runs (docs/TORCHTITAN.md, "The benchmark") on a GPU machine, from the
# repository root with .titan-wheels/, .data/ and .titan-assets/ carried there:
#
#   scripts/titan_converge.sh MODEL SECONDS OUT [bench_titan options ...]
#                                                    (MODEL: deepseek_v3 or llama4)
#
# trains MODEL's `small` flavor to 3052 steps of 8 x 2048 tokens (50.0M), every run at once on
# the one GPU, each cut after SECONDS (a call's length, less the install); the same command
# again, on the same machine, resumes each run from its latest checkpoint (every 150 steps).
# The checkpoints go under /tmp/titan-converge (DUMP): a folder inside the repository's copy
# does not outlive a call where each call brings a fresh copy. The runs: RECIPES (default
# bf16,nvfp4,mxfp8) and BF16's SEEDS (default 0,1; deepseek_v3's seed 0 ran whole on
# 2026-12-06, so SEEDS=1 there). OUT gets the JSON (conv_MODEL.json, for `--merge`) and the
# table; `bench_titan.py --merge` joins calls whose runs could not resume each other. Options
# after OUT go to bench_titan.py after these, so they override them (a CPU check:
# PYTHON=.venv/bin/python ... --flavor debugmodel --assets .titan-assets/bpe-2k --steps 4).
set -euo pipefail
model=${1:?deepseek_v3 or llama4}
seconds=${2:?seconds per run}
out=${3:?output folder}
cd "$(dirname "$0")/.."
mkdir -p "$out"
bash scripts/titan_install.sh 0.2.2 /tmp/titan-0.2.2 > "$out/install_$model.log"
recipes=${RECIPES:-bf16,nvfp4,mxfp8}
seeds=${SEEDS:-0,1}
# --parallel / --per-gpu: every run at once (up to 8), on one GPU or spread over several
PYTHONPATH=/tmp/titan-0.2.2 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "${PYTHON:-python3}" benchmarks/bench_titan.py --converge \
  --model "$model" --flavor small --modes compile --recipes "$recipes" --bf16-seeds "$seeds" \
  --parallel 8 --per-gpu 8 --batch 8 --seq-len 2048 --steps 3052 --warmup 20 \
  --checkpoint-interval 150 --assets .titan-assets/bpe-32k --timeout "$seconds" \
  --dump "${DUMP:-/tmp/titan-converge}/$model" --out "$out/conv_$model.json" \
  "${@:4}" 2>&1 | tee "$out/conv_$model.log"
