"""The rank supervisor: one per rank, started by ``mpiexec``, plain Python (no MPI).

It starts the real rank as its child, passing the MPI process-management handle on (``PMI_FD`` / the
inherited environment), forwards SIGTERM / SIGINT to it and records how it ended -- what ``waitpid`` says,
also for SIGKILL or ``os._exit``. Under an :class:`~.ranks.MpiPool` (:func:`supervise`) the rank is
:mod:`.rank_process` with its output in ``rank{r}.log`` and its end in ``rank{r}.exit.json``; under
``trtllm-ext serve --tp N`` (:func:`supervise_command`) it is the serving command itself.

Run as ``python -m tensorrt_llm_ext.runtime.rank_supervisor --supervise RUN_DIR`` or
``... --supervise-command LINGER_S [--launcher PID] -- CMD...`` (the launcher in :mod:`.ranks` builds these
lines). With ``--launcher``, a supervisor whose launcher has gone (SIGKILL, a closed terminal) ends its rank:
no job outlives the command that started it, still serving its port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tensorrt_llm_ext.runtime.rank_files import (JOB_DIR_ENV, JOB_JOINED, LAUNCHER_CHECK_S, SERVING, STAGE_FD_ENV,
                                                 env_rank, exit_record, pid_alive, read_json, signal_name, write_json)

__all__ = ["ORPHAN_DRAIN_S", "SUPERVISOR_LINGER_S", "die_with_parent", "supervise", "supervise_command"]

SUPERVISOR_LINGER_S = 30.0  # a supervisor whose rank failed waits for the launcher (see supervise)
# A rank whose launcher is gone: SIGTERM (rank 0 stops listening and drains), after this a second SIGTERM (every
# request ends at once), after as long again SIGKILL. Nobody is left to read the job's exit code.
ORPHAN_DRAIN_S = 10.0


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """In a child (before exec): send it ``sig`` when its parent dies (Linux ``PR_SET_PDEATHSIG``), so it
    never outlives the process that started it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the prctl: the death signal will never come
        os.kill(os.getpid(), sig)


def _end_when_launcher_dies(launcher: int, child: subprocess.Popen, rank: int) -> None:
    """Watch ``launcher`` (a daemon thread); once it is gone, end ``child`` (see :data:`ORPHAN_DRAIN_S`)."""
    while child.poll() is None:
        if not pid_alive(launcher):
            print(f"[TRT-LLM-EXT] [ERROR] rank {rank}: the launcher (pid {launcher}) is gone: ending the rank",
                  file=sys.stderr, flush=True)
            for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
                if child.poll() is not None:
                    return
                child.send_signal(sig)
                try:
                    child.wait(ORPHAN_DRAIN_S)
                except subprocess.TimeoutExpired:
                    pass
            return
        time.sleep(LAUNCHER_CHECK_S)


def _run_child(cmd: list[str], stdout=None, on_start=None, stage_fd: int | None = None,
               forwarded: list[int] | None = None) -> int:
    """Start the real rank (it inherits the MPI process-management handle), forward SIGTERM/SIGINT to it,
    return what ``waitpid`` says (negative: the signal that ended it). ``stage_fd``: the write end of a pipe
    the rank is told of (:func:`~.rank_files.tell_supervisor`); ``forwarded`` collects the signals passed on.

    The forwarding handlers are installed before the child is started: a SIGTERM that arrives while it
    starts is held and passed on once it runs (with the default action it would kill the supervisor, and
    the death signal would SIGKILL the rank instead of letting it drain). The rank gets its own process
    group: a signal the MPI launcher sends to the supervisor's group would otherwise reach it twice (directly
    and forwarded; measured with MPICH: one SIGTERM to ``serve --tp 2`` reached rank 0 twice, which a server
    takes as a second, forcing signal)."""
    fds = [int(os.environ["PMI_FD"])] if "PMI_FD" in os.environ else []  # MPICH's PMI connection
    env = None
    if stage_fd is not None:
        fds.append(stage_fd)
        env = {**os.environ, STAGE_FD_ENV: str(stage_fd)}
    child: subprocess.Popen | None = None
    held: list[int] = []

    def forward(signum, frame):
        if forwarded is not None:
            forwarded.append(signum)
        if child is None:
            held.append(signum)
        else:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    parent = os.getpid()
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, process_group=0, env=env,
                             stderr=subprocess.STDOUT if stdout is not None else None, pass_fds=fds,
                             preexec_fn=lambda: die_with_parent(parent))
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
    write_json(run_dir / f"rank{rank}.exit.json", exit_record(rc))
    if rc != 0:
        # Exiting now would make mpiexec kill the other ranks before the launcher collected their
        # stacks; the launcher kills this supervisor once it has (bounded by the linger time, and over
        # at once when the launcher is gone).
        launcher = (read_json(run_dir / "launcher.json") or {}).get("pid")
        end = time.monotonic() + SUPERVISOR_LINGER_S
        while time.monotonic() < end and (launcher is None or pid_alive(launcher)):
            time.sleep(min(LAUNCHER_CHECK_S, max(0.0, end - time.monotonic())))
    return _exit_code(rc)


