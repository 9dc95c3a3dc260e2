#!/usr/bin/env bash
# The weight cache on the GPU: moe-small, nvfp4 and mxfp8, 30 optimizer steps of two micro-batches
# with --deterministic, once with the cache (default) and once with --no-weight-cache; prints
# whether the loss rows and the final weights are equal bit for bit and writes
# $OUT/weight_cache_moe_small_h200.json (docs/TRAINING.md, "The weight cache in training").
# Run from the repository root on a CUDA machine: OUT=/tmp/out bash scripts/weight_cache_check.sh
set -u
export PYTHONPATH=$PWD
for r in nvfp4 mxfp8; do for c in weight-cache no-weight-cache; do
  timeout 100 python -m blockscale train --model moe-small --recipe $r --steps 30 --grad-accum 2 --batch-size 8 --deterministic --eval-every 0 --telemetry-every 0 --log-every 1 --ckpt-every 0 --quiet --$c --out /tmp/wc/$r-$c > /tmp/wc_$r-$c.log 2>&1 || tail -5 /tmp/wc_$r-$c.log
done; done
python - <<'PY'
import json, os, statistics, torch
from safetensors.torch import load_file
from blockscale.train import read_metrics
out = {}
for r in ("nvfp4", "mxfp8"):
    runs = {c: f"/tmp/wc/{r}-{c}" for c in ("weight-cache", "no-weight-cache")}
    loss = {c: [m["loss"] for m in read_metrics(d) if m["kind"] == "train"] for c, d in runs.items()}
    tps = {c: [m.get("tokens_per_s") for m in read_metrics(d) if m["kind"] == "train"][-10:] for c, d in runs.items()}
    ck = {}
    for c, d in runs.items():
        steps = sorted(os.listdir(f"{d}/checkpoints"))
        ck[c] = load_file(f"{d}/checkpoints/{steps[-1]}/model.safetensors")
    a, b = ck.values()
    same_w = all(torch.equal(a[k], b[k]) for k in a)
    out[r] = {"steps": len(loss["weight-cache"]), "losses_equal": loss["weight-cache"] == loss["no-weight-cache"],
              "weights_equal": same_w, "loss": loss, "tokens_per_s_last10": tps}
    print(r, "steps", len(loss["weight-cache"]), "losses equal:", out[r]["losses_equal"], "weights equal:", same_w,
          "final", loss["weight-cache"][-1], loss["no-weight-cache"][-1],
          "tok/s median last10 on/off", statistics.median(tps["weight-cache"]), statistics.median(tps["no-weight-cache"]))
json.dump(out, open(os.environ["OUT"] + "/weight_cache_moe_small_h200.json", "w"), indent=1)
PY
