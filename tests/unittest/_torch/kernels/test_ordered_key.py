"""The exact selection keys and the keyed Philox/Gumbel helpers: kernel vs torch twin, bit for bit."""

import pytest
import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.ordered_key import (EMPTY_KEY, LOG2E_F32, philox_4x32_10_torch, philox_4x32_10_wide,
                                                  block_best,
                                                  gumbel2_from_word, gumbel2_from_word_torch, gumbel2_noise,
                                                  gumbel2_noise_torch, gumbel_scale, gumbel_scale_torch, gumbel_words4,
                                                  key_to_id_torch, ordered_i32, ordered_i32_torch, pack_key,
                                                  shard_argmax_key_reference, uniform_from_word)

CPU = not torch.cuda.is_available()


def _noise_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise under the interpreter (numpy's log2 on both sides); within the GPU log2's error on CUDA."""
    if CPU:
        assert torch.equal(got.cpu(), want)
    else:
        torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)  # lg2.approx: ~1e-5 of the noise

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
    s = tl.full([N], seed, tl.int64)
    off = tl.full([N], offset, tl.int64)
    tl.store(g_ptr + c, gumbel2_noise(s, off, (c + vocab_start).to(tl.int64), 3), mask=valid)
    tl.store(u_ptr + c, gumbel_scale(x), mask=valid)  # per-"row" multiplier log2(e) / T of each value


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
        # IEEE division (div_rn) in both: bitwise on every backend; T <= 0 or NaN -> 1.0
        assert torch.equal(u.cpu(), gumbel_scale_torch(x.cpu().float()))
        ref_g = gumbel2_noise_torch(torch.tensor([[seed]]), torch.tensor([[offset]]), (c + start)[None], 3)[0]
        _noise_close(gn, ref_g)


def test_padded_or_empty_shard_never_wins():
    row = torch.full((1, 8), float("-inf"))
    # Only 3 real columns: the zero padding (logit 0 from zero weight rows) must not win.
    padded = torch.cat([row[:, :3], torch.zeros(1, 5)], dim=1)
    key = shard_argmax_key_reference(padded, 10, 13)
    assert key_to_id_torch(key).item() == 10
    assert shard_argmax_key_reference(torch.zeros(2, 4), 16, 13).tolist() == [EMPTY_KEY] * 2


# ----------------------------------------------------------------------------------------------------
# The Gumbel noise mapping: word gid % 4 of the Philox block with counter (gid // 4, offset, salt),
# G2 = -log2(-log2 u)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _words_kernel(g_ptr, w_ptr, u_ptr, e_ptr, word_in_ptr, seed, offset, gid0, n, N: tl.constexpr,
                  SALT: tl.constexpr):
    c = tl.arange(0, N)
    valid = c < n
    s = tl.full([N], seed, tl.int64)
    off = tl.full([N], offset, tl.int64)
    tl.store(g_ptr + c, gumbel2_noise(s, off, (c + gid0).to(tl.int64), SALT), mask=valid)
    q = tl.arange(0, N // 4).to(tl.int64) + gid0 // 4  # the blocks of ids gid0 .. (gid0 rounded down to 4)
    r0, r1, r2, r3 = gumbel_words4(seed, offset, q, SALT)
    i = tl.arange(0, N // 4) * 4
    tl.store(w_ptr + i, r0.to(tl.int64))
    tl.store(w_ptr + i + 1, r1.to(tl.int64))
    tl.store(w_ptr + i + 2, r2.to(tl.int64))
    tl.store(w_ptr + i + 3, r3.to(tl.int64))
    words = tl.load(word_in_ptr + c).to(tl.uint32)
    tl.store(u_ptr + c, uniform_from_word(words))
    tl.store(e_ptr + c, gumbel2_from_word(words))


def _gumbel2_of_word(r: torch.Tensor) -> torch.Tensor:
    """The documented word -> noise transform, written out in float64: u = ((r >> 9) + 0.5) 2^-23,
    G2 = -log2(-log2 u)."""
    u = ((r >> 9).to(torch.float64) + 0.5) * 2.0**-23
    return -torch.log2(-torch.log2(u))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gid0", [0, 4 * 12345 + 1, 2**32 - 64 - 3])
def test_gumbel_four_column_mapping(device, gid0):
    """One Philox block feeds four consecutive global ids: id 4q + w takes word w of the block with counter
    (q, offset lo, offset hi, salt), and G2 = -log2(-log2 u). Pinned here against Philox itself and a
    float64 evaluation of the mapping (the fp32 twin within 2e-6), for the kernel helpers (words and
    uniforms bitwise everywhere; the noise bitwise to the twin under the interpreter, within the GPU log2's
    error on CUDA), at an unaligned first id and near the 2^32 id limit."""
    n, N, salt = 61, 64, 0xD7AF7
    seed, offset = 2**40 + 977, 2**33 + 5
    gid = torch.arange(gid0, gid0 + n, dtype=torch.int64)
    q, w = gid // 4, gid % 4
    words = philox_4x32_10_torch(torch.full_like(q, seed), q, torch.full_like(q, offset & 0xFFFFFFFF),
                                  torch.full_like(q, offset >> 32), torch.full_like(q, salt))
    word = torch.stack(words).gather(0, w[None])[0]
    twin = gumbel2_noise_torch(torch.tensor([[seed]]), torch.tensor([[offset]]), gid[None], salt)[0]
    assert torch.equal(twin, gumbel2_from_word_torch(word))
    torch.testing.assert_close(twin.double(), _gumbel2_of_word(word), atol=2e-6, rtol=2e-6)
    # Ids of one block draw from one Philox call: distinct words, so distinct noise (independent draws).
    assert twin.unique().numel() == n

    g = torch.empty(n, device=device)
    got_words = torch.empty(N, dtype=torch.int64, device=device)
    edge = torch.tensor([0, 0x1FF, 0x200, 0xFFFFFFFF, 0xFFFFFE00, 0x80000000, 0x7FFFFFFF], dtype=torch.int64)
    word_in = torch.cat([edge, word[:N - edge.numel()]]).to(device)
    u = torch.empty(N, device=device)
    e = torch.empty(N, device=device)
    _words_kernel[(1,)](g, got_words, u, e, word_in, seed, offset, gid0, n, N=N, SALT=salt)
    _noise_close(g, twin)
    q0 = torch.arange(N // 4, dtype=torch.int64) + gid0 // 4
    ref_words = philox_4x32_10_torch(torch.full_like(q0, seed), q0, torch.full_like(q0, offset & 0xFFFFFFFF),
                                      torch.full_like(q0, offset >> 32), torch.full_like(q0, salt))
    assert torch.equal(got_words.cpu().view(-1, 4), torch.stack(ref_words, dim=1))
    ref_u = ((word_in.cpu() >> 9).to(torch.float32) + 0.5) * 2.0**-23
    assert torch.equal(u.cpu(), ref_u)  # the bit-trick uniform is exactly (top + 0.5) * 2^-23
    assert u.max().item() < 1.0 and u.min().item() > 0.0
    # Edge words (u next to 0 and to 1, where the series replaces the inner log): finite noise, the twin's
    # value, and the float64 mapping's within 2e-6 (near u = 1 the noise is large: relative error).
    want = gumbel2_from_word_torch(word_in.cpu())
    _noise_close(e, want)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(want.double(), _gumbel2_of_word(word_in.cpu()), atol=2e-6, rtol=2e-6)


@triton.jit
def _philox_pair_kernel(out_ptr, c_ptr, seed, N: tl.constexpr):
    i = tl.arange(0, N)
    c0 = tl.load(c_ptr + i).to(tl.uint32)
    c1 = tl.load(c_ptr + N + i).to(tl.uint32)
    c2 = tl.load(c_ptr + 2 * N + i).to(tl.uint32)
    c3 = tl.load(c_ptr + 3 * N + i).to(tl.uint32)
    a = tl.philox(seed, c0, c1, c2, c3)
    b = philox_4x32_10_wide(seed, c0, c1, c2, c3)
    for w in tl.static_range(4):
        tl.store(out_ptr + w * N + i, a[w].to(tl.int64))
        tl.store(out_ptr + (4 + w) * N + i, b[w].to(tl.int64))


@pytest.mark.parametrize("device", DEVICES)
def test_philox_wide_multiply_same_words(device):
    """The sampled loop's wide-multiply Philox (a schedule option) yields tl.philox's words bit for bit,
    and the torch twin's, for counters and seeds across the whole 32/64-bit range."""
    N = 64
    g = torch.Generator().manual_seed(3)
    c = torch.randint(0, 2**32, (4, N), generator=g, dtype=torch.int64)
    c[:, 0], c[:, 1], c[:, 2] = 0, 2**32 - 1, 2**31  # counter edges
    for seed in (0, 2**63 - 1, 2**40 + 977, -5):
        out = torch.empty(8, N, dtype=torch.int64, device=device)
        _philox_pair_kernel[(1,)](out, c.to(device), seed, N=N)
        out = out.cpu()
        assert torch.equal(out[:4], out[4:]), seed
        ref = philox_4x32_10_torch(torch.full((N,), seed, dtype=torch.int64), c[0], c[1], c[2], c[3])
        assert torch.equal(out[:4], torch.stack(ref)), seed


def test_log2_score_is_gumbel_max():
    """x * log2(e)/T + G2 is log2(e) * (x/T + G) - log2(log2 e) with G = -ln(-ln u): the same argmax as the
    natural-log Gumbel-max (checked in float64 over every 2^23 uniform is too slow here; 2^16 spread words
    against the float64 identity)."""
    r = torch.arange(0, 2**32, 2**16, dtype=torch.int64) + 0x1FF
    g2 = gumbel2_from_word_torch(r).double()
    u = ((r >> 9).to(torch.float64) + 0.5) * 2.0**-23
    g = -torch.log(-torch.log(u))
    torch.testing.assert_close(g2, float(LOG2E_F32) * g - torch.log2(torch.tensor(float(LOG2E_F32)).double()),
                               atol=2e-6, rtol=2e-6)
