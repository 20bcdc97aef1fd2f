"""Compile-only Triton launches for a named GPU target, on a machine without a GPU (test support).

Inside :class:`CompileOnly`:

* Triton's active driver is a stand-in that reports the target (``GPUTarget("cuda", 90, 32)`` for sm_90)
  and never touches a device;
* every ``@triton.jit`` launch compiles its specialization for that target (Triton's own
  ``JITFunction.run(..., warmup=True)`` path: front end, MLIR passes, LLVM, ``ptxas`` from the wheel) and
  launches nothing; a compile error is recorded with the kernel, its specialization and the error, and the
  launch returns without running (the caller's outputs stay unwritten);
* tensors report ``is_cuda`` (CPU tensors stand in for device buffers), so the launchers take their GPU
  branches (GPU schedules, GPU dot dtypes, the clocked exchange) and never the interpreter's, and
  ``torch.cuda.get_device_properties`` answers with the target's SM count.

Each :class:`CompileOnly` compiles into its own empty Triton cache directory, so every specialization
goes through the whole pipeline (no earlier run's binaries are reused) and its ``ptxas`` log is read; or, given
``cache_dir``, into that directory (kept: a prebuilt cache for the GPU, ``testing/triton_cache.py``), where an
entry already there is served from it (``CompiledVariant.cache_hit``, no ``ptxas`` log). ``triton_key`` keys
the cache as another build of Triton would (the GPU's wheel: ``triton_cache.triton_key_from``); Triton's
``triton_key`` is replaced inside the context only.
Never run kernels with it: outputs are garbage. Production code never imports this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
import resource
import tempfile
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import compiler as triton_compiler_module
from triton.runtime import cache as triton_cache_module
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

__all__ = ["ARCHES", "CompileFailure", "CompileOnly", "CompiledVariant", "PtxasInfo", "target_for"]


@dataclass(frozen=True)
class ArchFacts:
    """What the stand-in driver reports for one compute capability."""

    name: str
    sm_count: int  # torch.cuda.get_device_properties(...).multi_processor_count (schedules scale with it)
    max_shared: int  # bytes of shared memory one block may opt into (the launch fails above it)


ARCHES: dict[int, ArchFacts] = {
    90: ArchFacts("H200 (sm_90)", 132, 232448),
    100: ArchFacts("B200 (sm_100)", 148, 232448),
}
_MAX_THREADS = 1024  # threads per block on every target here


def target_for(arch: int) -> GPUTarget:
    if arch not in ARCHES:
        raise ValueError(f"arch: expected one of {sorted(ARCHES)}, got {arch}")
    return GPUTarget("cuda", arch, 32)


@dataclass(frozen=True)
class PtxasInfo:
    """``ptxas -v`` facts of one compiled kernel (-1 where the log did not say)."""

    registers: int = -1
    spill_stores: int = -1  # bytes
    spill_loads: int = -1  # bytes
    stack: int = -1  # bytes of stack frame

    @classmethod
    def parse(cls, log: str) -> "PtxasInfo":
        def grab(pattern: str) -> int:
            m = re.search(pattern, log)
            return int(m.group(1)) if m else -1

        return cls(registers=grab(r"Used (\d+) registers"), spill_stores=grab(r"(\d+) bytes spill stores"),
                   spill_loads=grab(r"(\d+) bytes spill loads"), stack=grab(r"(\d+) bytes stack frame"))


@dataclass
class CompiledVariant:
    """One specialization that compiled."""

    kernel: str  # module:qualname
    specialization: str
    arch: int
    compiled: object  # triton CompiledKernel (asm["cubin"], metadata)
    ptxas: PtxasInfo
    case: str  # the sweep case whose launch compiled it
    seconds: float  # CPU time of the compile (this process and its ptxas)
    cache_hit: bool = False  # served from the cache directory (no compile, no ptxas log)

    @property
    def shared(self) -> int:
        return int(self.compiled.metadata.shared)

    @property
    def num_warps(self) -> int:
        return int(self.compiled.metadata.num_warps)


@dataclass
class CompileFailure:
    """One launch that did not compile (or a resource the target cannot launch with)."""

    kernel: str
    specialization: str
    arch: int
    error: str
    case: str

    def describe(self) -> str:
        return (f"FAILED {self.kernel} for sm_{self.arch} (case {self.case})\n  specialization: {self.specialization}\n"
                f"  error: {self.error}")


def _describe_spec(signature: dict, constants: dict, options, configs) -> str:
    """``name: type`` per argument, constexpr values inline, ``/16`` on 16-divisible ints and pointers."""
    attrs = configs[0] if configs else {}
    divisible = {path[0] for path, values in attrs.items()
                 if any(v[0] == "tt.divisibility" for v in values)} if isinstance(attrs, dict) else set()
    consts = {path[0]: value for path, value in constants.items() if len(path) == 1}
    parts = []
    for i, (name, ty) in enumerate(signature.items()):
        if ty == "constexpr":
            value = consts.get(i, "?")
            parts.append(f"{name}={getattr(value, 'value', value)!r}")
        else:
            parts.append(f"{name}: {ty}{'/16' if i in divisible else ''}")
    return (f"({', '.join(parts)}) num_warps={options.num_warps} num_stages={options.num_stages}")


def _qualname(fn: JITFunction) -> str:
    return f"{fn.fn.__module__}:{fn.fn.__qualname__}"


class CompileOnly(contextlib.AbstractContextManager):
    """Compile every Triton launch for ``arch`` and run none; see the module docstring.

    ``variants`` and ``failures`` fill as launches happen; ``case`` names what the caller is doing (set it
    before each sweep case: it goes into every record).
    """

    _device_ids = iter(range(1_000_000, 2_000_000))  # a fresh per-kernel binder cache per context

    def __init__(self, arch: int = 90, cache_dir: str | None = None, triton_key: str | None = None):
        self.arch = arch
        self.cache_dir = cache_dir
        self.triton_key = triton_key
        self._hit = False
        self._last_key: tuple[str, str] | None = None  # (sha256 of the cache key, the key after triton_key())
        self.target = target_for(arch)
        self.facts = ARCHES[arch]
        self.variants: list[CompiledVariant] = []
        self.failures: list[CompileFailure] = []
        self.case = ""
        self._device = next(self._device_ids)
        self._pending: dict | None = None
        self._stack = contextlib.ExitStack()

    # -- the stand-in driver (what JITFunction.run asks of driver.active) -------------------------------
    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return self._device

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    # -- context -----------------------------------------------------------------------------------------
    def __enter__(self) -> "CompileOnly":
        stack = self._stack
        cache = self.cache_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix=f"compile_only_sm{self.arch}_"))
        prev_active = driver._active
        driver.set_active(self)
        stack.callback(setattr, driver, "_active", prev_active)
        stack.enter_context(knobs.cache.scope())
        knobs.cache.dir = cache
        stack.enter_context(knobs.nvidia.scope())
        knobs.nvidia.dump_ptxas_log = True  # ptxas already runs with -v; this prints its log, which we read
        stack.enter_context(knobs.runtime.scope())
        knobs.runtime.jit_cache_hook = self._before_compile
        stack.enter_context(knobs.compilation.scope())
        knobs.compilation.listener = self._after_compile
        if self.triton_key is not None:  # the key another Triton build computes (get_cache_key calls this global)
            self._patch(triton_cache_module, "triton_key", lambda: self.triton_key)
        if self.cache_dir is not None:  # a kept cache: note each entry's key past triton_key() (re-keying on unpack)
            self._patch(triton_compiler_module, "get_cache_key",
                        self._key_recorder(triton_compiler_module.get_cache_key))
        self._patch(JITFunction, "run", self._run_factory(JITFunction.run))
        self._patch(torch.Tensor, "is_cuda", property(lambda t: True))
        facts = self.facts
        props = SimpleNamespace(name=facts.name, multi_processor_count=facts.sm_count, major=self.arch // 10,
                                minor=self.arch % 10, shared_memory_per_block_optin=facts.max_shared)
        self._patch(torch.cuda, "get_device_properties", lambda device=None: props)
        stack.__enter__()
        return self

    def __exit__(self, *exc) -> bool | None:
        return self._stack.__exit__(*exc)

    def _patch(self, owner, name: str, value) -> None:
        had = name in vars(owner)
        old = vars(owner).get(name)
        setattr(owner, name, value)
        self._stack.callback((lambda: setattr(owner, name, old)) if had else (lambda: delattr(owner, name)))

    # -- interception ------------------------------------------------------------------------------------
    def _before_compile(self, *, fn, compile, **_) -> None:
        # Triton's hook before each compile: the specialization about to be compiled (returns None: compile).
        self._pending = {"kernel": f"{fn.module}:{fn.name}",
                         "spec": _describe_spec(compile["signature"], compile["constants"],
                                                SimpleNamespace(num_warps=compile["num_warps"],
                                                                num_stages=compile["num_stages"]),
                                                compile.get("configs"))}
        return None

    def _after_compile(self, *, cache_hit, metadata, **_) -> None:
        # Triton's listener after each compile() that returned: whether the cache directory served it.
        self._hit = bool(cache_hit)
        if self._last_key is not None and metadata.get("hash") == self._last_key[0]:
            from tensorrt_llm_ext.testing.triton_cache import write_key_rest

            write_key_rest(self.cache_dir, *self._last_key)

    def _key_recorder(self, original):
        def get_cache_key(src, backend, backend_options, env_vars):
            key = original(src, backend, backend_options, env_vars)
            prefix = triton_cache_module.triton_key() + "-"
            if key.startswith(prefix):
                self._last_key = (hashlib.sha256(key.encode()).hexdigest(), key[len(prefix):])
            return key

        return get_cache_key

    def _run_factory(self, original):
        ctx = self

        def run(fn: JITFunction, *args, grid, warmup, **kwargs):
            if driver._active is not ctx:  # another CompileOnly (nested) or none: not ours
                return original(fn, *args, grid=grid, warmup=warmup, **kwargs)
            return ctx._compile(original, fn, args, kwargs, grid)

        return run

    def _compile(self, original, fn: JITFunction, args, kwargs, grid):
        self._pending = None
        self._hit = False
        log = io.StringIO()
        t0 = _cpu_seconds()
        try:
            with contextlib.redirect_stdout(log):
                compiled = original(fn, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # every compile error is recorded and fails the check: nothing is hidden
            pending = self._pending or {"kernel": _qualname(fn),
                                        "spec": f"(not specialized: the arguments did not bind; "
                                                f"{len(args)} positional, keywords {sorted(kwargs)})"}
            message = f"{type(e).__name__}: {e}".strip()
            self.failures.append(CompileFailure(pending["kernel"], pending["spec"], self.arch,
                                                _trim(message), self.case))
            return None
        if self._pending is None:  # served from this context's in-memory cache: already recorded
            return compiled
        variant = CompiledVariant(self._pending["kernel"], self._pending["spec"], self.arch, compiled,
                                  PtxasInfo.parse(log.getvalue()), self.case,
                                  round(_cpu_seconds() - t0, 2), cache_hit=self._hit)
        self.variants.append(variant)
        self._check_launchable(variant)
        return compiled

    def _check_launchable(self, v: CompiledVariant) -> None:
        # What the driver checks when it loads a binary (it cannot here): shared memory and threads.
        if v.shared > self.facts.max_shared:
            self.failures.append(CompileFailure(v.kernel, v.specialization, self.arch,
                                                f"OutOfResources: shared memory {v.shared} B > {self.facts.max_shared} B "
                                                f"of {self.facts.name}", v.case))
        if v.num_warps * 32 > _MAX_THREADS:
            self.failures.append(CompileFailure(v.kernel, v.specialization, self.arch,
                                                f"OutOfResources: {v.num_warps} warps = {v.num_warps * 32} threads > "
                                                f"{_MAX_THREADS}", v.case))


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _trim(message: str, limit: int = 4000) -> str:
    """Compile errors carry the whole PTX on ptxas failures: keep the head, which names the problem."""
    return message if len(message) <= limit else message[:limit] + f"\n  ... ({len(message) - limit} more characters)"
