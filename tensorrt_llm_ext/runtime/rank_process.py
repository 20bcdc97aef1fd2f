"""A rank of an :class:`~.ranks.MpiPool`, started by its supervisor (:mod:`.rank_supervisor`).

It registers :mod:`faulthandler` (a fatal signal prints its Python stack; ``SIGUSR1`` prints every
thread's stack, even while it is blocked inside a C call), joins MPI, then runs the functions the launcher
ships it (cloudpickle, one ``task{n}.pkl`` per call) and writes each result or traceback
(``rank{r}.task{n}.pkl``) until told to stop. It exits within a second once its launcher is gone.

Run as ``python -m tensorrt_llm_ext.runtime.rank_process RUN_DIR``.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import cloudpickle

from tensorrt_llm_ext.runtime.rank_files import LAUNCHER_CHECK_S, env_rank, pid_alive, read_json, write_json

__all__ = ["IDLE_POLL_S", "TASK_POLL_S", "next_wait", "rank_main"]

TASK_POLL_S = 0.02  # the longest a rank between two calls sleeps between looks for its next task
IDLE_POLL_S = 0.1  # ... once it has waited IDLE_AFTER_S: a pool kept between uses costs ~0.2 % of a core, not ~1 %
IDLE_AFTER_S = 1.0


def next_wait(wait: float, waited_s: float) -> float:
    """The next sleep of a rank that has slept ``wait`` and waited ``waited_s`` in all for its next task: doubling
    from 1 ms up to ``TASK_POLL_S`` (calls that follow one another), to ``IDLE_POLL_S`` after ``IDLE_AFTER_S``
    (an idle pool: measured ~1 % of a core a rank at 20 ms, with ~10 pooled ranks idle through a CPU test run)."""
    return min(2 * wait, TASK_POLL_S if waited_s < IDLE_AFTER_S else IDLE_POLL_S)


def _exit_without_launcher(rank: int, pid: int) -> None:
    """A rank's watchdog: exit once the launching process is gone (SIGKILLed, say), idle or mid-call, so no
    rank outlives the process that would collect its result."""
    while pid_alive(pid):
        time.sleep(LAUNCHER_CHECK_S)
    print(f"[rank {rank}] the launcher (pid {pid}) is gone: exiting", file=sys.stderr, flush=True)
    os._exit(3)


def rank_main(run_dir: Path) -> None:
    """A rank: join MPI, then run ``task{n}.pkl`` for n = 0, 1, ... until ``stop`` appears."""
    faulthandler.enable(all_threads=True)  # a fatal signal (segfault, abort) prints the Python stacks
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for them before a kill
    rank = env_rank()
    from mpi4py import MPI

    from tensorrt_llm_ext.logger import use_private_rank_stream

    use_private_rank_stream()  # stdout/stderr go to rank<r>.log: keep every line there
    launcher = (read_json(run_dir / "launcher.json") or {}).get("pid")
    if launcher is not None:
        threading.Thread(target=_exit_without_launcher, args=(rank, launcher), daemon=True).start()
    write_json(run_dir / f"rank{rank}.ready.json", {"world": MPI.COMM_WORLD.Get_size(), "pid": os.getpid()})
    n = 0
    while True:
        task = run_dir / f"task{n}.pkl"
        wait, since = 0.001, time.monotonic()
        while not task.exists():
            if (run_dir / "stop").exists():
                return
            time.sleep(wait)
            wait = next_wait(wait, time.monotonic() - since)
        try:
            fn, args, kwargs = cloudpickle.loads(task.read_bytes())
            payload = ("ok", fn(*args, **kwargs), time.time())
        except BaseException:  # report everything, KeyboardInterrupt included, with the rank's traceback
            tb = traceback.format_exc()
            print(f"[rank {rank}] raised:\n{tb}", file=sys.stderr, flush=True)
            payload = ("error", tb, time.time())
        try:
            data = pickle.dumps(payload)
        except Exception as e:
            data = pickle.dumps(("error", f"its result could not be pickled: {type(e).__name__}: {e}", time.time()))
        sys.stdout.flush()
        tmp = run_dir / f"rank{rank}.task{n}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, run_dir / f"rank{rank}.task{n}.pkl")
        n += 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python -m tensorrt_llm_ext.runtime.rank_process RUN_DIR, got {sys.argv[1:]}")
    rank_main(Path(sys.argv[1]))
