"""Exact ``(value, global index)`` selection keys, shared by every selection kernel and the exchange.

A row's winner in ``torch.argmax`` order is: the first NaN if any; else the maximum; ties to the lowest
global index. We make that order a plain integer maximum:

* ``ordered_i32(x)``: fp32 -> int32, monotone in ``x``; ``-0.0`` and ``+0.0`` map alike (argmax treats them
  as a tie); every NaN maps to ``INT32_MAX`` (above ``+inf``).
* ``pack_key(ord, gid) = ord << 32 | (0xFFFFFFFF - gid)`` as int64: the larger key is the better
  candidate, the lower id wins a tie. ``EMPTY_KEY`` (``INT64_MIN``) is below every real key; a shard with
  no valid column contributes it.

The TP exchange is then one all-reduce MAX over int64 (exact at any vocab size below 2^32).

Keyed Gumbel-max sampling (every sampler of the project: the target's ``TARGET_SALT``, the drafter's
``DRAFT_SALT``, the Markov chain's ``MARKOV_SALT``), evaluated in log2 space. The word of global id ``g``
for a request ``(seed, offset)`` is word ``g % 4`` of Philox-4x32-10 keyed by ``seed`` with counter
``(g // 4, offset low word, offset high word, salt)``; it maps to ``u = ((word >> 9) + 0.5) * 2^-23`` and
to the noise ``G2 = -log2(E2)``, ``E2 = -log2(u)`` (an exponential variate scaled by ``log2 e``; for
``1 - u < 2^-6`` the series ``log2(e) * (t + t^2/2 + t^3/3 + t^4/4)``, ``t = 1 - u``, instead of the log,
which is inexact near 1). A row with temperature ``T > 0`` selects ``argmax(x * S + G2)`` with
``S = div_rn(log2 e, T)`` computed once per row. Since ``x * S + G2 = log2(e) * (x / T + G) - log2(log2 e)``
with ``G = -ln(-ln u)`` standard Gumbel, this is Gumbel-max in exact arithmetic: tokens follow
``softmax(x / T)``. Per element it costs two ``log2`` and one multiply-add (no divide, no natural log).

One Philox call yields the words of four consecutive ids (a kernel that owns them calls it once); the
four words of a block are independent, and the draw depends on ``(seed, offset, g, salt)`` only -- never
on the TP size, split or tile.

Triton helpers (``@triton.jit``) and torch twins live side by side. Integer and IEEE-rounded float ops
agree bit for bit everywhere; ``log2`` is the backend's: under the interpreter it is numpy's, and the
twins call numpy's on CPU tensors, so kernel and twin agree bit for bit there. On GPU ``tl.log2`` is the
device approximation and the score and near-1 series are explicit fmas (one rounding; the interpreter's
fma and the twins round twice), so GPU kernels and the torch twin can differ by ulps of the score: sampled
ids agree except at float near-ties. A GPU kernel still computes the same score for a
``(seed, offset, id, salt)`` at every TP size and tiling (the same instructions per element).
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
    return one_plus_top(r) - 0.999999940395355224609375


@triton.jit
def one_plus_top(r):
    """``1 + top * 2^-23`` (fp32 in ``[1, 2)``), ``top = r >> 9``: the float whose mantissa is ``top``;
    ``one_plus_top(r) - (1 - 2^-24)`` is :func:`uniform_from_word` exactly."""
    return ((r >> 9) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def one_minus_uniform(r):
    """``1 - uniform_from_word(r)``, bit for bit, without the subtraction: ``(comp + 0.5) * 2^-23``.

    ``comp = (r >> 9) ^ (2^23 - 1)`` is ``2^23 - 1 - top``, so this is ``1 - (top + 0.5) * 2^-23`` exactly
    (``t`` of :func:`gumbel2_from_word`); the same construction as :func:`uniform_from_word`.
    """
    one_comp = (((r >> 9) ^ 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    return one_comp - 0.999999940395355224609375


# Compiled kernels take log2 from the SFU (one MUFU.LG2; tl.log2 lowers to a ~20-instruction accurate
# log2f) and Philox's wide products from inline PTX; the interpreter has no inline asm and takes numpy's.
# Decided by what triton.jit made of this module's kernels (interpreted or compiled), so it always matches
# how they run.
_COMPILED: tl.constexpr = tl.constexpr(type(ordered_i32).__name__ != "InterpretedFunction")  # by name: no import


@triton.jit
def _maximum_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def nan_max(x, axis: tl.constexpr):
    """Max of ``x`` along ``axis`` (None: all), NaN where a NaN is among them: one NaN-propagating reduction when
    compiled; the interpreter, which runs a custom reduction's combine per element in Python (5x a kernel's whole
    time there), takes the same value from its own max (NaN ignored, as on the GPU) and a NaN count."""
    if _COMPILED:
        return tl.reduce(x, axis, _maximum_nan)
    else:
        return tl.where(tl.sum((x != x).to(tl.int32), axis) > 0, float("nan"), tl.max(x, axis))


@triton.jit
def _log2(x):
    """fp32 log2 of a normal ``x > 0``: ``lg2.approx.ftz.f32`` when compiled (absolute error about 2^-22 on
    [0.5, 2], relative elsewhere), numpy's under the interpreter.

    ``ftz``: on a normal input it is the same MUFU.LG2 as ``lg2.approx.f32`` (the same bits); the non-ftz form
    wraps it in a subnormal fix-up (a compare, a predicated scale, a predicated add). Every input here is
    normal: ``u >= 2^-24`` and ``-log2 u >= 8.6e-8`` (the series included).
    """
    if _COMPILED:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.log2(x)


@triton.jit
def gumbel2_from_word(r):
    """uint32 Philox word -> log2-space Gumbel noise ``G2 = -log2(-log2 u)``, ``u = uniform_from_word(r)``.

    ``t = 1 - u`` is exact for these 24-bit uniforms; near ``u = 1`` (``t < 2^-6``) ``-log2 u`` is the
    series ``log2(e) * (t + t^2/2 + t^3/3 + t^4/4)`` (error below ``t^5/5``, < 1e-10 relative), since a
    log's absolute error there could return 0 (``G2 = +inf``, a certain token) or a negative value.
    Elsewhere ``-log2 u >= 0.0227``, so the SFU log2's absolute error stays below 1e-5 of the noise.
    """
    return gumbel2_from_uniform(uniform_from_word(r))


@triton.jit
def gumbel2_from_uniform(u):
    """:func:`gumbel2_from_word` from ``u = uniform_from_word(r)``, for a kernel that has ``u``'s bits already
    (the shard kernel's skip bound)."""
    t = 1.0 - u
    # Explicit fma: one instruction sequence wherever this is inlined (compiled code would otherwise fuse
    # or not by context); the interpreter's fma rounds twice, as the torch twin's mul + add does.
    c = tl.fma(t, 0.25, 0.3333333432674408)
    c = tl.fma(t, c, 0.5)
    c = tl.fma(t, c, 1.0)
    series = t * c * 1.4426950216293335
    return -_log2(tl.where(t < 0.015625, series, -_log2(u)))


@triton.jit
def gumbel_scale(temp):
    """Per-row multiplier ``S = div_rn(log2 e, T)`` of a sampled row (``T > 0``); 1.0 for greedy rows (unused)."""
    return tl.math.div_rn(tl.full(temp.shape, 1.4426950216293335, tl.float32), tl.where(temp > 0, temp, 1.0))


@triton.jit
def gumbel_score(x, scale, noise):
    """The keyed Gumbel-max score ``x * S + G2`` (fp32) a sampled row maximises: one fma when compiled, so a
    column's score is the same instruction in every kernel, tile and TP size (the interpreter's fma rounds
    twice, as the torch twin does)."""
    return tl.fma(x, scale, noise)


@triton.jit
def philox_4x32_10_wide(seed, c0, c1, c2, c3):
    """Philox-4x32-10, the same words as ``tl.philox(seed, c0, c1, c2, c3)`` (uint32 counters, int64 seed),
    each round's two products taken as one 32x32 -> 64-bit multiply (``mul.wide.u32``: high and low word
    from one instruction) instead of separate ``mul.hi`` and ``mul.lo``."""
    s = seed.to(tl.int64)
    k0 = (s & 4294967295).to(tl.uint32)
    k1 = ((s >> 32) & 4294967295).to(tl.uint32)
    for _ in tl.static_range(10):
        if _COMPILED:
            # Compiled: the product pair in PTX, since LLVM turns some zext-multiplies of xor results into
            # 64-bit multiplies (ptxas then emits IMAD.HI + IMAD or a wide multiply and an add).
            lo0, hi0 = tl.inline_asm_elementwise(
                "{ .reg .b64 p; mul.wide.u32 p, $2, 0xCD9E8D57; mov.b64 {$0, $1}, p; }", "=r,=r,r", [c2],
                dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
            lo1, hi1 = tl.inline_asm_elementwise(
                "{ .reg .b64 p; mul.wide.u32 p, $2, 0xD2511F53; mov.b64 {$0, $1}, p; }", "=r,=r,r", [c0],
                dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
        else:
            p0 = c2.to(tl.uint64) * 3449720151  # 0xCD9E8D57
            p1 = c0.to(tl.uint64) * 3528531795  # 0xD2511F53
            lo0, hi0 = p0.to(tl.uint32), (p0 >> 32).to(tl.uint32)
            lo1, hi1 = p1.to(tl.uint32), (p1 >> 32).to(tl.uint32)
        c0 = hi0 ^ (c1 ^ k0)  # grouped so that a loop-invariant c ^ k (round 1) is hoisted as one value
        c2 = hi1 ^ (c3 ^ k1)
        c1 = lo0
        c3 = lo1
        k0 = k0 + 2654435769  # 0x9E3779B9, wraps mod 2^32
        k1 = k1 + 3144134277  # 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def gumbel_words4(seed, offset, group, SALT: tl.constexpr, WIDE_MUL: tl.constexpr = False):
    """The four uint32 words of the Philox block that feeds global ids ``4 * group + 0..3``.

    ``group`` (any integer block, = gid // 4) -> ``(w0, w1, w2, w3)`` of Philox-4x32-10 keyed by ``seed``
    with counter ``(group, offset low word, offset high word, SALT)``. Word ``w`` is the draw of global
    id ``4 * group + w``: one Philox call serves four consecutive columns. ``WIDE_MUL`` computes the same
    words with :func:`philox_4x32_10_wide` (a schedule choice: fewer multiply instructions).
    """
    off = offset.to(tl.int64)
    c0 = group.to(tl.uint32)  # group < 2^30 (ids below 2^32): the truncation is the value
    c1 = (off & 4294967295).to(tl.uint32) + c0 * 0
    c2 = ((off >> 32) & 4294967295).to(tl.uint32) + c0 * 0
    c3 = c0 * 0 + SALT
    if WIDE_MUL:
        return philox_4x32_10_wide(seed, c0, c1, c2, c3)
    else:
        return tl.philox(seed.to(tl.int64), c0, c1, c2, c3)


@triton.jit
def pick_word(w, r0, r1, r2, r3):
    """Elementwise ``(r0, r1, r2, r3)[w]`` for ``w`` in 0..3 (broadcasting)."""
    return tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))


@triton.jit
def straddled_word(k, a0, a1, a2, a3, b0, b1, b2, b3):
    """Word ``k`` (0..6) of two consecutive Philox blocks ``a`` then ``b``: a run of four ids that starts ``m``
    words into block ``a`` takes words ``m .. m + 3`` of the pair."""
    return tl.where(k < 4, pick_word(k, a0, a1, a2, a3), pick_word(k - 4, b0, b1, b2, b3))


@triton.jit
def gumbel2_noise(seed, offset, gid, SALT: tl.constexpr):
    """Log2-space Gumbel noise ``G2`` keyed by (request seed, request offset, global vocab id, salt).

    The draw of global id ``gid`` is word ``gid % 4`` of the Philox block with counter
    ``(gid // 4, offset low word, offset high word, SALT)`` (:func:`gumbel_words4`; the salt separates
    target, draft and Markov-chain draws), mapped by :func:`gumbel2_from_word`. This per-element form
    computes the whole block for each element; a kernel that owns four consecutive ids can call
    :func:`gumbel_words4` once for them (the shard-select kernel does) and gets the same values. The
    score is ``gumbel_score(x, gumbel_scale(T), G2)``.
    """
    g = gid.to(tl.int64) & 4294967295
    r0, r1, r2, r3 = gumbel_words4(seed, offset, g >> 2, SALT)
    return gumbel2_from_word(pick_word((g & 3).to(tl.int32), r0, r1, r2, r3))


@triton.jit
def gumbel2_noise_grouped(seed, offset, first_gid, ALIGNED: tl.constexpr, SALT: tl.constexpr,
                          JOIN: tl.constexpr = True):
    """:func:`gumbel2_noise` of runs of four consecutive ids, from one Philox call per run.

    ``first_gid`` ``[R, G]`` (or ``[1, G]``): the global id of each run's first column; ``seed`` / ``offset``
    broadcast with it to ``[R, G]`` (per row ``[R, 1]``, or scalars). Returns ``[R, 4G]`` fp32 whose element
    ``(r, 4 i + j)`` is, bit for bit, ``gumbel2_noise(seed[r], offset[r], first_gid[i] + j, SALT)`` (ids
    below ``2^32 - 4``, which every vocabulary is). ``ALIGNED`` (every ``first_gid % 4 == 0``, e.g. a shard
    whose first id is a multiple of 4): run ``i`` is exactly Philox block ``first_gid // 4``, one call per
    four ids. Otherwise a run straddles two blocks and takes the tail words of one and the head words of
    the next (two calls per four ids, still half the per-element form's). The Gumbel map after them runs
    once per element.

    ``JOIN`` (a schedule choice, the same values): True interleaves the runs' words with ``tl.join`` and
    reshapes to ``[R, 4G]``: each run's block is computed once, then moved to the lanes holding its columns
    (on an MMA accumulator layout a run spans two lanes: a shuffle). False broadcasts the words over a
    ``[R, G, 4]`` axis and picks each column's: no data movement, but where a run spans two lanes both
    compute its block (the 64-row wgmma tile needs this to stay within 255 registers; sm_90, Triton 3.6.0).
    """
    g = first_gid.to(tl.int64) & 4294967295
    a0, a1, a2, a3 = gumbel_words4(seed, offset, g >> 2, SALT)
    if ALIGNED:
        w0, w1, w2, w3 = a0, a1, a2, a3
    else:
        b0, b1, b2, b3 = gumbel_words4(seed, offset, (g >> 2) + 1, SALT)
        m = (g & 3).to(tl.int32)  # id first_gid + j is word m + j of the pair (a, b)
        w0 = pick_word(m, a0, a1, a2, a3)
        w1 = straddled_word(m + 1, a0, a1, a2, a3, b0, b1, b2, b3)
        w2 = straddled_word(m + 2, a0, a1, a2, a3, b0, b1, b2, b3)
        w3 = straddled_word(m + 3, a0, a1, a2, a3, b0, b1, b2, b3)
    if JOIN:
        # join(join(w0, w2), join(w1, w3))[r, i, p, q] = w_(2p + q): the row-major reshape puts w_j at 4 i + j.
        words = tl.join(tl.join(w0, w2), tl.join(w1, w3))
    else:
        words = pick_word(tl.arange(0, 4)[None, None, :], w0[:, :, None], w1[:, :, None], w2[:, :, None],
                          w3[:, :, None])
    words = tl.reshape(words, [w0.shape[0], w0.shape[1] * 4])
    return gumbel2_from_word(words)


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


def philox_4x32_10_torch(seed: torch.Tensor, c0, c1, c2, c3):
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


LOG2E_F32 = 1.4426950216293335  # fp32(log2 e), the constant the kernels use


def _log2_f32(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``log2`` as the kernels compute it on this device: under the Triton interpreter ``tl.log2`` is
    numpy's, so CPU tensors take numpy's (torch's CPU log2 may differ by an ulp); CUDA tensors take
    torch's (the GPU kernel's device approximation may differ by ulps, see the module docs)."""
    if x.device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.log2(x.contiguous().numpy()))
    return torch.log2(x)


def gumbel2_from_word_torch(r: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`gumbel2_from_word` (int64 tensor of uint32 words -> fp32), the same fp32 ops in
    the same order."""
    top = (r >> 9).to(torch.float32)
    u = (top + 0.5) * 1.1920928955078125e-07  # exact: 24 significant bits
    t = 1.0 - u
    series = t * (1.0 + t * (0.5 + t * (0.3333333432674408 + t * 0.25))) * LOG2E_F32
    return -_log2_f32(torch.where(t < 0.015625, series, -_log2_f32(u)))


def gumbel_scale_torch(temperatures: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`gumbel_scale`: ``log2(e) / T`` (IEEE fp32 division) for ``T > 0``, else 1.0."""
    t = temperatures.to(torch.float32)
    return torch.full_like(t, LOG2E_F32) / torch.where(t > 0, t, torch.ones_like(t))


def gumbel2_noise_torch(seed: torch.Tensor, offset: torch.Tensor, gid: torch.Tensor, salt: int) -> torch.Tensor:
    """Torch twin of :func:`gumbel2_noise`. ``seed``/``offset`` ``[R, 1]`` int64, ``gid`` ``[1, N]`` int64.

    Word ``gid % 4`` of Philox-4x32-10(seed; gid // 4, offset lo, offset hi, salt), mapped by
    :func:`gumbel2_from_word_torch`.
    """
    seed = seed.to(torch.int64)
    off = offset.to(torch.int64)
    gid = gid.to(torch.int64) & 0xFFFFFFFF
    c0 = (gid >> 2) + torch.zeros_like(off)
    c1 = (off & 0xFFFFFFFF) + torch.zeros_like(gid)
    c2 = ((off >> 32) & 0xFFFFFFFF) + torch.zeros_like(gid)
    c3 = torch.full_like(c0, salt & 0xFFFFFFFF)
    r0, r1, r2, r3 = philox_4x32_10_torch(seed + torch.zeros_like(c0), c0, c1, c2, c3)
    w = gid & 3
    return gumbel2_from_word_torch(torch.where(w == 0, r0, torch.where(w == 1, r1, torch.where(w == 2, r2, r3))))


def keyed_gumbel_scores_torch(x: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
                              vocab_start: int, salt: int) -> torch.Tensor:
    """The fp32 scores every keyed sampler maximises, for ``[R, N]`` logits whose column ``j`` is global id
    ``vocab_start + j``: ``x * S + G2`` for rows with ``T > 0`` (see the module docs), ``x`` for the others
    (``T <= 0`` or NaN: greedy). ``temperatures`` fp32, ``seeds`` / ``offsets`` int64, all ``[R]``.

    Example (the stock sampler: ``torch.argmax`` of the scores is the keyed Gumbel-max token)::

        ids = torch.argmax(keyed_gumbel_scores_torch(logits, temps, seeds, offsets, 0, TARGET_SALT), dim=-1)
    """
    xf = x.float()
    gid = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)[None, :] + vocab_start
    g = gumbel2_noise_torch(seeds[:, None], offsets[:, None], gid, salt)
    sampled = (temperatures > 0)[:, None]
    return torch.where(sampled, xf * gumbel_scale_torch(temperatures)[:, None] + g, xf)
