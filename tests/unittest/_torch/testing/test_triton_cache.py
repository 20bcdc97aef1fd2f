"""The prebuilt Triton cache (testing/triton_cache.py): ``triton_key()`` computed from a Triton's files equals the
running Triton's own; a cache built by the compile-only sweep, packed without IR and unpacked elsewhere (child
paths rewritten, the build directory gone) serves every specialization of a second run: nothing compiles."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import triton
from triton.runtime.cache import triton_key

import tensorrt_llm_ext
from tensorrt_llm_ext.testing.triton_cache import MANIFEST, rekey, triton_key_from, triton_key_parts

PKG = Path(tensorrt_llm_ext.__file__).parent

TINY_SWEEP = textwrap.dedent('''
    import torch
    import triton
    import triton.language as tl

    from tensorrt_llm_ext.testing.compile_sweep import SweepCase


    @triton.jit
    def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(x_ptr + offs, x * 2.0, mask=offs < n)


    def _launch():
        for dtype in (torch.float32, torch.float16):  # two specializations
            _scale_kernel[(1,)](torch.zeros(64, dtype=dtype), 64, BLOCK=64)


    SWEEP = (SweepCase("tiny", _launch, ("tiny_sweep:_scale_kernel",)),)
''')


def test_triton_key_from_the_installed_package_is_the_running_tritons_own():
    package = Path(triton.__file__).parent
    assert triton_key_from(package) == triton_key()
    assert triton_key_from(package.parent) == triton_key()  # the directory that holds triton/ (a site or a wheel)


def test_triton_key_from_a_wheel_equals_the_unpacked_tree_and_hashes_what_triton_key_walks(tmp_path):
    files = {
        "triton/__init__.py": "__version__ = '9.9.9'\n", "triton/runtime/cache.py": "# cache\n",
        "triton/compiler/__init__.py": "", "triton/compiler/compiler.py": "# c\n",
        "triton/backends/__init__.py": "", "triton/backends/nvidia/__init__.py": "",
        "triton/backends/nvidia/driver.py": "# d\n", "triton/backends/nvidia/lib/libdevice.10.bc": "not a module",
        "triton/backends/nvidia/notes/readme.py": "# a folder without __init__: not walked\n",
        "triton/_C/libtriton.so": "\x7fELF the compiler", "triton/language/__init__.py": "",
        "triton/language/core.py": "# core\n",
        "triton-9.9.9.dist-info/WHEEL": "Wheel-Version: 1.0\nTag: cp312-cp312-manylinux_2_28_x86_64\n",
    }
    tree = tmp_path / "tree"
    wheel = tmp_path / "triton-9.9.9-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            (tree / name).write_text(text)
            z.writestr(name, text)
    version, parts = triton_key_parts(tree)
    assert version == "9.9.9"
    assert [f for f, _ in parts] == ["runtime/cache.py", "compiler/compiler.py", "backends/nvidia/__init__.py",
                                     "backends/nvidia/driver.py", "_C/libtriton.so", "language/core.py"]
    assert triton_key_from(wheel) == triton_key_from(tree) == triton_key_from(tree / "triton")
    (tree / "triton/_C/libtriton.so").write_text("another build")  # what differs between cp311 and cp312 wheels
    assert triton_key_from(tree) != triton_key_from(wheel)


def test_rekey_leaves_a_cache_built_for_other_triton_sources(tmp_path):
    """Re-keying is for another build of the same sources only: a changed Python file of the compiler means
    another compiler, whose binaries must not be served."""
    package = Path(triton.__file__).parent
    version, parts = triton_key_parts(package)
    changed = [(f, h if f != "compiler/compiler.py" else "0" * 64) for f, h in parts]
    entry = tmp_path / "cache" / "SOMEENTRY"
    entry.mkdir(parents=True)
    (entry / "k.json").write_text("{}")
    (entry / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.json": "k.json"}}))
    (tmp_path / "cache" / MANIFEST).write_text(json.dumps({"triton_key": "x", "key_parts": {
        "version": version, "files": changed}, "key_rests": {"SOMEENTRY": "rest"}}))
    note = rekey(tmp_path / "cache", package)
    assert "not re-keyed" in note and "compiler/compiler.py" in note and "_C/libtriton.so" not in note, note
    assert entry.is_dir() and sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["SOMEENTRY", MANIFEST]


def _compile_check(tmp_path, *args):
    (tmp_path / "tiny_sweep.py").write_text(TINY_SWEEP)
    # the Triton of this process (a PYTHONPATH one too): the key it computes is the one the cache was built for
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), str(PKG.parent)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    proc = subprocess.run([sys.executable, "-m", "tensorrt_llm_ext.testing.compile_check", "--sweep-module",
                           "tiny_sweep", "--jobs", "1", *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _entries(cache: Path) -> set[str]:
    return {p.parent.name for p in cache.glob("*/__grp__*.json")}


def _another_build(tmp_path) -> Path:
    """The running Triton's sources with another libtriton.so: another build of the same release (as the cp311
    wheel here and the cp312 one on the GPU)."""
    other = tmp_path / "other_build" / "triton"
    shutil.copytree(Path(triton.__file__).parent, other, ignore=shutil.ignore_patterns("_C", "backends", "*.so*"))
    shutil.copytree(Path(triton.__file__).parent / "backends", other / "backends",
                    ignore=shutil.ignore_patterns("bin", "lib", "include", "*.so*"))
    (other / "_C").mkdir()
    (other / "_C" / "libtriton.so").write_bytes(b"another build")
    return other


def _unpack(tarball: Path, dest: Path, *args) -> str:
    proc = subprocess.run([sys.executable, "-m", "tensorrt_llm_ext.testing.triton_cache", "unpack", str(tarball),
                           str(dest), *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(PKG.parent)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_prebuilt_cache_moved_and_stripped_serves_every_specialization(tmp_path):
    """Built keyed for another build of this Triton (as the GPU's), packed without IR, unpacked elsewhere with the
    build directory gone: that build's key finds every specialization; re-keyed on unpack for the running Triton
    (only libtriton.so differs), the running Triton's own key finds them all too."""
    built, moved, tarball = tmp_path / "built", tmp_path / "moved", tmp_path / "cache.tar.xz"
    other = _another_build(tmp_path)
    out = _compile_check(tmp_path, "--cache-dir", str(built), "--pack", str(tarball), "--triton-key-from", str(other))
    assert "2 specializations of 1 kernels compiled" in out and "served from the cache" not in out, out
    assert "triton cache: 2 kernels" in out and "(IR dropped)" in out, out

    assert "2 kernel entries unpacked" in _unpack(tarball, moved)
    shutil.rmtree(built)  # a child path still pointing at the build directory would now be missing
    files = sorted(p.name for p in moved.rglob("*") if p.is_file())
    assert MANIFEST in files and all(f == MANIFEST or f.endswith((".json", ".cubin")) for f in files), files
    for grp in moved.glob("*/__grp__*.json"):
        children = json.loads(grp.read_text())["child_paths"]
        assert sorted(os.path.splitext(c)[1] for c in children) == [".cubin", ".json"], children
        assert all(os.path.isabs(p) and Path(p).parent == grp.parent and Path(p).is_file() for p in children.values())
    manifest = json.loads((moved / MANIFEST).read_text())
    assert manifest["entries"] == 2 and manifest["specializations"] == 2 and len(manifest["key_rests"]) == 2

    before = _entries(moved)
    out = _compile_check(tmp_path, "--cache-dir", str(moved), "--triton-key-from", str(other))
    assert "2 specializations of 1 kernels compiled" in out and "2 served from the cache" in out, out
    assert _entries(moved) == before  # no new entry: nothing compiled

    rekeyed = tmp_path / "rekeyed"
    note = _unpack(tarball, rekeyed, "--rekey-for", str(Path(triton.__file__).parent))
    assert "2 kernel entries unpacked" in note and "re-keyed 2 entries" in note, note
    assert not _entries(rekeyed) & before  # filed under other names: the key is in the lookup
    out = _compile_check(tmp_path, "--cache-dir", str(rekeyed))
    assert "2 specializations of 1 kernels compiled" in out and "2 served from the cache" in out, out
    assert len(_entries(rekeyed)) == 2
