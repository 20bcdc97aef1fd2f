#!/usr/bin/env python3
"""OPTIONAL add-on: pre-build, on this CPU machine, the bf16 batch-decode JIT modules
(head_dim 64 and 128, sm_90a = H100/H200) from the *trimmed* tree with FlashInfer's own
JIT code + pip's CUDA 13.0 nvcc, and pack them as FlashInfer AOT artifacts:
    flashinfer/data/aot/<module>/<module>.so
FlashInfer's JitSpec.try_load() loads data/aot/<name>/<name>.so before any JIT build
(flashinfer/jit/env.py get_aot_artifacts), so unpacking out/flashinfer_aot_sm90a.tar.gz
over the trimmed tree (same -C dir) skips the ~minutes of nvcc on the GPU machine.
Without it, the trimmed tree JIT-compiles at the first plan() as usual.
Only valid on SM90 GPUs (a wrong arch fails at the first kernel launch; then delete
flashinfer/data/aot to fall back to JIT).

Needs: out/flashinfer_trim.tar.gz (build_trim.py), the probe site (cpu_site),
a CUDA 13.0 toolchain dir, e.g.
  pip install --no-deps --target cuda13 "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" \
      "nvidia-cuda-crt==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*"
Slow on 2 cores: ~3.5 min per head_dim, single job.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--tar", default=".peer/flashinfer_trim.tar.gz")
ap.add_argument("--dest", default="/tmp/fi_trim_build", help="where the trimmed tree is unpacked")
ap.add_argument("--reuse", action="store_true", help="reuse --dest and its JIT workspace if present")
ap.add_argument("--cuda-home", default=".peer_src/cuda13/nvidia/cu13")
ap.add_argument("--site", default=".peer_src/cpu_site")
ap.add_argument("--head-dims", default="64,128")
ap.add_argument("--out", default=".peer/flashinfer_aot_sm90a.tar.gz")
a = ap.parse_args()
a.tar, a.cuda_home, a.site, a.out = (str(Path(x).resolve()) for x in (a.tar, a.cuda_home, a.site, a.out))

ws = a.dest + "_ws"
if os.environ.get("_FI_CHILD") != "1":
    if not (a.reuse and Path(a.dest, "flashinfer").is_dir()):
        shutil.rmtree(a.dest, ignore_errors=True)
        shutil.rmtree(ws, ignore_errors=True)
        os.makedirs(a.dest)
        with tarfile.open(a.tar) as tf:
            tf.extractall(a.dest)
    # link-time libs for pip's CUDA layout (no lib64/libcudart.so, no libcuda stub)
    ld = Path(a.dest + "_ld")
    ld.mkdir(exist_ok=True)
    rt = sorted(Path(a.cuda_home, "lib").glob("libcudart.so*"))[0]
    if not (ld / "libcudart.so").exists():
        (ld / "libcudart.so").symlink_to(rt)
    if not (ld / "libcuda.so").exists():
        (ld / "stub.c").write_text("void fi_libcuda_stub(void){}\n")
        subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(ld / "libcuda.so"),
                        str(ld / "stub.c")], check=True)
    env = dict(os.environ, _FI_CHILD="1", PYTHONPATH=f"{a.dest}:{a.site}", CUDA_HOME=a.cuda_home,
               FLASHINFER_CUDA_ARCH_LIST="9.0", FLASHINFER_WORKSPACE_BASE=ws, PYTHONDONTWRITEBYTECODE="1",
               MAX_JOBS="1", FLASHINFER_NVCC_THREADS="1", FLASHINFER_EXTRA_LDFLAGS=f"-L{ld}",
               LD_LIBRARY_PATH=str(Path(a.cuda_home, "lib")))
    sys.exit(subprocess.run(["nice", "-n", "10", sys.executable, __file__, *sys.argv[1:]], env=env).returncode)

import torch  # noqa: E402
import flashinfer  # noqa: E402,F401
from flashinfer.jit.attention import gen_batch_decode_module  # noqa: E402

stage = Path(a.out + ".stage")
shutil.rmtree(stage, ignore_errors=True)
names = []
for hd in [int(x) for x in a.head_dims.split(",")]:
    spec = gen_batch_decode_module(torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, hd, hd,
                                   0, False, False)
    spec.build()  # FlashInfer's own ninja build (no-op when up to date)
    mod = spec.load()  # loads through tvm-ffi: proves the .so and its exports are sane
    assert callable(mod.plan) and callable(mod.run), spec.name
    so = spec.jit_library_path
    dst = stage / "flashinfer" / "data" / "aot" / spec.name / f"{spec.name}.so"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(so, dst)
    names.append(f"{spec.name} ({so.stat().st_size} B)")
    print("built + loaded", spec.name, flush=True)
with tarfile.open(a.out, "w:gz") as tf:
    tf.add(stage / "flashinfer", arcname="flashinfer",
           filter=lambda ti: (setattr(ti, "mtime", 0), setattr(ti, "uid", 0), setattr(ti, "gid", 0),
                              setattr(ti, "uname", "root"), setattr(ti, "gname", "root"), ti)[-1])
shutil.rmtree(stage)
print(f"wrote {a.out} ({Path(a.out).stat().st_size} B):", *names, sep="\n  ")
