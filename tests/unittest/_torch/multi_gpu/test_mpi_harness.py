"""The multi-rank harness itself: a failing, dying or hanging rank is reported by rank within the bound,
never hung, and never takes the test process down."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorrt_llm_ext.testing.mpi import MpiPool, RankJobError, run_on_ranks

# Detection (a 20 ms poll) + 0.5 s for the peers' errors + 1 s stack dump + the kill, on 2 shared cores.
BOUND_S = 10.0


def _rank_one_raises():
    from mpi4py import MPI

    from tensorrt_llm_ext.distributed import init_from_mpi

    init_from_mpi()
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    return "fine"


def _rank_one_hangs():
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 1:
        time.sleep(3600)
    return "fine"


def _rank_one_exits_mid_run():
    import os

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from tensorrt_llm_ext.distributed import init_from_mpi

    init_from_mpi()
    t = torch.ones(2)
    dist.all_reduce(t)  # mid-run: both ranks joined the process group and ran a collective
    if MPI.COMM_WORLD.Get_rank() == 1:
        print("rank 1: os._exit(7) mid-run", flush=True)
        os._exit(7)
    dist.all_reduce(t)  # rank 0 waits here for the dead rank
    return t.tolist()


def _ranks():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_failing_rank_is_reported_with_its_traceback(mpi_pool_executor):
    t0 = time.monotonic()
    with pytest.raises(RankJobError) as err:
        run_on_ranks(mpi_pool_executor, _rank_one_raises, timeout=60)
    assert err.value.headline.startswith("rank 1 raised ValueError: deliberate failure on rank 1"), str(err.value)
    assert "in _rank_one_raises" in str(err.value)  # its traceback
    assert time.monotonic() - t0 < BOUND_S
    assert mpi_pool_executor.broken  # the fixture starts a fresh pool for the next test


def test_rank_that_exits_mid_run_is_named_with_its_exit_code():
    """A rank that ``os._exit``s mid-run: named with its exit code and last log lines, as the CLI does (was:
    MPICH SIGKILLed the spawning test process within 5 s, no result line)."""
    pool = MpiPool(2).start()
    try:
        with pytest.raises(RankJobError) as err:
            run_on_ranks(pool, _rank_one_exits_mid_run, timeout=120)
        # Bounded from the rank's death (its supervisor's record), not from the call: the ranks' start-up and
        # first collective before it took 10.5 s under load (2 busy loops beside the test on 2 cores).
        noticed = time.time() - err.value.outcomes[1].ended_at
        assert err.value.headline == "rank 1 exited with code 7", str(err.value)
        assert "os._exit(7) mid-run" in err.value.outcomes[1].log_tail
        assert noticed < BOUND_S, noticed
        assert pool.broken
    finally:
        pool.shutdown()


def test_hanging_rank_fails_within_timeout():
    pool = MpiPool(2).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RankJobError) as err:
            run_on_ranks(pool, _rank_one_hangs, timeout=5)
        assert err.value.headline.startswith("rank(s) [1] gave no result within the time limit of 5s")
        hung = err.value.outcomes[1]
        assert hung.stopped_by_launcher and "in _rank_one_hangs" in hung.log_tail  # its stack, dumped
        assert time.monotonic() - t0 < 5 + BOUND_S
        assert pool.broken
    finally:
        pool.shutdown()


_LAUNCHER = """
import sys, time
from tensorrt_llm_ext.runtime.ranks import MpiPool
pool = MpiPool(2, log_dir=sys.argv[1]).start()
print("started", flush=True)
time.sleep(600)
"""


def _processes_naming(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def test_ranks_exit_when_their_launcher_is_killed(tmp_path):
    """A SIGKILLed launcher (a killed CLI or test process) leaves no rank, supervisor or mpiexec behind."""
    logs = str(tmp_path / "pool")
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, logs], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout.readline().strip() == "started"
        assert len(_processes_naming(logs)) >= 5  # mpiexec + 2 supervisors + 2 ranks
        launcher.kill()
        launcher.wait(timeout=30)
        t0 = time.monotonic()
        while _processes_naming(logs) and time.monotonic() - t0 < BOUND_S:
            time.sleep(0.1)
        assert _processes_naming(logs) == [], f"left running {time.monotonic() - t0:.1f}s after the kill"
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_every_rank_runs_once(mpi_pool_executor):
    n = mpi_pool_executor.world_size
    assert run_on_ranks(mpi_pool_executor, _ranks) == list(range(n))
    assert run_on_ranks(mpi_pool_executor, _ranks) == list(range(n))  # the same ranks serve the next call


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_an_idle_pool_polls_less_often_and_still_answers(mpi_pool_executor):
    """A rank between calls looks for its next task every <= 20 ms for a second, then every 100 ms (a pool kept
    between a module's tests: ~0.2 % of a core a rank instead of ~1 %); a call after a longer idle is answered."""
    from tensorrt_llm_ext.runtime.rank_process import IDLE_AFTER_S, IDLE_POLL_S, TASK_POLL_S, next_wait

    schedule, wait, waited = [], 0.001, 0.0
    while waited < 3:
        waited += wait
        wait = next_wait(wait, waited)
        schedule.append((waited, wait))
    assert max(w for t, w in schedule if t < IDLE_AFTER_S) == TASK_POLL_S
    assert schedule[-1][1] == IDLE_POLL_S and all(w <= IDLE_POLL_S for _, w in schedule)
    assert sum(t < IDLE_AFTER_S for t, _ in schedule) > sum(t >= IDLE_AFTER_S for t, _ in schedule)
    time.sleep(IDLE_AFTER_S + 2 * IDLE_POLL_S)
    t0 = time.monotonic()
    assert run_on_ranks(mpi_pool_executor, _ranks) == [0, 1]
    assert time.monotonic() - t0 < BOUND_S


@pytest.mark.parametrize("mpi_pool_executor", [4], indirect=True)
def test_every_rank_runs_once_at_4_ranks(mpi_pool_executor):
    assert run_on_ranks(mpi_pool_executor, _ranks) == [0, 1, 2, 3]
