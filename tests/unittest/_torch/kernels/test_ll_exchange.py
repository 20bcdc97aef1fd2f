"""Low-latency tagged-word exchange: word layout, host-side model, the kernel's non-spinning paths (CPU,
interpreter) and the simulated-peers protocol on one GPU (CUDA tests skip without a GPU)."""

import random
import time

import pytest
import torch

from tensorrt_llm_ext.distributed.low_latency import LowLatencyExchange
from tensorrt_llm_ext.kernels.common import triton_runs_on
from tensorrt_llm_ext.kernels.ll_exchange import (SPIN_LIMIT, TAG_MASK, TAG_PERIOD, LLExchangeReference,
                                                  LLExchangeState, SimulatedPeers, allocate_flag, decode_words,
                                                  encode_words, interpreter_poll_cost, interpreter_poll_limit,
                                                  ll_exchange, ll_exchange_reference, tag_of)
from tensorrt_llm_ext.kernels.ordered_key import EMPTY_KEY, pack_key_torch, ordered_i32_torch
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

# 0 and the wrap points of a 14-bit and a 22-bit tag (earlier layouts), and of this layout's 32-bit tag
# (period 2^32 - 1), and near the end of the int64 epoch.
WRAP_EPOCHS = [0, 2**14 - 1, 2**22 - 2, 2**22 - 1, TAG_PERIOD - 2, TAG_PERIOD - 1, TAG_PERIOD, 2**32,
               2 * TAG_PERIOD - 1, 2**63 - 8]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _adversarial_keys(world: int, rows: int, seed: int) -> torch.Tensor:
    """``[world, rows]`` selection keys: NaN, +-inf, ties across ranks (lowest id must win), EMPTY rows,
    ids near 2^31, random values."""
    g = torch.Generator().manual_seed(seed)
    vals = torch.randn(world, rows, generator=g)
    ids = torch.randint(0, 2**31 - 1, (world, rows), generator=g)
    keys = pack_key_torch(ordered_i32_torch(vals), ids)
    if rows >= 5:
        keys[:, 0] = pack_key_torch(ordered_i32_torch(torch.full((world,), 1.5)),
                                    torch.arange(world) * 1000 + 7)  # tie: lowest id wins
        keys[0, 1] = pack_key_torch(ordered_i32_torch(torch.tensor([float("nan")])), torch.tensor([2**31 - 2]))[0]
        keys[:, 2] = EMPTY_KEY  # no candidate anywhere
        keys[-1, 3] = pack_key_torch(ordered_i32_torch(torch.tensor([float("inf")])), torch.tensor([0]))[0]
        keys[:, 4] = pack_key_torch(ordered_i32_torch(torch.full((world,), float("-inf"))), torch.arange(world))
    return keys


# ----------------------------------------------------------------------------------------------------
# Word layout
# ----------------------------------------------------------------------------------------------------
def test_word_layout_round_trip_and_tags_never_zero():
    keys = torch.tensor([EMPTY_KEY, 2**63 - 1, -1, 0, 1, -(2**32), 2**32 - 1, 0x7FFFFFFF_00000000], dtype=torch.int64)
    keys = torch.cat([keys, _adversarial_keys(3, 9, 1).flatten()])
    for e in WRAP_EPOCHS:
        words = encode_words(keys, e)
        assert torch.equal(decode_words(words), keys)
        tag = tag_of(e)
        assert 1 <= tag <= TAG_MASK
        assert bool(((words & TAG_MASK) == tag).all())
        assert bool((words != 0).all())  # a word is never the cleared value
    assert tag_of(TAG_PERIOD - 1) == 2**32 - 1 and tag_of(TAG_PERIOD) == 1 and tag_of(0) == 1
    # Consecutive epochs never share a tag, across the wrap too.
    for e in WRAP_EPOCHS:
        assert tag_of(e) != tag_of(e + 1) and tag_of(e) != tag_of(e + 2)


