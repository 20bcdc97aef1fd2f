"""``trtllm-ext compile-check``: every Triton kernel compiles for the GPU target, on a machine without one.

Runs the compile sweep (:mod:`tensorrt_llm_ext.testing.compile_sweep`: every launcher over the runtime's
dtypes, sampling modes, schedule-table rows and shapes) under
:class:`~tensorrt_llm_ext.testing.compile_only.CompileOnly` for each ``--arch`` (default 90: the H200), one
worker process per arch (the kernels must be ``JITFunction``\\ s, so the worker runs without
``TRITON_INTERPRET``). Fails (exit 1) on

* a specialization that does not compile (Triton front end, MLIR passes, LLVM or ``ptxas``): the kernel,
  its specialization (argument types, ``/16`` divisibility, constexpr values, warps, stages) and the error;
* a binary the target could not launch (shared memory or threads over its limits);
* a kernel a sweep case names that no launch compiled (a sweep gone stale);
* a spill (``ptxas`` spill stores or loads) in a kernel of the captured decode step, unless
  :data:`~tensorrt_llm_ext.testing.compile_sweep.ACCEPTED_SPILLS` names it with the reason.

``--table PATH`` writes the per-kernel resource table (registers, spills, shared memory, SASS instruction
counts from the wheel's ``cuobjdump``) as Markdown. ``--cache-dir DIR`` compiles into (and serves from) a kept
Triton cache, ``--pack TARBALL`` packs it for the GPU machine (:mod:`~tensorrt_llm_ext.testing.triton_cache`),
keyed as the Triton of ``--triton-key-from WHEEL_OR_DIR`` keys it. Test support: production code never imports it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from tensorrt_llm_ext.testing.kernel_resources import accepted_reason, sass_counts, write_table

__all__ = ["main"]

DEFAULT_SWEEP = "tensorrt_llm_ext.testing.compile_sweep"


# -- worker: one arch, in this process ------------------------------------------------------------------------
def _worker(arch: int, sweep_module: str, cases: list[str] | None, with_sass: bool, out_path: str,
            cache_dir: str | None = None, key_file: str | None = None, dtypes: str | None = None) -> int:
    import triton

    if triton.knobs.runtime.interpret:
        raise SystemExit("compile-check worker: TRITON_INTERPRET=1 makes every kernel an interpreted function; "
                         "run it without TRITON_INTERPRET")
    from tensorrt_llm_ext.testing.compile_only import CompileFailure, CompileOnly, _cpu_seconds

    sweep = importlib.import_module(sweep_module)
    if dtypes:
        sweep.DTYPES = _dtypes(dtypes)
    started = time.perf_counter()
    case_times = {}
    triton_key = None
    if key_file:
        with open(key_file) as f:
            triton_key = f.read()
    with CompileOnly(arch, cache_dir=cache_dir, triton_key=triton_key) as cc:
        backend_hash = triton.compiler.make_backend(cc.target).hash()  # ptxas version and arch: part of the key
        for case in sweep.SWEEP:
            if cases is not None and case.name not in cases:
                continue
            cc.case = case.name
            t0, c0 = time.perf_counter(), _cpu_seconds()
            try:
                case.run()
            except Exception as e:  # a launcher that raised before or between launches: reported, fails the check
                cc.failures.append(CompileFailure("(launcher)", "-", arch, f"{type(e).__name__}: {e}", case.name))
            case_times[case.name] = {"wall": round(time.perf_counter() - t0, 1), "cpu": round(_cpu_seconds() - c0, 1)}
            print(f"sm_{arch} {case.name}: {case_times[case.name]}", file=sys.stderr, flush=True)
            seen = {v.kernel for v in cc.variants if v.case == case.name} | {
                f.kernel for f in cc.failures if f.case == case.name}
            for kernel in case.kernels:
                if kernel not in seen:
                    cc.failures.append(CompileFailure(kernel, "-", arch, "no launch of this kernel in its sweep case "
                                                      "(the sweep no longer reaches it)", case.name))
    elapsed = time.perf_counter() - started
    captured = {k for case in sweep.SWEEP if case.captured for k in case.kernels}
    accepted = [vars(a) | {"when": list(a.when)} for a in getattr(sweep, "ACCEPTED_SPILLS", ())]
    variants = []
    for v in cc.variants:
        row = {"kernel": v.kernel, "spec": v.specialization, "case": v.case, "registers": v.ptxas.registers,
               "spill_stores": v.ptxas.spill_stores, "spill_loads": v.ptxas.spill_loads, "stack": v.ptxas.stack,
               "shared": v.shared, "num_warps": v.num_warps, "seconds": v.seconds, "captured": v.kernel in captured,
               "cache_hit": v.cache_hit}
        if with_sass:
            row.update(sass_counts(v.compiled.asm["cubin"], arch))
        variants.append(row)
    report = {
        "arch": arch, "triton": triton.__version__, "backend_hash": backend_hash, "seconds": round(elapsed, 1),
        "case_seconds": case_times, "dtypes": dtypes,
        "variants": variants,
        "failures": [vars(f) for f in cc.failures],
        "accepted_spills": accepted,
    }
    with open(out_path, "w") as f:
        json.dump(report, f)
    return 0


# -- driver ----------------------------------------------------------------------------------------------------
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # the sweep's FLOATS, in its order


def _dtypes(names: str) -> tuple:
    """``"bf16,fp32"`` -> the torch dtypes, in the given order (the sweep's ``DTYPES``)."""
    import torch

    return tuple(getattr(torch, DTYPE_NAMES[n.strip()]) for n in names.split(",") if n.strip())


def _dtype_list(p: argparse.ArgumentParser, given: str | None) -> str | None:
    """``--dtypes`` in the sweep's order without repeats, or None for every dtype (the default); a usage error for
    an unknown name or an empty list."""
    if given is None:
        return None
    names = [n.strip() for n in given.split(",") if n.strip()]
    if not names or any(n not in DTYPE_NAMES for n in names):
        p.error(f"--dtypes: expected a comma-separated list of {', '.join(DTYPE_NAMES)}, got {given!r}")
    subset = [n for n in DTYPE_NAMES if n in names]
    return None if len(subset) == len(DTYPE_NAMES) else ",".join(subset)


def _run_worker(arch: int, sweep_module: str, cases: list[str], with_sass: bool, cache_args: list[str],
                dtypes: str | None = None) -> dict:
    fd, path = tempfile.mkstemp(prefix=f"compile_check_sm{arch}_", suffix=".json")
    os.close(fd)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones
    cmd = [sys.executable, "-m", "tensorrt_llm_ext.testing.compile_check", "--worker", "--arch", str(arch),
           "--sweep-module", sweep_module, "--cases", ",".join(cases), "--out", path] + (["--sass"] if with_sass else [])
    cmd += ["--dtypes", dtypes] if dtypes else []
    cmd += cache_args
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"arch": arch, "crashed": True,
                    "error": f"worker exited {proc.returncode}\n{proc.stdout[-4000:]}{proc.stderr[-8000:]}"}
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def _partition(sweep, parts: int) -> list[list[str]]:
    """The sweep's cases in ``parts`` groups of about equal measured cost (largest first, to the lightest)."""
    groups: list[tuple[float, list[str]]] = [(0.0, []) for _ in range(parts)]
    for case in sorted(sweep.SWEEP, key=lambda c: -c.cost):
        i = min(range(parts), key=lambda j: groups[j][0])
        groups[i] = (groups[i][0] + case.cost, groups[i][1] + [case.name])
    return [names for _, names in groups if names]


