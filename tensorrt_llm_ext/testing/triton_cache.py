"""A prebuilt Triton cache for the GPU machine, built on one without a GPU (test support; standard library only).

Triton looks a compiled kernel up on disk under ``sha256(key)``, where the key joins ``triton_key()`` (a hash of
Triton's own Python sources under ``compiler/``, ``backends/``, ``language/``, ``runtime/cache.py`` and of the
bytes of ``_C/libtriton.so``), the kernel's source hash and specialization, the backend's hash (the ``ptxas``
version and the arch), the options' hash and the cache-invalidating environment variables. A cache built here
hits on the GPU only if each part is what the GPU's Triton computes there; ``triton_key()`` differs between two
builds of the same Triton release (the cp311 and cp312 wheels ship different ``libtriton.so`` bytes), so the
compile-only build keys its cache with :func:`triton_key_from` of the GPU's wheel.

Each entry is a directory ``<hash>/`` holding the kernel's files and a group file ``__grp__<name>.json`` whose
``child_paths`` are ABSOLUTE paths; Triton skips a child that does not exist. :func:`pack` keeps what a
``CompiledKernel`` loads (the metadata ``.json`` and the binary, ``.cubin``) and writes child paths relative to
the entry; :func:`unpack` writes them back as absolute paths under the directory it unpacks into.

``python -m tensorrt_llm_ext.testing.triton_cache unpack TARBALL DIR`` (``scripts/gpu_env.sh``), ``key PATH``,
``pack DIR TARBALL [--keep-ir]``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

__all__ = ["KEY_REST", "MANIFEST", "count_entries", "installed_triton_dir", "key_digest", "pack", "read_manifest",
           "rekey", "triton_key_from", "triton_key_parts", "unpack", "write_key_rest"]

MANIFEST = "triton_cache_manifest.json"  # what the cache was built for (read by scripts/triton_cache_report.py)
KEY_REST = "__key_rest__"  # beside an entry built here: its cache key past triton_key() (re-keying)
_KEPT_SUFFIXES = (".json", ".cubin", ".hsaco")  # what CompiledKernel needs: metadata and the binary


# -- triton_key() of a Triton that is not the running one -------------------------------------------------------
class _Tree:
    """Read-only view of a ``triton/`` package, in a directory or inside a wheel (paths relative to it)."""

    def __init__(self, path: Path):
        self.zip = None
        if path.is_file() and path.suffix == ".whl":
            self.zip = zipfile.ZipFile(path)
            names = self.zip.namelist()
            self.files = {n[len("triton/"):] for n in names if n.startswith("triton/") and not n.endswith("/")}
            self.dirs = {str(PurePosixPath(f).parent) for f in self.files}
            self.dirs |= {str(p) for d in list(self.dirs) for p in PurePosixPath(d).parents}
            self.root = None
            self.wheel_tags = self._wheel_tags(n for n in names if n.endswith(".dist-info/WHEEL"))
        else:
            self.root = path / "triton" if (path / "triton" / "__init__.py").exists() else path
            if not (self.root / "__init__.py").exists():
                raise FileNotFoundError(f"no Triton package (triton/__init__.py) in {path}")
            self.wheel_tags = self._wheel_tags(str(p) for p in self.root.parent.glob("triton-*.dist-info/WHEEL"))

    def _wheel_tags(self, wheel_files) -> list[str]:
        for name in wheel_files:
            text = self.zip.read(name).decode() if self.zip else Path(name).read_text()
            return re.findall(r"^Tag: (\S+)", text, flags=re.M)
        return []

    def listdir(self, rel: str) -> list[str]:
        if self.zip is None:
            return os.listdir(self.root / rel)
        prefix = "" if rel in ("", ".") else rel.rstrip("/") + "/"
        return sorted({p[len(prefix):].split("/")[0] for p in self.files | self.dirs
                       if p.startswith(prefix) and p != rel and p[len(prefix):]})

    def isdir(self, rel: str) -> bool:
        return (self.root / rel).is_dir() if self.zip is None else rel in self.dirs

    def exists(self, rel: str) -> bool:
        return (self.root / rel).is_file() if self.zip is None else rel in self.files

    def open(self, rel: str):
        return open(self.root / rel, "rb") if self.zip is None else self.zip.open("triton/" + rel)


def _extension_suffixes(tree: _Tree) -> list[str]:
    """The import system's extension suffixes of the Python the Triton was built for (its wheel's tag, else ours):
    they decide which files count as modules in the walk, as on that Python."""
    import importlib.machinery

    for tag in tree.wheel_tags:
        m = re.match(r"cp(\d)(\d+)-cp\d+-(manylinux\w*_x86_64|linux_x86_64)$", tag)
        if m:
            return [f".cpython-{m.group(1)}{m.group(2)}-x86_64-linux-gnu.so", ".abi3.so", ".so"]
    return list(importlib.machinery.EXTENSION_SUFFIXES)


def _module_walk(tree: _Tree, rel: str, ext_suffixes: list[str]):
    """The files ``pkgutil.walk_packages([dir], prefix)`` resolves, in its order (sorted listing, a package before
    its contents, depth first), read as ``find_spec(name).origin``: extension, then source, then bytecode."""
    loader_suffixes = ext_suffixes + [".py", ".pyc"]
    by_length = sorted(loader_suffixes, key=len, reverse=True)  # inspect.getmodulename: longest suffix first

    def module_name(fn: str) -> str | None:
        return next((fn[:-len(s)] for s in by_length if fn.endswith(s)), None)

    def origin(base: str, is_pkg: bool) -> str | None:
        stem = f"{base}/__init__" if is_pkg else base
        return next((stem + s for s in loader_suffixes if tree.exists(stem + s)), None)

    seen: set[str] = set()
    for fn in sorted(tree.listdir(rel)):
        name = module_name(fn)
        if name == "__init__" or name in seen:
            continue
        path = f"{rel}/{fn}"
        is_pkg = False
        if not name and tree.isdir(path) and "." not in fn:
            if not any(module_name(c) == "__init__" for c in tree.listdir(path)):
                continue  # a directory without __init__ is not walked
            name, is_pkg = fn, True
        if not name or "." in name:
            continue
        seen.add(name)
        base = f"{rel}/{name}"
        found = origin(base, is_pkg)
        if found is not None:
            yield found
        if is_pkg:
            yield from _module_walk(tree, base, ext_suffixes)


def _sha256(stream, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with stream as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def triton_key_parts(path: str | os.PathLike) -> tuple[str, list[tuple[str, str]]]:
    """The version and the (file, SHA-256) pairs that ``triton_key()`` joins, for the Triton in ``path``."""
    tree = _Tree(Path(path))
    with tree.open("__init__.py") as f:
        m = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", f.read().decode(), flags=re.M)
    if m is None:
        raise ValueError(f"no __version__ in {path}'s triton/__init__.py")
    ext = _extension_suffixes(tree)
    files = ["runtime/cache.py"]
    for sub in ("compiler", "backends"):
        files += list(_module_walk(tree, sub, ext))
    files.append("_C/libtriton.so")
    files += list(_module_walk(tree, "language", ext))
    return m.group(1), [(f, _sha256(tree.open(f))) for f in files]


def triton_key_from(path: str | os.PathLike) -> str:
    """What ``triton.runtime.cache.triton_key()`` returns under the Triton in ``path`` (a ``.whl``, a directory
    holding ``triton/``, or the ``triton`` package directory), computed from its files without importing it:
    the version, then the SHA-256 of ``runtime/cache.py``, of each module under ``compiler/`` and ``backends/``,
    of ``_C/libtriton.so`` and of each module under ``language/``, joined with ``-``."""
    version, parts = triton_key_parts(path)
    return version + "-".join(h for _, h in parts)


def key_digest(key: str) -> str:
    """A short, printable stand-in for a ``triton_key()`` string (it is thousands of characters)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


