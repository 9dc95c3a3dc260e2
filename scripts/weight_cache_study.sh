#!/usr/bin/env bash
# The 100M-token moe-small study's nvfp4 and mxfp8 arms (docs/TRAINING.md, "The 100M-token
# study": scripts/study.sh's settings, MODEL=moe-small COMPILE=0 STEPS=3052, seed 0) each run
# twice, with the weight cache (the default) and with --no-weight-cache, all --deterministic, on
# a 2-GPU machine: nvfp4's two runs side by side on GPU 0, mxfp8's on GPU 1. Then whether each
# pair's training losses, held-out losses and final weights are equal bit for bit. PAIRS
# ("nvfp4:0 mxfp8:1", recipe:GPU) picks the recipes and their GPU: "nvfp4:0" on one GPU.
#
#   DATA=dir RUNS=dir bash scripts/weight_cache_study.sh run       start, or continue from the
#       checkpoints: each run stops cleanly after MAX_MINUTES (8.3) with exit status 3; run again
#   RUNS=dir OUT=dir bash scripts/weight_cache_study.sh compare    $OUT/weight_cache_study.json
#       and a copy of each run's metrics under $OUT/metrics/
set -u
RUNS=${RUNS:?RUNS: where the runs and their checkpoints live}
REPO=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
run)
    DATA=${DATA:?DATA: the text corpus folder}
    pids=()
    for pair in ${PAIRS:-nvfp4:0 mxfp8:1}; do
        recipe=${pair%%:*} gpu=${pair##*:}
        for cache in weight-cache no-weight-cache; do
            mkdir -p "$RUNS/$cache"
            CUDA_VISIBLE_DEVICES=$gpu MODEL=${MODEL:-moe-small} COMPILE=0 STEPS=${STEPS:-3052} \
                MAX_MINUTES=${MAX_MINUTES:-8.3} EXTRA="--deterministic --$cache ${EXTRA:-}" \
                "$REPO/scripts/study.sh" run "$DATA" "$RUNS/$cache" "$recipe" \
                >> "$RUNS/$cache/$recipe.log" 2>&1 &
            pids+=($!)
        done
    done
    status=0
    for pid in "${pids[@]}"; do
        wait "$pid"; s=$?
        [ "$s" -gt "$status" ] && status=$s
    done
    for log in "$RUNS"/*/*.log; do echo "$log: $(tail -n 1 "$log")"; done
    exit "$status" ;;
compare)
    OUT=${OUT:?OUT: where the JSON goes}
    cd "$REPO" && python - "$RUNS" "$OUT" <<'PY'
import json, shutil, sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from blockscale.train.checkpoint import checkpoint_dirs
from blockscale.train.loop import read_metrics

runs, out = Path(sys.argv[1]), Path(sys.argv[2])
result = {}
for recipe in ("nvfp4", "mxfp8"):
    dirs = {c: runs / c / recipe for c in ("weight-cache", "no-weight-cache")}
    if not all(d.is_dir() for d in dirs.values()):
        continue
    rows = {c: read_metrics(d) for c, d in dirs.items()}
    train = {c: [(r["step"], r["loss"]) for r in m if r["kind"] == "train"] for c, m in rows.items()}
    evals = {c: [(r["step"], r["val_loss"]) for r in m if r["kind"] == "eval"] for c, m in rows.items()}
    weights = {}
    for c, d in dirs.items():
        last = checkpoint_dirs(d)[-1]  # the latest complete one
        weights[c] = (last.name, load_file(str(last / "model.safetensors")))
    (a_step, a), (b_step, b) = weights.values()
    result[recipe] = {
        "train_rows": [len(v) for v in train.values()],
        "last_step": [v[-1][0] if v else None for v in train.values()],
        "train_losses_equal": train["weight-cache"] == train["no-weight-cache"],
        "first_train_difference": next(
            (x for x, y in zip(*train.values()) if x != y), None),
        "val_losses": evals,
        "val_losses_equal": evals["weight-cache"] == evals["no-weight-cache"],
        "checkpoints": [a_step, b_step],
        "weights_equal": a_step == b_step and a.keys() == b.keys()
        and all(torch.equal(a[k], b[k]) for k in a),
    }
    for c, d in dirs.items():
        dest = out / "metrics" / c / recipe
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "config.json", "summary.json"):
            if (d / name).exists():
                shutil.copy(d / name, dest / name)
    r = result[recipe]
    print(recipe, "rows", r["train_rows"], "last step", r["last_step"], "train losses equal:",
          r["train_losses_equal"], "val equal:", r["val_losses_equal"], "weights equal:",
          r["weights_equal"], "final val", [v[-1][1] if v else None for v in evals.values()])
(out / "weight_cache_study.json").write_text(json.dumps(result, indent=1))
PY
    ;;
*) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2 ;;
esac
