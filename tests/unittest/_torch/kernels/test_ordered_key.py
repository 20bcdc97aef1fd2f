"""The exact selection keys and the keyed Philox/Gumbel helpers: kernel vs torch twin, bit for bit."""

import pytest
import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.ordered_key import (EMPTY_KEY, block_best, gumbel_noise, gumbel_noise_torch,
                                                  key_to_id_torch, ordered_i32, ordered_i32_torch, pack_key,
                                                  philox_uniform, philox_uniform_torch,
                                                  shard_argmax_key_reference)

# Triton takes CPU tensors only under the interpreter (CPU machines); on a GPU machine test CUDA.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


@triton.jit
def _probe_kernel(x_ptr, ord_ptr, key_ptr, u_ptr, g_ptr, seed, offset, n, vocab_start, N: tl.constexpr):
    c = tl.arange(0, N)
    valid = c < n
    x = tl.load(x_ptr + c, mask=valid, other=0.0).to(tl.float32)
    o = ordered_i32(x)
    tl.store(ord_ptr + c, o, mask=valid)
    best, col = block_best(o, c, valid, AXIS=0)
    tl.store(key_ptr, pack_key(best, (col + vocab_start).to(tl.int64)))
    cu = c.to(tl.uint32)
    tl.store(u_ptr + c, philox_uniform(seed, cu, cu * 0 + 5, cu * 0, cu * 0 + 7), mask=valid)
    s = tl.full([N], seed, tl.int64)
    off = tl.full([N], offset, tl.int64)
    tl.store(g_ptr + c, gumbel_noise(s, off, (c + vocab_start).to(tl.int64), 3), mask=valid)


def _rows():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 50, generator=g)
    base[0, 7] = float("nan"); base[0, 3] = float("nan")
    base[1] = float("-inf")
    base[2] = 0.0; base[2, 0] = -0.0
    base[3, 10] = float("inf"); base[3, 40] = float("inf")
    base[4] = 2.0
    return base


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_keys_match_torch_twins(device, dtype):
    n, N, start = 50, 64, 1000
    seed, offset = 123456789012, 2**33 + 17
    for row in _rows():
        x = row.to(dtype).to(device)
        ords = torch.empty(n, dtype=torch.int32, device=device)
        key = torch.empty(1, dtype=torch.int64, device=device)
        u = torch.empty(n, device=device)
        gn = torch.empty(n, device=device)
        _probe_kernel[(1,)](x, ords, key, u, gn, seed, offset, n, start, N=N)
        assert torch.equal(ords.cpu(), ordered_i32_torch(x.cpu()))
        ref_key = shard_argmax_key_reference(x.cpu()[None], start, start + n)
        assert torch.equal(key.cpu(), ref_key)
        assert key_to_id_torch(key.cpu()).item() == torch.argmax(x.cpu().float()).item() + start
        c = torch.arange(n)
        ref_u = philox_uniform_torch(torch.tensor(seed), c, torch.full_like(c, 5), torch.zeros_like(c),
                                     torch.full_like(c, 7))
        assert torch.equal(u.cpu(), ref_u)  # integer Philox: bitwise on every backend
        ref_g = gumbel_noise_torch(torch.tensor([[seed]]), torch.tensor([[offset]]), (c + start)[None], 3)[0]
        torch.testing.assert_close(gn.cpu(), ref_g, atol=2e-5, rtol=2e-5)  # GPU tl.log is approximate


def test_padded_or_empty_shard_never_wins():
    row = torch.full((1, 8), float("-inf"))
    # Only 3 real columns: the zero padding (logit 0 from zero weight rows) must not win.
    padded = torch.cat([row[:, :3], torch.zeros(1, 5)], dim=1)
    key = shard_argmax_key_reference(padded, 10, 13)
    assert key_to_id_torch(key).item() == 10
    assert shard_argmax_key_reference(torch.zeros(2, 4), 16, 13).tolist() == [EMPTY_KEY] * 2
