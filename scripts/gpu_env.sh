# Source on the GPU machine: carried wheels (pydantic, nvtx) into /tmp/site, source tree on PYTHONPATH.
# NVLink multicast stays off (shared hosts).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
trtllm-ext() { python3 -m tensorrt_llm_ext.cli "$@"; }
# A prebuilt Triton cache, when carried (.triton_cache.tar.xz from `trtllm-ext compile-check --pack`; see
# docs/compile_check.md): unpacked into TRITON_CACHE_DIR with its entries pointed at their new place (and filed
# under this Triton's key if it is another build of the release it was keyed for), so the kernels the compile
# sweep covers load instead of compiling. Without it, or if unpacking fails, Triton compiles as usual.
if [ -f .triton_cache.tar.xz ]; then
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
  python3 -m tensorrt_llm_ext.testing.triton_cache unpack .triton_cache.tar.xz "$TRITON_CACHE_DIR" --rekey-for auto \
    || echo "triton cache: .triton_cache.tar.xz not unpacked; kernels compile as usual"
fi
