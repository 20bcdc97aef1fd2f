#!/usr/bin/env bash
# Issue 41's GPU check of the sampling kernels on one H200, in ONE device call (cold machine included).
# Usage on the GPU machine, from the repo root (carry [".whl"]):  bash scripts/gpu_kernels.sh "$OUT/kernels"
# $1 (default ./out) receives two files only (a device call returns few): summary.txt (one line per stage,
# the test totals and the headline rows) and kernels_logs.tar.gz (every log; re-packed after each stage, so a
# run cut short still returns what it did).
#   1. the l0_h200 tests of the kernels this issue owns (verification / top-p and the block statistics,
#      selection and ordered keys, the Markov chain, strict acceptance), in three pytest processes at once (correctness only: they share
#      the GPU, and a cold machine spends most of this stage compiling, on 16 cores);
#   2. bench verify --profile: per-kernel time of one call at the TP-4 shard width, B = 1 and 32;
#   3. bench verify: the table (TP 1 and 4, B = 1 / 8 / 32 / 128, with and without top-p; the peers' columns are
#      the issue's numbers: vLLM / FlashInfer are not installed on the GPU machine);
#   4. bench step --temperature 1 --top-p 0.95 --rejection-sampling --profile, B = 1 / 8 / 32: the sampled step
#      against the greedy step of the same run, and by stage;
#   5. bench verify --one-pass-stats: the one-pass block statistics against verify_keys + verify_sums (TP 1 / 4
#      aligned shards, B = 1 / 8 / 32 / 128): whether the one-pass design is worth wiring in;
#   6. bench select: the main table (greedy % of floor, gumbel / greedy) at 64 and 256 rows;
#   7. bench markov: the chain per B on the full vocabulary (no schedule variants) and on the TP-4 shard;
#   8. with the time left: bench verify --profile at B = 32 with round 0 all-atomic (--hist-window 0) and with
#      4096-column tiles, against stage 2's rows.
# Every stage has its own limit and the whole run stays under T_TOTAL (default 560 s): a later stage gets what
# is left. The benches run one after another, after the tests, so their timings do not share the GPU.
set -u
out=${1:-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=$(mktemp -d)
summary=$out/summary.txt
: > "$summary"
source scripts/gpu_env.sh
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'python', sys.version.split()[0])"
} > "$logs/env.txt" 2>&1
cat "$logs/env.txt" >> "$summary"
pack() { cp "$summary" "$logs/summary.txt"; (cd "$logs" && tar czf "$out/kernels_logs.tar.gz" .); }
left() { local l=$(( ${T_TOTAL:-560} - SECONDS )); (( l < 1 )) && l=1; echo "$l"; }
run() {  # run NAME LIMIT CMD...: log to $logs/NAME.log, one summary line, re-pack the archive
  local name=$1 limit=$2; shift 2
  local l; l=$(left); (( limit > l )) && limit=$l
  local t0=$SECONDS
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s (limit ${limit}s)" >> "$summary"
  pack
}
# The l0_h200 test ids of one test file (optionally only names matching a pattern), read from the list itself,
# so this script never names a test the list dropped.
ids() { sed -n "s|^ *- \(${1}::[A-Za-z0-9_]*\).*|\1|p" test_lists/test-db/l0_h200.yml | grep -E "::(${2:-.*})" || true; }
verification_ids="$(ids unittest/_torch/speculative/test_verification.py) $(ids unittest/_torch/kernels/test_block_stats.py)"
selection_ids="$(ids unittest/_torch/speculative/test_vocab_parallel.py) $(ids unittest/_torch/kernels/test_ordered_key.py)
 $(ids unittest/_torch/kernels/test_spec_tail_kernels.py 'test_strict_accept.*')
 $(ids unittest/_torch/kernels/test_fail_closed.py 'test_(strict_accept|shard_select|markov).*')"
markov_ids="$(ids unittest/_torch/speculative/test_markov_chain.py) $(ids unittest/_torch/speculative/test_markov_exact_fold.py)"
tests() {  # tests NAME IDS...: one pytest process, verbose (a run cut short still shows what passed)
  local name=$1; shift
  if [ $# -eq 0 ]; then echo "$name: no test of l0_h200 selected (list changed?)" >> "$summary"; return; fi
  (cd tests && timeout "$T_TESTS" python3 -m pytest -v -p no:cacheprovider -rfE --timeout 150 "$@") \
    > "$logs/$name.log" 2>&1
  echo "$name rc=$? $(grep -cE ' PASSED' "$logs/$name.log") passed, $(grep -cE ' (FAILED|ERROR)' "$logs/$name.log") failed: $(tail -1 "$logs/$name.log")" \
    >> "$summary"
}
T_TESTS=$(( $(left) < ${T_TESTS:-150} ? $(left) : ${T_TESTS:-150} ))
t0=$SECONDS
tests tests_verification $verification_ids &
tests tests_selection $selection_ids &
tests tests_markov $markov_ids &
wait
echo "tests (three processes at once) $((SECONDS - t0))s (limit ${T_TESTS}s)" >> "$summary"
pack
run verify_profile 50 python3 -m tensorrt_llm_ext.cli bench verify --profile --tp-sizes 4 --batch-sizes 1,32
run verify 85 python3 -m tensorrt_llm_ext.cli bench verify --no-stock
run step_sampled 140 python3 -m tensorrt_llm_ext.cli bench step --temperature 1 --top-p 0.95 --rejection-sampling --profile --batch-sizes 1,8,32
run verify_one_pass 40 python3 -m tensorrt_llm_ext.cli bench verify --one-pass-stats --tp-sizes 4,1 --batch-sizes 1,8,32,128
run select 40 python3 -m tensorrt_llm_ext.cli bench select --tables main --rows 64,256 --tp-sizes 1,4
run markov 55 python3 -m tensorrt_llm_ext.cli bench markov --tables main,tp --batch 1,8,32,64,128 --variants 0 --tp-sizes 4 --tp-batch 1,32,128
# what is left: round 0 all-atomic (--hist-window 0) and 4096-column tiles, B = 32, against verify_profile's rows
run verify_profile_atomic 25 python3 -m tensorrt_llm_ext.cli bench verify --profile --tp-sizes 4 --batch-sizes 32 \
  --hist-window 0
run verify_profile_block4096 25 python3 -m tensorrt_llm_ext.cli bench verify --profile --tp-sizes 4 --batch-sizes 32 \
  --block-size 4096
for name in verify_profile verify step_sampled verify_one_pass select markov verify_profile_atomic \
  verify_profile_block4096; do  # the tables themselves (titles and rows)
  echo "--- $name" >> "$summary"
  grep -hE "^(### |\| )" "$logs/$name.log" 2>/dev/null | head -80 >> "$summary"
done
pack
cat "$summary"
rm -rf "$logs"
