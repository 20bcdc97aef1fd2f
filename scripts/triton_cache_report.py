"""Whether the prebuilt Triton cache hits on this machine, and how many kernels a command compiled (GPU machine).

Prints this Triton's ``triton_key()`` digest, the backend hash's ``ptxas`` release and the cache directory's
entries, and compares them with the manifest the cache was built with (``trtllm-ext compile-check --pack``;
docs/compile_check.md): a key or ptxas that differs means every prebuilt entry misses. With a command after
``--`` it runs the command with a Triton compilation listener in every Python process it starts (a
``sitecustomize`` on ``PYTHONPATH``) and prints the hits and compiles it saw, the kernels compiled and the
launcher modules built (gcc, not in the prebuilt cache). Never fails because of the report; with a command,
exits with the command's status. Usage, after ``source scripts/gpu_env.sh``:

    python3 scripts/triton_cache_report.py                       # the facts only
    python3 scripts/triton_cache_report.py -- bash scripts/gpu_kernels.sh
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the source tree, also when run from elsewhere

_EVENTS_ENV = "TRTLLM_EXT_TRITON_EVENTS"
# Installed in each Python process of the command: appends one line per compile() (hit or not), then runs the
# sitecustomize it shadows, if any.
_SITECUSTOMIZE = '''
import json, os, sys

def _trtllm_ext_listen():
    path = os.environ.get("%(env)s")
    if not path:
        return
    try:
        from triton import knobs
    except Exception:
        return
    previous = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        try:
            with open(path, "a") as f:
                f.write(json.dumps({"hit": bool(cache_hit), "name": str(metadata.get("name")),
                                    "pid": os.getpid()}) + "\\n")
        except Exception:
            pass
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    knobs.compilation.listener = listener

_trtllm_ext_listen()
_here = os.path.dirname(os.path.abspath(__file__))
for _p in sys.path:
    _next = os.path.join(_p, "sitecustomize.py")
    if os.path.abspath(_p or ".") != _here and os.path.isfile(_next):
        exec(compile(open(_next).read(), _next, "exec"), {"__name__": "sitecustomize", "__file__": _next})
        break
''' % {"env": _EVENTS_ENV}


def _cache_dir() -> Path:
    from triton import knobs

    return Path(knobs.cache.dir)


def _snapshot(cache: Path) -> tuple[set[str], set[str]]:
    """Kernel entries (hash folders with a group file) and launcher / utility modules (.so) in the cache."""
    if not cache.is_dir():
        return set(), set()
    kernels = {p.parent.name for p in cache.glob("*/__grp__*.json")}
    modules = {str(p.relative_to(cache)) for p in cache.glob("*/*.so")}
    return kernels, modules


def facts() -> None:
    import triton
    from triton.compiler import make_backend
    from triton.runtime.cache import triton_key

    from tensorrt_llm_ext.testing.triton_cache import count_entries, key_digest, read_manifest

    try:
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
    except Exception as e:  # no GPU here: the H200's target, to read the ptxas this Triton would use
        from triton.backends.compiler import GPUTarget

        print(f"(no active GPU driver: {type(e).__name__}; assuming sm_90)")
        target = GPUTarget("cuda", 90, 32)
    key = key_digest(triton_key())
    backend_hash = make_backend(target).hash()
    release = re.search(r"release [^\n]*", backend_hash)
    from triton import knobs

    ptxas = knobs.nvidia.ptxas
    print(f"triton {triton.__version__} ({os.path.dirname(triton.__file__)}), python {sys.version.split()[0]}: "
          f"triton_key {key}; sm_{target.arch} ptxas {release.group(0) if release else backend_hash!r} "
          f"({ptxas.path if ptxas else '?'}); TRITON_PTXAS_PATH={os.environ.get('TRITON_PTXAS_PATH', '(unset)')}")
    cache = _cache_dir()
    manifest = read_manifest(cache)
    print(f"cache {cache}: {count_entries(cache) if cache.is_dir() else 0} kernel entries")
    if manifest is None:
        print("no prebuilt cache manifest there (not unpacked: carry .triton_cache.tar.xz, source scripts/gpu_env.sh)")
        return
    built_hash = manifest.get("backend_hashes", {}).get(str(target.arch))
    key_ok, ptxas_ok = manifest.get("triton_key") == key, built_hash == backend_hash
    print(f"prebuilt: {manifest.get('entries')} entries built under {manifest.get('built_under')} for triton_key "
          f"{manifest.get('triton_key')} ({'matches' if key_ok else 'DIFFERS: every entry misses'}), "
          f"sm_{target.arch} ptxas {'matches' if ptxas_ok else 'DIFFERS: every entry misses'}")


def run(command: list[str]) -> int:
    cache = _cache_dir()
    before = _snapshot(cache)
    with tempfile.TemporaryDirectory(prefix="triton_cache_report_", ignore_cleanup_errors=True) as hook:
        Path(hook, "sitecustomize.py").write_text(_SITECUSTOMIZE)
        events = Path(hook, "events.jsonl")
        env = dict(os.environ, **{_EVENTS_ENV: str(events)})
        env["PYTHONPATH"] = os.pathsep.join([hook] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        rc = subprocess.call(command, env=env)
        try:
            seen = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
            after = _snapshot(cache)
            hits = sum(e["hit"] for e in seen)
            compiled = collections.Counter(e["name"] for e in seen if not e["hit"])
            top = ", ".join(f"{n} x{c}" for n, c in compiled.most_common(8))
            print(f"triton cache during the command: {hits} hits, {sum(compiled.values())} compiles "
                  f"({len(compiled)} kernels{': ' + top if top else ''}); {len(after[0] - before[0])} new entries, "
                  f"{len(after[1] - before[1])} launcher / utility modules built (gcc)")
        except Exception:
            print("triton cache report failed (the command's status is kept):\n" + traceback.format_exc(limit=3))
    return rc


def main(argv: list[str]) -> int:
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    try:
        facts()
    except Exception:
        print("triton cache facts failed (ignored):\n" + traceback.format_exc(limit=3))
    if not command:
        return 0
    try:
        return run(command)
    except Exception:
        print("triton cache report could not wrap the command; running it plainly:\n" + traceback.format_exc(limit=3))
        return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
