"""The environment switches this package reads: read once, here, at import.

No other module reads a switch. A few *set* variables for what they start, before it starts: the
launcher turns ``TRITON_INTERPRET`` on for CPU runs before any kernel module is imported
(``runtime/launch.py``), the rank launcher puts the interpreter's ``bin/`` first on the ranks' ``PATH``
(``runtime/ranks.py`` ``rank_env``), and the TP benchmark keeps ``NCCL_NVLS_ENABLE=0`` for its ranks. :func:`tensorrt_llm_ext.logger.log_environment`
logs the values once per process (the engine calls it at start).

TRITON_INTERPRET must be set before any ``@triton.jit`` is evaluated; this module only reports it.
A malformed value is not raised here (an import-time traceback): it is recorded in ``ENV.errors`` and the
default is used; the CLI refuses to start with a one-line error naming the variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class _Env:
    triton_interpret: bool
    # Seconds a collective may wait for a peer before the process group raises (no hang).
    collective_timeout_s: float
    log_level: str
    # Set by `trtllm-ext serve --tp N` on the ranks it launches through mpiexec.
    serve_rank: bool = False
    # TLLM_EXT_CHECK_VALUES=1: the kernel entry points read their per-row values back from the device and refuse
    # bad ones (FlashInfer's opt-in checks); off in serving, where SamplingParams.check already ran. Tests turn
    # it on (tests/conftest.py).
    check_values: bool = False
    # TLLM_EXT_PDL=0: the target's small-step kernels launch without programmatic dependent launch (Hopper+).
    pdl: bool = True
    # TLLM_EXT_GEMV_MAX_ROWS=N: the target's small-step products up to N rows take the dot-free few-row form
    # (kernels/fused_linear.py; default 1, the measured setting): for an A/B of a short verify block on the GPU.
    gemv_max_rows: int = 1
    # TLLM_EXT_DOT_K_SPLIT=1 / 2 / 4: the parts a 16-row dot tile's K blocks split into across its warps
    # (kernels/fused_linear.py DOT_K_SPLIT; default 4, the measured setting; 1: off): an A/B of the small steps'
    # products on the GPU.
    dot_k_split: int = 4
    # TLLM_EXT_SERVE_WARMUP=0: serve skips its start-up warm-up (runtime/warmup.py): a faster start, and an A/B of
    # what the warm-up changes; the first request of each kind then waits for its kernel builds.
    serve_warmup: bool = True
    # TLLM_EXT_SERVE_GC_FREEZE=0: serve leaves its start-up heap unfrozen (runtime/gc_pauses.py): full collections
    # while serving then walk every start-up object (an A/B of the freeze).
    serve_gc_freeze: bool = True
    # train-drafter's vocabulary-wide loss: TLLM_EXT_LOSS_LAYOUT forces a layout (rows / joint / dedup; unset: the
    # first step times them all), TLLM_EXT_LOSS_KERNEL=on / off its Triton row kernel untimed (auto: timed).
    loss_layout: str | None = None
    loss_kernel: str = "auto"
    # `trtllm-ext serve`'s API key when --api-key is not given (vLLM's VLLM_API_KEY); never logged.
    api_key: str | None = field(default=None, repr=False)
    errors: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        return (f"TRITON_INTERPRET={int(self.triton_interpret)}, TLLM_EXT_COLLECTIVE_TIMEOUT_S="
                f"{self.collective_timeout_s:g}, TLLM_EXT_LOG_LEVEL={self.log_level}, "
                f"TLLM_EXT_CHECK_VALUES={int(self.check_values)}, TLLM_EXT_PDL={int(self.pdl)}, "
                f"TLLM_EXT_GEMV_MAX_ROWS={self.gemv_max_rows}, TLLM_EXT_DOT_K_SPLIT={self.dot_k_split}, "
                f"TLLM_EXT_SERVE_WARMUP={int(self.serve_warmup)}, "
                f"TLLM_EXT_SERVE_GC_FREEZE={int(self.serve_gc_freeze)}, "
                f"TLLM_EXT_LOSS_LAYOUT={self.loss_layout or ''}, "
                f"TLLM_EXT_LOSS_KERNEL={self.loss_kernel}")


def _read() -> _Env:
    errors = []
    raw_timeout = os.environ.get("TLLM_EXT_COLLECTIVE_TIMEOUT_S", "120")
    try:
        timeout = float(raw_timeout)
        if not timeout > 0:
            raise ValueError
    except ValueError:
        errors.append(f"TLLM_EXT_COLLECTIVE_TIMEOUT_S={raw_timeout!r}: expected a number of seconds > 0")
        timeout = 120.0
    level = os.environ.get("TLLM_EXT_LOG_LEVEL", "INFO").upper()
    if level not in _LOG_LEVELS:
        errors.append(f"TLLM_EXT_LOG_LEVEL={level!r}: expected one of {', '.join(_LOG_LEVELS)}")
        level = "INFO"
    raw_rows = os.environ.get("TLLM_EXT_GEMV_MAX_ROWS", "1")
    try:
        gemv_rows = int(raw_rows)
        if not 0 <= gemv_rows <= 16:
            raise ValueError
    except ValueError:
        errors.append(f"TLLM_EXT_GEMV_MAX_ROWS={raw_rows!r}: expected an integer in [0, 16]")
        gemv_rows = 1
    raw_split = os.environ.get("TLLM_EXT_DOT_K_SPLIT", "4")
    if raw_split not in ("1", "2", "4"):
        errors.append(f"TLLM_EXT_DOT_K_SPLIT={raw_split!r}: expected 1, 2 or 4")
        raw_split = "4"
    layout = os.environ.get("TLLM_EXT_LOSS_LAYOUT") or None
    if layout not in (None, "rows", "joint", "dedup"):
        errors.append(f"TLLM_EXT_LOSS_LAYOUT={layout!r}: expected rows, joint or dedup (unset: timed at the first step)")
        layout = None
    loss_kernel = os.environ.get("TLLM_EXT_LOSS_KERNEL", "auto")
    if loss_kernel not in ("auto", "on", "off"):
        errors.append(f"TLLM_EXT_LOSS_KERNEL={loss_kernel!r}: expected auto, on or off")
        loss_kernel = "auto"
    return _Env(
        triton_interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
        collective_timeout_s=timeout,
        log_level=level,
        serve_rank=os.environ.get("TLLM_EXT_SERVE_RANK") == "1",
        check_values=os.environ.get("TLLM_EXT_CHECK_VALUES", "0") == "1",
        pdl=os.environ.get("TLLM_EXT_PDL", "1") != "0",
        gemv_max_rows=gemv_rows,
        dot_k_split=int(raw_split),
        serve_warmup=os.environ.get("TLLM_EXT_SERVE_WARMUP", "1") != "0",
        serve_gc_freeze=os.environ.get("TLLM_EXT_SERVE_GC_FREEZE", "1") != "0",
        loss_layout=layout,
        loss_kernel=loss_kernel,
        api_key=os.environ.get("TLLM_EXT_API_KEY"),  # "" kept: serve refuses an empty key (unset the variable instead)
        errors=tuple(errors),
    )


ENV = _read()