def supervise_command(cmd: list[str], linger_s: float, launcher: int | None = None) -> int:
    """One rank of a long-running MPI job (``trtllm-ext serve --tp N``): run ``cmd`` as a child with
    inherited stdout/stderr and return its exit code.

    MPICH's launcher kills every rank as soon as one process it started dies by a signal, even with
    ``-disable-auto-cleanup``. A rank that dies under this supervisor is reported here (which rank, how)
    and, for a follower of a job that serves (the rank said so: :data:`~.rank_files.SERVING`), the supervisor
    stays ``linger_s`` longer, so the surviving ranks notice the loss themselves (rank 0 answers 503 and
    exits non-zero) instead of being killed mid-response; during start-up no request is in flight, so its
    end is passed on at once, as rank 0's always is: it ends the job. A rank that ends before every rank joined
    MPI (it says when they have: :func:`~.rank_files.tell_supervisor`) takes the job down at once instead: its
    supervisor dies by SIGKILL.
    ``launcher``: the pid of the command that started the job; once it is gone the rank is ended
    (:func:`_end_when_launcher_dies`)."""
    rank = env_rank()

    def watch(child):
        if launcher is not None:
            threading.Thread(target=_end_when_launcher_dies, args=(launcher, child, rank), daemon=True,
                             name="launcher-watch").start()

    stage_read, stage_write = os.pipe()
    forwarded: list[int] = []
    try:
        rc = _run_child(cmd, on_start=watch, stage_fd=stage_write, forwarded=forwarded)
    finally:
        os.close(stage_write)
    stages = _read_stages(stage_read)
    job_dir = Path(os.environ[JOB_DIR_ENV]) if os.environ.get(JOB_DIR_ENV) else None
    if job_dir is not None:  # for the launcher: mpiexec's own exit code does not say how rank 0 ended
        write_json(job_dir / f"rank{rank}.exit.json", exit_record(rc))
    if rc == 0 and rank != 0 and job_dir is not None and SERVING in stages:
        # A follower's clean end follows rank 0's stop. mpiexec ends the whole job, SIGKILL, once a process exits
        # without MPI_Finalize (measured with MPICH: rank 0 killed before it could report its code, the job's code
        # 0): leave only once rank 0 has recorded its end (or the job ended this supervisor), within the linger.
        end = time.monotonic() + linger_s
        while not (job_dir / "rank0.exit.json").exists() and time.monotonic() < end:
            time.sleep(0.05)
    if rc != 0:
        how = f"was killed by signal {-rc} ({signal_name(-rc)})" if rc < 0 else f"exited with code {rc}"
        print(f"[TRT-LLM-EXT] [ERROR] rank {rank} {how}", file=sys.stderr, flush=True)
        stopped = rc < 0 and -rc in forwarded  # by the stop signal passed on to it, which every rank got
        if JOB_JOINED not in stages and not stopped:
            # A peer may still be on its way to MPI_Init: MPICH's mpiexec aborts the ranks already in MPI when a
            # process exits non-zero, but one that reaches MPI_Init later waits there for good (measured: rank 0
            # SIGKILLed 0.5 s into `serve --tp 2` hung it, rank 1 spinning in MPI_Init); a process that dies by a
            # signal makes it end every process. No peer can notice this loss, so nothing to linger for.
            print(f"[TRT-LLM-EXT] [ERROR] rank {rank} ended before every rank had joined MPI: ending the job",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        # Rank 0 is the one that answers and decides the job's end: never delay it. Nor a follower that failed while
        # the job started (a checkpoint every rank refuses, a stop signal before the ranks handle it): no request to
        # answer yet, and lingering kept the job 30 s, then ended it by SIGKILL (exit 9 instead of the ranks' code).
        if rank != 0 and linger_s > 0 and SERVING in stages:
            time.sleep(linger_s)
            # Still here: rank 0 did not end the job (stuck in a collective); mpiexec ends a job whose process dies
            # by a signal.
            print(f"[TRT-LLM-EXT] [ERROR] rank {rank}: rank 0 did not end the job within {linger_s:g} s of the loss: "
                  f"ending it", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    return _exit_code(rc)


def _read_stages(read_end: int) -> bytes:
    """The stages the rank told (they stay in the pipe after it ended); closes ``read_end``."""
    os.set_blocking(read_end, False)
    try:
        return os.read(read_end, 64)
    except BlockingIOError:
        return b""
    finally:
        os.close(read_end)


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else ""
    if mode == "--supervise":
        return supervise(Path(argv[1]))
    if mode == "--supervise-command" and len(argv) > 3 and argv[2] == "--":
        return supervise_command(argv[3:], float(argv[1]))
    if mode == "--supervise-command" and len(argv) > 5 and argv[2] == "--launcher" and argv[4] == "--":
        return supervise_command(argv[5:], float(argv[1]), int(argv[3]))
    raise SystemExit("usage: python -m tensorrt_llm_ext.runtime.rank_supervisor --supervise RUN_DIR | "
                     f"--supervise-command LINGER_S [--launcher PID] -- CMD..., got {argv}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