def _merge(arch: int, parts: list[dict]) -> dict:
    crashed = [p for p in parts if p.get("crashed")]
    if crashed:
        return {"arch": arch, "crashed": True, "error": "\n".join(p["error"] for p in crashed)}
    first = parts[0]
    return {"arch": arch, "triton": first["triton"], "backend_hash": first.get("backend_hash"),
            "seconds": max(p["seconds"] for p in parts), "dtypes": first.get("dtypes"),
            "case_seconds": {k: v for p in parts for k, v in p["case_seconds"].items()},
            "variants": [v for p in parts for v in p["variants"]],
            "failures": [f for p in parts for f in p["failures"]], "accepted_spills": first["accepted_spills"]}


def spill_failures(report: dict) -> list[str]:
    """Spills in captured-step kernels not covered by an accepted entry (one line each)."""
    out = []
    for v in report["variants"]:
        if (v["captured"] and (v["spill_stores"] > 0 or v["spill_loads"] > 0)
                and accepted_reason(report, v) is None):
            out.append(f"SPILL {v['kernel']} for sm_{report['arch']} (case {v['case']}): {v['spill_stores']} B "
                       f"stored, {v['spill_loads']} B loaded, {v['registers']} registers\n  specialization: {v['spec']}")
    return out


def _summarize(report: dict) -> tuple[bool, list[str]]:
    lines = []
    if report.get("crashed"):
        return False, [f"sm_{report['arch']}: compile-check worker failed: {report['error']}"]
    failures = report["failures"]
    spills = spill_failures(report)
    kernels = {v["kernel"] for v in report["variants"]}
    spilling = sorted({v["kernel"].split(":")[-1] for v in report["variants"]
                       if v["spill_stores"] > 0 or v["spill_loads"] > 0})
    ok = not failures and not spills
    cpu = sum(t["cpu"] for t in report["case_seconds"].values())
    hits = sum(bool(v.get("cache_hit")) for v in report["variants"])
    lines.append(f"sm_{report['arch']} (triton {report['triton']}): {len(report['variants'])} specializations of "
                 f"{len(kernels)} kernels compiled in {report['seconds']} s ({cpu:.0f} CPU s); {len(failures)} failed; "
                 f"spilling: {', '.join(spilling) or 'none'}" + (f"; {hits} served from the cache (no ptxas log)"
                                                                 if hits else "")
                 + (f"; float dtypes {report['dtypes']} only (--dtypes)" if report.get("dtypes") else ""))
    for f in failures:
        lines.append(f"FAILED {f['kernel']} for sm_{f['arch']} (case {f['case']})\n  specialization: "
                     f"{f['specialization']}\n  error: {f['error']}")
    lines.extend(spills)
    return ok, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trtllm-ext compile-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="90", help="compute capabilities, comma-separated (90 = H200, 100 = B200)")
    p.add_argument("--sweep", action="store_true", help="run the launcher sweep (the default and only mode)")
    p.add_argument("--sweep-module", default=DEFAULT_SWEEP, help=argparse.SUPPRESS)
    p.add_argument("--dtypes", default=None, metavar="LIST",
                   help="compile only these float dtypes of the sweep, comma-separated of bf16,fp16,fp32 (default: "
                        "all; CI: bf16, the GPU's default -- every kernel and launcher path at ~1/3 of the CPU)")
    p.add_argument("--table", default=None, help="write the per-kernel resource table (Markdown) to this path")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes compiling at once, split over arches and sweep cases (default: one per core)")
    p.add_argument("--cache-dir", default=None,
                   help="compile into this Triton cache directory and keep it (an entry already there is served "
                        "from it: no ptxas log, so no spill facts for it); default: a fresh temporary one per worker")
    p.add_argument("--pack", default=None, metavar="TARBALL",
                   help="pack the compiled kernels (metadata and cubin) as a tar.gz for the GPU machine "
                        "(scripts/gpu_env.sh unpacks it; docs/compile_check.md)")
    p.add_argument("--keep-ir", action="store_true", help="with --pack: keep the IR files (source, ttir, ttgir, "
                   "llir, ptx), which loading a kernel from the cache never reads")
    p.add_argument("--triton-key-from", default=None, metavar="WHEEL_OR_DIR",
                   help="key the cache as the Triton in this wheel or directory would (the GPU's: its libtriton.so "
                        "differs from this machine's build); the running Triton's key by default")
    p.add_argument("--triton-key-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sass", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cases", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        arches = [int(a) for a in args.arch.split(",") if a.strip()]
    except ValueError:
        p.error(f"--arch: expected comma-separated integers such as 90,100, got {args.arch!r}")
    from tensorrt_llm_ext.testing.compile_only import ARCHES

    for a in arches:
        if a not in ARCHES:
            p.error(f"--arch: expected one of {sorted(ARCHES)}, got {a}")
    args.dtypes = _dtype_list(p, args.dtypes)
    if args.worker:
        cases = args.cases.split(",") if args.cases else None
        return _worker(arches[0], args.sweep_module, cases, args.sass, args.out, args.cache_dir, args.triton_key_file,
                       args.dtypes)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="compile_check_") as scratch:
        cache_dir = args.cache_dir or (os.path.join(scratch, "cache") if args.pack else None)
        cache_args, key = [], None
        if cache_dir:
            cache_args = ["--cache-dir", os.path.abspath(cache_dir)]
        if args.triton_key_from:
            from tensorrt_llm_ext.testing.triton_cache import triton_key_from

            key = triton_key_from(args.triton_key_from)
            key_file = os.path.join(scratch, "triton_key")
            with open(key_file, "w") as f:
                f.write(key)
            cache_args += ["--triton-key-file", key_file]
        ok, reports = _check(args, arches, cache_args)
        if args.pack and all(not r.get("crashed") for r in reports):
            _pack(args, arches, reports, cache_dir, key)
    print(f"compile-check {'passed' if ok else 'FAILED'} in {time.perf_counter() - started:.1f} s")
    return 0 if ok else 1


