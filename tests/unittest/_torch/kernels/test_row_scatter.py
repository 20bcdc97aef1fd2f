"""The row scatter kernel (the sampled step's draft-logits store) vs its eager twin (``index_copy_``): bit for bit."""

import pytest
import torch

from tensorrt_llm_ext.kernels.row_scatter import scatter_rows, scatter_rows_reference

# Triton takes CPU tensors only under the interpreter (CPU machines); on a GPU machine test CUDA.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("row_shape", [(1,), (3, 7), (7, 1231), (2, 8192)])  # one element .. odd .. whole blocks
def test_scatter_rows_equals_index_copy(device, dtype, row_shape):
    g = torch.Generator().manual_seed(sum(row_shape))
    slots, b = 11, 5
    dst = torch.randn(slots, *row_shape, generator=g).mul(100).to(dtype).to(device)
    src = torch.randn(b, *row_shape, generator=g).mul(100).to(dtype).to(device)
    if dtype == torch.float32:  # non-finite values are copied as they are
        src.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for index in (torch.randperm(slots, generator=g)[:b], torch.arange(b)):
        for idt in (torch.int32, torch.int64):
            got = scatter_rows(dst.clone(), index.to(idt).to(device), src)
            want = scatter_rows_reference(dst.clone(), index.to(idt).to(device), src)
            assert torch.equal(got.view(torch.int8) if dtype != torch.int64 else got,
                               want.view(torch.int8) if dtype != torch.int64 else want)
            untouched = [s for s in range(slots) if s not in index.tolist()]
            assert torch.equal(got[untouched], dst[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_rows_strided_dst_rows_and_empty_batch(device):
    """Rows of ``dst`` at a row stride wider than a row (a slice of a larger buffer); a batch of none is a no-op."""
    base = torch.zeros(6, 2, 40, device=device)
    dst = base[:, :, :33]  # each row [2, 33] is not contiguous: refused
    src = torch.ones(2, 2, 33, device=device)
    with pytest.raises(ValueError, match="contiguous"):
        scatter_rows(dst, torch.tensor([1, 4], device=device), src)
    buf = torch.zeros(6, 3, 50, device=device)
    dst = buf[:, 1]  # rows [50] at stride 150
    src = torch.arange(100, dtype=torch.float32, device=device).view(2, 50)
    scatter_rows(dst, torch.tensor([4, 1], device=device), src)
    assert torch.equal(buf[4, 1], src[0]) and torch.equal(buf[1, 1], src[1])
    assert buf[:, [0, 2]].abs().sum() == 0 and buf[[0, 2, 3, 5]].abs().sum() == 0
    assert scatter_rows(dst, torch.zeros(0, dtype=torch.int64, device=device), src[:0]) is dst


def test_scatter_rows_rejects_bad_arguments():
    dst = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="index"):
        scatter_rows(dst, torch.tensor([0.0, 1.0]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="src"):
        scatter_rows(dst, torch.tensor([0, 1]), torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows"):
        scatter_rows(dst, torch.tensor([0, 1]), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="index"):
        scatter_rows(dst, torch.tensor([0, 1, 2]), torch.zeros(2, 3))
