"""Exact ``(value, global index)`` selection keys, shared by every selection kernel and the exchange.

A row's winner in ``torch.argmax`` order is: the first NaN if any; else the maximum; ties to the lowest
global index. We make that order a plain integer maximum:

* ``ordered_i32(x)``: fp32 -> int32, monotone in ``x``; ``-0.0`` and ``+0.0`` map alike (argmax treats them
  as a tie); every NaN maps to ``INT32_MAX`` (above ``+inf``).
* ``pack_key(ord, gid) = ord << 32 | (0xFFFFFFFF - gid)`` as int64: the larger key is the better
  candidate, the lower id wins a tie. ``EMPTY_KEY`` (``INT64_MIN``) is below every real key; a shard with
  no valid column contributes it.

The TP exchange is then one all-reduce MAX over int64 (exact at any vocab size below 2^32).

Keyed Gumbel noise (every sampler of the project: the target's ``TARGET_SALT``, the drafter's
``DRAFT_SALT``, the Markov chain's ``MARKOV_SALT``): the draw of global id ``g`` for a request
``(seed, offset)`` is word ``g % 4`` of Philox-4x32-10 keyed by ``seed`` with counter
``(g // 4, offset low word, offset high word, salt)``, mapped to ``u = ((word >> 9) + 0.5) * 2^-23`` and
``G = -log(-log u)``. One Philox call yields the draws of four consecutive ids (a kernel that owns them
calls it once); the four words of a block are independent, and the draw depends on
``(seed, offset, g, salt)`` only -- never on the TP size, split or tile.

Triton helpers (``@triton.jit``) and torch twins live side by side and agree bit for bit (the logs up to
an ulp: the GPU's ``tl.log`` is not torch's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
EMPTY_KEY = -(2**63)
_LO_MASK = 0xFFFFFFFF
MAX_VOCAB = 2**32 - 1


# ----------------------------------------------------------------------------------------------------
# Triton helpers
# ----------------------------------------------------------------------------------------------------
@triton.jit
def ordered_i32(x):
    """fp32 block -> int32 keys whose signed order is torch.argmax's value order (NaN highest)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def block_best(keys, cols, valid, AXIS: tl.constexpr):
    """Best ``(ordered key, column)`` along ``AXIS`` of a block; ``(INT32_MIN, 2^31-1)`` if none valid.

    ``cols`` must be int32 and increasing with the global index so the min column breaks ties.
    """
    k = tl.where(valid, keys, -2147483648)
    best = tl.max(k, axis=AXIS)
    if AXIS == 0:
        hit = (k == best) & valid
    else:
        hit = (k == tl.expand_dims(best, AXIS)) & valid
    col = tl.min(tl.where(hit, cols, 2147483647), axis=AXIS)
    return best, col


@triton.jit
def combine_best(best_k, best_c, k, c):
    """Merge a running best with a new candidate (elementwise): higher key, then lower column."""
    take = (k > best_k) | ((k == best_k) & (c < best_c))
    return tl.where(take, k, best_k), tl.where(take, c, best_c)


@triton.jit
def pack_key(ord_key, gid):
    """int32 ordered key + int64 global id -> int64 selection key (EMPTY_KEY when ord is INT32_MIN)."""
    hi = ord_key.to(tl.int64) << 32
    lo = 4294967295 - gid.to(tl.int64)
    return tl.where(ord_key == -2147483648, -9223372036854775808, hi | lo)


@triton.jit
def key_to_id(key):
    """int64 selection key -> global id (int64); -1 for EMPTY_KEY."""
    gid = 4294967295 - (key & 4294967295)
    return tl.where(key == -9223372036854775808, -1, gid)


@triton.jit
def uniform_from_word(r):
    """uint32 Philox word -> uniform in the open interval (0, 1): ``u = ((r >> 9) + 0.5) * 2^-23``.

    The top 23 bits: ``top + 0.5`` needs 24 significant bits, so it is exact in fp32 and
    ``u <= 1 - 2^-24 < 1`` (with 24 bits, ``2^24 - 0.5`` rounds to ``2^24`` and ``u`` could be exactly 1,
    making the Gumbel noise infinite). Computed without an int->float conversion: ``1 + top * 2^-23``
    is the float whose mantissa is ``top``, and adding ``-(1 - 2^-24)`` to it is exact, so the result is
    bit for bit ``(top + 0.5) * 2^-23``.
    """
    one_top = ((r >> 9) | 0x3F800000).to(tl.float32, bitcast=True)
    return one_top - 0.999999940395355224609375


