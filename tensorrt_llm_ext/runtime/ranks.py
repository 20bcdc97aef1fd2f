"""Supervised multi-rank jobs: N MPI ranks whose every fault is reported by rank, within a bound.

``launch_ranks(n, fn, ...)`` runs ``fn(*args, **kwargs)`` once on each of ``n`` ranks started by
``mpiexec`` and returns the results in rank order. The launching process is NOT part of the MPI job (a
dying MPI-spawned worker would abort it), so it survives any rank fault and reports it:

* ``mpiexec`` starts one **supervisor** per rank (plain Python, no MPI). It starts the real rank as its
  child, passing the MPI process-management handle on (``PMI_FD`` / the inherited environment), sends
  the rank's stdout and stderr to ``rank{r}.log`` and records how the rank ended (exit code or
  signal) in ``rank{r}.exit.json`` -- what ``waitpid`` says, also for SIGKILL or ``os._exit``.
* The **rank** registers :mod:`faulthandler` (a fatal signal prints its Python stack; ``SIGUSR1``
  prints every thread's stack, even while it is blocked inside a C call), runs ``fn`` and writes its
  result, or prints its traceback and exits with code 1.
* The **launcher** polls the run directory. At the first rank that ends badly, or when ``timeout``
  passes, it asks every surviving rank for its stacks (``SIGUSR1``), stops the whole job and raises
  :class:`RankJobError`: which rank, how (exit code / signal / no result in time), its last log lines.

Bounds. A dead rank is noticed within a poll interval (0.1 s) and the job is stopped within
``_DUMP_WAIT_S + _KILL_WAIT_S`` more. A hung rank (stuck in Python or in C) makes its peers' next
collective raise after the collective timeout (``collective_timeout``, exported to the ranks as
``TLLM_EXT_COLLECTIVE_TIMEOUT_S``), which ends the job as above; ``timeout`` bounds everything else.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import cloudpickle

_POLL_S = 0.1
_DUMP_WAIT_S = 1.0  # after SIGUSR1: time for the survivors' faulthandler to print their stacks
_KILL_WAIT_S = 5.0  # after SIGKILL: time for mpiexec and the supervisors to go
_FINISH_WAIT_S = 30.0  # after every rank wrote its result: time for MPI finalize and mpiexec to exit
_SUPERVISOR_LINGER_S = 30.0  # a supervisor whose rank failed waits for the launcher (see _supervise)
_LOG_TAIL = 20

# Environment variables that carry a rank's index under the process managers we meet (MPICH hydra,
# Open MPI / PMIx).
_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


@dataclass
class RankOutcome:
    """How one rank ended. ``returncode``/``signal`` come from the rank's supervisor (``waitpid``)."""

    rank: int
    returncode: int | None = None  # exit code (None: killed by a signal, or no record)
    signal: int | None = None  # the signal that ended it
    ended_at: float | None = None  # time.time() when its supervisor saw it end
    has_result: bool = False
    stopped_by_launcher: bool = False  # still running when the job was stopped
    log_tail: str = ""

    @property
    def failed(self) -> bool:
        return not self.has_result or self.returncode != 0

    def how(self) -> str:
        if self.stopped_by_launcher:
            return "was still running when the job was stopped (its stacks are in the log below)"
        if self.signal is not None:
            return f"was killed by signal {self.signal} ({_signal_name(self.signal)})"
        if self.returncode is None:
            return "left no exit record"
        if self.returncode != 0:
            return f"exited with code {self.returncode}"
        return "finished" if self.has_result else "exited with code 0 without a result"


class RankJobError(RuntimeError):
    """A multi-rank job failed: ``headline`` names the failing rank and how; ``outcomes`` has every rank."""

    def __init__(self, headline: str, outcomes: list[RankOutcome], log_dir: str):
        self.headline = headline
        self.outcomes = outcomes
        self.log_dir = log_dir
        parts = [headline, f"(rank logs: {log_dir})"]
        for o in outcomes:
            parts.append(f"--- rank {o.rank} {o.how()}")
            if o.failed and o.log_tail:
                parts.append(o.log_tail.rstrip())
        super().__init__("\n".join(parts))

    @property
    def failed_ranks(self) -> list[int]:
        return [o.rank for o in self.outcomes if o.failed]


