"""Low-latency tagged-word exchange: the TP-wide MAX of int64 selection keys over peers' memory.

Every rank writes its per-row words straight into every peer's buffer (torch symmetric memory on a
multi-GPU node; one device tensor for the single-GPU *simulated peers*) and spins on its own buffer
until its peers' words of this epoch are there -- NCCL's LL idea: each 8-byte word carries its own tag,
so a reader needs no flag and no fence between data and tag.

Word layout (two words per row, each an int64 written with one 8-byte store)::

    word 0 (hi): [ high 32 bits of the key | tag (32 bits) ]
    word 1 (lo): [ low 32 bits of the key  | tag (32 bits) ]
    tag(e)     = e mod (2^32 - 1) + 1          in [1, 2^32 - 1], never 0
    key        = (hi & 0xFFFFFFFF_00000000) | (lo >> 32 & 0xFFFFFFFF)

The key is the whole 64-bit selection key of :mod:`tensorrt_llm_ext.kernels.ordered_key` (order-preserving
value bits, ``0xFFFFFFFF - global id``), so the winner is exactly the NCCL path's (an all-reduce MAX of
the same keys) at any vocabulary below 2^32; no bits are traded for the tag.

Buffer of one rank: ``[2 halves, W source ranks, SLOT_ROWS rows, 2 words]`` int64. Epoch ``e`` uses half
``e & 1``; source rank ``s`` writes slot ``[e & 1, s]`` of every peer. The epoch is an int64 counter in
device memory, one per rank, advanced by the kernel itself (so a CUDA graph replays new epochs; a host
scalar would be frozen into the graph).

Why a stale word cannot alias:

* Tags are never 0, and a buffer starts zeroed: a never-written slot never matches.
* The reader clears every word it consumes (stores 0). The next write into the same slot is epoch
  ``e + 2`` (same half), and a peer reaches epoch ``e + 2`` only after it has read this rank's epoch
  ``e + 1`` word, which this rank writes in a later launch than the one that cleared the slot. So a
  slot holds either 0 or the word of the epoch being read -- whatever the tag width. The tag then only
  guards against words from a *broken* history (a peer that timed out and wrote late, a buffer not
  zeroed at setup): those carry another epoch's tag, which repeats only every 2^32 - 1 epochs.
* The int64 epoch does not wrap in practice (2^63 epochs at one per microsecond is 292 000 years).

Bounded wait: on a GPU the spin stops after ``timeout_s`` (:data:`WAIT_TIMEOUT_S` = 2 s) by the device's
nanosecond clock, read every :data:`TIMER_EVERY` polls; under the interpreter (no clock in the kernel) the
host turns ``timeout_s`` into a poll count at the poll cost it measured once (:func:`interpreter_poll_cost`);
``spin_limit`` polls bound it too, whichever is smaller. Rows still missing a peer's word then get
``EMPTY_KEY`` (no token is made from incomplete data: ``key_to_id`` gives -1), and the rank writes
``epoch + 1`` into its timeout flag, which lives in pinned host memory so the host reads it without a device
sync (``check_exchange``).
Words that were not consumed are left in place; after a timeout the exchange is dead (the worker
raises), and no later epoch is trusted.

Files: ``_ll_exchange_kernel`` (one program per driven rank), its launcher :func:`ll_exchange`,
:class:`SimulatedPeers` (single-GPU buffers for W ranks, one launch per round) and the host-side model
of the same state machine, :class:`LLExchangeReference` (pure torch/Python; what CPU tests drive, since
the Triton interpreter runs programs one after another and a cross-program spin cannot complete there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import (check_int, check_tensor, num_warps_for,
                                             refuse_allocation_while_capturing, triton_runs_on)
from tensorrt_llm_ext.kernels.ordered_key import EMPTY_KEY

__all__ = [
    "HALVES", "LLExchangeReference", "LLExchangeState", "MAX_WORLD", "SPIN_LIMIT", "WAIT_TIMEOUT_S",
    "SimulatedPeers", "TAG_PERIOD", "WORDS_PER_ROW", "buffer_shape", "decode_words", "encode_words",
    "default_spin_limit", "interpreter_poll_cost", "interpreter_poll_limit", "ll_exchange", "ll_exchange_reference",
    "tag_of",
]

TAG_BITS = 32
TAG_MASK = (1 << TAG_BITS) - 1
TAG_PERIOD = (1 << TAG_BITS) - 1  # tags 1 .. 2^32 - 1
HI_MASK = -(1 << 32)  # 0xFFFFFFFF_00000000 as int64
WORDS_PER_ROW = 2
HALVES = 2
# The peer axis of the kernel is always this wide (masked past the world size): one kernel variant per
# buffer size whatever the TP size, so the solo launch at setup loads exactly the variant used later.
MAX_WORLD = 8
# The wait is bounded in time on a GPU: the spin reads the device's nanosecond clock (%globaltimer) every
# TIMER_EVERY polls and stops once WAIT_TIMEOUT_S have passed, whatever a poll costs (measured on the H200:
# 215 ns with one row to 1197 ns with 8 peers x 128 rows, so a poll-count bound waited 1.0-5.6 s).
WAIT_TIMEOUT_S = 2.0
TIMER_EVERY = 16  # reading the clock is a few hundred cycles: not on every poll
# The poll bound: what tests use to force a timeout quickly, the default backstop under the interpreter (where
# the time bound becomes polls at the measured poll cost); on a GPU far beyond the time bound (2^31 - 1 polls
# >= 7 minutes).
SPIN_LIMIT = 4_640_000
NO_POLL_LIMIT = 2**31 - 1
MAX_TIMEOUT_S = 2000  # 2000 s in 1024-ns units still fits an int32


@triton.jit
def _globaltimer_ns():
    """The GPU's global nanosecond timer (PTX %globaltimer); not pure, so it is re-read in loops."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


