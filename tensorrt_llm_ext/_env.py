"""The environment switches this package reads: read once, here, at import.

No other module reads a switch. A few *set* variables for what they start, before it starts: the
launcher turns ``TRITON_INTERPRET`` on for CPU runs before any kernel module is imported
(``runtime/launch.py``), the MPI pool puts the venv's ``bin/`` on ``PATH`` for ``mpiexec``, and the TP
benchmark keeps ``NCCL_NVLS_ENABLE=0`` for its ranks. :func:`tensorrt_llm_ext.logger.log_environment`
logs the values once per process (the engine calls it at start).

TRITON_INTERPRET must be set before any ``@triton.jit`` is evaluated; this module only reports it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class _Env:
    triton_interpret: bool
    # Seconds a collective may wait for a peer before the process group raises (no hang).
    collective_timeout_s: float
    log_level: str

    def describe(self) -> str:
        return (f"TRITON_INTERPRET={int(self.triton_interpret)}, TLLM_EXT_COLLECTIVE_TIMEOUT_S="
                f"{self.collective_timeout_s:g}, TLLM_EXT_LOG_LEVEL={self.log_level}")


def _read() -> _Env:
    return _Env(
        triton_interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
        collective_timeout_s=float(os.environ.get("TLLM_EXT_COLLECTIVE_TIMEOUT_S", "120")),
        log_level=os.environ.get("TLLM_EXT_LOG_LEVEL", "INFO").upper(),
    )


ENV = _read()