# ----------------------------------------------------------------------------------------------------
# Launcher side
# ----------------------------------------------------------------------------------------------------
def _mpiexec() -> str:
    """The venv's mpiexec (next to this interpreter) first, else the first on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("launch_ranks: no mpiexec/mpirun found (install mpich, or put MPI's bin/ on PATH)")


def _pickle_job(fn, args, kwargs) -> bytes:
    module = sys.modules.get(fn.__module__) if hasattr(fn, "__module__") else None
    if module is not None and not module.__name__.startswith("tensorrt_llm_ext"):
        cloudpickle.register_pickle_by_value(module)  # test modules are not importable on the ranks
    return cloudpickle.dumps((fn, args, kwargs))


def _rank_env(collective_timeout: float | None, env: dict | None) -> dict:
    e = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])  # the ranks import this very package
    e["PYTHONPATH"] = pkg_root + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    if collective_timeout is not None:
        e["TLLM_EXT_COLLECTIVE_TIMEOUT_S"] = str(collective_timeout)
    # Open MPI refuses root and oversubscription without these (measured on the CI and H200 machines);
    # MPICH ignores them.
    for k in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "PRTE_ALLOW_RUN_AS_ROOT",
              "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM", "OMPI_MCA_rmaps_base_oversubscribe"):
        e.setdefault(k, "1")
    e.update(env or {})
    return e


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def launch_ranks(world_size: int, fn, *args, timeout: float = 1800.0, collective_timeout: float | None = None,
                 log_dir: str | None = None, env: dict | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` MPI ranks; results in rank order.

    Args:
        timeout: seconds the whole job may take; then every rank is stopped (a ``RankJobError`` naming
            the ranks without a result).
        collective_timeout: exported to the ranks as ``TLLM_EXT_COLLECTIVE_TIMEOUT_S`` (how long a
            collective waits for a peer before raising); default: the launcher's environment.
        log_dir: where the rank logs go (default: a fresh temporary directory, removed on success).
        env: extra environment variables for the ranks.

    Raises :class:`RankJobError` when any rank fails, dies or hangs (see the module docs for bounds).
    """
    if world_size < 1:
        raise ValueError(f"launch_ranks: world_size must be >= 1, got {world_size}")
    keep = log_dir is not None
    run_dir = Path(log_dir) if keep else Path(tempfile.mkdtemp(prefix="trtllm_ext_ranks_"))
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*"):
        old.unlink()
    (run_dir / "job.pkl").write_bytes(_pickle_job(fn, args, kwargs))
    cmd = [_mpiexec(), "-n", str(world_size), sys.executable, "-m", "tensorrt_llm_ext.runtime.ranks",
           "--supervise", str(run_dir)]
    launcher_log = open(run_dir / "mpiexec.log", "wb")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=launcher_log, stderr=subprocess.STDOUT,
                            env=_rank_env(collective_timeout, env), start_new_session=True)
    deadline = time.monotonic() + timeout
    reason = None
    try:
        while True:
            exits = {r: _read_json(run_dir / f"rank{r}.exit.json") for r in range(world_size)}
            bad = [r for r, e in exits.items() if e is not None and (e["returncode"] != 0 or e["signal"] is not None)]
            done = all((run_dir / f"rank{r}.result.pkl").exists() for r in range(world_size))
            if bad:
                reason = "failed"
                break
            if done:
                break
            if proc.poll() is not None:
                reason = "mpiexec"
                break
            if time.monotonic() > deadline:
                reason = "timeout"
                break
            time.sleep(_POLL_S)
        if reason is None:
            try:
                proc.wait(timeout=_FINISH_WAIT_S)
            except subprocess.TimeoutExpired:
                from tensorrt_llm_ext.logger import logger

                logger.warning(f"launch_ranks: every rank returned but mpiexec did not exit within "
                               f"{_FINISH_WAIT_S:.0f}s; stopping it")
                _stop(proc, run_dir, world_size, dump=False)
            results = [pickle.loads((run_dir / f"rank{r}.result.pkl").read_bytes()) for r in range(world_size)]
            if not keep:
                shutil.rmtree(run_dir, ignore_errors=True)
            return results
        alive = _stop(proc, run_dir, world_size, dump=True)
    finally:
        if proc.poll() is None:
            _stop(proc, run_dir, world_size, dump=False)
        launcher_log.close()
    outcomes = _outcomes(run_dir, world_size, alive)
    raise RankJobError(_headline(outcomes, reason, timeout, run_dir), outcomes, str(run_dir))


