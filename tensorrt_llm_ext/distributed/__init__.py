"""Distributed layer: process groups from MPI, rank agreement, AllReduce with fusion ops, pair exchange."""

from tensorrt_llm_ext.distributed.agree import agree_all, agree_any, agree_codes
from tensorrt_llm_ext.distributed.communicator import (backend_name, comm_device, init_from_mpi,
                                                       is_initialized, shutdown, tp_cpu_group, tp_group)
from tensorrt_llm_ext.distributed.ops import (AllReduce, AllReduceFusionOp, AllReduceParams,
                                              AllReduceStrategy, allgather)
from tensorrt_llm_ext.distributed.pair_exchange import PairExchange

__all__ = [
    "AllReduce", "AllReduceFusionOp", "AllReduceParams", "AllReduceStrategy", "PairExchange",
    "agree_all", "agree_any", "agree_codes", "allgather", "backend_name", "comm_device", "init_from_mpi",
    "is_initialized", "shutdown", "tp_cpu_group", "tp_group",
]
