"""The one way ranks are launched: ``mpiexec`` found once, every rank supervised, every fault named within a bound.

This module is the launcher. Used by ``trtllm-ext generate --tp N`` (:func:`launch_ranks`), ``trtllm-ext
serve --tp N`` (:func:`launch_command`), ``bench tp``, ``info`` and the multi-rank tests (:class:`MpiPool`,
:func:`run_on_ranks`; ``tensorrt_llm_ext.testing.mpi`` re-exports them for pytest).

The launching process is NOT part of the MPI job, so it survives any rank fault and reports it (and a rank
exits within a second once its launcher is gone). Three processes, one module each:

* ``mpiexec`` starts one **supervisor** per rank (:mod:`.rank_supervisor`, plain Python, no MPI). It
  starts the real rank as its child, passing the MPI process-management handle on, sends the rank's
  stdout and stderr to ``rank{r}.log`` and records how the rank ended (exit code or signal) in
  ``rank{r}.exit.json`` -- what ``waitpid`` says, also for SIGKILL or ``os._exit``.
* The **rank** (:mod:`.rank_process`) registers :mod:`faulthandler` (a fatal signal prints its Python
  stack; ``SIGUSR1`` prints every thread's stack, even while it is blocked inside a C call), joins MPI,
  then runs the functions the launcher ships it (cloudpickle, one ``task{n}.pkl`` per call) and writes
  each result or traceback (``rank{r}.task{n}.pkl``) until told to stop.
* The **launcher** (:class:`MpiPool`, here) polls the run directory. At the first rank that raises or ends,
  or when the call's ``timeout`` passes, it asks every rank still running for its stacks
  (``SIGUSR1``), stops the whole job and raises :class:`RankJobError`: which rank, how (raised / exit
  code / signal / no result in time), its last log lines; a rank that was still running when a peer
  timed out waiting for it in a collective is named as hung. :func:`launch_ranks` is one call on a
  fresh pool. SIGTERM / SIGINT to the launcher during :func:`launch_ranks` is forwarded to the ranks,
  waited for (``_TERM_WAIT_S``), then the rest is killed (:class:`RankJobInterrupted`).

The three talk only through the run directory (:mod:`.rank_files`).

Why not ``mpi4py.futures.MPIPoolExecutor``: it spawns its workers into the launching process's own MPI
job, and MPICH's process manager SIGKILLs that whole job, the spawning process included, when a worker
dies (measured: a worker's ``os._exit(7)`` killed the pytest process within 5 s, with no result line).

Bounds. A dead rank or a raised error is noticed within a poll interval (``_POLL_S``); the peers get
``_ERROR_GRACE_S`` to report theirs, then the job is stopped within ``_DUMP_WAIT_S + _KILL_WAIT_S``
more. A hung rank (stuck in Python or in C) makes its peers' next collective raise after the collective
timeout (``collective_timeout``, exported to the ranks as ``TLLM_EXT_COLLECTIVE_TIMEOUT_S``), which ends
the call as above; ``timeout`` bounds everything else.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import cloudpickle

from tensorrt_llm_ext.runtime.rank_files import JOB_DIR_ENV, pid_alive, read_json, signal_name, write_json

_POLL_S = 0.02  # the launcher's poll of the run directory
_ERROR_GRACE_S = 0.5  # after a rank's error: time for its peers to report theirs (an error at the same time)
_DUMP_WAIT_S = 1.0  # after SIGUSR1: time for the survivors' faulthandler to print their stacks
_KILL_WAIT_S = 5.0  # after SIGKILL: time for mpiexec and the supervisors to go
_FINISH_WAIT_S = 30.0  # after the stop request: time for MPI finalize and mpiexec to exit
_TERM_WAIT_S = 5.0  # after a forwarded SIGTERM/SIGINT: time for the ranks to end by themselves
_START_TIMEOUT_S = 120.0  # mpiexec + supervisors + MPI init of every rank (0.6-0.8 s measured for 2-4 ranks)
_LOG_TAIL = 20


# ----------------------------------------------------------------------------------------------------
# mpiexec, the ranks' environment, shipping functions
# ----------------------------------------------------------------------------------------------------
_MPIEXEC: tuple[list[str], dict[str, str]] | None = None


def mpiexec_command() -> tuple[list[str], dict[str, str]]:
    """``(argv prefix, environment)`` for starting ranks; found once per process.

    The ``mpiexec`` next to this interpreter (the venv's ``mpich`` wheel) first, else the first ``mpiexec``
    / ``mpirun`` on PATH. MPICH (hydra) needs no flags; Open MPI (any other ``--version``) gets
    ``--oversubscribe`` (4 ranks on 2 cores) and, as root, ``OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)`` and
    ``PRTE_ALLOW_RUN_AS_ROOT(_CONFIRM)`` (measured on the CI and H200 machines). Raises
    ``FileNotFoundError`` saying what to install.
    """
    global _MPIEXEC
    if _MPIEXEC is None:
        exe = str(Path(sys.executable).parent / "mpiexec")
        if not os.path.exists(exe):
            exe = shutil.which("mpiexec") or shutil.which("mpirun")
        if exe is None:
            raise FileNotFoundError("no mpiexec/mpirun found (install the mpich wheel, or put MPI's bin/ on PATH)")
        try:
            version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            version = ""
        env: dict[str, str] = {}
        if "HYDRA" in version or "MPICH" in version:
            flags: list[str] = []
        else:
            flags = ["--oversubscribe"]
            if os.geteuid() == 0:
                env = {k: "1" for k in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
                                        "PRTE_ALLOW_RUN_AS_ROOT", "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM")}
        _MPIEXEC = ([exe, *flags], env)
    return list(_MPIEXEC[0]), dict(_MPIEXEC[1])


def rank_env(collective_timeout: float | None = None, env: dict | None = None) -> dict[str, str]:
    """The ranks' environment: this one, with this package first on PYTHONPATH, the interpreter's ``bin/``
    first on PATH, what :func:`mpiexec_command` needs, the collective timeout and ``env`` on top."""
    e = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])  # the ranks import this very package
    e["PYTHONPATH"] = pkg_root + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    e.update(mpiexec_command()[1])
    if collective_timeout is not None:
        e["TLLM_EXT_COLLECTIVE_TIMEOUT_S"] = str(collective_timeout)
    e.update(env or {})
    return e


def pickle_call(fn, args, kwargs) -> bytes:
    """``(fn, args, kwargs)`` by cloudpickle; a function from outside the package (a test module, a script)
    travels by value, since the ranks cannot import it."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is not None and not module.__name__.startswith("tensorrt_llm_ext"):
        cloudpickle.register_pickle_by_value(module)
    return cloudpickle.dumps((fn, args, kwargs))


