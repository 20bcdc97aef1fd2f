"""Low-latency exchange setup over MPI: agreed fallback on CPU (gloo), one-rank failures at each step,
the agreed Markov exactness guard, and the real symmetric-memory path on a multi-GPU node."""

import pytest
import torch

from tensorrt_llm_ext.testing.mpi import run_on_ranks
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture


def _fallback_case(strategy: str):
    import torch

    from tensorrt_llm_ext.distributed import PairExchange, comm_device, init_from_mpi
    from tensorrt_llm_ext.kernels.ordered_key import EMPTY_KEY

    mapping = init_from_mpi()
    ex = PairExchange(mapping, strategy, max_rows=16)
    keys = torch.tensor([mapping.tp_rank * 10 + 1, EMPTY_KEY, -mapping.tp_rank], dtype=torch.int64,
                        device=comm_device())
    ex.exchange_(keys)
    ex.check_exchange()  # the NCCL backend never raises here
    return ex.backend, ex.backend_reason, keys.cpu().tolist()


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
@pytest.mark.parametrize("strategy", ["auto", "low_latency"])
def test_cpu_ranks_all_fall_back_to_nccl(mpi_pool_executor, strategy):
    if torch.cuda.is_available():
        pytest.skip("the CPU fallback; GPU ranks set the exchange up (see test_symmetric_memory_exchange)")
    results = run_on_ranks(mpi_pool_executor, _fallback_case, strategy, timeout=60)
    assert [r[0] for r in results] == ["nccl", "nccl"]
    assert results[0][1] == results[1][1] == "tp rank 0: not a CUDA rank with an NCCL process group"
    assert [r[2] for r in results] == [[11, -(2**63), 0]] * 2


def _one_rank_fails_case(step: str, failing_rank: int):
    """Pretend the platform is fine, let ``step`` fail on ``failing_rank`` only; record later steps."""
    import torch

    import tensorrt_llm_ext.distributed.low_latency as ll
    from tensorrt_llm_ext.distributed import init_from_mpi

    mapping = init_from_mpi()
    calls = []
    ll._platform_failure = lambda m: ll.SetupFailure.NONE

    def allocate(shape, device):
        calls.append("allocate")
        if step == "allocate" and mapping.tp_rank == failing_rank:
            raise RuntimeError("CUDA driver error: out of memory (injected)")
        return torch.zeros(shape, dtype=torch.int64, device=device)

    def rendezvous(buffer, m):
        calls.append("rendezvous")
        if step == "rendezvous" and mapping.tp_rank == failing_rank:
            raise RuntimeError("no P2P access between the ranks' devices (injected)")
        raise AssertionError("a rank entered warm-up territory in a test that must stop before it")

    ll._allocate_symmetric = allocate
    ll._rendezvous = rendezvous
    exchange, reason = ll.setup_low_latency_exchange(mapping, 8)
    return exchange is None, reason, calls


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_allocation_failing_on_one_rank_is_agreed(mpi_pool_executor, failing_rank):
    results = run_on_ranks(mpi_pool_executor, _one_rank_fails_case, "allocate", failing_rank, timeout=90)
    reason = f"tp rank {failing_rank}: allocating symmetric memory or the timeout flag failed"
    assert [r[:2] for r in results] == [(True, reason)] * 2
    # Nobody entered the collective rendezvous, not even the rank whose allocation succeeded.
    assert [r[2] for r in results] == [["allocate"], ["allocate"]]


def _rendezvous_fails_case(failing_rank: int):
    import torch

    import tensorrt_llm_ext.distributed.low_latency as ll
    from tensorrt_llm_ext.distributed import init_from_mpi

    mapping = init_from_mpi()
    calls = []
    ll._platform_failure = lambda m: ll.SetupFailure.NONE
    ll._allocate_symmetric = lambda shape, device: torch.zeros(shape, dtype=torch.int64, device=device)

    def rendezvous(buffer, m):
        calls.append("rendezvous")
        if mapping.tp_rank == failing_rank:
            raise RuntimeError("rendezvous: peer handle exchange failed (injected)")
        return None, [buffer.data_ptr()] * m.tp_size

    def warmup(*args):
        calls.append("warmup")
        return ll.SetupFailure.NONE, ""

    ll._rendezvous = rendezvous
    ll._step_warmup = warmup
    exchange, reason = ll.setup_low_latency_exchange(mapping, 8, strategy="low_latency")
    return exchange is None, reason, calls


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_rendezvous_failing_on_one_rank_is_agreed(mpi_pool_executor):
    results = run_on_ranks(mpi_pool_executor, _rendezvous_fails_case, 1, timeout=90)
    reason = "tp rank 1: the symmetric-memory rendezvous failed"
    assert [r[:2] for r in results] == [(True, reason)] * 2
    assert [r[2] for r in results] == [["rendezvous"], ["rendezvous"]]  # no rank went on to warm up


