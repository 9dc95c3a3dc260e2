#!/usr/bin/env bash
# The GPU checks to run before an issue that touches kernels, the linear path or training is
# resolved, one part per call (a call on a lent GPU runs at most 10 minutes). From the
# repository root on the GPU machine (python3 with torch and triton; no install of blockscale):
#
#   scripts/gpu_check.sh tests OUT     every gpu-marked test (pytest -m gpu); log in OUT  (~9 min:
#                                      129 tests on 2026-11-29 were 57% done at 300 s);
#                                      FILES='tests/test_a.py tests/test_b.py' for a part of them
#   scripts/gpu_check.sh kernels OUT   check_amax_gpu + bench_quantize; JSON in OUT       (~3 min)
#   scripts/gpu_check.sh linear OUT    bench_linear + the step breakdown of each recipe    (~4 min)
#   scripts/gpu_check.sh ab OUT        the kernels changed on 2026-11-25 (SR bits hashed, MXFP8
#                                      dq rounded in FP32), dense and grouped, against the code
#                                      they replaced (A/B, one GPU, two processes each; their gpu
#                                      tests are in `tests`)                             (~4 min)
#   scripts/gpu_check.sh sweep OUT     bench_quantize --sweep: each kernel family's tiles timed
#                                      again (more configs since 2026-11-25, and a 128-register
#                                      cap), then the MoE per-group kernels at each tile and
#                                      register cap (bench_grouped_mm --kernel-tiles)     (~6 min)
#   scripts/gpu_check.sh models OUT    bench_model: llama-1b compiled, BF16 / nvfp4 / mxfp8
#                                      (~4 min; RECIPES=bf16,nvfp4 for fewer); with TILES='...'
#                                      (a sweep's --tiles line) a second process runs them with
#                                      those tiles (~8 min with all three recipes);
#                                      MODEL=llama-8b BATCH=4 for the 8B shape (~5 min)
#   scripts/gpu_check.sh cublas OUT    the MXFP8 cuBLAS route (gemm/dispatch.py, CUBLAS_BF16_OUT,
#                                      on since 2026-11-26): its GPU test, then llama-1b compiled
#                                      BF16 / mxfp8 without and with it, two processes (~5 min)
#   scripts/gpu_check.sh moe OUT       the MoE issue's tables: bench_grouped_mm (BF16, nvfp4,
#                                      mxfp8; every shape, token count and expert count) with
#                                      the per-group kernel table, then bench_moe_layer eager
#                                      and compiled                                       (~4 min)
#   scripts/gpu_check.sh train OUT     bench_train --compile on small, batch 32: the study's
#                                      speed and memory per recipe, each alone on the GPU (~2 min a
#                                      quantized recipe: compiling it; give it two at a time)
#                                      RECIPES=nvfp4-no-hadamard,... times the study's ablations
#                                      instead (bf16 always runs first: the ratios are to it)
#   scripts/gpu_check.sh gradweight OUT grad_weight with FP32 outputs (TOKENS_FP32_LAUNCH;
#                                      `halves` the default since it was timed): its GPU test, each
#                                      launch at the Mixtral-like up projection (bench_grouped_mm
#                                      --gemms), then the Mixtral-like model compiled with
#                                      each launch in LAUNCHES (all three), one process each
#                                      (~4 min; LAUNCHES="halves pointers" for fewer)
#   scripts/gpu_check.sh dqonly OUT    activation copies written as their `_dq` alone (the
#                                      default since timed on 2026-11-29): their GPU tests
#                                      (~2 min), then each MoE model's activation launches full
#                                      and `dq only` (bench_moe_kernels; over 2 min for the
#                                      two models) and bench_quantize's dense rows (~6 min)
#   scripts/gpu_check.sh dqonly-models OUT  the same in the models: compiled Mixtral-like and
#                                      llama-1b, BF16 / nvfp4 / mxfp8, with the default and
#                                      with --activation-codes (as before), one process each
#                                      (Mixtral-like ~1 min a process, llama-1b over 2.5:
#                                      ~8 min, close to a call's limit)
#   scripts/gpu_check.sh rowsws OUT    the rows GEMMs warp-specialized (ROWS_WARP_SPECIALIZE,
#                                      off): its GPU test, then bench_grouped_mm --gemms at
#                                      the Qwen3-like and DeepSeek-V3-like expert shapes
#                                      (131072 rows) against CUTLASS and our default tiles,
#                                      CONFIGS (--gemm-configs) overriding; first
#                                      benchmarks/research/ws_rows_check.py, where its bits
#                                      differ. The WS launch hung on an H200 (2026-11-29), and
#                                      with the device-made A descriptor gave wrong results
#                                      (2026-12-01): its timings mean nothing until that check
#                                      says 'same bits' or 'order only'
#   scripts/gpu_check.sh dist OUT      two GPUs: the gpu-marked distributed tests (NCCL), then
#                                      bench_distributed.py suite --parts "${PARTS:-exact,ep}"
#                                      (HF_MODELS=llama-1b,..., HF_RANKS [0,2: one GPU
#                                      without FSDP, and 2 ranks], HF_BATCH, HF_MODES and
#                                      TAG, a suffix of the JSON's name, for the hf part) (~6 min)
#
# Each part writes OUT/PART.log (and its JSON) and ends with the part's own table; the exit
# status is the first failing command's (124/137: past STEP_TIMEOUT, 570 s a command).
set -uo pipefail