# ----------------------------------------------------------------------------------------------------
# Outcomes and errors
# ----------------------------------------------------------------------------------------------------
@dataclass
class RankOutcome:
    """How one rank fared in a failed call. ``returncode``/``signal`` come from its supervisor (``waitpid``)."""

    rank: int
    returncode: int | None = None  # exit code (None: still running, killed by a signal, or no record)
    signal: int | None = None  # the signal that ended it
    ended_at: float | None = None  # time.time() when its supervisor saw it end
    has_result: bool = False  # returned a value for this call
    error: str | None = None  # the traceback it raised in this call
    error_at: float | None = None
    running_at_failure: bool = False  # neither returned nor ended when the launcher began stopping the job
    stopped_by_launcher: bool = False  # still running when the job was stopped
    log_tail: str = ""

    @property
    def failed(self) -> bool:
        return not self.has_result

    @property
    def failed_at(self) -> float | None:
        """When it raised or ended badly (None: it did neither)."""
        if self.error is not None:
            return self.error_at
        bad_end = self.signal is not None or self.returncode not in (None, 0)
        return self.ended_at if bad_end or (self.returncode == 0 and not self.has_result) else None

    def how(self) -> str:
        if self.error is not None:
            return f"raised {self.error.strip().splitlines()[-1]}"
        if self.stopped_by_launcher:
            return "was still running when the job was stopped (its stacks are in the log below)"
        if self.signal is not None:
            ended = f"was killed by signal {self.signal} ({signal_name(self.signal)})"
        elif self.returncode not in (None, 0):
            ended = f"exited with code {self.returncode}"
        elif self.returncode == 0 and not self.has_result:
            ended = "exited with code 0 without a result"
        elif self.has_result:
            return "finished"
        else:
            return "left no exit record"
        if self.running_at_failure:
            return f"was still running at the first failure (its stacks are in the log below), then {ended}"
        return ended