# ----------------------------------------------------------------------------------------------------
# Host-side model
# ----------------------------------------------------------------------------------------------------
def _slots_hold_only_current_words(model: LLExchangeReference) -> bool:
    """The protocol invariant: every non-zero word in rank i's half h has the tag of the next epoch i
    reads in half h."""
    for i in range(model.world):
        e = model.epoch[i]
        for h in (0, 1):
            want = tag_of(e if (e & 1) == h else e + 1)
            words = model.buffers[i, h]
            nz = words != 0
            if bool(((words & TAG_MASK) != want)[nz].any()):
                return False
    return True


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("start", WRAP_EPOCHS)
def test_model_concurrent_rounds_across_wrap(world, start):
    rows = 7
    model = LLExchangeReference(world, slot_rows=9)
    model.epoch = [start] * world
    for i in range(4):  # crosses the wrap for the epochs just below it
        keys = _adversarial_keys(world, rows, seed=start % 1000 + i)
        out = ll_exchange_reference(keys, model)
        assert torch.equal(out, keys.max(0).values.expand(world, rows))
        assert model.flag == [0] * world
        assert bool((model.buffers == 0).all())  # consumed and cleared, both halves
    assert model.epoch == [start + 4] * world


@pytest.mark.parametrize("start", [0, 2**14 - 1, 2**22 - 2, TAG_PERIOD - 1])
def test_model_late_peer_is_waited_for(start):
    world, rows = 3, 5
    model = LLExchangeReference(world, slot_rows=5)
    model.epoch = [start] * world
    keys = _adversarial_keys(world, rows, seed=3)

    def late(poll):
        if poll == 4:
            model.publish(2, keys[2])
        if poll == 9:
            model.publish(1, keys[1])

    model.publish(0, keys[0])
    out0 = model.collect(0, spin_limit=50, between_polls=late)
    out1, out2 = model.collect(1, spin_limit=0), model.collect(2, spin_limit=0)
    want = keys.max(0).values
    for out in (out0, out1, out2):
        assert torch.equal(out, want)
    assert model.flag == [0, 0, 0] and bool((model.buffers == 0).all())


def test_model_peer_that_never_writes_times_out():
    world, rows, e = 2, 4, 2**22 - 2
    model = LLExchangeReference(world, slot_rows=4)
    model.epoch = [e, e]
    keys = _adversarial_keys(world, rows, seed=4)
    model.publish(0, keys[0])
    polls = []
    out = model.collect(0, spin_limit=25, between_polls=polls.append)
    assert len(polls) == 25
    assert torch.equal(out, torch.full((rows,), EMPTY_KEY))  # no row is made from rank 0's keys alone
    assert model.flag == [e + 1, 0] and model.epoch == [e + 1, e]


@pytest.mark.parametrize("start", [1, 2**14 - 1, 2**22 - 1, TAG_PERIOD - 1])
def test_model_zeroed_and_stale_words_are_never_taken(start):
    """A zeroed slot (tag 0) and words of other epochs (the previous use of the half, the other half's
    epoch, a future epoch) are ignored: with the peer absent, the round times out."""
    world, rows = 2, 3
    for stale_epoch in (None, start - 2, start - 1, start + 1, start + 2):
        model = LLExchangeReference(world, slot_rows=3)
        model.epoch = [start, start]
        if stale_epoch is not None and stale_epoch >= 0:
            words = encode_words(torch.tensor([5, 6, 7], dtype=torch.int64) << 40, stale_epoch)
            model.buffers[0, start & 1, 1, :rows] = words  # planted where rank 0 reads epoch `start`
        keys = torch.tensor([1, 2, 3], dtype=torch.int64)
        model.publish(0, keys)
        out = model.collect(0, spin_limit=3)
        assert torch.equal(out, torch.full((rows,), EMPTY_KEY)), stale_epoch
        assert model.flag[0] == start + 1


