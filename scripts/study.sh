#!/usr/bin/env bash
# The convergence study: every recipe and NVFP4 ablation on `small`, same seed, data order and
# hyperparameters; see docs/TRAINING.md ("The study"). Runs from any directory; needs only
# python3 with torch, safetensors, matplotlib (tqdm optional); no install of blockscale.
#
#   scripts/study.sh smoke DATA OUT        every variant for 20 steps (seq 256), then a compiled
#                                          NVFP4 run: checks the whole pipeline on CUDA (~1-2 min)
#   scripts/study.sh list                  the variant names
#   scripts/study.sh run DATA OUT [NAME]   one variant (or all in turn); each call stops cleanly
#                                          after MAX_MINUTES with exit status 3: rerun the same
#                                          command to continue (status 0: finished)
#   scripts/study.sh queue DATA OUT NAME.. the named variants one after another (one GPU: set
#                                          CUDA_VISIBLE_DEVICES); with UNTIL (epoch seconds) each
#                                          run's MAX_MINUTES is the time left, and none starts
#                                          with under a minute left
#   scripts/study.sh start DATA OUT NAME.. each named variant in its own detached process (setsid,
#                                          log in OUT/NAME.log), side by side; GPUS="0 1" deals
#                                          them out over those GPUs in turn (default: all share
#                                          the visible ones). Returns at once: poll with status
#   scripts/study.sh status OUT            one line per run: step, tokens, last training and
#                                          held-out loss, tokens/s, and whether it still runs
#   scripts/study.sh report DATA OUT       report.md, plots and report.json from the runs so far
#   scripts/study.sh pack OUT DEST         DEST/study.tar.gz: reports, metrics, configs (no checkpoints)
#
# Environment: PYTHON (python3), STEPS (6104: 6104 x 32 x 1024 = 200.0M tokens per run),
# BATCH (32), LR (1e-3), MAX_MINUTES (8.5), COMPILE (1), SEED (0), MODEL (small; tiny checks
# the script itself on a CPU), SEQ_LEN (1024; tiny's CPU check uses less), EXTRA (more train
# flags for every run, e.g. "--deterministic --no-weight-cache").
# Two GPUs: CUDA_VISIBLE_DEVICES=0 scripts/study.sh run DATA OUT bf16 &
#           CUDA_VISIBLE_DEVICES=1 scripts/study.sh run DATA OUT nvfp4 & wait
set -euo pipefail

PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
VARIANTS="bf16 nvfp4 mxfp8 nvfp4_fwd_mxfp8_bwd bf16-seed$((${SEED:-0} + 1)) nvfp4-no-hadamard nvfp4-no-stochastic-rounding nvfp4-no-weight-2d nvfp4-no-bf16-tail"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; }
abspath() { if [ "$1" = stdlib ]; then echo stdlib; else realpath -m "$1"; fi; }
blockscale() { (cd "$REPO" && PYTHONUNBUFFERED=1 "$PYTHON" -m blockscale "$@"); }

mode=${1:-}
case "$mode" in
list) echo "$VARIANTS" | tr ' ' '\n'; exit 0 ;;
pack)
    [ $# -eq 3 ] || usage
    out=$(abspath "$2"); dest=$(abspath "$3"); mkdir -p "$dest"
    tar -C "$out" --exclude=checkpoints -czf "$dest/study.tar.gz" .
    echo "$dest/study.tar.gz"; exit 0 ;;
status)
    [ $# -eq 2 ] || usage
    (cd "$REPO" && "$PYTHON" - "$(abspath "$2")") <<'PY'
import json, sys, time
from pathlib import Path
from blockscale.train.loop import read_metrics
runs = sorted(p.parent for p in Path(sys.argv[1]).glob("runs/*/metrics.jsonl"))
if not runs:
    print(f"no runs under {sys.argv[1]}/runs yet")
for run in runs:
    rows = read_metrics(run)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    summary = run / "summary.json"
    state = json.loads(summary.read_text())["status"] if summary.exists() else "running"
    age = time.time() - (run / "metrics.jsonl").stat().st_mtime
    t = train[-1] if train else {}
    print(f"{run.name:30s} step {t.get('step', 0):6d}  tokens {t.get('tokens', 0) / 1e6:7.1f}M"
          f"  loss {t.get('loss', float('nan')):.4f}"
          f"  val {evals[-1]['val_loss'] if evals else float('nan'):.4f}"
          f"  {t.get('tokens_per_s', 0):9,.0f} tok/s  {state} (metrics written {age:.0f}s ago)")
PY
    exit 0 ;;
smoke | run | report | queue | start) [ $# -ge 3 ] || usage ;;
*) usage ;;
esac
data=$(abspath "$2"); out=$(abspath "$3"); name=${4:-}

