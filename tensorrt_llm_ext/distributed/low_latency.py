"""The low-latency pair exchange over torch symmetric memory, set up identically on every TP rank.

:class:`LowLatencyExchange` runs :func:`tensorrt_llm_ext.kernels.ll_exchange.ll_exchange` on a buffer of
symmetric memory (one per rank, every peer's mapped into this rank's address space): one kernel per
exchange, no NCCL launch. :func:`setup_low_latency_exchange` builds it in agreed steps over the TP
group's CPU (gloo) group, so no rank enters a collective that a peer has bailed out of:

1. **allocate**: check the platform (CUDA with an NCCL process group, a torch build with
   ``torch.distributed._symmetric_memory``, ``tp <= 8``), allocate and zero the word buffer, the device
   epoch counter and the pinned-host timeout flag, and compile *and load* the kernel with a solo launch
   (no peer, no spin). Then **agree** (every rank's failure code, one tiny all-reduce).
2. **rendezvous** (a collective of torch symmetric memory, entered only if every rank allocated), build
   the table of the peers' buffer addresses. Then **agree**.
3. **warm up**: one real round on every rank with known keys, checked after a device sync (wrong
   result or timeout = failure). Then **agree**.

Any failure, on any rank, makes every rank log the same line (the first failing rank and its reason)
and return ``None``: the caller uses NCCL. TP 1 needs no exchange at all; it returns ``None`` without a
collective. The kernel is compiled and loaded before the first spin: measured on the H200, a first
launch that has to load its module while a peer already spins serializes behind it and times out.

Not covered (as in torch itself): a rank that dies *inside* the rendezvous before publishing its
handle leaves its peers in torch's store exchange, bounded only by the process group's timeout.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass

import torch

from tensorrt_llm_ext.distributed.agree import agree_codes
from tensorrt_llm_ext.distributed.communicator import backend_name, comm_device, tp_group
from tensorrt_llm_ext.kernels.ll_exchange import (MAX_WORLD, WAIT_TIMEOUT_S, LLExchangeState,
                                                  allocate_flag, buffer_shape, ll_exchange)
from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.mapping import Mapping

__all__ = ["ExchangeStrategy", "LL_MAX_ELEMENTS", "LowLatencyExchange", "SetupFailure", "max_ll_rows",
           "setup_low_latency_exchange"]

# One program holds [MAX_WORLD, next_pow2(rows)] words of each kind in registers: past this many the
# spin spills, and NCCL is the better exchange at such sizes anyway.
LL_MAX_ELEMENTS = 4096


class ExchangeStrategy(str, enum.Enum):
    """How :class:`~tensorrt_llm_ext.distributed.PairExchange` exchanges (``speculative_config.exchange``)."""

    AUTO = "auto"  # low-latency where it sets up on every rank, else NCCL (logged at INFO)
    NCCL = "nccl"  # always the NCCL all-reduce MAX
    LOW_LATENCY = "low_latency"  # asked for: a setup failure falls back to NCCL too, logged as a WARNING


class SetupFailure(enum.IntEnum):
    """Why the low-latency exchange did not set up on a rank (0 = it did); agreed across ranks."""

    NONE = 0
    NOT_CUDA = 1
    NO_SYMMETRIC_MEMORY = 2
    TOO_MANY_RANKS = 3
    ALLOCATE = 4
    COMPILE = 5
    RENDEZVOUS = 6
    WARMUP = 7

    def describe(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    SetupFailure.NONE: "set up",
    SetupFailure.NOT_CUDA: "not a CUDA rank with an NCCL process group",
    SetupFailure.NO_SYMMETRIC_MEMORY: "this torch build has no torch.distributed._symmetric_memory",
    SetupFailure.TOO_MANY_RANKS: f"more than {MAX_WORLD} TP ranks",
    SetupFailure.ALLOCATE: "allocating symmetric memory or the timeout flag failed",
    SetupFailure.COMPILE: "compiling or loading the exchange kernel failed",
    SetupFailure.RENDEZVOUS: "the symmetric-memory rendezvous failed",
    SetupFailure.WARMUP: "the warm-up round was wrong or timed out",
}


def max_ll_rows() -> int:
    """The most rows one low-latency exchange carries (register budget of the kernel's one program)."""
    return LL_MAX_ELEMENTS // MAX_WORLD


class LowLatencyExchange:
    """The exchange of one TP group on this rank; built by :func:`setup_low_latency_exchange`.

    :meth:`exchange_` is CUDA-graph safe (one launch, in place, no allocation, no host sync).
    """

    def __init__(self, mapping: Mapping, state: LLExchangeState, buffer: torch.Tensor, handle,
                 timeout_s: float = WAIT_TIMEOUT_S):
        self.mapping = mapping
        self.state = state
        self.timeout_s = timeout_s
        # Keep the symmetric allocation (and its mapping of the peers) alive as long as the exchange.
        self._buffer = buffer
        self._handle = handle

    @property
    def max_rows(self) -> int:
        return self.state.slot_rows

    def exchange_(self, keys: torch.Tensor) -> torch.Tensor:
        """``[R]`` int64 keys -> the TP-wide maximum, in place (``R <= max_rows``); returns ``keys``."""
        ll_exchange(keys.view(1, -1), self.state, timeout_s=self.timeout_s, out=keys.view(1, -1))
        return keys

    def timed_out_epoch(self) -> int | None:
        """The epoch of the last timed-out round, or None (reads pinned host memory: no device sync)."""
        value = int(self.state.flag[0])
        return None if value == 0 else value - 1

    def check_exchange(self) -> None:
        """Raise ``RuntimeError`` if an exchange round ran out of spin (a peer's words never arrived)."""
        epoch = self.timed_out_epoch()
        if epoch is not None:
            raise RuntimeError(
                f"low-latency pair exchange (tp rank {self.mapping.tp_rank}/{self.mapping.tp_size}): a peer's "
                f"words did not arrive within {self.timeout_s:g} s at epoch {epoch}; the rows of that round hold no "
                "token. A peer is dead or stalled.")


@dataclass
class _Attempt:
    """What this rank has built so far (released when a later step fails)."""

    buffer: torch.Tensor | None = None
    epoch: torch.Tensor | None = None
    flag: torch.Tensor | None = None
    handle: object = None
    state: LLExchangeState | None = None


def _platform_failure(mapping: Mapping) -> SetupFailure:
    if backend_name() != "nccl" or not torch.cuda.is_available() or comm_device().type != "cuda":
        return SetupFailure.NOT_CUDA
    try:  # a plain `import torch.distributed...` here would make `torch` local to this function
        importlib.import_module("torch.distributed._symmetric_memory")  # private in every torch so far
    except ImportError:
        return SetupFailure.NO_SYMMETRIC_MEMORY
    return SetupFailure.NONE


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocate_symmetric(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem.empty(shape, dtype=torch.int64, device=device)


def _rendezvous(buffer: torch.Tensor, mapping: Mapping) -> tuple[object, list[int]]:
    """Collective: map every peer's buffer; returns the handle and each rank's buffer address here."""
    import torch.distributed._symmetric_memory as symm_mem

    handle = symm_mem.rendezvous(buffer, tp_group(mapping))
    ptrs = [handle.get_buffer(r, tuple(buffer.shape), buffer.dtype).data_ptr() for r in range(mapping.tp_size)]
    if ptrs[mapping.tp_rank] != buffer.data_ptr():
        raise RuntimeError("symmetric memory maps this rank's buffer at another address")
    return handle, ptrs


def _step_allocate(mapping: Mapping, rows: int, timeout_s: float, at: _Attempt) -> tuple[SetupFailure, str]:
    dev = comm_device()
    try:
        at.buffer = _allocate_symmetric(buffer_shape(mapping.tp_size, rows), dev)
        at.buffer.zero_()
        at.epoch = torch.zeros(1, dtype=torch.int64, device=dev)
        at.flag = allocate_flag(1, dev)
    except Exception as e:  # any allocator error (no P2P, out of memory, a backend refusing)
        return SetupFailure.ALLOCATE, f"{type(e).__name__}: {e}"
    try:
        # Solo launch: the same kernel variant with world = 1 (no peer, no spin), so the module is
        # compiled and loaded on this rank before any peer can spin against it.
        solo = LLExchangeState(buf_ptrs=torch.tensor([at.buffer.data_ptr()], dtype=torch.int64, device=dev),
                               epoch=torch.zeros(1, dtype=torch.int64, device=dev), flag=at.flag,
                               world=1, slot_rows=rows, rank_base=0)
        keys = torch.full((1, rows), 7, dtype=torch.int64, device=dev)
        ll_exchange(keys, solo, spin_limit=0, out=keys)
        _sync(dev)
        if int(at.flag[0]) != 0 or int(keys[0, 0]) != 7:
            return SetupFailure.COMPILE, "the solo launch did not return its own keys"
    except Exception as e:
        return SetupFailure.COMPILE, f"{type(e).__name__}: {e}"
    return SetupFailure.NONE, ""


def _step_rendezvous(mapping: Mapping, rows: int, timeout_s: float, at: _Attempt) -> tuple[SetupFailure, str]:
    try:
        at.handle, ptrs = _rendezvous(at.buffer, mapping)
        at.state = LLExchangeState(buf_ptrs=torch.tensor(ptrs, dtype=torch.int64, device=at.buffer.device),
                                   epoch=at.epoch, flag=at.flag, world=mapping.tp_size, slot_rows=rows,
                                   rank_base=mapping.tp_rank)
    except Exception as e:
        return SetupFailure.RENDEZVOUS, f"{type(e).__name__}: {e}"
    return SetupFailure.NONE, ""


def _warmup_keys(mapping: Mapping, rows: int, rank: int, device) -> torch.Tensor:
    """Distinct keys per rank and row whose maximum comes from a different rank on different rows."""
    r = torch.arange(rows, dtype=torch.int64, device=device)
    return ((r + rank) % mapping.tp_size) * 1_000_003 + r


def _step_warmup(mapping: Mapping, rows: int, timeout_s: float, at: _Attempt) -> tuple[SetupFailure, str]:
    try:
        dev = at.buffer.device
        keys = _warmup_keys(mapping, rows, mapping.tp_rank, dev).view(1, rows)
        expect = torch.stack([_warmup_keys(mapping, rows, i, dev) for i in range(mapping.tp_size)]).amax(0)
        ll_exchange(keys, at.state, timeout_s=timeout_s, out=keys)
        _sync(dev)
        if int(at.flag[0]) != 0:
            return SetupFailure.WARMUP, "a peer's warm-up words did not arrive (timeout)"
        if not torch.equal(keys[0], expect):
            return SetupFailure.WARMUP, "the warm-up round returned wrong keys"
    except Exception as e:
        return SetupFailure.WARMUP, f"{type(e).__name__}: {e}"
    return SetupFailure.NONE, ""


def _agreed(mapping: Mapping, code: SetupFailure, detail: str) -> str | None:
    """Agree on the step's outcome; the same reason text on every rank, or None when all succeeded."""
    if code != SetupFailure.NONE and detail:
        logger.debug(f"low-latency exchange setup, tp rank {mapping.tp_rank}: {code.name}: {detail}")
    codes = agree_codes(mapping, int(code))
    for rank, c in enumerate(codes):
        if c != SetupFailure.NONE:
            return f"tp rank {rank}: {SetupFailure(c).describe()}"
    return None


def setup_low_latency_exchange(mapping: Mapping, max_rows: int, *, strategy: ExchangeStrategy | str = "auto",
                               timeout_s: float = WAIT_TIMEOUT_S) -> tuple[LowLatencyExchange | None, str]:
    """Set up the low-latency exchange for up to ``max_rows`` rows (call on every rank of the TP group).

    Returns ``(exchange, reason)``: the exchange and ``"low_latency"``, or ``None`` and the reason it
    fell back (identical on every rank; already logged, one line per rank).
    """
    strategy = ExchangeStrategy(strategy)
    if strategy == ExchangeStrategy.NCCL:
        return None, "exchange='nccl'"
    if mapping.tp_size == 1:
        return None, "tp_size == 1: nothing to exchange"  # uniform: no collective
    rows = max(1, max_rows)
    # Uniform checks (the same inputs on every rank) still go through the agreement below, which keeps
    # every rank on the same sequence of collectives.
    code, detail = _platform_failure(mapping), ""
    if code == SetupFailure.NONE and mapping.tp_size > MAX_WORLD:
        code = SetupFailure.TOO_MANY_RANKS
    if rows > max_ll_rows():
        rows = max_ll_rows()  # larger exchanges go through NCCL, per call (decided on the shape)
    at = _Attempt()
    if code == SetupFailure.NONE:
        code, detail = _step_allocate(mapping, rows, timeout_s, at)
    reason = _agreed(mapping, code, detail)
    if reason is None:
        reason = _agreed(mapping, *_step_rendezvous(mapping, rows, timeout_s, at))
    if reason is None:
        reason = _agreed(mapping, *_step_warmup(mapping, rows, timeout_s, at))
    if reason is not None:
        line = (f"PairExchange(tp={mapping.tp_size}): low-latency exchange unavailable ({reason}); "
                f"using the NCCL all-reduce")
        (logger.warning if strategy == ExchangeStrategy.LOW_LATENCY else logger.info)(line)
        return None, reason
    logger.info(f"PairExchange(tp={mapping.tp_size}): low-latency exchange over symmetric memory, up to {rows} "
                f"rows per round, wait bound {timeout_s:g} s")
    return LowLatencyExchange(mapping, at.state, at.buffer, at.handle, timeout_s), "low_latency"

