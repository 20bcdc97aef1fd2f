#!/usr/bin/env bash
# One batched GPU validation run (the l0_h200 list, then the benchmarks), logs under $1 (default ./out).
# Usage on the GPU machine, from the repo root:  bash scripts/gpu_validate.sh "$OUT" [bench ...]
# Each stage is bounded by its own timeout so one slow stage cannot eat the others' time.
# TESTS="path::name ..." runs those tests instead of the whole l0_h200 list (a short device budget);
# BENCH_ARGS_<name>="..." passes arguments to `bench <name>`. PACK_CACHE=1 (the default; 0: off) packs this
# machine's Triton cache after the tests into $1/gpu_triton_cache.tar.xz: carried as .triton_cache.tar.xz next
# time, every kernel the run compiled loads instead of compiling (docs/compile_check.md).
set -u
out=${1:-out}; shift || true
benches=("$@"); [ ${#benches[@]} -gt 0 ] || benches=(step verify exchange)
mkdir -p "$out"
source scripts/gpu_env.sh
# l0_h200's SmolLM2 test fails without its GGUF: the one gpu_real_model.sh prepare joined on this machine
joined=out/real_model/SmolLM2-135M-Instruct.Q4_1.gguf
[ -z "${TLLM_EXT_SMOLLM2_GGUF:-}" ] && [ -f "$joined" ] && export TLLM_EXT_SMOLLM2_GGUF=$PWD/$joined
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])"; } > "$out/env.txt" 2>&1
if [ -n "${TESTS:-}" ]; then
  (cd tests && timeout "${L0_TIMEOUT:-330}" python3 -m pytest $TESTS -q --timeout 150 -p no:cacheprovider -rfE) > "$out/l0_h200.log" 2>&1
else
  timeout "${L0_TIMEOUT:-330}" python3 -m tensorrt_llm_ext.cli test-list l0_h200 --jobs "${L0_JOBS:-8}" -- -q --timeout 150 \
    -p no:cacheprovider -rfE > "$out/l0_h200.log" 2>&1
fi
echo "l0_h200 rc=$?" >> "$out/l0_h200.log"
grep -E "passed|failed" "$out/l0_h200.log" | tail -2
if [ "${PACK_CACHE:-1}" = 1 ] && [ -d "${TRITON_CACHE_DIR:-}" ]; then
  python3 -m tensorrt_llm_ext.testing.triton_cache pack "$TRITON_CACHE_DIR" "$out/gpu_triton_cache.tar.xz" | tail -1
fi
for b in "${benches[@]}"; do
  extra_var="BENCH_ARGS_$b"
  timeout "${BENCH_TIMEOUT:-120}" python3 -m tensorrt_llm_ext.cli bench $b ${!extra_var:-} > "$out/bench_$b.log" 2>&1
  echo "bench $b rc=$?" >> "$out/bench_$b.log"
  tail -1 "$out/bench_$b.log"
done