PYTHON=${PYTHON:-python3}
part=${1:-}
out=${2:-}
[ -n "$part" ] && [ -n "$out" ] || { sed -n '2,69p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log="$out/$part.log"
status=0
step() {
    # a hard deadline per command (SIGTERM, then SIGKILL 10 s later): a pytest with Inductor's
    # compile workers up once ignored a plain timeout and held the call for its full 10 minutes
    timeout -k 10 "${STEP_TIMEOUT:-570}" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    [ "$status" = 0 ] && status=$rc
    return 0
}

case "$part" in
tests) step "$PYTHON" -m pytest -q -rf -m gpu -p no:cacheprovider ${FILES:-tests} ;;
kernels)
    step "$PYTHON" benchmarks/research/check_amax_gpu.py
    step "$PYTHON" benchmarks/bench_quantize.py --json "$out/bench_quantize.json" ;;
linear)
    step "$PYTHON" benchmarks/bench_linear.py --json "$out/bench_linear.json"
    for r in nvfp4 mxfp8 nvfp4_fwd_mxfp8_bwd; do
        step "$PYTHON" benchmarks/research/breakdown_linear.py --recipe "$r" --json "$out/breakdown_$r.json"
    done ;;
ab)
    step "$PYTHON" benchmarks/bench_quantize.py --only "SR,mxfp8" --json "$out/bench_quantize_new.json"
    step "$PYTHON" benchmarks/bench_quantize.py --only "SR,mxfp8" --replaced sr-philox,mx-dq-integer \
        --json "$out/bench_quantize_replaced.json"
    for variant in new replaced; do  # the MoE kernels, DeepSeek-V3-like, 8 experts
        code=""
        [ "$variant" = replaced ] && code=sr-philox,mx-dq-integer
        step "$PYTHON" benchmarks/bench_grouped_mm.py --kernels --recipes bf16 --shapes deepseek-v3 \
            --tokens 32768 --experts 8 --replaced "$code" --json "$out/grouped_$variant.json"
    done
    ;;
sweep)
    step "$PYTHON" benchmarks/bench_quantize.py --sweep --json "$out/bench_quantize_sweep.json"
    # the grouped kernels' both-direction tiles (kernels.grouped.TILES), DeepSeek-V3-like: the
    # backward's 203 registers keep 2 programs an SM at 64x64/4; 168 and 128 caps give 3 and 4
    step "$PYTHON" benchmarks/bench_grouped_mm.py --kernels --recipes bf16 --shapes deepseek-v3 \
        --tokens 32768 --experts 8 \
        --kernel-tiles "64,64,4;64,64,4,168;64,64,4,128;64,64,8;32,64,4;32,128,8;32,128,4" \
        --json "$out/grouped_kernel_tiles.json" ;;
models)
    recipes=${RECIPES:-bf16,nvfp4,mxfp8}
    model=${MODEL:-llama-1b}
    args=(--models "$model" --compile --recipes "$recipes" --batch-size "${BATCH:-8}")
    step "$PYTHON" benchmarks/bench_model.py "${args[@]}" \
        --out "$out/bench_model_${model}_compiled.json"
    if [ -n "${TILES:-}" ]; then
        step "$PYTHON" benchmarks/bench_model.py "${args[@]}" --tiles "$TILES" \
            --out "$out/bench_model_${model}_compiled_tiles.json"
    fi ;;
cublas)
    step "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemm.py -k cublas_bf16
    args=(--models llama-1b --compile --recipes bf16,mxfp8)
    step "$PYTHON" benchmarks/bench_model.py "${args[@]}" --no-cublas-bf16-out \
        --out "$out/bench_model_llama1b_mxfp8.json"
    step "$PYTHON" benchmarks/bench_model.py "${args[@]}" \
        --out "$out/bench_model_llama1b_mxfp8_cublas.json" ;;
