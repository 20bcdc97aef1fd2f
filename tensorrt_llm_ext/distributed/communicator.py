"""Process groups from MPI: rank/world from mpi4py, rendezvous over MPI, NCCL on CUDA else gloo.

One state per process (idempotent): MPI-launched test workers are reused across tests, so a second
``init_from_mpi`` with the same world returns the groups already built.

Shutdown: :func:`shutdown` tears the groups down in order -- every rank meets once (bounded), then
``destroy_process_group`` joins gloo's / NCCL's threads -- and ``init_from_mpi`` registers it at exit, before
mpi4py's own finalisation (measured: a script that just returned aborted with "terminate called without an
active exception", exit 6, in 4 of 10 runs at 2 ranks; a gloo thread was still joinable at static destruction).
"""

from __future__ import annotations

import atexit
import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tensorrt_llm_ext._env import ENV
from tensorrt_llm_ext.logger import logger, set_rank
from tensorrt_llm_ext.mapping import Mapping


@dataclass
class _State:
    world_size: int
    rank: int
    backend: str
    device: torch.device
    cpu_group: object  # gloo group over the whole world, for host-side agreement
    tp_groups: dict = field(default_factory=dict)  # tuple(ranks) -> (device group, cpu group)


_STATE: _State | None = None
_AT_EXIT = False  # shutdown() registered with atexit
SHUTDOWN_BARRIER_S = 10.0  # how long shutdown() waits for the other ranks before tearing down anyway


STORE_HOST = "127.0.0.1"  # the ranks of a job share one host (multi-node is not served)


def _mpi_comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def init_from_mpi(
    tp_size: int | None = None,
    enable_attention_dp: bool = False,
    timeout_s: float | None = None,
    backend: str | None = None,
) -> Mapping:
    """Initialise torch.distributed from the MPI world and return this rank's :class:`Mapping`.

    Args:
        tp_size: TP size (default: the whole world); must divide the world size.
        enable_attention_dp: recorded on the Mapping (disables vocab-parallel selection and fusion).
        timeout_s: how long a collective waits for a peer before raising (default from ``_env``).
        backend: force ``"gloo"`` or ``"nccl"``; default NCCL when CUDA is available, else gloo.
    """
    global _STATE
    comm = _mpi_comm()
    world, rank = comm.Get_size(), comm.Get_rank()
    set_rank(rank, world)
    tp = world if tp_size is None else tp_size
    if tp < 1 or world % tp != 0:
        raise ValueError(f"tp_size={tp} does not divide the MPI world size {world}")
    mapping = Mapping(world_size=world, rank=rank, tp_size=tp, pp_size=world // tp,
                      enable_attention_dp=enable_attention_dp,
                      gpus_per_node=max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 8)
    if _STATE is not None and dist.is_initialized():
        if (_STATE.world_size, _STATE.rank) != (world, rank):
            raise RuntimeError("torch.distributed is already initialised with another world")
        _ensure_tp_groups(mapping)
        return mapping

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", mapping.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else ENV.collective_timeout_s)
    # Rank 0's store listens on a port the OS picks as it binds (port 0), then MPI tells the others: a port found
    # free and bound later could be taken in between (EADDRINUSE under parallel jobs).
    store = dist.TCPStore(STORE_HOST, 0, world, True, timeout=timeout, wait_for_workers=False) if rank == 0 else None
    port = comm.bcast(store.port if rank == 0 else None, root=0)
    if rank != 0:
        store = dist.TCPStore(STORE_HOST, port, world, False, timeout=timeout)
    addr = f"tcp://{STORE_HOST}:{port}"
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, store=store, world_size=world, rank=rank, timeout=timeout, **kwargs)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    _STATE = _State(world_size=world, rank=rank, backend=backend, device=device, cpu_group=cpu_group)
    global _AT_EXIT
    if not _AT_EXIT:  # after mpi4py's import: atexit runs this first (last in, first out)
        atexit.register(shutdown)
        _AT_EXIT = True
    _ensure_tp_groups(mapping)
    logger.debug(f"rank {rank}/{world}: torch.distributed {backend} at {addr}")
    return mapping


def shutdown(timeout_s: float = SHUTDOWN_BARRIER_S) -> None:
    """Tear down what :func:`init_from_mpi` built: wait until every rank has called it (at most ``timeout_s``;
    no rank closes its connections while a peer still uses them), destroy every process group (which joins
    their threads), forget the state. Idempotent; registered at exit by ``init_from_mpi``, so a script that
    simply returns exits 0. Call it yourself on every rank to end the groups earlier; a process that must not
    wait for its peers (one of them died) leaves with ``os._exit`` instead, which skips it."""
    global _STATE
    state, _STATE = _STATE, None
    if state is None or not dist.is_initialized():
        return
    if state.world_size > 1:
        try:
            dist.monitored_barrier(group=state.cpu_group, timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:  # a peer died or is stuck: tear this rank down regardless
            logger.warning(f"rank {state.rank}: shutdown: not every rank arrived within {timeout_s:g} s "
                           f"({str(e).splitlines()[0][:200]}); destroying the process groups anyway")
    dist.destroy_process_group()


def _ensure_tp_groups(mapping: Mapping) -> None:
    """Create the TP groups of ``mapping``'s layout (a collective over all ranks; cached)."""
    assert _STATE is not None
    for pp in range(mapping.pp_size):
        ranks = tuple(range(pp * mapping.tp_size, (pp + 1) * mapping.tp_size))
        if ranks in _STATE.tp_groups:
            continue
        if len(ranks) == _STATE.world_size:
            groups = (dist.group.WORLD, _STATE.cpu_group)
        else:
            dev = dist.new_group(list(ranks))
            cpu = dist.new_group(list(ranks), backend="gloo") if _STATE.backend != "gloo" else dev
            groups = (dev, cpu)
        _STATE.tp_groups[ranks] = groups


def is_initialized() -> bool:
    return _STATE is not None and dist.is_initialized()


def comm_device() -> torch.device:
    """Where collective tensors must live (CUDA for NCCL, CPU for gloo)."""
    return _STATE.device if _STATE is not None else torch.device("cpu")


def backend_name() -> str | None:
    return _STATE.backend if _STATE is not None else None


def _tp_groups(mapping: Mapping):
    """``(device group, gloo group)`` of ``mapping``'s TP group; None at tp 1."""
    if mapping.tp_size == 1:
        return None
    if _STATE is None:
        raise RuntimeError("tp_size > 1 needs torch.distributed: call init_from_mpi() first")
    return _STATE.tp_groups[mapping.tp_group]


def tp_group(mapping: Mapping):
    """The device process group of ``mapping``'s TP group (None at tp 1)."""
    groups = _tp_groups(mapping)
    return groups[0] if groups is not None else None


def tp_cpu_group(mapping: Mapping):
    """The gloo group of ``mapping``'s TP group, for host-side agreement (None at tp 1)."""
    groups = _tp_groups(mapping)
    return groups[1] if groups is not None else None


def world_cpu_group():
    return None if _STATE is None else _STATE.cpu_group
