"""Host -> device copies on the admission and prefill path (kernels/common.py): the values and dtypes of a plain
copy, and on CUDA a copy that does not wait for the work queued on the stream (a pageable copy does)."""

from __future__ import annotations

import time

import pytest
import torch

from tensorrt_llm_ext.kernels.common import copy_from_host_, host_to_device


def _devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
def test_values_and_dtypes_reach_the_device(device):
    x = host_to_device([3, -1, 2**40], torch.int64, device)
    assert x.device.type == device and x.dtype == torch.int64 and x.tolist() == [3, -1, 2**40]
    y = host_to_device(torch.tensor([0.5, 1.5]), torch.float16, device)
    assert y.dtype == torch.float16 and y.tolist() == [0.5, 1.5]
    dst = torch.zeros(2, 3, dtype=torch.int32, device=device)
    copy_from_host_(dst[1, 1:], torch.tensor([7, 9], dtype=torch.int32))
    assert dst.tolist() == [[0, 0, 0], [0, 7, 9]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the stream is what is waited for")
def test_copies_do_not_wait_for_the_queued_step():
    """Behind ~200 ms of queued device work the pinned copies return at once and land after it, in stream order;
    a pageable copy (torch.tensor(..., device="cuda")) waits for the queued work first."""
    dst = torch.zeros(4, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.2)  # ~200 ms
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    x = host_to_device([1, 2, 3, 4], torch.int32, "cuda")
    copy_from_host_(dst, torch.tensor([5, 6, 7, 8], dtype=torch.int32))
    pinned_s = time.perf_counter() - t0
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    torch.tensor([1, 2, 3, 4], dtype=torch.int32, device="cuda")
    pageable_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert x.tolist() == [1, 2, 3, 4] and dst.tolist() == [5, 6, 7, 8]
    assert pinned_s < 0.05 < pageable_s, (pinned_s, pageable_s)
