"""One logger for the package, with rank-tagged and once-only helpers.

At TP > 1 (after :func:`set_rank`), every rank runs the same code and would print the same INFO lines N
times. So: rank 0 prints its INFO lines live, untagged; other ranks keep theirs and hand them over at
:func:`flush_rank_logs` (a collective at a point every rank reaches: end of start-up, end of a run), where
rank 0 prints only the lines that differ from its own, tagged ``[rank r]``. WARNING and ERROR lines are
printed live by every rank, tagged ``[rank r]`` on ranks > 0. A rank whose stderr is a log file of its
own (the CLI's rank launcher, :func:`use_private_rank_stream`) prints its INFO lines live as well, so its
log shows what it did up to a fault. The gate sits on this package's stream handler only (pytest's caplog
and other handlers see every record).
"""

from __future__ import annotations

import logging
import sys

from tensorrt_llm_ext._env import ENV

_LOGGER_NAME = "tensorrt_llm_ext"
_seen_once: set[str] = set()
_rank, _world = 0, 1
_held: list[str] = []  # INFO lines since the last flush (rank 0: printed; others: held back)
_private_stream = False  # this rank's stderr is its own log file (runtime/rank_process.py): print every line live


class _RankGate(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if _world == 1:
            return True
        if record.levelno <= logging.INFO:
            _held.append(record.getMessage())
            if not (_rank == 0 or _private_stream):
                return False
        if _rank > 0:
            record.msg, record.args = f"[rank {_rank}] {record.getMessage()}", ()
        return True


def _make_logger() -> logging.Logger:
    log = logging.getLogger(_LOGGER_NAME)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [TRT-LLM-EXT] [%(levelname)s] %(message)s", "%H:%M:%S"))
        handler.addFilter(_RankGate())
        log.addHandler(handler)
        log.setLevel(ENV.log_level)
        log.propagate = True
    return log


logger = _make_logger()


def set_rank(rank: int, world_size: int) -> None:
    """This process is ``rank`` of ``world_size`` (called by ``init_from_mpi``)."""
    global _rank, _world
    _rank, _world = rank, world_size


def use_private_rank_stream() -> None:
    """This rank's stderr is a file of its own (the CLI's rank launcher): print its INFO lines live too,
    tagged, so its log shows what it did up to a fault."""
    global _private_stream
    _private_stream = True


def flush_rank_logs(group=None) -> None:
    """Collective over ``group``: rank 0 prints the other ranks' INFO lines that differ from its own."""
    if _world == 1:
        return
    import torch.distributed as dist

    mine = list(_held)
    _held.clear()
    size = dist.get_world_size(group)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, (_rank, mine), group=group)
    if _rank != 0:
        return
    own = set(mine)
    for rank, lines in sorted(gathered):
        for line in lines if rank != 0 else ():
            if line not in own:
                logger.info(f"[rank {rank}] {line}")
    _held.clear()


def info_once(msg: str, key: str | None = None) -> None:
    """Log ``msg`` at INFO once per process (keyed by ``key`` or the message itself)."""
    k = key or msg
    if k not in _seen_once:
        _seen_once.add(k)
        logger.info(msg)


def log_environment() -> None:
    """Log the environment switches (:mod:`tensorrt_llm_ext._env`) once per process."""
    info_once(f"environment: {ENV.describe()}", key="environment")

