# Source on the GPU machine after scripts/gpu_env.sh: FlashInfer 0.7.4 as a benchmark peer (bench target's
# `flashinfer attn` column), from the trimmed bundle scripts/flashinfer_peer/build_trim.py writes to .peer/
# (carry ".peer": ~10 MiB; the AOT decode modules skip the JIT on SM90). A missing bundle leaves the column out,
# with the reason in the benchmark's output.
if [ -f .peer/flashinfer_trim.tar.gz ]; then
  mkdir -p /tmp/fi /tmp/site
  [ -d /tmp/fi/flashinfer ] || tar xzf .peer/flashinfer_trim.tar.gz -C /tmp/fi
  [ -f .peer/flashinfer_aot_sm90a.tar.gz ] && tar xzf .peer/flashinfer_aot_sm90a.tar.gz -C /tmp/fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peer/apache_tvm_ffi-*.whl 2>/dev/null \
    || python3 -m zipfile -e .peer/apache_tvm_ffi-*.whl /tmp/site
  . scripts/flashinfer_peer/fi_env.sh
else
  echo "gpu_flashinfer: no .peer/flashinfer_trim.tar.gz (python3 scripts/flashinfer_peer/build_trim.py builds it)"
fi
