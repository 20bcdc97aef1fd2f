"""The drafter's building blocks on one rank: ``RMSNorm`` (Triton vs its eager twin), ``Linear`` (TP 1 and
its column / row shards built in one process) and the block-latent store."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.contract import DraftBlockPlacement
from tensorrt_llm_ext.kernels.rms_norm import rms_norm_reference
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.modules.attention import write_block_latents
from tensorrt_llm_ext.modules.linear import Linear, TensorParallelMode
from tensorrt_llm_ext.modules.rms_norm import RMSNorm

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 7), (5, 64), (3, 129)])
def test_rms_norm_module_triton_vs_eager(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype)
    norm = RMSNorm(hidden, 1e-6, dtype)
    norm.init_weights(g)
    out = norm(x)
    ref, _ = rms_norm_reference(x, norm.weight, 1e-6)
    out2, res_out = norm(x.view(1, rows, hidden), residual=res.view(1, rows, hidden))
    ref2, ref_res = rms_norm_reference(x, norm.weight, 1e-6, residual=res)
    # fp32: same math, different rsqrt; bf16: the interpreter truncates fp32->bf16 stores (GPU rounds).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(out2.view(rows, hidden), ref2, **tol)
    torch.testing.assert_close(res_out.view(rows, hidden), ref_res, **tol)


def test_linear_column_row_tp1_and_shards():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 10, generator=g)
    b = torch.randn(12, generator=g)
    x = torch.randn(3, 10, generator=g)
    ref = x @ w.T + b
    for mode in (None, TensorParallelMode.COLUMN, TensorParallelMode.ROW):
        lin = Linear(10, 12, bias=True, dtype=torch.float32, tensor_parallel_mode=mode)
        lin.load_weights(w, b)
        torch.testing.assert_close(lin(x), ref, atol=1e-6, rtol=1e-6)
    # Shards built per rank in one process (no collective is run): column outputs concatenate,
    # un-reduced row partials sum (bias once, on rank 0).
    cols, parts = [], []
    for r in range(2):
        m = Mapping(world_size=2, rank=r, tp_size=2)
        c = Linear(10, 12, bias=True, dtype=torch.float32, mapping=m, tensor_parallel_mode=TensorParallelMode.COLUMN)
        c.load_weights(w, b)
        cols.append(c(x))
        row = Linear(10, 12, bias=True, dtype=torch.float32, mapping=m, tensor_parallel_mode=TensorParallelMode.ROW,
                     reduce_output=False)
        row.load_weights(w, b)
        assert row.weight.shape == (12, 5) and c.weight.shape == (6, 10)
        parts.append(row(x[:, r * 5:(r + 1) * 5]))
    torch.testing.assert_close(torch.cat(cols, -1), ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(parts[0] + parts[1], ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="divisible"):
        Linear(9, 12, mapping=Mapping(world_size=2, rank=0, tp_size=2), tensor_parallel_mode=TensorParallelMode.ROW)
    with pytest.raises(ValueError, match="expected full weight"):
        Linear(10, 12).load_weights(w[:, :9])
    gen = torch.Generator().manual_seed(3)
    a = Linear(10, 12, dtype=torch.float32)
    a.init_weights(gen)
    s = Linear(10, 12, dtype=torch.float32, mapping=Mapping(world_size=2, rank=1, tp_size=2),
               tensor_parallel_mode=TensorParallelMode.COLUMN)
    s.init_weights(torch.Generator().manual_seed(3))
    assert torch.equal(s.weight, a.weight[6:])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_write_block_latents_skips_unplaced(device):
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(6, 4, 5, generator=g).to(device)
    lat = torch.randn(2, 3, 5, generator=g).to(device)
    pos = torch.zeros(2, 3, dtype=torch.int32)
    ids = torch.tensor([[-1, 4, -1], [2, -1, 0]], dtype=torch.int32)
    offs = torch.tensor([[0, 3, 1], [1, 0, 0]], dtype=torch.int32)
    place = DraftBlockPlacement(pos, ids.to(device), offs.to(device), pos[:, 0], pos[:, 0])
    before = pool.clone()
    write_block_latents(pool, place, lat)
    expect = before.clone()
    for b in range(2):
        for k in range(3):
            if ids[b, k] >= 0:
                expect[ids[b, k], offs[b, k]] = lat[b, k]
    assert torch.equal(pool, expect)  # stored bit for bit, nothing else touched
    none = DraftBlockPlacement(pos, torch.full_like(ids, -1).to(device), offs.to(device), pos[:, 0], pos[:, 0])
    write_block_latents(pool, none, lat)
    assert torch.equal(pool, expect)