# The comparison: every call passes the same flags, so every run of it has the same config.
COMPARE=(compare --model "${MODEL:-small}" --data "$data" --seed "${SEED:-0}" --noise-floor
         --recipes bf16,nvfp4,mxfp8,nvfp4_fwd_mxfp8_bwd
         --ablate hadamard,stochastic_rounding,weight_2d,bf16_tail)

if [ "$mode" = smoke ]; then
    # Every variant, a few steps each, then torch.compile on the NVFP4 path.
    blockscale "${COMPARE[@]}" --out "$out" --quiet --steps 20 --batch-size 8 --seq-len 256 \
        --warmup-steps 5 --log-every 5 --eval-every 10 --eval-tokens 65536 --telemetry-every 10 \
        --keep-checkpoints 1
    blockscale train --model "${MODEL:-small}" --data "$data" --recipe nvfp4 --out "$out/compiled-nvfp4" --quiet \
        --steps 10 --batch-size 8 --seq-len 256 --warmup-steps 2 --log-every 5 --eval-every 10 \
        --eval-tokens 65536 --telemetry-every 5 --keep-checkpoints 1 --compile
    echo "smoke run finished: $out/report.md"
    exit 0
fi

STUDY=(--steps "${STEPS:-6104}" --batch-size "${BATCH:-32}" --seq-len "${SEQ_LEN:-1024}"
       --lr "${LR:-1e-3}" --warmup-steps 200 --log-every 10 --eval-every 500
       --eval-tokens 1048576 --telemetry-every 500 --ckpt-every 1000 --keep-checkpoints 1
       --max-minutes "${MAX_MINUTES:-8.5}")
[ "${COMPILE:-1}" = 1 ] && STUDY+=(--compile)
read -r -a extra <<< "${EXTRA:-}"
STUDY+=("${extra[@]}")

case "$mode" in
start)
    shift 3
    [ $# -ge 1 ] || usage
    mkdir -p "$out"
    read -r -a gpus <<< "${GPUS:-}"
    i=0
    for v in "$@"; do
        env=()
        [ ${#gpus[@]} -gt 0 ] && env=(CUDA_VISIBLE_DEVICES="${gpus[$((i % ${#gpus[@]}))]}")
        env "${env[@]}" setsid nohup "$0" run "$data" "$out" "$v" > "$out/$v.log" 2>&1 < /dev/null &
        echo "$v: started (pid $!${env:+, ${env[0]}}), log $out/$v.log"
        i=$((i + 1))
    done ;;
queue)
    shift 3
    [ $# -ge 1 ] || usage
    for v in "$@"; do
        if [ -n "${UNTIL:-}" ]; then
            left=$(( UNTIL - $(date +%s) ))
            [ "$left" -ge 60 ] || { echo "$v: not started, ${left}s left"; continue; }
            export MAX_MINUTES=$(awk "BEGIN { print $left / 60 }")
        fi
        "$0" run "$data" "$out" "$v" || echo "$v: exit status $?"
    done ;;
run)
    only=(); [ -n "$name" ] && only=(--only "$name")
    status=0
    blockscale "${COMPARE[@]}" "${STUDY[@]}" --out "$out" --quiet "${only[@]}" || status=$?
    # Exit status 3: stopped cleanly (MAX_MINUTES or SIGINT/SIGTERM) with a checkpoint.
    [ "$status" = 3 ] && echo "stopped with a checkpoint (MAX_MINUTES=${MAX_MINUTES:-8.5} reached, or a signal): run the same command again to continue"
    exit "$status" ;;
report) blockscale "${COMPARE[@]}" "${STUDY[@]}" --out "$out" --report-only --quiet ;;
esac