def _rank_pids(run_dir: Path, world_size: int) -> dict[int, int]:
    pids = {}
    for r in range(world_size):
        info = _read_json(run_dir / f"rank{r}.pid.json")
        if info is not None:
            pids[r] = info["pid"]
    return pids


def _stop(proc: subprocess.Popen, run_dir: Path, world_size: int, dump: bool) -> set[int]:
    """Dump the survivors' stacks (``dump``), then kill every rank and mpiexec; returns the ranks that
    were still running."""
    pids = _rank_pids(run_dir, world_size)
    alive = {r for r, pid in pids.items() if _pid_alive(pid) and not (run_dir / f"rank{r}.exit.json").exists()}
    if dump and alive:
        _signal_all([pids[r] for r in alive], signal.SIGUSR1)
        time.sleep(_DUMP_WAIT_S)
        # A peer that was already on its way out (its own error, e.g. the dead rank's closed socket)
        # ended by itself: it was not stopped by the launcher.
        alive = {r for r in alive if not (run_dir / f"rank{r}.exit.json").exists()}
    _signal_all(pids.values(), signal.SIGKILL)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec, its proxies and the supervisors
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=_KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        pass
    return alive


def _outcomes(run_dir: Path, world_size: int, alive: set[int]) -> list[RankOutcome]:
    out = []
    for r in range(world_size):
        e = _read_json(run_dir / f"rank{r}.exit.json")
        o = RankOutcome(rank=r, has_result=(run_dir / f"rank{r}.result.pkl").exists(),
                        log_tail=_tail(run_dir / f"rank{r}.log"))
        if r in alive:
            o.stopped_by_launcher = True
        elif e is not None:
            o.returncode, o.signal, o.ended_at = e["returncode"], e["signal"], e["time"]
        out.append(o)
    return out


def _headline(outcomes: list[RankOutcome], reason: str, timeout: float, run_dir: Path) -> str:
    ended = sorted((o for o in outcomes if o.failed and o.ended_at is not None), key=lambda o: o.ended_at)
    hung = [o.rank for o in outcomes if o.stopped_by_launcher]
    if reason == "timeout":
        missing = [o.rank for o in outcomes if not o.has_result]
        return f"rank(s) {missing} gave no result within the job timeout of {timeout:.0f}s (timeout)"
    if ended:
        first = ended[0]
        tail = first.log_tail.lower()
        if hung and ("timed out" in tail or "timeout" in tail):
            return (f"rank(s) {hung} stopped responding (hung): rank {first.rank} timed out waiting for "
                    f"them in a collective and {first.how()}")
        return f"rank {first.rank} {first.how()}"
    if reason == "mpiexec":
        return f"mpiexec exited before every rank reported: {_tail(run_dir / 'mpiexec.log', 8)}"
    return "the job failed without a rank record"


# ----------------------------------------------------------------------------------------------------
# Supervisor and rank side (run under mpiexec)
# ----------------------------------------------------------------------------------------------------
def _env_rank() -> int:
    for k in _RANK_ENV:
        if k in os.environ:
            return int(os.environ[k])
    raise RuntimeError(f"supervisor: none of {_RANK_ENV} is set (not started by mpiexec?)")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # readers never see a half-written record


