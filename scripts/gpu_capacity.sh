#!/usr/bin/env bash
# Capacity check (issue 36): 256 concurrent requests of 2048 tokens (prompt 1536 + output 512) through the one
# batching loop (`generate` drives serve's Scheduler) on SmolLM2-135M's shape with random weights (bf16, CUDA
# graphs, chunked prefill of max_num_tokens 8192): pool pages / tokens / GiB, peak pages in use, peak requests
# holding a slot, device memory, every request finished. Logs and capacity.json under $1.
# Usage on the GPU machine, from the repo root (carry .whl: pydantic):  bash scripts/gpu_capacity.sh "$OUT"
# Extra arguments go to scripts/gpu_capacity.py (e.g. --modes target_only,speculative); timeout T_CAPACITY (s).
set -u
out=${1:-out}
shift || true
mkdir -p "$out"
source scripts/gpu_env.sh
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
timeout "${T_CAPACITY:-300}" python3 scripts/gpu_capacity.py --out "$out" "$@" > "$out/capacity.log" 2>&1
rc=$?
echo "capacity rc=$rc" | tee -a "$out/capacity.log"
grep -vE "^\[.*\] \[TRT-LLM-EXT\] \[(INFO|DEBUG)\]" "$out/capacity.log" | tail -20
exit $rc