@triton.jit
def philox_uniform(seed, c0, c1, c2, c3):
    """Uniform in (0, 1) from the first output word of Philox-4x32-10 keyed by ``seed``, counter c0..c3."""
    r0, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    return uniform_from_word(r0)


@triton.jit
def gumbel_from_word(r):
    """uint32 Philox word -> Gumbel(0, 1) noise ``-log(-log u)``, ``u = uniform_from_word(r)``."""
    return -tl.log(_neg_log_uniform(uniform_from_word(r)))


@triton.jit
def gumbel_words4(seed, offset, group, SALT: tl.constexpr):
    """The four uint32 words of the Philox block that feeds global ids ``4 * group + 0..3``.

    ``group`` (any integer block, = gid // 4) -> ``(w0, w1, w2, w3)`` of Philox-4x32-10 keyed by ``seed``
    with counter ``(group, offset low word, offset high word, SALT)``. Word ``w`` is the draw of global
    id ``4 * group + w``: one Philox call serves four consecutive columns.
    """
    off = offset.to(tl.int64)
    c0 = (group.to(tl.int64) & 1073741823).to(tl.uint32)
    c1 = (off & 4294967295).to(tl.uint32) + c0 * 0
    c2 = ((off >> 32) & 4294967295).to(tl.uint32) + c0 * 0
    c3 = c0 * 0 + SALT
    return tl.philox(seed.to(tl.int64), c0, c1, c2, c3)


@triton.jit
def pick_word(w, r0, r1, r2, r3):
    """Elementwise ``(r0, r1, r2, r3)[w]`` for ``w`` in 0..3 (broadcasting)."""
    return tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))


@triton.jit
def gumbel_noise(seed, offset, gid, SALT: tl.constexpr):
    """Gumbel(0, 1) noise keyed by (request seed, request offset, global vocab id, salt).

    The draw of global id ``gid`` is word ``gid % 4`` of the Philox block with counter
    ``(gid // 4, offset low word, offset high word, SALT)`` (:func:`gumbel_words4`; the salt separates
    target, draft and Markov-chain draws). This per-element form computes the whole block for each
    element; a kernel that owns four consecutive ids can call :func:`gumbel_words4` once for them (the
    shard-select kernel does) and gets the same values. Independent of TP size, split and block size by
    construction: the draw depends on (seed, offset, gid, salt) only.
    """
    g = gid.to(tl.int64) & 4294967295
    r0, r1, r2, r3 = gumbel_words4(seed, offset, g >> 2, SALT)
    return gumbel_from_word(pick_word((g & 3).to(tl.int32), r0, r1, r2, r3))


@triton.jit
def _neg_log_uniform(u):
    """``-log(u)`` for ``u`` in (0, 1), accurate near 1 where GPU ``tl.log`` is approximate.

    ``t = 1 - u`` is exact for our 24-bit uniforms. For ``t < 2^-6`` the series ``t + t^2/2 + t^3/3 +
    t^4/4`` (error below ``t^5/5``, < 1e-10 relative) replaces ``log``, whose absolute error near 1 could
    otherwise return 0 (making the Gumbel noise +inf and the token certain) or a positive value.
    """
    t = 1.0 - u
    series = t * (1.0 + t * (0.5 + t * (0.3333333432674408 + t * 0.25)))
    return tl.where(t < 0.015625, series, -tl.log(u))


