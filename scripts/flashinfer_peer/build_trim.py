#!/usr/bin/env python3
"""Build a trimmed FlashInfer tree holding only what ``import flashinfer`` and the
JIT of ``BatchDecodeWithPagedKVCacheWrapper`` (fa2 CUDA-core decode: plan + run) need.

Output: ``out/flashinfer_trim.tar.gz`` -- a plain directory tarball whose root holds
``flashinfer/`` (unpack it and put the folder on PYTHONPATH), plus
``out/FLASHINFER_TRIM_MANIFEST.txt`` and a copy of the apache-tvm-ffi wheel.

How the contents are chosen (all from the wheel itself, nothing guessed by hand):

* Python: a probe subprocess (fi_probe.py, CPU only) imports the *full* extracted
  package, generates the batch-decode JIT specs (bf16/fp16 x head_dim 64/128; these are
  the sources ``get_batch_decode_module`` compiles on the GPU) and writes their
  ninja files against a fake CUDA home.  Every flashinfer module it loaded is kept.
  To that, the module-level (import-time) imports of those modules are added
  statically and recursively, so that a branch not taken on this CPU machine (e.g.
  one gated on CUDA availability) cannot hit a dropped module on the GPU.
* Files the probe opened under the package (csrc sources, jinja templates and
  ``data/cutlass/include/cutlass/arch/arch.h``, which ``compilation_context`` reads
  at import to decide SM107 support) are kept.
* C++: ``data/include`` is kept whole; ``data/cccl/libcudacxx`` is kept whole (the
  vendored CCCL 3.6 is put *before* the CUDA toolkit's own CCCL with -I, so partial
  copies would mix versions); from ``data/csrc``, ``cutlass``, ``spdlog``, ``cub`` and
  ``thrust`` only the files reached by a recursive ``#include`` scan of the
  generated sources are kept (the scan ignores #if, so it over-approximates).  All
  top-level csrc ``*.jinja`` templates are kept (small).  Include directories that end
  up empty are still created so the ninja command lines stay the same.
* A second probe run on the trimmed tree must import, regenerate the same specs,
  and leave no ``#include`` unresolved that resolved in the full tree.

Usage: python3 build_trim.py [--wheel W] [--tvm-wheel T] [--out DIR]
        [--probe-python PY] [--probe-site DIR]
The probe environment needs torch (CPU is fine), jinja2, filelock, packaging, numpy,
requests, tqdm, plus what the GPU machine has and the CPU venv lacks: apache-tvm-ffi
(for the probe interpreter's Python), nvidia-ml-py, einops, tabulate, cuda-bindings,
cuda-core, cuda-pathfinder.  ``--setup-probe-site`` pip-installs those into
``--probe-site``.  Deliberately *not* installed, as on the GPU machine: cuda-tile,
nvidia-cutlass-dsl, nvidia-cudnn-frontend, nccl4py, nccl-extensions.
"""
from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEF_WHEEL = Path(".peer_src/flashinfer_python-0.7.4-py3-none-any.whl")
DEF_TVM = Path(".peer_src/apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl")
# pinned (installed --no-deps: only these, never a newer torch or CUDA wheel pulled in); the versions of the
# 2026-12-04 rebuild
PROBE_DEPS = ["nvidia-ml-py==13.615.71", "einops==0.8.2", "tabulate==0.10.0", "ninja==1.13.2",
              "cuda-bindings==13.5.0", "cuda-core==1.2.2", "cuda-pathfinder==1.9.0", "apache-tvm-ffi==0.1.15.post2"]
# Include dirs, in the order flashinfer.jit.cpp_ext puts them on the nvcc line
# (vendored CCCL with -I first, then -isystem ...).  Relative to flashinfer/data.
SEARCH = ["cccl/cub", "cccl/libcudacxx/include", "cccl/thrust", "include", "csrc",
          "cutlass/include", "cutlass/tools/util/include", "spdlog/include"]
KEEP_WHOLE = ["include", "cccl/libcudacxx"]
EXTRA_PY = ["py.typed", "version.py", "_build_meta.py"]
INC = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def log(*a):
    print("[fi-trim]", *a, flush=True)


def extract(wheel: Path, dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("flashinfer/")]
        z.extractall(dest, names)
    return dest / "flashinfer"


