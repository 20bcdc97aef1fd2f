#!/usr/bin/env bash
# The target forward on the GPU (issue 36): the target's kernel tests (paged attention, fused small-step layer),
# generate --check under CUDA graphs, `bench target` on the SmolLM2-135M shape (every B x C row, fused vs unfused
# layer, launches per step), the graph-replay / lossless GPU tests, then the 8B shape's rows with what time is left.
# Logs and tables under $1.
# Usage on the GPU machine, from the repo root:  bash scripts/gpu_target.sh "$OUT"
# Stage timeouts in seconds (override with T_KERNEL, T_GENERATE, T_BENCH, T_GRAPH, T_BENCH8B); the whole run stays
# under T_TOTAL (default 570) -- a stage gets at most what is left.
set -u
out=${1:-out}
mkdir -p "$out"
source scripts/gpu_env.sh
total=${T_TOTAL:-570}
budget() { local left=$((total - SECONDS)); (( left < 1 )) && left=1; (( $1 < left )) && echo "$1" || echo "$left"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
(cd tests && timeout "$(budget "${T_KERNEL:-120}")" python3 -m pytest unittest/_torch/kernels/test_paged_attention.py \
  unittest/_torch/kernels/test_fused_linear.py unittest/_torch/kernels/test_fused_qkv.py \
  unittest/_torch/models/test_llama_target_fused.py -q -x -p no:cacheprovider -rfE) > "$out/kernel_tests.log" 2>&1
echo "kernel tests rc=$?" | tee -a "$out/kernel_tests.log"; tail -3 "$out/kernel_tests.log"
timeout "$(budget "${T_GENERATE:-90}")" python3 -m tensorrt_llm_ext.cli generate --check --cuda-graph --no-progress \
  > "$out/generate_check.log" 2>&1
echo "generate --check rc=$?" | tee -a "$out/generate_check.log"; grep -E "check" "$out/generate_check.log" | tail -2
timeout "$(budget "${T_BENCH:-170}")" python3 -m tensorrt_llm_ext.cli bench target --shapes smollm2-135m \
  --spec-shapes '' ${BENCH_ARGS:-} > "$out/bench_target.log" 2>&1
echo "bench target rc=$?" | tee -a "$out/bench_target.log"; grep -E "^\||launches" "$out/bench_target.log" | head -40
(cd tests && timeout "$(budget "${T_GRAPH:-150}")" python3 -m pytest integration/test_dspark_lossless.py \
  integration/test_cuda_graph_replay.py -k "cuda_graph or gpu" -q -p no:cacheprovider -rfE) > "$out/graph_tests.log" 2>&1
echo "graph tests rc=$?" | tee -a "$out/graph_tests.log"; tail -3 "$out/graph_tests.log"
timeout "$(budget "${T_BENCH8B:-150}")" python3 -m tensorrt_llm_ext.cli bench target --shapes llama-8b \
  --spec-shapes '' ${BENCH8B_ARGS:-} > "$out/bench_target_8b.log" 2>&1
echo "bench target 8b rc=$?" | tee -a "$out/bench_target_8b.log"; grep -E "^\|" "$out/bench_target_8b.log" | head -20
echo "total ${SECONDS}s"
