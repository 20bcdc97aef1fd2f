"""What every kernel launcher shares: where Triton runs, the capture guard, validation, launch settings.

One place for each, so every launcher words its errors alike and picks ``num_warps`` the same way:

* :func:`triton_runs_on` / :func:`is_capturing`: dispatch facts (CUDA, or the CPU interpreter).
* :class:`CaptureAllocationError` and :func:`refuse_allocation_while_capturing`: a launcher called
  without ``out=`` buffers while a CUDA graph is capturing would allocate inside the graph; it raises
  this one exception type instead.
* :func:`check_tensor`, :func:`check_devices`, :func:`check_contiguous`, :func:`check_int`: ``ValueError`` naming the argument, what was expected and
  what arrived.
* :func:`num_warps_for`: warps for a block of ``n`` elements per program.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tensorrt_llm_ext._env import ENV

__all__ = [
    "INT_DTYPES", "CaptureAllocationError", "check_contiguous", "check_devices", "check_int", "check_tensor",
    "is_capturing", "num_warps_for", "programmatic_launch", "sm_count",
    "refuse_allocation_while_capturing", "set_programmatic_launch", "triton_runs_on",
]


INT_DTYPES = (torch.int32, torch.int64)


def triton_runs_on(t: torch.Tensor) -> bool:
    """True when a Triton kernel can take ``t`` (CUDA, or CPU with TRITON_INTERPRET=1)."""
    return t.is_cuda or ENV.triton_interpret


_PDL = {"on": ENV.pdl}


def set_programmatic_launch(on: bool) -> bool:
    """Turn programmatic dependent launch on / off for later launches (graphs keep what they captured); returns
    the previous setting. ``TLLM_EXT_PDL=0`` starts a process with it off. The benchmark's comparison."""
    prev, _PDL["on"] = _PDL["on"], bool(on)
    return prev


def programmatic_launch(t: torch.Tensor) -> bool:
    """Whether a launch over ``t`` uses programmatic dependent launch (PDL): on CUDA at compute capability 9.0+,
    never under the interpreter (it does not run ``griddepcontrol``), unless switched off.

    A kernel launched so may start while the previous kernel of the stream still runs: before its
    ``gdc_wait()`` it reads only what that previous kernel does not write (weights, norm weights, biases, step inputs
    such as positions and the page table, and -- where the caller says so -- a residual an earlier kernel wrote) and
    writes nothing; it calls ``gdc_launch_dependents()`` right after the wait, so at most one kernel runs ahead, and
    when a kernel starts, every kernel before the previous one has completed (the previous one waited on it before
    letting this one start)."""
    if not _PDL["on"] or not t.is_cuda or ENV.triton_interpret:
        return False
    return torch.cuda.get_device_properties(t.device).major >= 9


def is_capturing(device: torch.device | str | None = None) -> bool:
    """True while the current CUDA stream is capturing a graph (never on a CPU device / CPU machine)."""
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class CaptureAllocationError(RuntimeError):
    """A launcher would allocate while a CUDA graph is capturing (pass its ``out=`` buffers)."""


def refuse_allocation_while_capturing(name: str, device: torch.device | str | None = None) -> None:
    """Raise :class:`CaptureAllocationError` when ``name`` is about to allocate inside a capture."""
    if is_capturing(device):
        raise CaptureAllocationError(
            f"{name}: would allocate while a CUDA graph is capturing; pass preallocated out= buffers")


def host_to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host values (a list, or a CPU tensor) as a ``dtype`` tensor on ``device``. On CUDA from pinned memory,
    asynchronously: a copy from pageable memory first waits for everything queued on the stream (the step in
    flight, whose host work the overlap scheduler means to hide), one from pinned memory is only ordered behind
    it. The caching host allocator keeps the pinned block until its copy is done."""
    device = torch.device(device)
    host = data.to(dtype) if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_from_host_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for a host ``src``: pinned and asynchronous where ``dst`` is on CUDA
    (:func:`host_to_device`'s reason)."""
    if dst.is_cuda:
        return dst.copy_(src.pin_memory(), non_blocking=True)
    return dst.copy_(src)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    shape: tuple[int | None, ...] | None = None,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    unit_last_stride: bool = False,
) -> torch.Tensor:
    """Validate one launcher argument; raise ``ValueError`` saying what was expected and what arrived.

    ``shape`` entries of ``None`` match any size. ``contiguous`` demands a dense tensor (a launcher
    that indexes rows as ``ptr + i`` reads a strided or broadcast view wrongly, so it must refuse it);
    ``unit_last_stride`` only the innermost stride 1 (rows may be strided). Returns ``t``.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if dtype is not None:
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in dtypes:
            raise ValueError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {_dtype_names((t.dtype,))}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got shape {list(t.shape)} stride "
                         f"{list(t.stride())} (call .contiguous() on strided or broadcast views)")
    if unit_last_stride and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected unit stride in the last dimension, got stride {list(t.stride())}")
    return t


def check_devices(device: torch.device, **tensors: torch.Tensor) -> None:
    """Every named tensor on ``device``."""
    for name, t in tensors.items():
        if t.device != torch.device(device):
            raise ValueError(f"{name}: expected device {device}, got {t.device}")


def check_contiguous(**tensors: torch.Tensor) -> None:
    """Every named tensor dense (launchers that index ``ptr + i`` must refuse strided/broadcast views)."""
    for name, t in tensors.items():
        check_tensor(name, t, contiguous=True)


def check_int(name: str, v, *, lo: int | None = None, hi: int | None = None) -> int:
    """A Python int (not bool) with ``lo <= v < hi`` where given; ``ValueError`` otherwise."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name}: expected a Python int, got {type(v).__name__}")
    if (lo is not None and v < lo) or (hi is not None and v >= hi):
        lo_s = "-inf" if lo is None else str(lo)
        hi_s = "inf" if hi is None else str(hi)
        raise ValueError(f"{name}: expected an int in [{lo_s}, {hi_s}), got {v}")
    return v


def num_warps_for(block: int, *, elements_per_warp: int = 256, min_warps: int = 1, max_warps: int = 8) -> int:
    """Warps for a program that handles ``block`` elements: one per ``elements_per_warp``, clamped to
    ``[min_warps, max_warps]``, a power of two (the launch-settings helper every launcher uses)."""
    warps = max(min_warps, min(max_warps, block // elements_per_warp))
    return 1 << (warps.bit_length() - 1)


_SM_COUNTS: dict[torch.device, int] = {}


def sm_count(device: torch.device | str, cpu: int = 8) -> int:
    """The device's SM count (asked once per device), for launch schedules that scale with it; ``cpu`` off CUDA
    (the interpreter: a few programs still take the multi-program paths)."""
    device = torch.device(device)
    if device.type != "cuda":
        return cpu
    n = _SM_COUNTS.get(device)
    if n is None:
        n = _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n
