"""What the rank launcher, the rank supervisors and the ranks share: the run directory's records and the
process facts all three read.

The three talk only through files in one run directory (:mod:`.ranks` names them): JSON records written
atomically (:func:`write_json`, read back by :func:`read_json`), the shipped calls and their results.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

__all__ = ["JOB_DIR_ENV", "JOB_JOINED", "LAUNCHER_CHECK_S", "RANK_ENV", "SERVING", "STAGE_FD_ENV", "env_rank",
           "exit_record", "pid_alive", "read_json", "signal_name", "tell_supervisor", "write_json"]

LAUNCHER_CHECK_S = 1.0  # how often a rank (and a lingering supervisor) checks that its launcher is still alive

# Environment variables that carry a rank's index under the process managers we meet (MPICH hydra,
# Open MPI / PMIx).
RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")

# A directory where each supervisor of a long-running job (serve --tp N) records how its rank ended (rank{r}.exit.json).
JOB_DIR_ENV = "TLLM_EXT_RANK_JOB_DIR"

# How far a rank got, told to its supervisor (tell_supervisor) through a pipe whose write end the variable names.
STAGE_FD_ENV = "TLLM_EXT_SUPERVISOR_STAGE_FD"
JOB_JOINED = b"j"  # every rank of the job has joined MPI (this rank's process groups are up)
SERVING = b"s"  # start-up is over on every rank: requests may be in flight from now on


def read_json(path: Path) -> dict | None:
    """A JSON record of the run directory; None while it is missing or half-written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: dict) -> None:
    """Write a record atomically (a temporary file, then a rename)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # readers never see a half-written record


def exit_record(rc: int) -> dict:
    """How a rank ended, from ``waitpid``'s ``rc`` (negative: the signal), as the supervisors record it."""
    return {"returncode": rc if rc >= 0 else None, "signal": -rc if rc < 0 else None, "time": time.time()}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (one we may not signal counts as alive). A zombie -- ended, not yet reaped by
    its parent (a script that waits for it later) -- has ended: ``kill(pid, 0)`` still succeeds for it, so the
    ranks watching a SIGKILLed launcher would run on until its parent reaps it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")  # the state follows the name
    except (OSError, IndexError):  # no procfs (not Linux), or it ended meanwhile: kill() answered
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")



def tell_supervisor(stage: bytes) -> None:
    """In a rank: tell its supervisor (``serve --tp N``) that it reached ``stage`` (:data:`JOB_JOINED`,
    :data:`SERVING`); a no-op in a process without one. The supervisor decides by it how a failed rank's end
    reaches ``mpiexec`` (:func:`~.rank_supervisor.supervise_command`)."""
    fd = os.environ.get(STAGE_FD_ENV)
    if fd is None:
        return
    try:
        os.write(int(fd), stage)
    except (OSError, ValueError):  # the supervisor is gone, or the variable was not ours: nothing to tell
        pass


def env_rank() -> int:
    """This process's rank, from the variable its process manager set."""
    for k in RANK_ENV:
        if k in os.environ:
            return int(os.environ[k])
    raise RuntimeError(f"supervisor: none of {RANK_ENV} is set (not started by mpiexec?)")


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; real-time signals without a name in :class:`signal.Signals` get ``signal N``
    (``signal.Signals(N)`` would raise, and a supervisor must not die while reporting its rank)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
