"""Environment switches, read once at import and logged. Nothing else in the package reads os.environ.

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


def _read() -> _Env:
    return _Env(
        triton_interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
        collective_timeout_s=float(os.environ.get("TLLM_EXT_COLLECTIVE_TIMEOUT_S", "120")),
        log_level=os.environ.get("TLLM_EXT_LOG_LEVEL", "INFO").upper(),
    )


ENV = _read()