class RankJobError(RuntimeError):
    """A multi-rank call failed: ``headline`` names the failing rank and how; ``outcomes`` has every rank."""

    def __init__(self, headline: str, outcomes: list[RankOutcome], log_dir: str):
        self.headline = headline
        self.outcomes = outcomes
        self.log_dir = log_dir
        parts = [headline, f"(rank logs: {log_dir})"]
        for o in outcomes:
            parts.append(f"--- rank {o.rank} {o.how()}")
            if o.error is not None:
                parts.append("\n".join("    | " + line for line in o.error.rstrip().splitlines()[-_LOG_TAIL:]))
            elif o.failed and o.log_tail:
                parts.append(o.log_tail.rstrip())
        super().__init__("\n".join(parts))


class RankJobInterrupted(RankJobError):
    """The launcher got SIGTERM / SIGINT (``signum``): it was forwarded to the ranks and the job stopped."""

    def __init__(self, signum: int, headline: str, outcomes: list[RankOutcome], log_dir: str):
        self.signum = signum
        super().__init__(headline, outcomes, log_dir)


# ----------------------------------------------------------------------------------------------------
# Launcher side
# ----------------------------------------------------------------------------------------------------
def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _tail(path: Path, n: int = _LOG_TAIL) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    | " + line for line in lines[-n:])