def _pack(args, arches: list[int], reports: list[dict], cache_dir: str, key: str | None) -> None:
    import triton

    from tensorrt_llm_ext.testing.triton_cache import key_digest, pack, triton_key_parts

    # the files of the key, so that the GPU can re-key the cache for another build of the same release
    version, parts = triton_key_parts(args.triton_key_from or os.path.dirname(triton.__file__))
    assert key is None or key == version + "-".join(h for _, h in parts)
    manifest = {"arches": arches, "backend_hashes": {str(r["arch"]): r["backend_hash"] for r in reports},
                "triton_key": key_digest(version + "-".join(h for _, h in parts)),
                "key_parts": {"version": version, "files": parts}, "triton_key_from": args.triton_key_from or "running",
                "built_under": f"triton {triton.__version__}, python {sys.version.split()[0]}",
                "specializations": sum(len(r["variants"]) for r in reports), "ir": args.keep_ir}
    facts = pack(cache_dir, args.pack, keep_ir=args.keep_ir, manifest=manifest)
    print(f"triton cache: {facts['entries']} kernels, {facts['files']} files ({facts['raw_bytes'] / 2**20:.1f} MiB) "
          f"packed into {args.pack}: {facts['bytes'] / 2**20:.2f} MiB{'' if args.keep_ir else ' (IR dropped)'}; "
          f"keyed for triton_key {manifest['triton_key']}")


def _check(args, arches: list[int], cache_args: list[str]) -> tuple[bool, list[dict]]:
    jobs = args.jobs or os.cpu_count() or 1
    # One worker process per (arch, group of cases): `jobs` processes compile at once.
    groups = _partition(importlib.import_module(args.sweep_module), max(1, jobs // len(arches)))
    tasks = [(a, g) for a in arches for g in groups]
    with ThreadPoolExecutor(jobs) as pool:
        parts = list(pool.map(lambda t: _run_worker(t[0], args.sweep_module, t[1], args.table is not None,
                                                    cache_args, args.dtypes), tasks))
    reports = [_merge(a, [p for (arch, _), p in zip(tasks, parts) if arch == a]) for a in arches]
    ok = True
    for report in reports:
        report_ok, lines = _summarize(report)
        ok &= report_ok
        print("\n".join(lines))
    if args.table and all(not r.get("crashed") for r in reports):
        write_table(args.table, reports)
        print(f"resource table written to {args.table}")
    return ok, reports


if __name__ == "__main__":
    sys.exit(main())
