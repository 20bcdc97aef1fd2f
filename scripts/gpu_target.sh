#!/usr/bin/env bash
# The target forward on the GPU (issue 36): the target's kernel tests (paged attention, fused small-step layer,
# programmatic dependent launch on vs off), generate --check under CUDA graphs (the speculative step vs the
# verify-shaped lossless reference), `bench target` on the SmolLM2-135M shape (B 1/8/32/64 x C 512/1k/2k/8k:
# the [B, 1] target-only step, decode with and without PDL, attention vs its floor and FlashInfer, the attention
# launch candidates), the PDL probe, the graph-replay / lossless GPU tests, then the 8B shape's rows with what
# time is left. Logs and tables under $1, packed into $1/gpu_target_logs.tgz.
# Usage on the GPU machine, from the repo root (carry ".whl" and ".peer"):  bash scripts/gpu_target.sh "$OUT"
# FlashInfer's column needs the .peer bundle (docs/target_forward.md); without it the column says why it is absent.
# BENCH_ARGS (default --no-attn-configs; BENCH_ARGS="" adds the attention launch-candidates table, ~60 s more).
# Stage timeouts in seconds (override with T_KSPLIT, T_KERNEL, T_GENERATE, T_BENCH, T_PDL, T_GRAPH, T_BENCH8B); the whole
# run stays under T_TOTAL (default 570) -- a stage gets at most what is left.
set -u
out=${1:-out}
mkdir -p "$out"
source scripts/gpu_flashinfer.sh > "$out/flashinfer_env.log" 2>&1
source scripts/gpu_env.sh
total=${T_TOTAL:-570}
budget() { local left=$((total - SECONDS)); (( left < 1 )) && left=1; (( $1 < left )) && echo "$1" || echo "$left"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
# The K-split dot tiles' A/B (DOT_K_SPLIT, docs/target_forward.md; 4 by default since 2026-12-08): the forward's graph
# replay under each setting at [1, 1] / [32, 1] and the verify shapes [1, 4] / [1, 8] / [4, 8], the first variant
# again last (the run's drift), then the whole target-only step with the split off (TLLM_EXT_DOT_K_SPLIT=1) beside
# the default's table below.
timeout "$(budget "${T_KSPLIT:-150}")" python3 scripts/profile_target_kernels.py --batch-sizes 1,32 --context 1024 \
  --variants default,ks1,ks2,dot1ks4,default > "$out/ksplit.log" 2>&1
timeout "$(budget "${T_KSPLIT:-150}")" python3 scripts/profile_target_kernels.py --steps 1x4,1x8,4x8 --context 1024 \
  --variants default,ks1,ks2,default >> "$out/ksplit.log" 2>&1
echo "k-split A/B rc=$?" | tee -a "$out/ksplit.log"; grep -E "^--" "$out/ksplit.log"
TLLM_EXT_DOT_K_SPLIT=1 timeout "$(budget "${T_KSPLIT:-150}")" python3 -m tensorrt_llm_ext.cli bench target \
  --shapes smollm2-135m --spec-shapes '' --batch-sizes 1,32 --contexts 1024 --no-layer-compare --no-attn-configs \
  > "$out/bench_target_ks1.log" 2>&1
echo "bench target (TLLM_EXT_DOT_K_SPLIT=1) rc=$?" | tee -a "$out/bench_target_ks1.log"
# the whole fused forward first (programmatic launch on vs off under graphs), then the kernels one by one
(cd tests && timeout "$(budget "${T_KERNEL:-110}")" python3 -m pytest unittest/_torch/models/test_llama_target_fused.py \
  unittest/_torch/kernels/test_paged_attention.py unittest/_torch/kernels/test_fused_linear.py \
  unittest/_torch/kernels/test_fused_qkv.py -q -p no:cacheprovider -rfE) > "$out/kernel_tests.log" 2>&1
echo "kernel tests rc=$?" | tee -a "$out/kernel_tests.log"; tail -3 "$out/kernel_tests.log"
timeout "$(budget "${T_GENERATE:-80}")" python3 -m tensorrt_llm_ext.cli generate --check --cuda-graph --no-progress \
  > "$out/generate_check.log" 2>&1
echo "generate --check rc=$?" | tee -a "$out/generate_check.log"; grep -E "check|agree|DIFFER" "$out/generate_check.log" | tail -3
# Two runs: the table is as wide as the longest context of a run, and the attention's launch form follows it (a table
# of at most 4k keys: one-block pieces, one stage -- what serve's default max_seq_len launches; docs/target_forward.md)
for ctxs in 512,1024,2048 8192; do
  timeout "$(budget "${T_BENCH:-170}")" python3 -m tensorrt_llm_ext.cli bench target --shapes smollm2-135m \
    --spec-shapes '' --batch-sizes 1,8,32,64 --contexts $ctxs --no-layer-compare ${BENCH_ARGS---no-attn-configs} \
    >> "$out/bench_target.log" 2>&1
  echo "bench target (contexts $ctxs) rc=$?" | tee -a "$out/bench_target.log"
done
grep -E "^\||launches|flashinfer" "$out/bench_target.log" | head -60
timeout "$(budget "${T_PDL:-20}")" python3 scripts/probe_pdl.py > "$out/probe_pdl.log" 2>&1
echo "probe_pdl rc=$?" | tee -a "$out/probe_pdl.log"; grep "^|" "$out/probe_pdl.log"
(cd tests && timeout "$(budget "${T_GRAPH:-120}")" python3 -m pytest integration/test_dspark_lossless.py \
  integration/test_cuda_graph_replay.py -k "cuda_graph or gpu" -q -p no:cacheprovider -rfE) > "$out/graph_tests.log" 2>&1
echo "graph tests rc=$?" | tee -a "$out/graph_tests.log"; tail -3 "$out/graph_tests.log"
timeout "$(budget "${T_BENCH8B:-100}")" python3 -m tensorrt_llm_ext.cli bench target --shapes llama-8b \
  --spec-shapes '' --batch-sizes 1,32 --contexts 1024,8192 --no-layer-compare --no-attn-configs ${BENCH8B_ARGS:-} \
  > "$out/bench_target_8b.log" 2>&1
echo "bench target 8b rc=$?" | tee -a "$out/bench_target_8b.log"; grep -E "^\|" "$out/bench_target_8b.log" | head -12
echo "total ${SECONDS}s"
tar czf "$out/gpu_target_logs.tgz" -C "$out" $(cd "$out" && ls *.log *.txt)
