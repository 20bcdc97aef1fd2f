"""``trtllm-ext info``: the environment and a multi-rank self-check of the distributed layer."""

from __future__ import annotations

import platform
import sys

from tensorrt_llm_ext.runtime.ranks import mpiexec_command


def environment_report() -> list[tuple[str, str]]:
    import torch
    import triton

    from tensorrt_llm_ext import __version__
    from tensorrt_llm_ext._env import ENV

    rows = [
        ("tensorrt_llm_ext", __version__),
        ("python", sys.version.split()[0]),
        ("platform", platform.platform()),
        ("torch", torch.__version__),
        ("triton", triton.__version__),
        ("triton interpreter", "on" if ENV.triton_interpret else "off"),
        ("step ops", _step_ops_row()),
        ("GPU", ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
         if torch.cuda.is_available() else "none (CPU; Triton kernels need TRITON_INTERPRET=1)"),
    ]
    try:
        from mpi4py import MPI

        rows.append(("MPI", MPI.Get_library_version().splitlines()[0].strip()))
    except Exception as e:  # report, don't fail: the single-rank paths work without MPI
        rows.append(("MPI", f"unavailable ({e})"))
    try:
        rows.append(("mpiexec", " ".join(mpiexec_command()[0])))
    except FileNotFoundError as e:
        rows.append(("mpiexec", f"not found ({e})"))
    return rows


def _step_ops_row() -> str:
    """The op table ``generate`` / ``serve`` run here (:func:`~tensorrt_llm_ext.speculative.step_ops.step_ops_for`)."""
    import torch

    from tensorrt_llm_ext.speculative.step_ops import fused_ops_run_on

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return "fused Triton kernels"
    if fused_ops_run_on(device):
        return "fused Triton kernels in the interpreter (TRITON_INTERPRET=1: slow, for tests)"
    return "stock torch ops (CPU; TRITON_INTERPRET=1 runs the fused kernels in the interpreter)"


def _rank_check(vocab: int):
    import torch

    from tensorrt_llm_ext.distributed import (AllReduce, AllReduceFusionOp, AllReduceParams, PairExchange,
                                              comm_device, init_from_mpi)
    from tensorrt_llm_ext.kernels.ordered_key import shard_argmax_key_reference
    from tensorrt_llm_ext.kernels.rms_norm import rms_norm_reference
    from tensorrt_llm_ext.mapping import vocab_shards

    mapping = init_from_mpi()
    dev = comm_device()
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(8, vocab, generator=g)
    rows[1, vocab // 2:] = float("nan")
    rows[2] = 1.0
    split = vocab_shards(vocab, mapping.tp_size)  # the LM head's split (zero padding on the last rank)
    shard, start, width = split.width, split.start(mapping.tp_rank), split.num_valid(mapping.tp_rank)
    local = torch.zeros(8, shard)
    local[:, :width] = rows[:, start:start + width]
    ids = PairExchange(mapping).winner_ids(shard_argmax_key_reference(local, start, vocab).to(dev)).cpu()
    exchange_ok = torch.equal(ids, rows.argmax(-1))
    parts = torch.randn(mapping.tp_size, 4, 64, generator=g)
    w = torch.rand(64, generator=g) + 0.5
    out = AllReduce(mapping)(parts[mapping.tp_rank].to(dev).clone(),
                             AllReduceParams(AllReduceFusionOp.RMS_NORM, norm_weight=w.to(dev))).cpu()
    ref, _ = rms_norm_reference(parts.sum(0), w, 1e-6)
    norm_ok = torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    return mapping.rank, exchange_ok, norm_ok


def multi_rank_selfcheck(world_size: int = 2, vocab: int = 1001, timeout: float = 120.0) -> list[tuple]:
    from tensorrt_llm_ext.runtime.ranks import launch_ranks

    return launch_ranks(world_size, _rank_check, vocab, timeout=timeout)
