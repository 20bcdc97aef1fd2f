"""MPI-launched multi-rank execution for tests, with every wait bounded.

Functions are shipped by value with cloudpickle (test modules are not importable on the workers), run
on every rank of an ``mpi4py.futures.MPIPoolExecutor``, and their results or tracebacks come back. A
rank that raises is reported with its own traceback; a rank that hangs fails the call after
``timeout`` seconds and the pool is killed, so a broken test never hangs the suite.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import cloudpickle

from tensorrt_llm_ext._env import ENV

DEFAULT_TIMEOUT_S = 300.0
# Beyond the watchdog: a peer waiting in a collective raises after the collective timeout; a rank
# that still has not answered then is stuck in C and is named (and killed) as not answering.
_GRACE_S = ENV.collective_timeout_s + 10.0


class RankFailure(RuntimeError):
    """One or more ranks raised or did not answer in time."""


def _on_alarm(signum, frame):
    raise TimeoutError("rank exceeded its time limit (the traceback shows where it was stuck)")


def _worker_entry(blob: bytes, timeout: float):
    """Runs on a worker: unpickle ``(fn, args)``, call it, return ``(status, rank, payload)``.

    A watchdog alarm turns a hang in Python code into an exception with a traceback; a hang inside a
    collective ends with the process group's own timeout. Errors come back as values, so the worker
    stays alive and the pool can be shut down cleanly (killing an MPICH worker aborts the whole job,
    the spawning test process included).
    """
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    armed = threading.current_thread() is threading.main_thread()
    if armed:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        # A rank blocked inside a C call never runs the alarm's Python handler: faulthandler prints
        # its stack to stderr from C at the same deadline, so the stuck rank is visible.
        faulthandler.dump_traceback_later(timeout, exit=False)
    try:
        fn, args, kwargs = cloudpickle.loads(blob)
        return ("ok", rank, fn(*args, **kwargs))
    except BaseException:  # report everything, KeyboardInterrupt included, with the rank's traceback
        tb = traceback.format_exc()
        print(f"[rank {rank}] raised:\n{tb}", file=sys.stderr, flush=True)
        return ("error", rank, tb)
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _worker_info():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), os.getpid()


@dataclass
class MpiPool:
    """An MPIPoolExecutor of ``world_size`` workers plus what is needed to kill it if it hangs."""

    world_size: int
    executor: object = None
    pids: list = field(default_factory=list)
    broken: bool = False

    def start(self, timeout: float = 120.0) -> "MpiPool":
        from mpi4py.futures import MPIPoolExecutor

        # mpi4py spawns through the venv's mpiexec; make sure it is found.
        bindir = os.path.dirname(sys.executable)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        self.executor = MPIPoolExecutor(max_workers=self.world_size)
        futures = [self.executor.submit(_worker_info) for _ in range(self.world_size)]
        deadline = time.monotonic() + timeout
        infos = []
        try:
            for f in futures:
                infos.append(f.result(timeout=max(0.1, deadline - time.monotonic())))
        except Exception as e:  # a spawn that fails hangs; never wait past the deadline
            self.discard()
            raise RankFailure(f"could not start {self.world_size} MPI workers within {timeout:.0f}s: {e!r}")
        self.pids = sorted({pid for _, _, pid in infos})
        sizes = {size for _, size, _ in infos}
        if sizes != {self.world_size}:
            self.discard()
            raise RankFailure(f"MPI workers report world sizes {sizes}, expected {self.world_size}")
        return self

    def discard(self) -> None:
        """Stop using this pool: its workers exit once their current task returns."""
        self.broken = True
        if self.executor is not None:
            try:
                self.executor.shutdown(wait=False, cancel_futures=True)
            except Exception:
                pass
        self.executor = None

    def kill(self) -> None:
        """Last resort for a worker stuck in C code past every timeout: SIGKILL it.

        MPICH then aborts the whole job, this process included -- a visible failure, never a hang.
        """
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.discard()

    def shutdown(self) -> None:
        if self.executor is not None and not self.broken:
            self.executor.shutdown(wait=True)
        elif self.executor is not None:
            self.discard()
        self.executor = None


def _pickle_call(fn, args, kwargs) -> bytes:
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    if module is not None and not module.__name__.startswith("tensorrt_llm_ext"):
        cloudpickle.register_pickle_by_value(module)
    return cloudpickle.dumps((fn, args, kwargs))


def run_on_ranks(pool, fn, *args, timeout: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` once on every rank of ``pool``; return results in rank order.

    Raises :class:`RankFailure` with each failing rank's traceback. A rank still running after
    ``timeout`` seconds raises on its own (watchdog); one that does not answer ``_GRACE_S`` later is
    killed. After any failure the pool is discarded and the fixture starts a fresh one.
    """
    mpool = pool if isinstance(pool, MpiPool) else None
    executor = mpool.executor if mpool is not None else pool
    world = mpool.world_size if mpool is not None else executor._max_workers
    blob = _pickle_call(fn, args, kwargs)
    futures = [executor.submit(_worker_entry, blob, timeout) for _ in range(world)]
    deadline = time.monotonic() + timeout + _GRACE_S
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    pending = 0
    for f in futures:
        try:
            status, rank, payload = f.result(timeout=max(0.1, deadline - time.monotonic()))
        except Exception as e:  # timeout or a dead worker
            pending += 1
            errors[-pending] = f"no answer within {timeout:.0f}s + {_GRACE_S:.0f}s ({type(e).__name__}: {e})"
            continue
        if status == "ok":
            results[rank] = payload
        else:
            errors[rank] = payload
    if errors:
        if mpool is not None:
            # A rank raised: its peers may hold half-finished collectives. Start fresh next time.
            mpool.kill() if pending else mpool.discard()
        # Futures are not bound to ranks: the ranks that never answered are the ones missing.
        silent = sorted(set(range(world)) - set(results) - {r for r in errors if r >= 0})
        lines = [f"{len(errors)} of {world} ranks failed:"]
        for rank, text in sorted(errors.items(), key=lambda kv: kv[0]):
            who = f"rank {rank}" if rank >= 0 else f"rank {silent[-rank - 1]}" if -rank <= len(silent) else "a rank"
            lines.append(f"--- {who} ---\n{text.rstrip()}")
        raise RankFailure("\n".join(lines))
    return [results[r] for r in sorted(results)]
