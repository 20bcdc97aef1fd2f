"""One logger for the package, with once-only helpers."""

from __future__ import annotations

import logging
import sys

from tensorrt_llm_ext._env import ENV

_LOGGER_NAME = "tensorrt_llm_ext"
_seen_once: set[str] = set()


def _make_logger() -> logging.Logger:
    log = logging.getLogger(_LOGGER_NAME)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [TRT-LLM-EXT] [%(levelname)s] %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(ENV.log_level)
        log.propagate = True
    return log


logger = _make_logger()


def info_once(msg: str, key: str | None = None) -> None:
    """Log ``msg`` at INFO once per process (keyed by ``key`` or the message itself)."""
    k = key or msg
    if k not in _seen_once:
        _seen_once.add(k)
        logger.info(msg)


def warning_once(msg: str, key: str | None = None) -> None:
    k = key or msg
    if k not in _seen_once:
        _seen_once.add(k)
        logger.warning(msg)


def log_environment() -> None:
    """Log the environment switches (:mod:`tensorrt_llm_ext._env`) once per process."""
    info_once(f"environment: {ENV.describe()}", key="environment")