def tag_of(epoch: int) -> int:
    """The tag of ``epoch`` (a Python int, ``0 <= epoch < 2^63 - 1``): never 0."""
    return epoch % TAG_PERIOD + 1


def buffer_shape(world: int, slot_rows: int) -> tuple[int, int, int, int]:
    """One rank's word buffer: ``[2 halves, world source ranks, slot_rows, 2 words]`` int64."""
    return (HALVES, world, slot_rows, WORDS_PER_ROW)


def encode_words(keys: torch.Tensor, epoch: int) -> torch.Tensor:
    """``[R]`` int64 keys -> ``[R, 2]`` int64 words of ``epoch`` (torch twin of the kernel's packing)."""
    tag = tag_of(epoch)
    hi = (keys & HI_MASK) | tag
    lo = (keys << 32) | tag
    return torch.stack([hi, lo], dim=-1)


def decode_words(words: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` int64 words -> ``[...]`` int64 keys (tags dropped)."""
    return (words[..., 0] & HI_MASK) | ((words[..., 1] >> 32) & TAG_MASK)


# ----------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["rows", "world", "rank_base", "spin_limit", "timeout_units", "stride_keys"],
            do_not_specialize_on_alignment=["keys_ptr", "out_ptr"])
def _ll_exchange_kernel(
    keys_ptr, out_ptr, buf_ptrs_ptr, epoch_ptr, flag_ptr,
    rows, world, rank_base, spin_limit, timeout_units, stride_keys,
    SLOT_ROWS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, TIMED: tl.constexpr,
    TIMER_EVERY: tl.constexpr,
):
    """One program per driven rank (1 on a real rank, W for simulated peers): publish, spin, combine.

    ``buf_ptrs_ptr [world]`` int64: base address of every rank's word buffer as seen from this device.
    """
    sim = tl.program_id(0)
    rank = rank_base + sim
    r = tl.arange(0, BLOCK_R)
    rmask = r < rows
    keys = tl.load(keys_ptr + sim * stride_keys + r, mask=rmask, other=-9223372036854775808)
    epoch = tl.load(epoch_ptr + sim)
    tag = epoch % 4294967295 + 1
    half = epoch & 1

    p = tl.arange(0, BLOCK_W)
    peer = (p < world) & (p != rank)
    m2 = peer[:, None] & rmask[None, :]  # [BLOCK_W, BLOCK_R]
    slot_words = SLOT_ROWS * 2
    row_off = r[None, :].to(tl.int64) * 2

    # Publish this rank's words into slot [half, rank] of every peer (one 8-byte store per word: the
    # tag travels with the data, so no fence is needed between them).
    bases = tl.load(buf_ptrs_ptr + p, mask=p < world, other=0)
    dst = bases.to(tl.pointer_type(tl.int64))[:, None] + ((half * world + rank) * slot_words + row_off)
    hi_word = (keys & -4294967296) | tag
    lo_word = (keys << 32) | tag
    zero2 = tl.zeros([BLOCK_W, BLOCK_R], dtype=tl.int64)
    tl.store(dst, zero2 + hi_word[None, :], mask=m2)
    tl.store(dst + 1, zero2 + lo_word[None, :], mask=m2)

    # Spin on this rank's own slots [half, peer] until every peer's words of this epoch are there.
    mine = tl.load(buf_ptrs_ptr + rank).to(tl.pointer_type(tl.int64))
    src = mine + (half * world + p[:, None].to(tl.int64)) * slot_words + row_off
    w_hi = tl.load(src, mask=m2, other=0, volatile=True)
    w_lo = tl.load(src + 1, mask=m2, other=0, volatile=True)
    ok = (((w_hi & 4294967295) == tag) & ((w_lo & 4294967295) == tag)) | ~m2
    polls = 0
    # Loop-carried types stay fixed (int32 polls, int64 clock) on every path.
    elapsed = tl.full([], 0, tl.int64)
    if TIMED:
        t0 = _globaltimer_ns()
    while (tl.min(ok.to(tl.int32)) == 0) & (polls < spin_limit) & (elapsed < timeout_units):
        need = m2 & ~ok
        w_hi = tl.where(ok, w_hi, tl.load(src, mask=need, other=0, volatile=True))
        w_lo = tl.where(ok, w_lo, tl.load(src + 1, mask=need, other=0, volatile=True))
        ok = (((w_hi & 4294967295) == tag) & ((w_lo & 4294967295) == tag)) | ~m2
        polls += 1
        if TIMED:
            if polls % TIMER_EVERY == 0:
                elapsed = (_globaltimer_ns() - t0) >> 10  # in units of 1.024 us

    got = ok & m2
    # Consume and clear: the slot holds 0 again until the peer writes epoch + 2.
    tl.store(src, zero2, mask=got)
    tl.store(src + 1, zero2, mask=got)
    peer_keys = (w_hi & -4294967296) | ((w_lo >> 32) & 4294967295)
    peer_keys = tl.where(got, peer_keys, -9223372036854775808)
    best = tl.maximum(keys, tl.max(peer_keys, axis=0))
    missing = tl.max((m2 & ~ok).to(tl.int32), axis=0) > 0  # [BLOCK_R]
    tl.store(out_ptr + sim * stride_keys + r, tl.where(missing, -9223372036854775808, best), mask=rmask)
    timed_out = tl.max(missing.to(tl.int32)) > 0
    tl.store(flag_ptr + sim, epoch + 1, mask=timed_out)
    tl.store(epoch_ptr + sim, epoch + 1)


# ----------------------------------------------------------------------------------------------------
# State and launcher
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LLExchangeState:
    """The fixed state one process drives (allocated once, before any capture).

    ``P`` is the number of ranks this process drives: 1 on a real rank, ``world`` for simulated peers.
    """

    buf_ptrs: torch.Tensor  # [world] int64 on the device: base address of each rank's word buffer
    epoch: torch.Tensor  # [P] int64 on the device: the next epoch of each driven rank
    flag: torch.Tensor  # [P] int64 timeout flags: 0, or (epoch + 1) of the last timeout (pinned host on CUDA)
    world: int
    slot_rows: int  # rows a buffer holds (the most rows one exchange may carry)
    rank_base: int  # rank of the first driven rank (this rank; 0 for simulated peers)

    @property
    def driven(self) -> int:
        return self.epoch.shape[0]

    @property
    def block_r(self) -> int:
        return triton.next_power_of_2(self.slot_rows)


def allocate_flag(n: int, device: torch.device) -> torch.Tensor:
    """``[n]`` int64 zeros the kernel can write and the host can read without a sync: pinned host memory
    on CUDA (mapped into the device's address space by unified addressing), a plain tensor elsewhere."""
    if device.type == "cuda":
        return torch.zeros(n, dtype=torch.int64, pin_memory=True)
    return torch.zeros(n, dtype=torch.int64, device=device)


def _timeout_units(timeout_s: float) -> int:
    """Seconds -> the kernel's clock units (1024 ns). Always an int32 value (<= MAX_TIMEOUT_S), so every
    timeout runs the one compiled variant that the setup launch loaded. The interpreter has no clock
    (its elapsed time stays 0): it gets the largest bound, and the host bounds its polls instead
    (:func:`interpreter_poll_limit`)."""
    return int(timeout_s * 1e9) >> 10


def default_spin_limit(device: torch.device) -> int:
    """The poll bound that goes with the time bound: none to speak of on a GPU, :data:`SPIN_LIMIT` where
    there is no clock (the interpreter; there the time bound becomes a poll bound too, see
    :func:`interpreter_poll_limit`)."""
    return NO_POLL_LIMIT if device.type == "cuda" else SPIN_LIMIT


# Seconds per poll of the interpreted spin, per BLOCK_R (the peer axis is always MAX_WORLD wide), measured once.
_POLL_COST_S: dict[int, float] = {}
_PROBE_POLLS = 32
_PROBE_REPEATS = 3


def _launch(keys, out, state: LLExchangeState, spin_limit: int, timeout_units: int, timed: bool) -> None:
    _ll_exchange_kernel[(state.driven,)](
        keys, out, state.buf_ptrs, state.epoch, state.flag,
        keys.shape[1], state.world, state.rank_base, spin_limit, timeout_units, keys.stride(0),
        SLOT_ROWS=state.slot_rows, BLOCK_W=MAX_WORLD, BLOCK_R=state.block_r, TIMED=timed,
        TIMER_EVERY=TIMER_EVERY,
        num_warps=num_warps_for(MAX_WORLD * state.block_r, elements_per_warp=128, max_warps=4),
    )


def interpreter_poll_cost(slot_rows: int) -> float:
    """Seconds one poll of the spin takes under the interpreter for buffers of ``slot_rows`` rows.

    Measured once per process and block size on a private two-rank state whose peer never writes (the
    same kernel, ``spin_limit`` 0 and :data:`_PROBE_POLLS`, best of :data:`_PROBE_REPEATS`), so the host
    can turn the time bound into a poll bound where the kernel has no clock. About 1.4 ms on the 2-core CI machine."""
    block_r = triton.next_power_of_2(slot_rows)
    if block_r not in _POLL_COST_S:
        bufs = torch.zeros((2, *buffer_shape(2, slot_rows)), dtype=torch.int64)
        ptrs = torch.tensor([bufs[0].data_ptr(), bufs[1].data_ptr()], dtype=torch.int64)

        def run(polls: int) -> float:
            st = LLExchangeState(buf_ptrs=ptrs, epoch=torch.zeros(1, dtype=torch.int64),
                                 flag=torch.zeros(1, dtype=torch.int64), world=2, slot_rows=slot_rows, rank_base=0)
            keys = torch.zeros(1, slot_rows, dtype=torch.int64)
            t0 = time.perf_counter()
            _launch(keys, keys, st, polls, _timeout_units(MAX_TIMEOUT_S), timed=False)
            return time.perf_counter() - t0

        run(0)  # first launch: the interpreter's own set-up
        # Best of a few runs each: a loaded machine only ever adds time. A difference that noise ate (the base
        # as slow as the probe) falls back to the probe's whole time per poll, an over-estimate that ends the
        # wait early, never the under-estimate that made a 50 ms bound last 24 s on a loaded CI machine.
        base = min(run(0) for _ in range(_PROBE_REPEATS))
        probe = min(run(_PROBE_POLLS) for _ in range(_PROBE_REPEATS))
        per_poll = (probe - base) / _PROBE_POLLS
        _POLL_COST_S[block_r] = per_poll if per_poll * 4 >= probe / _PROBE_POLLS else probe / _PROBE_POLLS
    return _POLL_COST_S[block_r]


def interpreter_poll_limit(timeout_s: float, slot_rows: int) -> int:
    """The time bound as a poll bound under the interpreter: the polls that fit in ``timeout_s`` at the
    measured cost (:func:`interpreter_poll_cost`)."""
    return min(NO_POLL_LIMIT, int(timeout_s / interpreter_poll_cost(slot_rows)))


def ll_exchange(keys: torch.Tensor, state: LLExchangeState, *, timeout_s: float = WAIT_TIMEOUT_S,
                spin_limit: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One exchange round for every driven rank: ``keys [P, R]`` int64 -> ``out [P, R]`` TP-wide MAX.

    The wait ends after ``timeout_s`` (GPU clock; under the interpreter the polls that fit in it at the
    measured poll cost) or ``spin_limit`` polls (default :func:`default_spin_limit`), whichever comes first;
    rows whose peers' words did not arrive by then hold ``EMPTY_KEY`` and the driven rank's ``state.flag``
    entry is set to ``epoch + 1``. ``out`` may be ``keys`` (in place).
    Advances ``state.epoch`` by one per driven rank. CUDA-graph safe with ``out``: one launch, no
    allocation, no host sync; the epoch lives on the device, so replays use fresh epochs.
    """
    p = state.driven
    check_tensor("keys", keys, shape=(p, None), dtype=torch.int64, contiguous=True)
    rows = keys.shape[1]
    check_int("rows", rows, lo=0, hi=state.slot_rows + 1)
    if spin_limit is None:
        spin_limit = default_spin_limit(keys.device)
    check_int("spin_limit", spin_limit, lo=0, hi=2**31)
    if isinstance(timeout_s, bool) or not (isinstance(timeout_s, (int, float)) and 0 <= timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout_s: expected seconds in [0, {MAX_TIMEOUT_S}], got {timeout_s!r}")
    if not triton_runs_on(keys):
        raise ValueError(f"keys: expected a CUDA tensor (or TRITON_INTERPRET=1 on CPU), got {keys.device}")
    if keys.device != state.epoch.device:
        raise ValueError(f"keys: expected device {state.epoch.device}, got {keys.device}")
    if out is None:
        refuse_allocation_while_capturing("ll_exchange", keys.device)
        out = torch.empty_like(keys)
    check_tensor("out", out, shape=(p, rows), dtype=torch.int64, device=keys.device, contiguous=True)
    if rows == 0:
        return out
    if keys.is_cuda:
        _launch(keys, out, state, spin_limit, _timeout_units(timeout_s), timed=True)
    else:
        # No clock in the interpreted kernel (its elapsed time stays 0 under the largest time bound): the host
        # turns timeout_s into polls at the measured poll cost, so the wait is bounded in time here too.
        spin_limit = min(spin_limit, interpreter_poll_limit(timeout_s, state.slot_rows))
        _launch(keys, out, state, spin_limit, _timeout_units(MAX_TIMEOUT_S), timed=False)
    return out


class SimulatedPeers:
    """``world`` ranks on one device: every rank's buffer in one tensor, one launch per round.

    ``buffers [world, 2, world, slot_rows, 2]`` int64 (zeroed); rank ``i``'s buffer is ``buffers[i]``.
    One program per simulated rank writes into the others' slots and spins on its own, so a round
    completes only if all programs are resident at once (true on a GPU for ``world <= 8``; never under
    the interpreter, which runs programs one after another: there the early ranks time out).
    """

    def __init__(self, world: int, slot_rows: int, device: torch.device | str):
        check_int("world", world, lo=1, hi=MAX_WORLD + 1)
        check_int("slot_rows", slot_rows, lo=1, hi=2**16)
        device = torch.device(device)
        self.buffers = torch.zeros((world, *buffer_shape(world, slot_rows)), dtype=torch.int64, device=device)
        ptrs = [self.buffers[i].data_ptr() for i in range(world)]
        self.state = LLExchangeState(
            buf_ptrs=torch.tensor(ptrs, dtype=torch.int64, device=device),
            epoch=torch.zeros(world, dtype=torch.int64, device=device),
            flag=allocate_flag(world, device), world=world, slot_rows=slot_rows, rank_base=0)

    def set_epoch(self, epoch: int) -> None:
        """Start every simulated rank at ``epoch`` (outside capture)."""
        self.state.epoch.fill_(epoch)

    def exchange(self, keys: torch.Tensor, *, timeout_s: float = WAIT_TIMEOUT_S, spin_limit: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``keys [world, R]`` (row ``i`` = rank ``i``'s keys) -> ``[world, R]`` exchanged keys."""
        return ll_exchange(keys, self.state, timeout_s=timeout_s, spin_limit=spin_limit, out=out)


# ----------------------------------------------------------------------------------------------------
# Host-side model (the eager twin)
# ----------------------------------------------------------------------------------------------------
class LLExchangeReference:
    """Pure torch/Python model of the protocol's state machine, one step at a time.

    Holds the same buffers ``[world, 2, world, slot_rows, 2]``, per-rank epochs and timeout flags as the
    kernel. A round of rank ``i`` is :meth:`publish` then :meth:`collect`; a test interleaves ranks'
    steps in any order (``between_polls`` runs between two polls of a spinning rank, e.g. to let a late
    peer publish), which the GPU can do and the interpreter cannot.
    """

    def __init__(self, world: int, slot_rows: int):
        self.world, self.slot_rows = world, slot_rows
        self.buffers = torch.zeros((world, *buffer_shape(world, slot_rows)), dtype=torch.int64)
        self.epoch = [0] * world
        self.flag = [0] * world
        self._pending: dict[int, torch.Tensor] = {}

    def publish(self, rank: int, keys: torch.Tensor) -> None:
        """Rank ``rank`` writes its ``[R]`` keys of its current epoch into every peer's slot."""
        e = self.epoch[rank]
        words = encode_words(keys.to(torch.int64), e)
        for peer in range(self.world):
            if peer != rank:
                self.buffers[peer, e & 1, rank, : keys.shape[0]] = words
        self._pending[rank] = keys.to(torch.int64).clone()

    def arrived(self, rank: int, rows: int) -> torch.Tensor:
        """``[world, rows]`` bool: which peers' words of ``rank``'s current epoch are in its buffer."""
        e = self.epoch[rank]
        slots = self.buffers[rank, e & 1, :, :rows]
        tag = tag_of(e)
        ok = ((slots[..., 0] & TAG_MASK) == tag) & ((slots[..., 1] & TAG_MASK) == tag)
        ok[rank] = True
        return ok

    def collect(self, rank: int, spin_limit: int = SPIN_LIMIT,
                between_polls: Callable[[int], None] | None = None) -> torch.Tensor:
        """Spin (at most ``spin_limit`` extra polls), consume and clear, combine; returns ``[R]`` keys.

        Mirrors the kernel: one poll before the loop, then up to ``spin_limit`` more; missing rows get
        ``EMPTY_KEY`` and set the flag to ``epoch + 1``; the epoch advances either way.
        """
        keys = self._pending.pop(rank)
        rows = keys.shape[0]
        e = self.epoch[rank]
        ok = self.arrived(rank, rows)
        polls = 0
        while not bool(ok.all()) and polls < spin_limit:
            if between_polls is not None:
                between_polls(polls)
            ok = ok | self.arrived(rank, rows)  # words already seen stay seen (the kernel keeps them)
            polls += 1
        slots = self.buffers[rank, e & 1, :, :rows]
        peer_keys = decode_words(slots)
        got = ok.clone()
        got[rank] = False
        best = keys.clone()
        for s in range(self.world):
            best = torch.where(got[s], torch.maximum(best, peer_keys[s]), best)
        slots[got] = 0  # consume and clear
        missing = ~ok.all(dim=0)
        out = torch.where(missing, torch.full_like(best, EMPTY_KEY), best)
        if bool(missing.any()):
            self.flag[rank] = e + 1
        self.epoch[rank] = e + 1
        return out


def ll_exchange_reference(keys: torch.Tensor, model: LLExchangeReference) -> torch.Tensor:
    """Eager twin of one fully concurrent round: every rank publishes, then every rank collects.

    ``keys [world, R]`` int64 -> ``[world, R]``; the result's rows all equal ``keys.max(0)`` when the
    model's state is consistent.
    """
    for i in range(model.world):
        model.publish(i, keys[i])
    return torch.stack([model.collect(i, spin_limit=0) for i in range(model.world)])