def _guard_case(mismatch_rank: int):
    import torch

    from tensorrt_llm_ext.distributed import init_from_mpi
    from tensorrt_llm_ext.speculative.markov_exactness import resolve_markov_mode

    mapping = init_from_mpi()
    g = torch.Generator().manual_seed(5)
    vocab, r, tp = 512, 12, mapping.tp_size  # a shape where the CPU GEMM slices exactly
    width = -(-vocab // tp)
    w1 = torch.randn(vocab, r, generator=g)
    w2_pad = torch.zeros(width * tp, r)
    w2_pad[:vocab] = torch.randn(vocab, r, generator=g)
    start = mapping.tp_rank * width
    shard = w2_pad[start:start + width]
    full = w2_pad[:vocab].clone()
    if mapping.tp_rank == mismatch_rank:
        full[start + 3, 0] += 1.0  # this rank's projection now differs from "the full one"
    sizes = range(1, 7)  # "auto" is given the same sizes here: those it would run exact
    return [resolve_markov_mode(m, mapping, w1, full, shard, start, vocab, sizes) for m in ("exact", "auto", "fused")]


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
@pytest.mark.parametrize("mismatch_rank", [-1, 1])
def test_markov_exactness_guard_is_agreed(mpi_pool_executor, mismatch_rank):
    results = run_on_ranks(mpi_pool_executor, _guard_case, mismatch_rank, timeout=90)
    want = ["exact", "auto", "fused"] if mismatch_rank < 0 else ["fused", "fused", "fused"]
    assert results == [want, want]


def _symmetric_memory_case():
    import torch

    from tensorrt_llm_ext.distributed import PairExchange, init_from_mpi
    from tensorrt_llm_ext.distributed.low_latency import setup_low_latency_exchange
    from tensorrt_llm_ext.kernels.ll_exchange import TAG_PERIOD
    from tensorrt_llm_ext.kernels.ordered_key import EMPTY_KEY

    mapping = init_from_mpi()
    tp, me = mapping.tp_size, mapping.tp_rank
    ll_ex = PairExchange(mapping, "low_latency", max_rows=128)
    nccl_ex = PairExchange(mapping, "nccl")
    assert ll_ex.backend == "low_latency", ll_ex.backend_reason
    g = torch.Generator().manual_seed(3)
    out = {"mismatch": 0}
    for start in (1, 2**14 - 1, 2**22 - 2, TAG_PERIOD - 1):
        # The same on every rank. Safe to jump here only because the NCCL exchange below orders every
        # rank's previous low-latency round before this fill (a peer may not still be reading our words).
        ll_ex.low_latency.state.epoch.fill_(start)
        for rows in (1, 8, 64, 128):
            keys = torch.randint(-(2**62), 2**62, (tp, rows), generator=g)
            keys[:, 0] = EMPTY_KEY
            a = keys[me].cuda().contiguous()
            b = a.clone()
            if me == tp - 1:
                torch.cuda._sleep(5_000_000)  # a late peer
            ll_ex.exchange_(a)
            nccl_ex.exchange_(b)
            out["mismatch"] += int(not torch.equal(a, b))
    # CUDA graph: three exchanges per replay, replayed with new keys.
    static = torch.zeros(64, dtype=torch.int64, device="cuda")
    outs = [torch.zeros_like(static) for _ in range(3)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        for o in outs:
            o.copy_(static)
            ll_ex.exchange_(o)
    for rep in range(5):
        keys = torch.randint(-(2**62), 2**62, (tp, 64), generator=g)
        static.copy_(keys[me])
        graph.replay()
        torch.cuda.synchronize()
        out["mismatch"] += sum(int(not torch.equal(o.cpu(), keys.max(0).values)) for o in outs)
    ll_ex.check_exchange()
    # A peer that never writes: a short bound, rank 0 alone runs a round.
    short, reason = setup_low_latency_exchange(mapping, 4, timeout_s=0.05)
    assert short is not None, reason
    raised = False
    if me == 0:
        k = torch.ones(4, dtype=torch.int64, device="cuda")
        short.exchange_(k)
        torch.cuda.synchronize()
        try:
            short.check_exchange()
        except RuntimeError as e:
            raised = "low-latency pair exchange" in str(e)
    torch.distributed.barrier()
    return out["mismatch"], raised


@pytest.mark.parametrize("mpi_pool_executor", [2, 4], indirect=True)
def test_symmetric_memory_exchange(mpi_pool_executor):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA GPUs with symmetric memory (l0_dgx_h200)")
    results = run_on_ranks(mpi_pool_executor, _symmetric_memory_case, timeout=240)
    assert [m for m, _ in results] == [0] * len(results)
    assert results[0][1] is True