def run_probe(py: str, site: Path, pkg_parent: Path, work: Path) -> dict:
    fake = work / "fakecuda"
    (fake / "bin").mkdir(parents=True, exist_ok=True)
    (fake / "include").mkdir(exist_ok=True)
    nvcc = fake / "bin" / "nvcc"
    nvcc.write_text('#!/bin/sh\necho "nvcc: NVIDIA (R) Cuda compiler driver"\n'
                    'echo "Cuda compilation tools, release 13.0, V13.0.88"\n')
    nvcc.chmod(0o755)
    ws = work / "fi_ws"
    shutil.rmtree(ws, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_")}
    env.update(PYTHONPATH=f"{pkg_parent}{os.pathsep}{site}", PYTHONDONTWRITEBYTECODE="1",
               CUDA_HOME=str(fake), FLASHINFER_CUDA_ARCH_LIST="9.0", FLASHINFER_WORKSPACE_BASE=str(ws),
               CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([py, str(HERE / "probe.py"), str(pkg_parent / "flashinfer")], env=env,
                       cwd=str(work), capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-6000:])
        raise SystemExit(f"probe failed (rc={r.returncode}) on {pkg_parent}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def module_level_imports(path: Path, modname: str, is_pkg: bool) -> set[str]:
    """flashinfer modules imported at module level (not inside def/class bodies)."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    pkg = modname if is_pkg else modname.rpartition(".")[0]

    def visit(stmts):
        for n in stmts:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(n, ast.Import):
                out.update(a.name for a in n.names if a.name.split(".")[0] == "flashinfer")
            elif isinstance(n, ast.ImportFrom):
                if n.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (n.level - 1)]
                    mod = ".".join(base + ([n.module] if n.module else []))
                else:
                    mod = n.module or ""
                if mod.split(".")[0] != "flashinfer":
                    continue
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in n.names)  # may be submodules
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(n, field, None)
                if isinstance(sub, list):
                    visit(sub)
            if isinstance(n, ast.With):
                pass  # body handled above
    visit(tree.body)
    return out


def mod_to_file(root: Path, mod: str) -> Path | None:
    rel = mod.split(".")[1:]
    p = root.joinpath(*rel)
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    f = p.with_suffix(".py") if rel else root / "__init__.py"
    return f if f.is_file() else None


def file_to_mod(root: Path, f: Path) -> tuple[str, bool]:
    rel = f.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def python_closure(root: Path, loaded: list[str]) -> tuple[set[Path], list[str]]:
    keep = {Path(p) for p in loaded}
    todo = list(keep)
    added_static = []
    while todo:
        f = todo.pop()
        mod, is_pkg = file_to_mod(root, f)
        for m in module_level_imports(f, mod, is_pkg):
            # every parent package's __init__ too
            parts = m.split(".")
            for i in range(1, len(parts) + 1):
                g = mod_to_file(root, ".".join(parts[:i]))
                if g is not None and g not in keep:
                    keep.add(g)
                    todo.append(g)
                    added_static.append(".".join(parts[:i]))
    return keep, sorted(set(added_static))


def include_scan(roots: list[Path], search: list[Path]) -> tuple[set[Path], set[str]]:
    seen: set[Path] = set()
    unresolved: set[str] = set()
    stack = list(roots)
    while stack:
        f = stack.pop()
        if f in seen:
            continue
        seen.add(f)
        for kind, name in INC.findall(f.read_text(errors="replace")):
            cands = ([f.parent] if kind == '"' else []) + search
            for d in cands:
                p = d / name
                if p.is_file():
                    stack.append(p.resolve())
                    break
            else:
                unresolved.add(name)
    return seen, unresolved


def cxx_closure(pkg: Path, probe: dict) -> tuple[set[Path], set[str]]:
    data = (pkg / "data").resolve()
    search = [data / s for s in SEARCH]
    roots = []
    for s in probe["specs"]:
        for src in s["sources"]:
            roots.append(Path(src))
        gen = Path(s["sources"][0]).parent
        roots += sorted(gen.glob("*.inc"))
    seen, unresolved = include_scan(roots, search)
    # unresolved names that only exist in the generated dir are fine ("batch_decode_config.inc")
    return {p for p in seen if data in p.parents}, unresolved


def copy_rel(src_root: Path, dst_root: Path, rel: Path):
    d = dst_root / rel
    d.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src_root / rel, d)


def det_tar(src_parent: Path, names: list[str], out: Path):
    """Deterministic tar.gz (sorted, mtime 0, root-owned)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        paths = []
        for n in names:
            base = src_parent / n
            paths.append(base)
            paths += list(base.rglob("*")) if base.is_dir() else []
        for p in sorted(set(paths)):
            ti = tf.gettarinfo(str(p), arcname=str(p.relative_to(src_parent)))
            ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = 0, 0, 0, "root", "root"
            ti.mode = 0o755 if p.is_dir() else 0o644
            if p.is_file():
                with open(p, "rb") as fh:
                    tf.addfile(ti, fh)
            else:
                tf.addfile(ti)
    with open(out, "wb") as fh, gzip.GzipFile(fileobj=fh, mode="wb", compresslevel=9, mtime=0,
                                              filename="") as gz:
        gz.write(buf.getvalue())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", type=Path, default=DEF_WHEEL)
    ap.add_argument("--tvm-wheel", type=Path, default=DEF_TVM)
    ap.add_argument("--out", type=Path, default=Path(".peer"))
    ap.add_argument("--work", type=Path, default=Path(".peer_src/work"))
    ap.add_argument("--probe-python", default=sys.executable)
    ap.add_argument("--probe-site", type=Path, default=Path(".peer_src/cpu_site"))
    ap.add_argument("--setup-probe-site", action="store_true",
                    help="pip install the probe-only deps into --probe-site first")
    args = ap.parse_args()
    # the probe runs in --work: paths given relative to the caller's folder must not be read from there
    args.probe_site, args.wheel, args.tvm_wheel = (p.resolve() for p in (args.probe_site, args.wheel, args.tvm_wheel))

    if args.setup_probe_site:
        subprocess.run([args.probe_python, "-m", "pip", "install", "--upgrade", "--no-deps", "--target",
                        str(args.probe_site), *PROBE_DEPS], check=True)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    log("extracting", args.wheel.name)
    full_parent = work / "full"
    full = extract(args.wheel, full_parent)

    log("probe on the full tree")
    probe = run_probe(args.probe_python, args.probe_site, full_parent, work)
    loaded = [p for p in probe["modules"]]
    py_keep, static_added = python_closure(full, loaded)
    for e in EXTRA_PY:
        if (full / e).is_file():
            py_keep.add(full / e)
    opened = {Path(p) for p in probe["opened"] if not p.endswith((".py", ".pyc"))}
    cxx_keep, unresolved_full = cxx_closure(full, probe)
    data = (full / "data").resolve()
    csrc = data / "csrc"
    jinja = set(csrc.glob("*.jinja"))

    log(f"python: {len(loaded)} modules loaded by the probe, +{len(static_added)} from static "
        f"module-level imports; C++ scan reached {len(cxx_keep)} files under data/")

    # ---- assemble the trimmed tree
    trim_parent = work / "trim"
    shutil.rmtree(trim_parent, ignore_errors=True)
    trim = trim_parent / "flashinfer"
    trim.mkdir(parents=True)
    files: set[Path] = set()
    files |= {p.resolve() for p in py_keep}
    files |= {p.resolve() for p in opened}
    files |= cxx_keep | jinja
    for w in KEEP_WHOLE:
        files |= {p.resolve() for p in (data / w).rglob("*") if p.is_file()}
    for f in sorted(files):
        copy_rel(full.resolve(), trim, f.relative_to(full.resolve()))
    for s in SEARCH:  # keep every include dir on the nvcc line present, even if empty
        (trim / "data" / s).mkdir(parents=True, exist_ok=True)

    # ---- what was dropped, by top-level area (for the manifest)
    def area(rel: Path) -> str:
        parts = rel.parts
        if parts[0] == "data":
            return "/".join(parts[:3]) if len(parts) > 3 and parts[1] in ("cccl", "cutlass") else "/".join(parts[:2])
        return parts[0] if len(parts) > 1 else "(top-level .py)"
    dropped: dict[str, list[int]] = {}
    kept: dict[str, list[int]] = {}
    for p in full.rglob("*"):
        if not p.is_file():
            continue
        rel = p.relative_to(full)
        tgt = kept if (trim / rel).is_file() else dropped
        a = tgt.setdefault(area(rel), [0, 0])
        a[0] += 1
        a[1] += p.stat().st_size

    # ---- verify: probe again on the trimmed tree
    log("probe on the trimmed tree")
    probe2 = run_probe(args.probe_python, args.probe_site, trim_parent, work)
    _, unresolved_trim = cxx_closure(trim, probe2)
    newly = sorted(unresolved_trim - unresolved_full)
    if newly:
        raise SystemExit(f"trimmed tree leaves includes unresolved: {newly}")
    if [s["name"] for s in probe2["specs"]] != [s["name"] for s in probe["specs"]]:
        raise SystemExit("trimmed tree generates different JIT specs")
    for s2 in probe2["specs"]:
        for src in s2["sources"]:
            txt = Path(src).read_text()
            if not txt:
                raise SystemExit(f"empty generated source {src}")
    into = sorted({str(p.relative_to(data)).split("/")[0] + "/" + str(p.relative_to(data)).split("/")[1]
                   for p in cxx_keep})

    notes = [
        "flashinfer_trim: FlashInfer 0.7.4 trimmed to import + BatchDecodeWithPagedKVCacheWrapper "
        "(fa2 CUDA-core decode JIT).",
        f"source wheel: {args.wheel.name} sha256={hashlib.sha256(args.wheel.read_bytes()).hexdigest()}",
        "built by scripts/flashinfer_peer/build_trim.py. No file content was edited;",
        "only files were left out. Other FlashInfer APIs may fail with ModuleNotFoundError or missing",
        "csrc files at their first use; BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=False,",
        "backend='auto'|'fa2') on SM80/SM90 is the supported surface.",
        "",
        f"python modules loaded by `import flashinfer` + decode spec generation: {len(loaded)};",
        f"added from static module-level imports (not executed on the CPU probe): {len(static_added)}",
        *(f"  + {m}" for m in static_added),
        f"include dirs reached by the #include scan of the decode sources: {', '.join(into)}",
        "C++ includes not resolved inside the package (CUDA toolkit / libstdc++ / tvm-ffi headers):",
        "  " + " ".join(sorted(unresolved_full)),
        "",
        "kept (files, bytes) by area:",
        *(f"  {k}: {v[0]} files, {v[1]} B" for k, v in sorted(kept.items())),
        "dropped (files, bytes) by area:",
        *(f"  {k}: {v[0]} files, {v[1]} B" for k, v in sorted(dropped.items())),
    ]
    (trim / "TRIM_MANIFEST.txt").write_text("\n".join(notes) + "\n")
    (args.out / "FLASHINFER_TRIM_MANIFEST.txt").write_text("\n".join(notes) + "\n")

    lic = trim_parent / "flashinfer_trim_licenses"
    with zipfile.ZipFile(args.wheel) as z:
        for n in z.namelist():
            if ".dist-info/licenses/" in n and not n.endswith("/"):
                d = lic / n.split(".dist-info/licenses/", 1)[1]
                d.parent.mkdir(parents=True, exist_ok=True)
                d.write_bytes(z.read(n))
    out_tar = args.out / "flashinfer_trim.tar.gz"
    det_tar(trim_parent, ["flashinfer", "flashinfer_trim_licenses"], out_tar)
    tvm = args.tvm_wheel.name
    cmd = ("mkdir -p /tmp/fi /tmp/site && tar xzf .peer/flashinfer_trim.tar.gz -C /tmp/fi && "
           f"{{ python3 -m pip install -q --no-index --no-deps --target /tmp/site .peer/{tvm} || "
           f"python3 -m zipfile -e .peer/{tvm} /tmp/site; }} && "
           ". scripts/flashinfer_peer/fi_env.sh && python3 scripts/flashinfer_peer/smoke.py --all")
    aot = cmd.replace("-C /tmp/fi && ", "-C /tmp/fi && tar xzf .peer/flashinfer_aot_sm90a.tar.gz -C /tmp/fi && ", 1)
    (args.out / "GPU_COMMAND.txt").write_text(
        "# optional, SM90 only: with out/flashinfer_aot_sm90a.tar.gz (build_aot.py) also carried,\n"
        "# this variant skips the nvcc JIT on the GPU (prebuilt bf16 decode modules, head_dim 64/128):\n# "
        + aot + "\n"
        "# default (JIT at first plan()):\n"
        "# carry .peer/ (flashinfer_trim.tar.gz, " + tvm + "); fi_env.sh and smoke.py travel with the tree\n"
        "# (FI_ROOT=/tmp/fi FI_SITE=/tmp/site are fi_env.sh's defaults; the zipfile fallback equals pip --target for this wheel: no .data dir)\n" + cmd + "\n")
    shutil.copy2(args.tvm_wheel, args.out / args.tvm_wheel.name)
    n_files = sum(1 for p in trim.rglob("*") if p.is_file())
    unpacked = sum(p.stat().st_size for p in trim.rglob("*") if p.is_file())
    log(f"wrote {out_tar} ({out_tar.stat().st_size / 2**20:.2f} MiB; {n_files} files, "
        f"{unpacked / 2**20:.1f} MiB unpacked) + {args.tvm_wheel.name} "
        f"({args.tvm_wheel.stat().st_size / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
