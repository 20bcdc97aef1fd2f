#!/usr/bin/env bash
# The target forward on the GPU (issue 36): the paged attention kernel's tests, generate --check under CUDA
# graphs, `bench target` (every row), then the graph-replay / lossless GPU tests. Logs and tables under $1.
# Usage on the GPU machine, from the repo root:  bash scripts/gpu_target.sh "$OUT"
# Each stage has its own timeout (seconds; override with T_KERNEL, T_GENERATE, T_BENCH, T_GRAPH).
set -u
out=${1:-out}
mkdir -p "$out"
source scripts/gpu_env.sh
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
(cd tests && timeout "${T_KERNEL:-90}" python3 -m pytest unittest/_torch/kernels/test_paged_attention.py -q -x \
  -p no:cacheprovider -rfE) > "$out/kernel_tests.log" 2>&1
echo "kernel tests rc=$?" | tee -a "$out/kernel_tests.log"; tail -3 "$out/kernel_tests.log"
timeout "${T_GENERATE:-90}" python3 -m tensorrt_llm_ext.cli generate --check --cuda-graph --no-progress \
  > "$out/generate_check.log" 2>&1
echo "generate --check rc=$?" | tee -a "$out/generate_check.log"; grep -E "check" "$out/generate_check.log" | tail -2
timeout "${T_BENCH:-300}" python3 -m tensorrt_llm_ext.cli bench target ${BENCH_ARGS:-} > "$out/bench_target.log" 2>&1
echo "bench target rc=$?" | tee -a "$out/bench_target.log"; grep -E "^\|" "$out/bench_target.log" | head -80
(cd tests && timeout "${T_GRAPH:-240}" python3 -m pytest integration/test_dspark_lossless.py \
  integration/test_cuda_graph_replay.py -k "cuda_graph or gpu" -q -p no:cacheprovider -rfE) > "$out/graph_tests.log" 2>&1
echo "graph tests rc=$?" | tee -a "$out/graph_tests.log"; tail -3 "$out/graph_tests.log"
