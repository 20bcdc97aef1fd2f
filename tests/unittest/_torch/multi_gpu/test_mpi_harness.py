"""The multi-rank harness itself: a failing or hanging rank is reported within the timeout, never hung."""

import time

import pytest

from tensorrt_llm_ext.testing.mpi import MpiPool, RankFailure, run_on_ranks


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


def _ranks():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_failing_rank_is_reported_with_its_traceback(mpi_pool_executor):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_on_ranks(mpi_pool_executor, _rank_one_raises, timeout=60)
    assert "rank 1" in str(err.value) and "deliberate failure on rank 1" in str(err.value)
    assert time.monotonic() - t0 < 60
    assert mpi_pool_executor.broken  # the fixture starts a fresh pool for the next test


def test_hanging_rank_fails_within_timeout():
    pool = MpiPool(2).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"(?s)rank 1.*time limit"):
            run_on_ranks(pool, _rank_one_hangs, timeout=5)
        assert time.monotonic() - t0 < 30
        assert pool.broken
    finally:
        pool.shutdown()


@pytest.mark.parametrize("mpi_pool_executor", [2, 4], indirect=True)
def test_every_rank_runs_once(mpi_pool_executor):
    n = mpi_pool_executor.world_size
    assert run_on_ranks(mpi_pool_executor, _ranks) == list(range(n))