class MpiPool:
    """``world_size`` MPI ranks kept running across calls, each under a supervisor; see the module docs.

    ``MpiPool(2).start()``, then :meth:`run` (or :func:`run_on_ranks`) any number of times, then
    :meth:`shutdown`. After a failed call the pool is ``broken`` (its ranks were stopped): start a new one.

    Args:
        collective_timeout: exported to the ranks as ``TLLM_EXT_COLLECTIVE_TIMEOUT_S`` (how long a
            collective waits for a peer before raising); default: this process's environment.
        log_dir: where the rank logs go (default: a fresh temporary directory, removed by a clean
            :meth:`shutdown`; kept after a failure and named in the error).
        env: extra environment variables for the ranks.
    """

    def __init__(self, world_size: int, *, collective_timeout: float | None = None, log_dir: str | None = None,
                 env: dict | None = None):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"MpiPool: world_size: expected an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self.collective_timeout = collective_timeout
        self.env = dict(env or {})
        self._keep = log_dir is not None
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.proc: subprocess.Popen | None = None
        self.broken = False
        self._tasks = 0
        self._launcher_log = None
        self._received: list[int] = []  # signals caught while forwarding (see forwarding_signals)

    # -- life cycle ----------------------------------------------------------------------------------
    def start(self, timeout: float = _START_TIMEOUT_S) -> "MpiPool":
        """Start the ranks and wait until every one has joined MPI (``RankJobError`` naming the ranks that
        did not, within ``timeout``)."""
        launcher, _ = mpiexec_command()
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="trtllm_ext_ranks_"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for old in [*self.log_dir.glob("rank*"), *self.log_dir.glob("task*"), self.log_dir / "stop"]:
            if old.is_file():
                old.unlink()
        cmd = [*launcher, "-n", str(self.world_size), sys.executable, "-m",
               "tensorrt_llm_ext.runtime.rank_supervisor", "--supervise", str(self.log_dir)]
        write_json(self.log_dir / "launcher.json", {"pid": os.getpid()})  # the ranks exit when it is gone
        self._launcher_log = open(self.log_dir / "mpiexec.log", "wb")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._launcher_log,
                                     stderr=subprocess.STDOUT, env=rank_env(self.collective_timeout, self.env),
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            ready = [read_json(self.log_dir / f"rank{r}.ready.json") for r in range(self.world_size)]
            if all(ready):
                sizes = {x["world"] for x in ready}
                if sizes != {self.world_size}:
                    self._fail(f"the ranks report MPI world sizes {sorted(sizes)}, expected {self.world_size}",
                               "start", dump=False)
                return self
            if self._received:
                self._interrupted(self._received[0], None)
            if self._exits() or self.proc.poll() is not None or time.monotonic() > deadline:
                missing = [r for r, x in enumerate(ready) if x is None]
                why = "in time" if time.monotonic() > deadline else "(a rank or mpiexec ended)"
                self._fail(f"could not start {self.world_size} MPI ranks: rank(s) {missing} did not join MPI {why}; "
                           f"mpiexec: {_tail(self.log_dir / 'mpiexec.log', 8).strip() or 'said nothing'}",
                           "start", dump=True)
            time.sleep(_POLL_S)

    def shutdown(self) -> None:
        """Ask the ranks to exit (they finalize MPI) and wait for mpiexec, bounded; stop it past the bound."""
        if self.proc is None:
            return
        if not self.broken and self.proc.poll() is None:
            (self.log_dir / "stop").write_text("")
            try:
                self.proc.wait(timeout=_FINISH_WAIT_S)
            except subprocess.TimeoutExpired:
                from tensorrt_llm_ext.logger import logger

                logger.warning(f"MpiPool: the ranks did not exit within {_FINISH_WAIT_S:.0f}s of the stop request; "
                               "stopping them")
        self._kill()
        if not self._keep and not self.broken:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def kill(self) -> None:
        """Stop every rank now (SIGKILL); the pool is broken."""
        self.broken = True
        self._kill()

    @contextlib.contextmanager
    def forwarding_signals(self):
        """Within: SIGTERM / SIGINT to this process (main thread only) is passed on to the ranks at the next
        poll of :meth:`start` or :meth:`run`, which stop the job and raise :class:`RankJobInterrupted`."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        restore = {s: signal.signal(s, lambda signum, frame: self._received.append(signum))
                   for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in restore.items():
                signal.signal(s, handler)

    # -- calls ---------------------------------------------------------------------------------------
    def run(self, fn, *args, timeout: float = 300.0, **kwargs) -> list:
        """``fn(*args, **kwargs)`` once on every rank; the results in rank order.

        Raises :class:`RankJobError` (and breaks the pool) when a rank raises, dies, or any rank gives no
        result within ``timeout`` seconds.
        """
        if self.proc is None or self.broken:
            raise RuntimeError("MpiPool.run: the pool is not running (start() it; a failed call breaks it)")
        n = self._tasks
        self._tasks += 1
        tmp = self.log_dir / f"task{n}.tmp"
        tmp.write_bytes(pickle_call(fn, args, kwargs))
        os.replace(tmp, self.log_dir / f"task{n}.pkl")
        deadline = time.monotonic() + timeout
        error_seen = None
        while True:
            results = self._results(n)
            if all(r is not None and r[0] == "ok" for r in results):
                return [r[1] for r in results]
            if self._received:
                self._interrupted(self._received[0], n)
            errors = [r for r in results if r is not None and r[0] == "error"]
            if errors and error_seen is None:
                error_seen = time.monotonic()
            if self._exits():
                self._fail(None, "failed", n=n, dump=True)
            if error_seen is not None and (all(r is not None for r in results)
                                           or time.monotonic() > error_seen + _ERROR_GRACE_S):
                self._fail(None, "failed", n=n, dump=True)
            if self.proc.poll() is not None:
                self._fail(None, "mpiexec", n=n, dump=True)
            if time.monotonic() > deadline:
                self._fail(None, "timeout", n=n, dump=True, timeout=timeout)
            time.sleep(_POLL_S)

    # -- internals -----------------------------------------------------------------------------------
    def _results(self, n: int) -> list:
        out = []
        for r in range(self.world_size):
            path = self.log_dir / f"rank{r}.task{n}.pkl"
            try:
                out.append(pickle.loads(path.read_bytes()) if path.exists() else None)
            except Exception as e:  # a result this process cannot unpickle is that rank's error
                out.append(("error", f"its result could not be unpickled here: {type(e).__name__}: {e}", time.time()))
        return out

    def _exits(self) -> dict[int, dict]:
        return {r: e for r in range(self.world_size) if (e := read_json(self.log_dir / f"rank{r}.exit.json"))}

    def _pids(self) -> dict[int, int]:
        return {r: x["pid"] for r in range(self.world_size) if (x := read_json(self.log_dir / f"rank{r}.pid.json"))}

    def _running(self, n: int | None) -> set[int]:
        """Ranks alive that neither ended nor answered call ``n``."""
        pids, exits = self._pids(), self._exits()
        results = self._results(n) if n is not None else [None] * self.world_size
        return {r for r, pid in pids.items() if r not in exits and results[r] is None and pid_alive(pid)}

    def _kill(self) -> None:
        if self.proc is not None:
            _signal_all(self._pids().values(), signal.SIGKILL)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # mpiexec, its proxies and the supervisors
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        if self._launcher_log is not None:
            self._launcher_log.close()
            self._launcher_log = None

    def _stop(self, n: int | None, dump: bool) -> tuple[set[int], set[int], dict[int, dict]]:
        """Dump the stacks of the ranks still running (``dump``), then kill the job. Returns the ranks running
        when the stop began, those still running at the kill, and the exit records from before the kill (the
        kill's own SIGKILLs are not how a rank ended)."""
        self.broken = True
        running = self._running(n)
        still = set(running)
        if dump and running:
            pids = self._pids()
            _signal_all([pids[r] for r in running], signal.SIGUSR1)
            time.sleep(_DUMP_WAIT_S)
            # A peer on its way out (its own error, e.g. the dead rank's closed socket) ended or answered by
            # itself: it was not stopped by the launcher.
            still = running & self._running(n)
        exits = self._exits()
        self._kill()
        return running, still, exits

    def _outcomes(self, n: int | None, running: set[int], still: set[int],
                  exits: dict[int, dict]) -> list[RankOutcome]:
        results = self._results(n) if n is not None else [None] * self.world_size
        out = []
        for r in range(self.world_size):
            res, e = results[r], exits.get(r)
            o = RankOutcome(rank=r, has_result=res is not None and res[0] == "ok",
                            log_tail=_tail(self.log_dir / f"rank{r}.log"), running_at_failure=r in running,
                            stopped_by_launcher=r in still)
            if res is not None and res[0] == "error":
                o.error, o.error_at = res[1], res[2]
            if e is not None:
                o.returncode, o.signal, o.ended_at = e["returncode"], e["signal"], e["time"]
            out.append(o)
        return out

    def _fail(self, headline: str | None, reason: str, *, n: int | None = None, dump: bool,
              timeout: float = 0.0):
        running, still, exits = self._stop(n, dump)
        outcomes = self._outcomes(n, running, still, exits)
        raise RankJobError(headline or _headline(outcomes, reason, timeout, self.log_dir), outcomes,
                           str(self.log_dir))

    def _interrupted(self, signum: int, n: int | None):
        """Pass ``signum`` on to every rank, give them ``_TERM_WAIT_S`` to end (or answer), kill the rest,
        raise."""
        self.broken = True
        t0 = time.monotonic()
        _signal_all(self._pids().values(), signum)
        while time.monotonic() < t0 + _TERM_WAIT_S and self._running(n):
            time.sleep(_POLL_S)
        waited = time.monotonic() - t0
        running, still, exits = self._stop(n, dump=False)
        outcomes = self._outcomes(n, set(), still, exits)
        headline = (f"interrupted by {signal_name(signum)}: passed on to the {self.world_size} ranks, "
                    + (f"{len(still)} still running after {_TERM_WAIT_S:g}s were killed" if still
                       else f"which ended within {waited:.1f}s")
                    + "; mpiexec stopped, no rank left running")
        raise RankJobInterrupted(signum, headline, outcomes, str(self.log_dir))


def _headline(outcomes: list[RankOutcome], reason: str, timeout: float, run_dir: Path) -> str:
    # A rank that died comes first: its peers' errors (a closed connection) follow from it, and a rank of
    # this launcher never dies of its own error (it reports it and waits).
    failures = sorted((o for o in outcomes if o.failed_at is not None),
                      key=lambda o: (o.error is not None, o.failed_at))
    running = [o.rank for o in outcomes if o.running_at_failure]
    if reason == "timeout" and not failures:
        missing = [o.rank for o in outcomes if not o.has_result]
        return f"rank(s) {missing} gave no result within the time limit of {timeout:g}s (hung; stacks in the logs)"
    if failures:
        first = failures[0]
        others = [r for r in running if r != first.rank]
        # Only a raised timeout (gloo: "Timed out waiting", NCCL: "... before timing out") says the peers
        # stopped responding; a death is its own cause.
        said = first.error.strip().splitlines()[-1].lower() if first.error else ""
        if others and any(w in said for w in ("timed out", "timeout", "timing out")):
            return (f"rank(s) {others} stopped responding (hung): rank {first.rank} timed out waiting for "
                    f"them in a collective and {first.how()}")
        return f"rank {first.rank} {first.how()}"
    if reason == "mpiexec":
        return f"mpiexec exited before every rank reported: {_tail(run_dir / 'mpiexec.log', 8)}"
    return "the job failed without a rank record"


def run_on_ranks(pool: MpiPool, fn, *args, timeout: float = 300.0, **kwargs) -> list:
    """``pool.run(fn, *args, timeout=timeout, **kwargs)``: ``fn`` once on every rank, results in rank order."""
    return pool.run(fn, *args, timeout=timeout, **kwargs)


def launch_ranks(world_size: int, fn, *args, timeout: float = 1800.0, collective_timeout: float | None = None,
                 log_dir: str | None = None, env: dict | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh MPI ranks; results in rank order.

    Args:
        timeout: seconds the call may take; then every rank is stopped (a ``RankJobError`` naming the ranks
            without a result).
        collective_timeout, log_dir, env: as for :class:`MpiPool` (the logs are kept after a failure).

    Raises :class:`RankJobError` when any rank fails, dies or hangs (see the module docs for bounds), and
    :class:`RankJobInterrupted` when this process gets SIGTERM / SIGINT meanwhile (called from the main
    thread): the signal is passed on to the ranks, which get ``_TERM_WAIT_S`` to end before the rest of
    the job is killed.

    Example::

        launch_ranks(2, my_fn, 3, timeout=60)   # [my_fn(3) on rank 0, my_fn(3) on rank 1]
    """
    pool = MpiPool(world_size, collective_timeout=collective_timeout, log_dir=log_dir, env=env)
    with pool.forwarding_signals():
        try:
            pool.start()
            return pool.run(fn, *args, timeout=timeout, **kwargs)
        finally:
            pool.shutdown()


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a served job gracefully -- ``serve``'s drain at TP 1, :func:`launch_command`'s forward
    at TP N: SIGTERM, SIGINT, and SIGHUP (the terminal closed) unless this process ignores it (``nohup``: the job
    must outlive the terminal)."""
    hup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGTERM, signal.SIGINT, *hup)


def launch_command(world_size: int, cmd: list[str], *, linger_s: float, env: dict | None = None) -> int:
    """Run the command ``cmd`` on ``world_size`` MPI ranks, each under
    :func:`~tensorrt_llm_ext.runtime.rank_supervisor.supervise_command`; SIGTERM /
    SIGINT to this process is passed on to ``mpiexec`` (which passes it to every rank); returns rank 0's exit
    code (rank 0 decides the job's end; 128 + N for a signal N), or ``mpiexec``'s where rank 0 left no record
    (its supervisor was killed). Raises ``FileNotFoundError`` without an ``mpiexec``.

    ``mpiexec``'s code alone is not to be trusted: measured with MPICH, rank 0 exiting 3 half a second after its
    follower exited 0 gave 0 or 9, never 3 (MPICH SIGKILLs the job once a process exits without MPI_Finalize, and
    reports the first one's code: a server that could not listen reported success). Each supervisor records its
    rank's end in a directory of this call (a follower that ended cleanly waits for rank 0's record).

    ``mpiexec`` runs in its own session, so a terminal's Ctrl-C reaches this process only, and every signal is
    passed on as SIGTERM. Measured with MPICH's ``mpiexec``: a SIGINT reaches rank 0 twice (and a second one
    kills the whole job, exit 255), a SIGTERM reaches every rank once, each time -- so rank 0 drains on the
    first and ends every request cleanly on the second. After a second signal the job's exit code is 128 + the
    signal received here (130 for SIGINT), as at TP 1, whatever the ranks' codes: once told twice, MPICH's
    ``mpiexec`` SIGKILLs the ranks still running when the first one exits (a follower that is just leaving;
    measured: its "BAD TERMINATION ... signal 9" banner, never a lost response).
    """
    from tensorrt_llm_ext.runtime.rank_supervisor import die_with_parent

    launcher, _ = mpiexec_command()
    me = os.getpid()
    full = [*launcher, "-n", str(world_size), sys.executable, "-m", "tensorrt_llm_ext.runtime.rank_supervisor",
            "--supervise-command", str(linger_s), "--launcher", str(me), "--", *cmd]
    received: list[int] = []
    proc = None

    def forward(signum, frame):
        received.append(signum)
        if proc is not None:
            proc.send_signal(signal.SIGTERM)

    # Installed before mpiexec starts (a signal meanwhile is passed on once it runs). SIGHUP (the terminal
    # closed) drains like SIGTERM, unless it is ignored here (nohup): then it stays ignored and the job serves on.
    # A launcher killed outright (SIGKILL) cannot pass anything on: mpiexec gets SIGTERM as its parent-death
    # signal, and each rank's supervisor ends its rank once this pid is gone.
    old = {s: signal.signal(s, forward) for s in stop_signals()}
    job_dir = tempfile.mkdtemp(prefix="trtllm_ext_job_")
    try:
        proc = subprocess.Popen(full, env=rank_env(None, {**(env or {}), JOB_DIR_ENV: job_dir}),
                                start_new_session=True, preexec_fn=lambda: die_with_parent(me, signal.SIGTERM))
        for _ in received:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait()
        rank0 = read_json(Path(job_dir) / "rank0.exit.json") or {}
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(job_dir, ignore_errors=True)
    rc = rc if rc >= 0 else 128 - rc
    if len(received) > 1:  # told twice to stop: rank 0 ended every request on the second signal (see above)
        return 128 + received[-1]
    if rank0 and received and rank0["signal"] == signal.SIGTERM:
        # Ended, before it had a handler, by the SIGTERM passed on in place of the signal received here: the code that
        # signal gives at TP 1 (Ctrl-C while the ranks start: 130, was 143).
        return 128 + received[0]
    if rank0:  # rank 0 decides the job's end
        return 128 + rank0["signal"] if rank0["signal"] else rank0["returncode"]
    return rc