# ----------------------------------------------------------------------------------------------------
# torch twins (host/eager; also what tests and the exchange use)
# ----------------------------------------------------------------------------------------------------
def ordered_i32_torch(values: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`ordered_i32` (any float dtype; converted to fp32 exactly)."""
    x = values.float()
    x = torch.where(x == 0, torch.zeros_like(x), x)
    bits = x.view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return torch.where(torch.isnan(x), torch.full_like(key, INT32_MAX), key)


def pack_key_torch(ord_key: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    hi = ord_key.to(torch.int64) << 32
    lo = _LO_MASK - gid.to(torch.int64)
    return torch.where(ord_key == INT32_MIN, torch.full_like(hi, EMPTY_KEY), hi | lo)


def key_to_id_torch(keys: torch.Tensor) -> torch.Tensor:
    gid = _LO_MASK - (keys & _LO_MASK)
    return torch.where(keys == EMPTY_KEY, torch.full_like(gid, -1), gid)


def shard_argmax_key_reference(shard_logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Eager: each row of ``[R, V_local]`` shard logits -> its int64 selection key.

    Columns whose global id is ``>= vocab_size`` (the padded tail of the last shard) never win; a shard
    with no valid column yields ``EMPTY_KEY``.
    """
    rows, width = shard_logits.shape
    valid = max(0, min(width, vocab_size - vocab_start))
    if valid == 0:
        return torch.full((rows,), EMPTY_KEY, dtype=torch.int64, device=shard_logits.device)
    x = shard_logits[:, :valid].float()
    ords = ordered_i32_torch(x).to(torch.int64)
    best = ords.max(dim=1).values
    # Lowest column among the maxima: argmax of a boolean returns the first True.
    col = (ords == best[:, None]).to(torch.uint8).argmax(dim=1)
    return pack_key_torch(best.to(torch.int32), col + vocab_start)


def _philox_4x32_10_torch(seed: torch.Tensor, c0, c1, c2, c3):
    """Philox-4x32-10 on int64 tensors holding uint32 values (matches ``tl.philox``)."""
    m = 0xFFFFFFFF
    k0 = seed & m
    k1 = (seed >> 32) & m
    a, b = 0xD2511F53, 0xCD9E8D57
    for _ in range(10):
        p0 = b * c2  # B * c2, full 64-bit product of 32-bit values (fits in int64 as unsigned? see below)
        p1 = a * c0
        hi0 = _umulhi(b, c2)
        hi1 = _umulhi(a, c0)
        n0 = hi0 ^ c1 ^ k0
        n2 = hi1 ^ c3 ^ k1
        n1 = p0 & m
        n3 = p1 & m
        c0, c1, c2, c3 = n0, n1, n2, n3
        k0 = (k0 + 0x9E3779B9) & m
        k1 = (k1 + 0xBB67AE85) & m
    return c0, c1, c2, c3


# The Philox twin under its public name, for callers outside this module.
philox_4x32_10_torch = _philox_4x32_10_torch


def _umulhi(a: int, x: torch.Tensor) -> torch.Tensor:
    """High 32 bits of the 64-bit product of constant ``a`` and uint32 values ``x`` (no int64 overflow)."""
    x_lo = x & 0xFFFF
    x_hi = x >> 16
    a_lo = a & 0xFFFF
    a_hi = a >> 16
    lo_lo = a_lo * x_lo
    mid1 = a_hi * x_lo
    mid2 = a_lo * x_hi
    hi_hi = a_hi * x_hi
    carry = ((lo_lo >> 16) + (mid1 & 0xFFFF) + (mid2 & 0xFFFF)) >> 16
    return (hi_hi + (mid1 >> 16) + (mid2 >> 16) + carry) & 0xFFFFFFFF


def philox_uniform_torch(seed, c0, c1, c2, c3) -> torch.Tensor:
    """Torch twin of :func:`philox_uniform` (inputs broadcastable int64 tensors of uint32 values)."""
    r0, _, _, _ = _philox_4x32_10_torch(seed, c0, c1, c2, c3)
    top = (r0 >> 9).to(torch.float32)
    return (top + 0.5) * 1.1920928955078125e-07


def gumbel_noise_torch(seed: torch.Tensor, offset: torch.Tensor, gid: torch.Tensor, salt: int) -> torch.Tensor:
    """Torch twin of :func:`gumbel_noise`. ``seed``/``offset`` ``[R, 1]`` int64, ``gid`` ``[1, N]`` int64.

    Word ``gid % 4`` of Philox-4x32-10(seed; gid // 4, offset lo, offset hi, salt). The uniforms are
    bit-identical to the kernel's; the logs are torch's (the kernel's ``tl.log`` may differ by an ulp on
    GPU), so compare sampled ids through statistics or near-tie-aware checks.
    """
    seed = seed.to(torch.int64)
    off = offset.to(torch.int64)
    gid = gid.to(torch.int64) & 0xFFFFFFFF
    c0 = (gid >> 2) + torch.zeros_like(off)
    c1 = (off & 0xFFFFFFFF) + torch.zeros_like(gid)
    c2 = ((off >> 32) & 0xFFFFFFFF) + torch.zeros_like(gid)
    c3 = torch.full_like(c0, salt & 0xFFFFFFFF)
    r0, r1, r2, r3 = _philox_4x32_10_torch(seed + torch.zeros_like(c0), c0, c1, c2, c3)
    w = gid & 3
    r = torch.where(w == 0, r0, torch.where(w == 1, r1, torch.where(w == 2, r2, r3)))
    top = (r >> 9).to(torch.float32)
    u = (top + 0.5) * 1.1920928955078125e-07
    t = 1.0 - u
    series = t * (1.0 + t * (0.5 + t * (0.3333333432674408 + t * 0.25)))
    return -torch.log(torch.where(t < 0.015625, series, -torch.log(u)))
