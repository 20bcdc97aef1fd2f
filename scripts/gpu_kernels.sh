#!/usr/bin/env bash
# Issue 41's GPU check of the verification kernels on one H200: logs under $1 (default ./out), also packed into
# $1/kernels_logs.tar.gz (a device call returns at most 8 files). A cold machine JIT-compiles every kernel on first
# use: with 45 / 20 / 15 / 35 / 60 s stage limits every stage timed out on 2026-12-04, so the limits below are
# sized for a cold start and the whole run stays under T_TOTAL (default 560 s).
# Usage on the GPU machine, from the repo root:  bash scripts/gpu_kernels.sh "$OUT"
#   1. the verification tests compiled (kernel vs twin, TP invariance over simulated shards, CUDA-graph capture
#      and replay, the new last-round counts and round-0 register windows);
#   2. bench verify --profile (per kernel, one call) at the TP-4 shard width, B = 1 and 32, with the round-0
#      register windows (the default) and all-atomic (--hist-window 0);
#      and 4096-column tiles against the default 1024 (B = 32, no change of values: the masses are tiling-exact);
#   3. bench verify, the table (TP 1 and 4, B = 1 / 8 / 32 / 128, no stock baseline);
#   4. bench step --temperature 1 --top-p 0.95 --rejection-sampling --profile at B = 1 / 8 / 32: the sampled step
#      against the greedy step of the same run, and by stage.
# The peers' columns of bench verify are the issue's reference numbers (vLLM / FlashInfer are not installed on
# the GPU machine); each stage has its own timeout so one slow stage cannot eat the others' time.
set -u
out=${1:-out}
mkdir -p "$out"
source scripts/gpu_env.sh
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])"
} > "$out/env.txt" 2>&1
run() {  # run NAME TIMEOUT CMD...: log to $out/NAME.log, one summary line
  local name=$1 limit=$2; shift 2
  local left=$(( ${T_TOTAL:-560} - SECONDS )); (( left < 1 )) && left=1; (( limit > left )) && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$out/summary.txt"
}
run test_verification 200 bash -c "cd tests && python3 -m pytest -q -p no:cacheprovider -rfE --timeout 120 \
  unittest/_torch/speculative/test_verification.py -k 'gpu_ or last_radix or round0 or tp_invariant or equals_twin \
  or extreme or narrow or distributed'"
grep -E "passed|failed" "$out/test_verification.log" | tail -1
run verify_profile 90 python3 -m tensorrt_llm_ext.cli bench verify --profile --tp-sizes 4 --batch-sizes 1,32
run verify_profile_atomic 60 python3 -m tensorrt_llm_ext.cli bench verify --profile --tp-sizes 4 --batch-sizes 1,32 \
  --hist-window 0
# the passes over every row are far above the HBM floor at B = 32 (few bytes in flight per thread): 4096-column
# tiles (16 elements per thread) against the default 1024
run verify_profile_block4096 60 python3 -m tensorrt_llm_ext.cli bench verify --profile --tp-sizes 4 --batch-sizes 32 \
  --block-size 4096
run verify 120 python3 -m tensorrt_llm_ext.cli bench verify --no-stock
run step_sampled 150 python3 -m tensorrt_llm_ext.cli bench step --temperature 1 --top-p 0.95 --rejection-sampling \
  --profile --batch-sizes 1,8,32
cat "$out/summary.txt"
(cd "$out" && tar czf kernels_logs.tar.gz --exclude kernels_logs.tar.gz .)
