"""Probe run by build_trim.py in a subprocess (CPU only).

Imports flashinfer from the given root, then generates (without compiling) the
JIT specs of the batch-decode modules the project uses and writes their ninja
files, recording every flashinfer Python module loaded and every file under the
package opened.  Prints one JSON object on stdout.
"""
import json
import os
import sys

root = os.path.realpath(sys.argv[1])
opened = set()


def _hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        p = os.fsdecode(args[0])
        try:
            p = os.path.realpath(p)
        except Exception:
            return
        if p.startswith(root + os.sep):
            opened.add(p)


sys.addaudithook(_hook)
import torch  # noqa: E402

import flashinfer  # noqa: E402
from flashinfer.decode import get_batch_decode_uri  # noqa: E402,F401
from flashinfer.jit.attention import gen_batch_decode_module  # noqa: E402
from flashinfer.utils import PosEncodingMode  # noqa: E402

assert hasattr(flashinfer, "BatchDecodeWithPagedKVCacheWrapper")
specs = []
for dt in (torch.bfloat16, torch.float16):
    for hd in (64, 128):
        spec = gen_batch_decode_module(dt, dt, dt, torch.int32, hd, hd,
                                       PosEncodingMode["NONE"].value, False, False)
        spec.write_ninja()
        specs.append({"name": spec.name, "sources": [str(s) for s in spec.sources],
                      "ninja": str(spec.ninja_path)})
mods = sorted({os.path.realpath(m.__file__) for k, m in list(sys.modules.items())
               if (k == "flashinfer" or k.startswith("flashinfer.")) and getattr(m, "__file__", None)})
print(json.dumps({"modules": mods, "opened": sorted(opened), "specs": specs,
                  "csrc_dir": str(flashinfer.jit.env.FLASHINFER_CSRC_DIR)}))