def _signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; real-time signals without a name in :class:`signal.Signals` get ``signal N``
    (``signal.Signals(N)`` would raise, and a supervisor must not die while reporting its rank)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


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
    the death signal would SIGKILL the rank instead of letting it drain)."""
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
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout,
                             stderr=subprocess.STDOUT if stdout is not None else None, pass_fds=fds,
                             preexec_fn=lambda: _die_with_parent(parent))
    for signum in held:
        child.send_signal(signum)
    if on_start is not None:
        on_start(child)
    return child.wait()


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _supervise(run_dir: Path) -> int:
    rank = _env_rank()
    with open(run_dir / f"rank{rank}.log", "wb") as log:
        rc = _run_child([sys.executable, "-m", "tensorrt_llm_ext.runtime.ranks", "--rank", str(run_dir)],
                        stdout=log, on_start=lambda child: _write_json(
                            run_dir / f"rank{rank}.pid.json", {"pid": child.pid, "supervisor": os.getpid()}))
    sig = -rc if rc < 0 else None
    _write_json(run_dir / f"rank{rank}.exit.json",
                {"returncode": rc if rc >= 0 else None, "signal": sig, "time": time.time()})
    if rc != 0:
        # Exiting now would make mpiexec kill the other ranks before the launcher collected their
        # stacks; the launcher kills this supervisor once it has (bounded by the linger time).
        time.sleep(_SUPERVISOR_LINGER_S)
    return _exit_code(rc)


def supervise_command(cmd: list[str], linger_s: float) -> int:
    """One rank of a long-running MPI job (``trtllm-ext serve --tp N``): run ``cmd`` as a child with
    inherited stdout/stderr and return its exit code.

    MPICH's launcher kills every rank as soon as one process it started dies by a signal, even with
    ``-disable-auto-cleanup``. A rank that dies under this supervisor is reported here (which rank, how)
    and the supervisor stays ``linger_s`` longer, so the surviving ranks notice the loss themselves
    (rank 0 answers 503 and exits non-zero) instead of being killed mid-response. Rank 0's own end is
    passed on at once: it ends the job."""
    rank = _env_rank()
    rc = _run_child(cmd)
    if rc != 0:
        how = f"was killed by signal {-rc} ({_signal_name(-rc)})" if rc < 0 else f"exited with code {rc}"
        print(f"[TRT-LLM-EXT] [ERROR] rank {rank} {how}", file=sys.stderr, flush=True)
        if rank != 0:  # rank 0 is the one that answers and decides the job's end: never delay it
            time.sleep(linger_s)
    return _exit_code(rc)


def _rank_main(run_dir: Path) -> None:
    faulthandler.enable(all_threads=True)  # a fatal signal (segfault, abort) prints the Python stacks
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for them before a kill
    rank = _env_rank()
    from tensorrt_llm_ext.logger import use_private_rank_stream

    use_private_rank_stream()  # stdout/stderr go to rank<r>.log: keep every line there
    try:
        fn, args, kwargs = cloudpickle.loads((run_dir / "job.pkl").read_bytes())
        result = fn(*args, **kwargs)
        tmp = run_dir / f"rank{rank}.result.tmp"
        tmp.write_bytes(pickle.dumps(result))
        os.replace(tmp, run_dir / f"rank{rank}.result.pkl")
    except BaseException:
        print(f"[rank {rank}] raised:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # no MPI finalize: it could wait for a peer that is gone


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else ""
    if mode == "--supervise":
        return _supervise(Path(argv[1]))
    if mode == "--rank":
        _rank_main(Path(argv[1]))
        return 0
    if mode == "--supervise-command" and len(argv) > 3 and argv[2] == "--":
        return supervise_command(argv[3:], float(argv[1]))
    raise SystemExit("usage: python -m tensorrt_llm_ext.runtime.ranks --supervise|--rank RUN_DIR | "
                     f"--supervise-command LINGER_S -- CMD..., got {argv}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
