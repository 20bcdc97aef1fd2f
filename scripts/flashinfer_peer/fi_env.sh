# source me (bash) after unpacking: puts the trimmed FlashInfer + tvm-ffi on PYTHONPATH and makes
# FlashInfer's JIT link step work when the CUDA toolkit has no lib64/libcudart.so (pip's
# nvidia/cu13 layout has lib/libcudart.so.13 only; FlashInfer links -L$CUDA_HOME/lib64 -lcudart -lcuda).
#   FI_ROOT (default /tmp/fi)  : where flashinfer_trim.tar.gz was unpacked
#   FI_SITE (default /tmp/site): where the apache-tvm-ffi wheel was installed (pip --target)
FI_ROOT=${FI_ROOT:-/tmp/fi}
FI_SITE=${FI_SITE:-/tmp/site}
export PYTHONPATH="$FI_ROOT:$FI_SITE${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${CUDA_HOME:-}" ]; then
  if command -v nvcc >/dev/null 2>&1; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  elif [ -x /usr/local/cuda/bin/nvcc ]; then
    CUDA_HOME=/usr/local/cuda
  else  # pip's cuda-toolkit (nvidia-cuda-nvcc) layout
    CUDA_HOME=$(python3 - <<'EOF' 2>/dev/null
import glob, os, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for n in sorted(glob.glob(os.path.join(d, "nvidia", "cu*", "bin", "nvcc"))):
        print(os.path.dirname(os.path.dirname(n))); sys.exit(0)
EOF
)
  fi
  export CUDA_HOME
fi
echo "fi_env: CUDA_HOME=${CUDA_HOME:-<none>} nvcc=$([ -x "$CUDA_HOME/bin/nvcc" ] && "$CUDA_HOME/bin/nvcc" --version | tail -2 | head -1)"
if [ -n "${CUDA_HOME:-}" ] && [ ! -e "$CUDA_HOME/lib64/libcudart.so" ]; then
  FI_LD=${FI_LD:-/tmp/fi_ld}
  mkdir -p "$FI_LD"
  rt=$(ls "$CUDA_HOME"/lib64/libcudart.so* "$CUDA_HOME"/lib/libcudart.so* \
          "$CUDA_HOME"/targets/*/lib/libcudart.so* 2>/dev/null | head -1)
  [ -z "$rt" ] && rt=$(python3 -c "import glob,os,torch;d=os.path.dirname(os.path.dirname(torch.__file__));print((sorted(glob.glob(d+'/nvidia/cu*/lib/libcudart.so*'))+sorted(glob.glob(d+'/nvidia/cuda_runtime/lib/libcudart.so*'))+[''])[0])" 2>/dev/null)
  drv=$(ls "$CUDA_HOME"/lib64/stubs/libcuda.so "$CUDA_HOME"/lib/stubs/libcuda.so 2>/dev/null | head -1)
  [ -z "$drv" ] && drv=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? /{print $NF; exit}')
  [ -n "$rt" ] && ln -sfn "$rt" "$FI_LD/libcudart.so"
  if [ -n "$drv" ]; then ln -sfn "$drv" "$FI_LD/libcuda.so"
  elif [ ! -e "$FI_LD/libcuda.so" ]; then  # link-time stub only; soname makes the loader use the driver's
    echo 'void fi_libcuda_stub(void){}' > "$FI_LD/stub.c" &&
      ${CC:-cc} -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$FI_LD/libcuda.so" "$FI_LD/stub.c" && drv="stub"
  fi
  export FLASHINFER_EXTRA_LDFLAGS="${FLASHINFER_EXTRA_LDFLAGS:+$FLASHINFER_EXTRA_LDFLAGS }-L$FI_LD"
  echo "fi_env: no $CUDA_HOME/lib64/libcudart.so; linking via $FI_LD (cudart=${rt:-MISSING} cuda=${drv:-MISSING})"
fi