moe)
    step "$PYTHON" benchmarks/bench_grouped_mm.py --recipes bf16 nvfp4 mxfp8 --kernels \
        --json "$out/bench_grouped_mm.json"
    step "$PYTHON" benchmarks/bench_moe_layer.py --compile --json "$out/bench_moe_layer.json" ;;
train)
    step "$PYTHON" benchmarks/bench_train.py --model small --batch-size 32 --compile \
        --recipes "${RECIPES:-bf16,nvfp4,mxfp8,nvfp4_fwd_mxfp8_bwd}" --json "$out/bench_train.json" ;;
gradweight)
    step "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/test_grouped_mm.py \
        -k fp32_grad_weight_launches
    step "$PYTHON" benchmarks/bench_grouped_mm.py --gemms --recipes bf16 --shapes mixtral-up \
        --tokens 32768 --experts 8 --json "$out/grad_weight_fp32_launches.json"
    for launch in ${LAUNCHES:-per_tile halves pointers}; do
        step "$PYTHON" benchmarks/bench_moe_model.py --models mixtral --compile --memory none \
            --recipes bf16,nvfp4,mxfp8 --steps 4 --warmup 1 --fp32-grad-weight-launch "$launch" \
            --out "$out/moe_mixtral_compiled_$launch.json"
    done ;;
dqonly)
    step "$PYTHON" -m pytest -q -rf -m gpu -p no:cacheprovider tests/test_grouped_mm.py \
        tests/test_linear.py tests/test_kernels_nvfp4.py tests/test_kernels_mxfp8.py
    step "$PYTHON" benchmarks/bench_moe_kernels.py --models mixtral deepseek-v3 \
        --json "$out/moe_kernels_dq_only.json"
    step "$PYTHON" benchmarks/bench_quantize.py --json "$out/bench_quantize_dq_only.json" ;;
rowsws)
    step "$PYTHON" benchmarks/research/ws_rows_check.py --json "$out/ws_rows_check.json"
    step "$PYTHON" -m pytest -q -rf -m gpu -p no:cacheprovider tests/test_grouped_mm.py \
        -k warp_specialized
    cfgs=${CONFIGS:-"128,256,64,8,3;128,256,64,4,3,1;128,128,64,4,4,1;128,256,64,4,4,1;128,256,128,4,2,1"}
    step "$PYTHON" benchmarks/bench_grouped_mm.py --gemms --shapes qwen3-up qwen3-down \
        --tokens 131072 --experts 128 --gemm-configs "$cfgs" --json "$out/rows_ws_qwen3.json"
    step "$PYTHON" benchmarks/bench_grouped_mm.py --gemms --shapes deepseek-up deepseek-down \
        --tokens 131072 --experts 256 --gemm-configs "$cfgs" --json "$out/rows_ws_deepseek.json" ;;
dqonly-models)
    for codes in "" --activation-codes; do
        step "$PYTHON" benchmarks/bench_moe_model.py --models mixtral --compile --memory none \
            --recipes bf16,nvfp4,mxfp8 --steps 4 --warmup 1 $codes \
            --out "$out/moe_mixtral_compiled${codes:+_full_codes}.json"
        step "$PYTHON" benchmarks/bench_model.py --models llama-1b --compile \
            --recipes bf16,nvfp4,mxfp8 --steps 5 --warmup 1 $codes \
            --out "$out/llama_1b_compiled${codes:+_full_codes}.json"
    done ;;
dist)
    [ "${TESTS:-1}" = 1 ] && step "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider \
        tests/test_distributed_*.py
    step "$PYTHON" benchmarks/bench_distributed.py suite --parts "${PARTS:-exact,ep}" \
        --hf-models "${HF_MODELS:-llama-1b,llama-8b-8l}" --hf-ranks "${HF_RANKS:-0,2}" \
        ${HF_BATCH:+--hf-batch "$HF_BATCH"} ${HF_MODES:+--hf-modes "$HF_MODES"} \
        --json "$out/bench_distributed${TAG:+_$TAG}.json" ;;
*) echo "unknown part '$part': tests, kernels, ab, sweep, linear, models, cublas, moe, train," \
        "gradweight, dqonly, dqonly-models, rowsws or dist" >&2
   exit 2 ;;
esac
echo "gpu_check $part: exit status $status (log $log)"
exit "$status"