def test_model_random_schedules_keep_the_invariant():
    """Ranks advance in random interleavings (publish, polls, collect) for many epochs: every result is
    the maximum, no round times out, and a slot only ever holds 0 or the word its reader expects next."""
    rnd = random.Random(11)
    for world in (2, 3, 5):
        rows = 4
        model = LLExchangeReference(world, slot_rows=rows)
        start = rnd.choice([0, TAG_PERIOD - 3, 2**22 - 3])
        model.epoch = [start] * world
        rounds = 12
        inputs = [_adversarial_keys(world, rows, seed=100 + k) for k in range(rounds)]
        done = [0] * world
        published = [False] * world
        results: dict[tuple[int, int], torch.Tensor] = {}
        while min(done) < rounds:
            i = rnd.randrange(world)
            if done[i] == rounds:
                continue
            if not published[i]:
                model.publish(i, inputs[done[i]][i])
                published[i] = True
            elif bool(model.arrived(i, rows).all()):
                results[(i, done[i])] = model.collect(i, spin_limit=0)
                done[i] += 1
                published[i] = False
            assert _slots_hold_only_current_words(model)
            # No rank gets more than one epoch ahead of any peer.
            assert max(model.epoch) - min(model.epoch) <= 1
        for (i, k), out in results.items():
            assert torch.equal(out, inputs[k].max(0).values), (world, i, k)
        assert model.flag == [0] * world


# ----------------------------------------------------------------------------------------------------
# The kernel's non-spinning paths (interpreter on CPU, or the GPU)
# ----------------------------------------------------------------------------------------------------
def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _rank_state(buffers: torch.Tensor, rank: int, epoch: int, slot_rows: int) -> LLExchangeState:
    dev = buffers.device
    world = buffers.shape[0]
    return LLExchangeState(
        buf_ptrs=torch.tensor([buffers[i].data_ptr() for i in range(world)], dtype=torch.int64, device=dev),
        epoch=torch.full((1,), epoch, dtype=torch.int64, device=dev), flag=allocate_flag(1, dev),
        world=world, slot_rows=slot_rows, rank_base=rank)


@pytest.mark.parametrize("world,rows", [(2, 1), (3, 7), (8, 5)])
@pytest.mark.parametrize("start", [0, 2**14 - 1, 2**22 - 2, TAG_PERIOD - 1, TAG_PERIOD])
def test_kernel_matches_model_with_peers_already_written(world, rows, start):
    """Peers have published (host model); the kernel runs one rank's round: same output, same buffers
    (its words published into the peers, its own slots consumed and cleared), epoch advanced."""
    dev = _device()
    slot_rows, me = 8, world - 1
    model = LLExchangeReference(world, slot_rows)
    model.epoch = [start] * world
    keys = _adversarial_keys(world, rows, seed=start % 97 + world)
    for i in range(world):
        if i != me:
            model.publish(i, keys[i])
    buffers = model.buffers.clone().to(dev)
    state = _rank_state(buffers, me, start, slot_rows)
    mine = keys[me].clone().view(1, rows).to(dev)
    got = ll_exchange(mine, state, spin_limit=0, out=mine)  # in place
    model.publish(me, keys[me])
    want = model.collect(me, spin_limit=0)
    assert torch.equal(got.cpu()[0], want) and torch.equal(want, keys.max(0).values)
    assert torch.equal(buffers.cpu(), model.buffers)
    assert int(state.epoch.cpu()[0]) == start + 1 and int(state.flag[0]) == 0


@pytest.mark.parametrize("start", [1, 2**14 - 1, 2**22 - 2, TAG_PERIOD - 1])
def test_kernel_absent_peer_and_stale_words_time_out(start):
    """Zeroed slots and a stale word (the previous use of the half) are not taken: the bounded spin
    ends, rows hold EMPTY_KEY, the flag holds epoch + 1, and check_exchange raises naming the exchange."""
    dev = _device()
    world, rows, slot_rows = 2, 3, 4
    buffers = torch.zeros((world, 2, world, slot_rows, 2), dtype=torch.int64)
    buffers[0, start & 1, 1, 0] = encode_words(torch.tensor([9 << 40]), start - 2)[0]
    buffers = buffers.to(dev)
    state = _rank_state(buffers, 0, start, slot_rows)
    keys = torch.arange(1, rows + 1, dtype=torch.int64).view(1, rows).to(dev)
    out = ll_exchange(keys, state, spin_limit=5 if dev.type == "cpu" else 20000)
    assert torch.equal(out.cpu()[0], torch.full((rows,), EMPTY_KEY))
    assert int(state.flag[0]) == start + 1
    assert int(buffers[0, start & 1, 1, 0, 0].cpu()) != 0  # an unconsumed word is left where it was
    ex = LowLatencyExchange(Mapping(world_size=2, rank=0, tp_size=2), state, buffers, handle=None, timeout_s=0.5)
    assert ex.timed_out_epoch() == start
    with pytest.raises(RuntimeError, match=rf"low-latency pair exchange \(tp rank 0/2\).*epoch {start}"):
        ex.check_exchange()


