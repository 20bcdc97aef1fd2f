"""The rank supervisor: one per rank, started by ``mpiexec``, plain Python (no MPI).

It starts the real rank as its child, passing the MPI process-management handle on (``PMI_FD`` / the
inherited environment), forwards SIGTERM / SIGINT to it and records how it ended -- what ``waitpid`` says,
also for SIGKILL or ``os._exit``. Under an :class:`~.ranks.MpiPool` (:func:`supervise`) the rank is
:mod:`.rank_process` with its output in ``rank{r}.log`` and its end in ``rank{r}.exit.json``; under
``trtllm-ext serve --tp N`` (:func:`supervise_command`) it is the serving command itself.

Run as ``python -m tensorrt_llm_ext.runtime.rank_supervisor --supervise RUN_DIR`` or
``... --supervise-command LINGER_S -- CMD...`` (the launcher in :mod:`.ranks` builds these lines).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tensorrt_llm_ext.runtime.rank_files import (LAUNCHER_CHECK_S, env_rank, pid_alive, read_json, signal_name,
                                                 write_json)

__all__ = ["SUPERVISOR_LINGER_S", "supervise", "supervise_command"]

SUPERVISOR_LINGER_S = 30.0  # a supervisor whose rank failed waits for the launcher (see supervise)


def _die_with_parent(parent: int) -> None:
    """In the child (before exec): SIGKILL it when its supervisor dies, so no rank outlives a killed job."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the supervisor died before the prctl: the death signal will never come
        os.kill(os.getpid(), signal.SIGKILL)


def _run_child(cmd: list[str], stdout=None, on_start=None) -> int:
    """Start the real rank (it inherits the MPI process-management handle), forward SIGTERM/SIGINT to it,
    return what ``waitpid`` says (negative: the signal that ended it).

    The forwarding handlers are installed before the child is started: a SIGTERM that arrives while it
    starts is held and passed on once it runs (with the default action it would kill the supervisor, and
    the death signal would SIGKILL the rank instead of letting it drain). The rank gets its own process
    group: a signal the MPI launcher sends to the supervisor's group would otherwise reach it twice (directly
    and forwarded; measured with MPICH: one SIGTERM to ``serve --tp 2`` reached rank 0 twice, which a server
    takes as a second, forcing signal)."""
    fds = [int(os.environ["PMI_FD"])] if "PMI_FD" in os.environ else []  # MPICH's PMI connection
    child: subprocess.Popen | None = None
    held: list[int] = []

    def forward(signum, frame):
        if child is None:
            held.append(signum)
        else:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    parent = os.getpid()
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, process_group=0,
                             stderr=subprocess.STDOUT if stdout is not None else None, pass_fds=fds,
                             preexec_fn=lambda: _die_with_parent(parent))
    for signum in held:
        child.send_signal(signum)
    if on_start is not None:
        on_start(child)
    return child.wait()


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def supervise(run_dir: Path) -> int:
    """One rank of an :class:`~.ranks.MpiPool`: run the rank with its output in ``rank{r}.log``, record how it
    ended in ``rank{r}.exit.json`` and return its exit code."""
    rank = env_rank()
    with open(run_dir / f"rank{rank}.log", "ab") as log:
        rc = _run_child([sys.executable, "-m", "tensorrt_llm_ext.runtime.rank_process", str(run_dir)],
                        stdout=log, on_start=lambda child: write_json(
                            run_dir / f"rank{rank}.pid.json", {"pid": child.pid, "supervisor": os.getpid()}))
    sig = -rc if rc < 0 else None
    write_json(run_dir / f"rank{rank}.exit.json",
               {"returncode": rc if rc >= 0 else None, "signal": sig, "time": time.time()})
    if rc != 0:
        # Exiting now would make mpiexec kill the other ranks before the launcher collected their
        # stacks; the launcher kills this supervisor once it has (bounded by the linger time, and over
        # at once when the launcher is gone).
        launcher = (read_json(run_dir / "launcher.json") or {}).get("pid")
        end = time.monotonic() + SUPERVISOR_LINGER_S
        while time.monotonic() < end and (launcher is None or pid_alive(launcher)):
            time.sleep(min(LAUNCHER_CHECK_S, max(0.0, end - time.monotonic())))
    return _exit_code(rc)


def supervise_command(cmd: list[str], linger_s: float) -> int:
    """One rank of a long-running MPI job (``trtllm-ext serve --tp N``): run ``cmd`` as a child with
    inherited stdout/stderr and return its exit code.

    MPICH's launcher kills every rank as soon as one process it started dies by a signal, even with
    ``-disable-auto-cleanup``. A rank that dies under this supervisor is reported here (which rank, how)
    and the supervisor stays ``linger_s`` longer, so the surviving ranks notice the loss themselves
    (rank 0 answers 503 and exits non-zero) instead of being killed mid-response. Rank 0's own end is
    passed on at once: it ends the job."""
    rank = env_rank()
    rc = _run_child(cmd)
    if rc != 0:
        how = f"was killed by signal {-rc} ({signal_name(-rc)})" if rc < 0 else f"exited with code {rc}"
        print(f"[TRT-LLM-EXT] [ERROR] rank {rank} {how}", file=sys.stderr, flush=True)
        if rank != 0:  # rank 0 is the one that answers and decides the job's end: never delay it
            time.sleep(linger_s)
    return _exit_code(rc)


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else ""
    if mode == "--supervise":
        return supervise(Path(argv[1]))
    if mode == "--supervise-command" and len(argv) > 3 and argv[2] == "--":
        return supervise_command(argv[3:], float(argv[1]))
    raise SystemExit("usage: python -m tensorrt_llm_ext.runtime.rank_supervisor --supervise RUN_DIR | "
                     f"--supervise-command LINGER_S -- CMD..., got {argv}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
