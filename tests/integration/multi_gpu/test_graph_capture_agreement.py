"""A CUDA-graph capture that fails on one rank becomes an eager fallback on every rank, never a hang."""

import pytest

from tensorrt_llm_ext.testing.mpi import run_on_ranks


def _capture_case(failing_rank: int):
    from tensorrt_llm_ext.distributed import init_from_mpi
    from tensorrt_llm_ext.runtime.cuda_graph import agree_on_capture

    mapping = init_from_mpi()
    calls = []

    def capture():
        calls.append(mapping.rank)
        if mapping.rank == failing_rank:
            raise RuntimeError("operation not permitted when stream is capturing")

    return agree_on_capture(mapping, capture), calls


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
@pytest.mark.parametrize("failing_rank", [-1, 1])
def test_capture_failure_is_agreed_across_ranks(mpi_pool_executor, failing_rank):
    results = run_on_ranks(mpi_pool_executor, _capture_case, failing_rank, timeout=60)
    expected = failing_rank < 0  # no failing rank: graphs everywhere; one failing rank: eager everywhere
    assert [ok for ok, _ in results] == [expected, expected]
    assert [calls for _, calls in results] == [[0], [1]]  # every rank attempted its own capture