def test_interpreter_runs_simulated_ranks_one_after_another():
    """Under the interpreter one launch's programs run in order, so the early ranks time out and the
    last completes: exactly the model's sequential schedule (on a GPU they run at once: see below)."""
    if torch.cuda.is_available():
        pytest.skip("the sequential schedule is the interpreter's; the GPU runs the ranks concurrently")
    world, rows, start = 3, 5, TAG_PERIOD - 1
    sim = SimulatedPeers(world, 6, "cpu")
    sim.set_epoch(start)
    keys = _adversarial_keys(world, rows, seed=5)
    out = sim.exchange(keys, spin_limit=2)
    model = LLExchangeReference(world, 6)
    model.epoch = [start] * world
    want = []
    for i in range(world):
        model.publish(i, keys[i])
        want.append(model.collect(i, spin_limit=2))
    assert torch.equal(out, torch.stack(want))
    assert torch.equal(sim.buffers, model.buffers)
    assert sim.state.flag.tolist() == model.flag == [start + 1, start + 1, 0]
    assert torch.equal(out[-1], keys.max(0).values)


def test_interpreter_wait_is_bounded_in_time():
    """Under the interpreter (no clock in the kernel) the default wait still ends after about ``timeout_s``:
    the host turns it into polls at the measured poll cost (was: the default 4.64 M polls, about 1.9 h)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter's bound; the GPU's is test_gpu_wait_is_bounded_in_time_not_polls")
    world, slot_rows, timeout_s = 2, 4, 0.05
    buffers = torch.zeros((world, 2, world, slot_rows, 2), dtype=torch.int64)
    state = _rank_state(buffers, 0, 0, slot_rows)  # rank 1 never runs: a dead peer
    ex = LowLatencyExchange(Mapping(world_size=2, rank=0, tp_size=2), state, buffers, handle=None,
                            timeout_s=timeout_s)
    polls = interpreter_poll_limit(timeout_s, slot_rows)
    assert polls == int(timeout_s / interpreter_poll_cost(slot_rows)) and 0 < polls < SPIN_LIMIT
    assert interpreter_poll_limit(10 * timeout_s, slot_rows) >= 10 * polls
    t0 = time.monotonic()
    out = ex.exchange_(torch.tensor([5, 9, 1, 7], dtype=torch.int64))
    elapsed = time.monotonic() - t0
    assert elapsed < timeout_s + 3.0, elapsed  # + one interpreted launch, on a loaded 2-core machine
    assert torch.equal(out, torch.full((4,), EMPTY_KEY))
    with pytest.raises(RuntimeError, match=r"did not arrive within 0.05 s at epoch 0"):
        ex.check_exchange()


def test_launcher_validation():
    dev = _device()
    sim = SimulatedPeers(2, 4, dev)
    with pytest.raises(ValueError, match="keys: expected dtype int64"):
        sim.exchange(torch.zeros(2, 3, dtype=torch.int32, device=dev))
    with pytest.raises(ValueError, match=r"keys: expected shape \[2, \*\]"):
        sim.exchange(torch.zeros(3, 3, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match=r"rows: expected an int in \[0, 5\)"):
        sim.exchange(torch.zeros(2, 5, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match="keys: expected a contiguous tensor"):
        sim.exchange(torch.zeros(4, 2, dtype=torch.int64, device=dev).t())
    with pytest.raises(ValueError, match="world: expected an int in"):
        SimulatedPeers(9, 4, dev)
    with pytest.raises(ValueError, match="spin_limit"):
        sim.exchange(torch.zeros(2, 3, dtype=torch.int64, device=dev), spin_limit=-1)
    for bad in (-1.0, 2001, "2", True, float("nan")):
        with pytest.raises(ValueError, match=r"timeout_s: expected seconds in \[0, 2000\]"):
            sim.exchange(torch.zeros(2, 3, dtype=torch.int64, device=dev), timeout_s=bad)
    assert triton_runs_on(sim.state.epoch)


# ----------------------------------------------------------------------------------------------------
# GPU: simulated peers (one launch, all ranks resident), CUDA graphs, a late peer on another stream
# ----------------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("rows", [1, 8, 64, 128])
def test_gpu_simulated_round_across_wrap(world, rows):
    sim = SimulatedPeers(world, 128, "cuda")
    for start in WRAP_EPOCHS:
        sim.set_epoch(start)
        for i in range(3):
            keys = _adversarial_keys(world, rows, seed=i + rows).cuda()
            out = sim.exchange(keys)
            assert torch.equal(out.cpu(), keys.max(0).values.expand(world, rows).cpu()), (start, i)
        assert sim.state.flag.tolist() == [0] * world
        assert bool((sim.buffers == 0).all())
        assert sim.state.epoch.tolist() == [start + 3] * world


@needs_cuda
@pytest.mark.parametrize("world", [2, 8])
def test_gpu_simulated_cuda_graph_replay(world):
    rows = 40
    sim = SimulatedPeers(world, 64, "cuda")
    sim.set_epoch(2**22 - 3)
    keys = torch.zeros(world, rows, dtype=torch.int64, device="cuda")
    outs = [torch.zeros_like(keys) for _ in range(3)]
    sim.exchange(keys, out=outs[0])  # warm: compile and load before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        for o in outs:
            sim.exchange(keys, out=o)
    e0 = int(sim.state.epoch[0])
    for rep in range(6):  # the device epoch advances per replay: new tags, alternating halves
        k = _adversarial_keys(world, rows, seed=rep).cuda()
        keys.copy_(k)
        graph.replay()
        torch.cuda.synchronize()
        for o in outs:
            assert torch.equal(o.cpu(), k.max(0).values.expand(world, rows).cpu())
    assert sim.state.epoch.tolist() == [e0 + 18] * world
    assert sim.state.flag.tolist() == [0] * world


@needs_cuda
@pytest.mark.parametrize("start", [0, 2**14 - 1, 2**22 - 2, TAG_PERIOD - 1])
def test_gpu_late_peer_on_another_stream(start):
    """Rank 0 and rank 1 as two launches on two streams; rank 1 starts ~5 ms late and is waited for."""
    world, rows = 2, 8
    sim = SimulatedPeers(world, rows, "cuda")
    states = [LLExchangeState(buf_ptrs=sim.state.buf_ptrs, epoch=sim.state.epoch[i:i + 1],
                              flag=sim.state.flag[i:i + 1], world=world, slot_rows=rows, rank_base=i)
              for i in range(world)]
    keys = [_adversarial_keys(world, rows, seed=9)[i:i + 1].cuda() for i in range(world)]
    outs = [torch.empty_like(k) for k in keys]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for warm in (True, False):  # the first pass loads the module (a first launch would serialize)
        sim.set_epoch(start)
        torch.cuda.synchronize()
        with torch.cuda.stream(streams[0]):
            ll_exchange(keys[0], states[0], out=outs[0])
        with torch.cuda.stream(streams[1]):
            if not warm:
                torch.cuda._sleep(10_000_000)  # ~5 ms of clock cycles
            ll_exchange(keys[1], states[1], out=outs[1])
        torch.cuda.synchronize()
        if warm:
            # Measured on the H200: the very first pair of launches can serialize (module loading) and time
            # out; the product warms every variant at setup for exactly this reason. Only the late-peer pass
            # below is under test.
            sim.state.flag.zero_()
    want = torch.cat(keys).max(0).values.cpu()
    assert torch.equal(outs[0].cpu()[0], want) and torch.equal(outs[1].cpu()[0], want)
    assert sim.state.flag.tolist() == [0, 0]


@needs_cuda
def test_gpu_timeout_flag_is_in_pinned_host_memory():
    world, rows = 2, 4
    sim = SimulatedPeers(world, rows, "cuda")
    assert sim.state.flag.is_pinned() and sim.state.flag.device.type == "cpu"
    st = LLExchangeState(buf_ptrs=sim.state.buf_ptrs, epoch=sim.state.epoch[:1], flag=sim.state.flag[:1],
                         world=world, slot_rows=rows, rank_base=0)
    out = ll_exchange(torch.ones(1, rows, dtype=torch.int64, device="cuda"), st, spin_limit=100_000)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.full((1, rows), EMPTY_KEY))
    assert sim.state.flag.tolist() == [1, 0]  # epoch 0 timed out: flag = epoch + 1


@needs_cuda
@pytest.mark.parametrize("rows", [1, 128])
def test_gpu_wait_is_bounded_in_time_not_polls(rows):
    """With no poll bound, a peer that never writes ends the wait after timeout_s by the GPU clock,
    whatever a poll costs (1 row and 128 rows poll at very different rates)."""
    import time

    world = 8
    sim = SimulatedPeers(world, rows, "cuda")
    st = LLExchangeState(buf_ptrs=sim.state.buf_ptrs, epoch=sim.state.epoch[:1], flag=sim.state.flag[:1],
                         world=world, slot_rows=rows, rank_base=0)
    keys = torch.ones(1, rows, dtype=torch.int64, device="cuda")
    ll_exchange(keys, st, timeout_s=0.001, out=keys)  # compile and load
    torch.cuda.synchronize()
    sim.state.flag.zero_()
    t0 = time.perf_counter()
    out = ll_exchange(torch.ones(1, rows, dtype=torch.int64, device="cuda"), st, timeout_s=0.25)
    torch.cuda.synchronize()
    waited = time.perf_counter() - t0
    assert 0.25 <= waited < 0.45, waited
    assert torch.equal(out.cpu(), torch.full((1, rows), EMPTY_KEY))
    assert sim.state.flag.tolist()[0] == 2  # epoch 1 timed out


def test_check_exchange_reaches_pair_exchange_and_selector():
    """A timed-out round (flag set by the kernel) raises from PairExchange.check_exchange and from the
    selector the worker calls once per step; a clean flag does not."""
    from tensorrt_llm_ext.distributed import PairExchange
    from tensorrt_llm_ext.speculative.selection_decision import VocabParallelSelection
    from tensorrt_llm_ext.speculative.token_selector import VocabParallelSelector

    dev = _device()
    buffers = torch.zeros((2, 2, 2, 2, 2), dtype=torch.int64, device=dev)
    state = _rank_state(buffers, 0, 41, 2)
    pair = PairExchange(Mapping())
    pair.low_latency = LowLatencyExchange(Mapping(world_size=2, rank=0, tp_size=2), state, buffers, None,
                                          timeout_s=0.5)
    gathered = VocabParallelSelection(target_enabled=False, draft_enabled=False, target_reason="test",
                                      draft_reason="test")
    sel = VocabParallelSelector(gathered, None, None, None, pair)
    pair.check_exchange()
    sel.check_exchange()
    ll_exchange(torch.zeros(1, 2, dtype=torch.int64, device=dev), state, spin_limit=3)  # the peer never writes
    # The launch is asynchronous and the flag is read without a sync (pinned host memory): the engine checks
    # it once the step is done (Engine.collect_step synchronizes first). Read straight after the launch, the
    # GPU had not written it yet -- the H200's DID NOT RAISE.
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    assert int(state.flag[0]) == 42  # epoch 41 timed out
    for check in (pair.check_exchange, sel.check_exchange):
        with pytest.raises(RuntimeError, match="low-latency pair exchange .* at epoch 41"):
            check()