# -- pack / unpack -----------------------------------------------------------------------------------------------
def _base32(hex_digest: str) -> str:
    """An entry's folder name, as Triton's cache manager names it from the key's SHA-256."""
    return base64.b32encode(bytes.fromhex(hex_digest)).decode().rstrip("=")


def write_key_rest(cache_dir: str | os.PathLike, key_sha256: str, rest: str) -> None:
    """Note beside an entry its cache key past ``triton_key()`` (source, backend, options and environment hashes):
    with it, :func:`rekey` can file the entry under another ``triton_key()``."""
    entry = Path(cache_dir) / _base32(key_sha256)
    if entry.is_dir() and not (entry / KEY_REST).exists():
        (entry / KEY_REST).write_text(rest)


def _groups(cache_dir: Path):
    return sorted(cache_dir.glob("*/__grp__*.json"))


def _point_group_at(grp: Path) -> None:
    """Rewrite a group file's children as absolute paths in its own folder (their file names are what counts)."""
    children = json.loads(grp.read_text()).get("child_paths") or {}
    grp.write_text(json.dumps({"child_paths": {c: str(grp.parent / os.path.basename(p)) for c, p in children.items()}}))


def count_entries(cache_dir: str | os.PathLike) -> int:
    """Compiled kernels in a cache directory whose group file names an existing metadata file."""
    n = 0
    for grp in _groups(Path(cache_dir)):
        try:
            children = json.loads(grp.read_text()).get("child_paths") or {}
        except (OSError, ValueError):
            continue
        n += any(c.endswith(".json") and os.path.exists(p) for c, p in children.items())
    return n


