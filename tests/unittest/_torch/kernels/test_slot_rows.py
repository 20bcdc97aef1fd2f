"""Rows moved between a batch and a slot-indexed buffer (the sampled step's draft-logits store and load) vs the eager
twins (``index_copy_`` / ``index_select``): bit for bit."""

import pytest
import torch

from tensorrt_llm_ext.kernels.slot_rows import (gather_rows, gather_rows_reference, scatter_rows,
                                                scatter_rows_reference)

# Triton takes CPU tensors only under the interpreter (CPU machines); on a GPU machine test CUDA.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 else t.view(torch.int8)  # NaN payloads compared as bits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("row_shape", [(1,), (3, 7), (7, 1231), (2, 8192)])  # one element .. odd .. whole blocks
def test_slot_rows_equal_index_copy_and_index_select(device, dtype, row_shape):
    g = torch.Generator().manual_seed(sum(row_shape))
    slots, b = 11, 5
    slotted = torch.randn(slots, *row_shape, generator=g).mul(100).to(dtype).to(device)
    batch = torch.randn(b, *row_shape, generator=g).mul(100).to(dtype).to(device)
    if dtype == torch.float32:  # non-finite values move as they are
        batch.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        slotted.view(-1)[-3:] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for index in (torch.randperm(slots, generator=g)[:b], torch.arange(b)):
        for idt in (torch.int32, torch.int64):
            idx = index.to(idt).to(device)
            got = scatter_rows(slotted.clone(), idx, batch)
            assert torch.equal(_bits(got), _bits(scatter_rows_reference(slotted.clone(), idx, batch)))
            untouched = [s for s in range(slots) if s not in index.tolist()]
            assert torch.equal(_bits(got[untouched]), _bits(slotted[untouched]))
            out = torch.zeros_like(batch)
            assert gather_rows(slotted, idx, out) is out
            assert torch.equal(_bits(out), _bits(gather_rows_reference(slotted, idx, torch.empty_like(batch))))
            assert torch.equal(_bits(gather_rows(got, idx, torch.zeros_like(batch))), _bits(batch))  # round trip


@pytest.mark.parametrize("device", DEVICES)
def test_slot_rows_strided_rows_and_empty_batch(device):
    """Rows of the slotted buffer at a row stride wider than a row (a slice of a larger buffer); rows that are not
    each contiguous are refused; a batch of none is a no-op."""
    base = torch.zeros(6, 2, 40, device=device)
    with pytest.raises(ValueError, match="contiguous"):
        scatter_rows(base[:, :, :33], torch.tensor([1, 4], device=device), torch.ones(2, 2, 33, device=device))
    buf = torch.zeros(6, 3, 50, device=device)
    dst = buf[:, 1]  # rows [50] at stride 150
    src = torch.arange(100, dtype=torch.float32, device=device).view(2, 50)
    scatter_rows(dst, torch.tensor([4, 1], device=device), src)
    assert torch.equal(buf[4, 1], src[0]) and torch.equal(buf[1, 1], src[1])
    assert buf[:, [0, 2]].abs().sum() == 0 and buf[[0, 2, 3, 5]].abs().sum() == 0
    out = torch.zeros(3, 2, 50, device=device)[:, 1]  # out rows at a stride too
    gather_rows(dst, torch.tensor([1, 4, 0], device=device), out)
    assert torch.equal(out, torch.stack([src[1], src[0], torch.zeros(50, device=device)]))
    assert scatter_rows(dst, torch.zeros(0, dtype=torch.int64, device=device), src[:0]) is dst
    assert gather_rows(dst, torch.zeros(0, dtype=torch.int64, device=device), out[:0]).shape == (0, 50)


def test_slot_rows_reject_bad_arguments():
    dst = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="index"):
        scatter_rows(dst, torch.tensor([0.0, 1.0]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="src"):
        scatter_rows(dst, torch.tensor([0, 1]), torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows"):
        scatter_rows(dst, torch.tensor([0, 1]), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="index"):
        scatter_rows(dst, torch.tensor([0, 1, 2]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="out"):
        gather_rows(dst, torch.tensor([0, 1]), torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="rows"):
        gather_rows(dst, torch.tensor([0, 1]), torch.zeros(2, 5))