def pack(cache_dir: str | os.PathLike, tarball: str | os.PathLike, keep_ir: bool = False,
         manifest: dict | None = None) -> dict:
    """Write the kernel entries of ``cache_dir`` to ``tarball`` (``.tar.xz``: xz at its strongest preset, which
    finds the repeats between cubins, 4.1 MiB against gzip's 10.1 for the sweep; ``.tar.gz``: gzip), each group's
    child paths relative to its entry; without ``keep_ir`` only the metadata and the binary of each kernel (the
    IR files -- source, ttir, ttgir, llir, ptx -- are never read when a kernel is loaded from the cache). Returns
    counts and bytes."""
    cache_dir = Path(cache_dir)
    entries = files = raw = 0
    if str(tarball).endswith(".tar.xz"):
        opened = tarfile.open(tarball, "w:xz", preset=9 | lzma.PRESET_EXTREME)
    elif str(tarball).endswith((".tar.gz", ".tgz")):
        opened = tarfile.open(tarball, "w:gz", compresslevel=9)
    else:
        raise ValueError(f"{tarball}: expected a .tar.xz or .tar.gz name")
    rests = {}
    with opened as tar:
        for grp in _groups(cache_dir):
            entry = grp.parent
            children = json.loads(grp.read_text()).get("child_paths") or {}
            kept = {c: p for c, p in children.items()
                    if Path(p).is_file() and (keep_ir or c.endswith(_KEPT_SUFFIXES))}
            if not any(c.endswith(".json") for c in kept):
                continue  # an entry without metadata (a launcher module, an interrupted compile) is no kernel
            for child, p in sorted(kept.items()):
                tar.add(p, arcname=f"{entry.name}/{child}")
                raw += Path(p).stat().st_size
            data = json.dumps({"child_paths": {c: c for c in sorted(kept)}}).encode()
            info = tarfile.TarInfo(f"{entry.name}/{grp.name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            entries += 1
            files += len(kept)
            if (entry / KEY_REST).is_file():
                rests[entry.name] = (entry / KEY_REST).read_text()
        if manifest is not None:
            data = json.dumps(dict(manifest, entries=entries, key_rests=rests), indent=1).encode()
            info = tarfile.TarInfo(MANIFEST)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return {"entries": entries, "files": files, "raw_bytes": raw, "bytes": os.path.getsize(tarball)}


def unpack(tarball: str | os.PathLike, cache_dir: str | os.PathLike) -> int:
    """Extract ``tarball`` into ``cache_dir`` and point every group's children at their files there (absolute
    paths, as Triton writes them). Returns the kernel entries now usable in ``cache_dir``."""
    cache_dir = Path(cache_dir).resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball, "r:*") as tar:
        for member in tar.getmembers():
            if not (member.isfile() or member.isdir()) or member.name.startswith("/") or ".." in member.name.split("/"):
                raise ValueError(f"{tarball}: unexpected member {member.name!r}")
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4 / 3.12: the safe filter, and no warning
            tar.extractall(cache_dir, filter="data")
        else:  # members checked above: plain files and folders inside cache_dir
            tar.extractall(cache_dir)
    for grp in _groups(cache_dir):  # relative (pack) or absolute paths of another machine
        _point_group_at(grp)
    return count_entries(cache_dir)


def installed_triton_dir() -> str | None:
    """The ``triton`` package the running Python would import, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("triton")
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None


def rekey(cache_dir: str | os.PathLike, triton_path: str | os.PathLike) -> str:
    """File an unpacked cache's entries under the ``triton_key()`` of the Triton in ``triton_path`` when that Triton
    differs from the one the cache was keyed for in ``_C/libtriton.so`` alone (another build of the same release:
    the same version and Python sources, so the same compiler); otherwise leave it. Returns what it did."""
    cache_dir = Path(cache_dir)
    manifest = read_manifest(cache_dir)
    if not manifest or "key_parts" not in manifest:
        return "no key facts in the manifest: not re-keyed"
    version, parts = triton_key_parts(triton_path)
    key = version + "-".join(h for _, h in parts)
    if key_digest(key) == manifest.get("triton_key"):
        return f"keyed for this Triton (triton_key {key_digest(key)})"
    built, here = dict(manifest["key_parts"]["files"]), dict(parts)
    differ = sorted(f for f in set(built) | set(here) if built.get(f) != here.get(f))
    if version != manifest["key_parts"]["version"] or differ != ["_C/libtriton.so"]:
        return (f"built for another Triton ({manifest['key_parts']['version']} against {version}; files that differ: "
                f"{', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''}): not re-keyed, its entries will miss")
    moved, rests = 0, {}
    for name, rest in manifest.get("key_rests", {}).items():
        entry = cache_dir / name
        if not entry.is_dir():
            continue
        new_hash = hashlib.sha256(f"{key}-{rest}".encode()).hexdigest()
        target = cache_dir / _base32(new_hash)
        if target.exists():  # this Triton compiled it already: keep its own
            shutil.rmtree(entry)
        else:
            entry.rename(target)
            for meta in target.glob("*.json"):
                if not meta.name.startswith("__grp__"):  # the metadata names its key's hash
                    data = json.loads(meta.read_text())
                    data["hash"] = new_hash
                    meta.write_text(json.dumps(data))
            for grp in target.glob("__grp__*.json"):
                _point_group_at(grp)
            moved += 1
        rests[target.name] = rest
    (cache_dir / MANIFEST).write_text(json.dumps(dict(manifest, triton_key=key_digest(key), key_rests=rests,
                                                     rekeyed_from=manifest.get("triton_key")), indent=1))
    return (f"re-keyed {moved} entries for this Triton (triton_key {key_digest(key)}: only _C/libtriton.so differs "
            f"from the build the cache was keyed for, {manifest.get('triton_key')})")


def read_manifest(cache_dir: str | os.PathLike) -> dict | None:
    path = Path(cache_dir) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tensorrt_llm_ext.testing.triton_cache",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    k = sub.add_parser("key", help="the triton_key() digest of a Triton wheel or directory (and which files differ "
                       "from a second one)")
    k.add_argument("path")
    k.add_argument("other", nargs="?")
    pk = sub.add_parser("pack", help="pack a Triton cache directory")
    pk.add_argument("cache_dir")
    pk.add_argument("tarball")
    pk.add_argument("--keep-ir", action="store_true")
    u = sub.add_parser("unpack", help="unpack a packed cache, child paths rewritten to DIR")
    u.add_argument("tarball")
    u.add_argument("cache_dir")
    u.add_argument("--rekey-for", default=None, metavar="TRITON_DIR",
                   help="file the entries under this Triton's triton_key() when only its libtriton.so differs from "
                        "the build the cache was keyed for ('auto': the triton this Python would import)")
    args = p.parse_args(argv)
    if args.command == "key":
        key = triton_key_from(args.path)
        print(f"{args.path}: triton_key {key_digest(key)} ({key.count('-')} hashes)")
        if args.other:
            print(f"{args.other}: triton_key {key_digest(triton_key_from(args.other))}")
            (va, a), (vb, b) = triton_key_parts(args.path), triton_key_parts(args.other)
            differ = [f for f, h in a if h != dict(b).get(f)] + [f for f, _ in b if f not in dict(a)]
            print(f"hashed files that differ: {', '.join(differ) or 'none'}"
                  + ("" if va == vb else f"; versions {va} / {vb}"))
        return 0
    if args.command == "pack":
        print(json.dumps(pack(args.cache_dir, args.tarball, keep_ir=args.keep_ir)))
        return 0
    n = unpack(args.tarball, args.cache_dir)
    note = ""
    if args.rekey_for:
        where = installed_triton_dir() if args.rekey_for == "auto" else args.rekey_for
        note = "; " + (rekey(args.cache_dir, where) if where else "no triton installed: not re-keyed")
    print(f"triton cache: {n} kernel entries unpacked into {args.cache_dir}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
