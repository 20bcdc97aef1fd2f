"""Shard selection: each row of vocab-shard logits ``[R, V_local]`` -> one int64 selection key.

The key (see :mod:`tensorrt_llm_ext.kernels.ordered_key`) orders candidates exactly as ``torch.argmax``
over the gathered row does (first NaN, then the maximum, ties to the lowest global id), so the TP
exchange is one all-reduce MAX over ``[R]`` int64 and the winner's id is read back from the key.

Optionally the value is perturbed for keyed Gumbel-max sampling: per row temperature ``T`` (fp32,
``T <= 0`` = greedy), seed and offset (int64); the score is ``x * S + G2`` in fp32 with
``S = div_rn(log2 e, T)`` once per row and ``G2 = gumbel2_noise(seed, offset, global id, SALT)`` (word
``id % 4`` of the Philox block ``id // 4``, two ``log2``; see :mod:`tensorrt_llm_ext.kernels.ordered_key`).
A sampled row runs its own loop (``_sampled_span``): one Philox call per four columns (two when the
shard's start is not a multiple of 4), and the exact score only for tiles where a cheap bound (one
``exp2`` per column) says some column could beat the program's best so far; the skipped columns provably
lose, so the keys are those of the full computation. The noise depends on the global vocab id only, so a
draw is the same at every TP size, split count and block size.

One launch per call. Few rows give few programs, and one program reading a 400 KB row is far from
the HBM roof, so the launcher splits each row's columns over ``num_splits`` programs (one wave of
resident programs, :func:`plan_splits`) and the partial winners are combined inside the same launch. A
greedy program folds two tiles per loop iteration while the next two are already loading
(``_greedy_span``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import (CaptureAllocationError, check_int, check_tensor, is_capturing,
                                             num_warps_for, sm_count, triton_runs_on)
from tensorrt_llm_ext.logger import info_once

from tensorrt_llm_ext.kernels.ordered_key import (
    EMPTY_KEY,
    MAX_VOCAB,
    block_best,
    gumbel2_from_uniform,
    gumbel_scale,
    gumbel_score,
    gumbel_words4,
    key_to_id,
    key_to_id_torch,
    keyed_gumbel_scores_torch,
    nan_max,
    one_plus_top,
    ordered_i32,
    ordered_i32_torch,
    pack_key,
    pack_key_torch,
    pick_word,
    straddled_word,
)

# Philox counter word c3 of the Gumbel noise: separates the target sampler's draws from the drafter's
# (and from the Markov chain's, which owns its own salt) for the same (seed, offset, id).
TARGET_SALT = 0x5E1EC7
DRAFT_SALT = 0xD7AF7

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Bytes per tile: 4096 bf16/fp16 (2048 fp32) columns over 8 warps, i.e. two 16-byte loads per thread per
# tile. The loop keeps the next two tiles in flight while it folds the current two (see the kernel).
_TILE_BYTES = 8192
# Resident programs per SM the split plan aims for (one wave: a second partial wave would double the tail).
_PROGRAMS_PER_SM = 2
# The sampled kernel's schedule (a launch with temperatures): it is issue-bound (Philox per four columns,
# the skip bound per column), not bandwidth-bound, so it has its own tile, warps and wave target.
_SAMPLED_TILE_COLUMNS = 2048
_SAMPLED_WARPS = 4
_SAMPLED_PROGRAMS_PER_SM = 4
# Philox with one 32x32 -> 64-bit multiply per product pair (the same words; see philox_4x32_10_wide): 11-15 %
# off the sampled kernel at every swept shape (`bench select --tables sampled`, H100, 2026-12-06: 64 rows 30.90 ->
# 27.21 us, 256 rows 90.69 -> 77.12, a TP-4 shard at 256 rows 29.21 -> 26.08).
_SAMPLED_WIDE_MUL = True


@triton.jit
def _fold(x, start, best_v, best_s, valid, MASKED: tl.constexpr):
    """Fold one tile (fp32 ``x``, tile start column ``start``) into the per-lane running best.

    Per lane ``(best value, start of the tile that gave it)``, in torch.argmax order, kept in the float
    domain so the hot loop is ~5 instructions per element (a bandwidth-bound kernel must not become
    issue-bound): a lane takes the tile's value when ``not (x <= best)`` -- strictly greater, or ``x`` is
    NaN -- and its best is not NaN yet, so each lane keeps its first NaN, else its maximum at the lowest
    column (later tiles have higher columns; ``-0.0 == +0.0`` ties, as in torch). Tracking the tile start
    (a scalar) instead of the column saves an add per element; the column is ``start + lane``.
    """
    take = ~(x <= best_v) & (best_v == best_v)
    if MASKED:
        take = take & valid
    return tl.where(take, x, best_v), tl.where(take, start, best_s)


@triton.jit
def _greedy_span(row_ptr, col_begin, col_end, BLOCK: tl.constexpr):
    """Best ``(ordered key, local column)`` of the row's columns ``[col_begin, col_end)`` in torch.argmax
    order (``(INT32_MIN, ...)`` when the span is empty).

    Full tiles load unmasked in effect: their masks are per-program scalars (splat), which keep the loads
    vectorized. Two tiles per iteration, and the next two are loaded before the current two are folded,
    so up to four tiles per program are in flight while it computes (few rows leave the kernel
    latency-bound otherwise: each program would wait for every load before it issues the next).
    """
    lanes = tl.arange(0, BLOCK)
    # Per-lane running best (value, tile start). It starts at (-inf, col_begin): a lane whose values are
    # all -inf keeps its first column, which is then the right answer; a lane past col_end (a short
    # chunk) is never taken and stays invalid (column >= col_end).
    best_v = tl.full(lanes.shape, float("-inf"), tl.float32)
    best_s = tl.full(lanes.shape, 0, tl.int32) + col_begin
    zero = tl.zeros(lanes.shape, tl.int32)
    n_full = (col_end - col_begin) // BLOCK
    x0 = tl.load(row_ptr + col_begin + lanes, mask=zero < n_full, other=0.0)
    x1 = tl.load(row_ptr + col_begin + BLOCK + lanes, mask=zero + 1 < n_full, other=0.0)
    for t in range(0, n_full, 2):
        c0 = x0
        c1 = x1
        start = col_begin + t * BLOCK
        x0 = tl.load(row_ptr + start + 2 * BLOCK + lanes, mask=zero + (t + 2) < n_full, other=0.0)
        x1 = tl.load(row_ptr + start + 3 * BLOCK + lanes, mask=zero + (t + 3) < n_full, other=0.0)
        best_v, best_s = _fold(c0.to(tl.float32), start, best_v, best_s, lanes, False)
        if t + 1 < n_full:
            best_v, best_s = _fold(c1.to(tl.float32), start + BLOCK, best_v, best_s, lanes, False)
    full_end = col_begin + n_full * BLOCK
    if full_end < col_end:
        valid = full_end + lanes < col_end
        x = tl.load(row_ptr + full_end + lanes, mask=valid, other=0.0)
        best_v, best_s = _fold(x.to(tl.float32), full_end, best_v, best_s, valid, True)
    # Across lanes: exact ordered keys (NaN highest), the lowest column among equal keys.
    best_c = best_s + lanes
    return block_best(ordered_i32(best_v), best_c, best_c < col_end, 0)


# log2(log2 e): -log2(u) >= log2(e) * (1 - u), so G2 = -log2(-log2 u) <= -log2(1 - u) - LOG2_LOG2E (rounded down).
_LOG2_LOG2E = tl.constexpr(0.52876)
# Slack of the skip bound, in log2 units: far above the score's rounding and the SFU log2/exp2 errors
# (about 1e-5 here), and scaled with the magnitudes involved (see _sampled_tile).
_SKIP_SLACK = tl.constexpr(0.00390625)


@triton.jit
def _tile_words(seed, offset, vocab_start, start, G: tl.constexpr, ALIGNED: tl.constexpr, SALT: tl.constexpr,
                WIDE_MUL: tl.constexpr):
    """Philox words of a ``[G, 4]`` tile: element ``(i, j)`` is local column ``start + 4 i + j`` (``start`` a
    multiple of 4), its word that of global id ``vocab_start + start + 4 i + j``.

    The groups lie along the fast axis, so a group's four words stay in one thread and each thread runs
    Philox once per group it owns. ``ALIGNED`` (``vocab_start % 4 == 0``, every shard of a vocabulary
    divisible by 4 tp): group ``i`` is exactly Philox block ``(vocab_start + start) / 4 + i``, one call
    per four columns. Otherwise a group straddles two blocks and takes the tail words of one and the head
    words of the next (two calls per four columns; such shards also have odd row strides, so their loads
    are not vectorized either).
    """
    q = ((vocab_start + start) >> 2).to(tl.int64) + tl.arange(0, G).to(tl.int64)[:, None]
    j = tl.arange(0, 4)[None, :]
    a0, a1, a2, a3 = gumbel_words4(seed, offset, q, SALT, WIDE_MUL)
    if ALIGNED:
        w = pick_word(j, a0, a1, a2, a3)
    else:
        b0, b1, b2, b3 = gumbel_words4(seed, offset, q + 1, SALT, WIDE_MUL)
        w = straddled_word(j + (vocab_start & 3).to(tl.int32), a0, a1, a2, a3, b0, b1, b2, b3)
    return w


@triton.jit
def _bound_lift(thr):
    """``thr + log2(log2 e)`` less a slack, per tile. The slack absorbs the fp32 rounding of ``x * S + G2``
    (relative 2^-24 of magnitudes near ``|thr|``) and the device exp2 / log2 approximations; skipping less
    than possible never changes a result."""
    return thr + (_LOG2_LOG2E - _SKIP_SLACK) - tl.abs(thr) * 3.814697265625e-06


@triton.jit
def _bound_sum(xf, scale, lift, o):
    """``fl(e + o)``, ``e = 2^(x S - lift)``, ``o = one_plus_top(w)``: ``>= 2`` (or NaN) wherever ``t < e``.

    ``t = (2 - 2^-24) - o`` exactly, so ``t < e`` means ``e + o > 2 - 2^-24``, the midpoint below 2, and the
    sum rounds to ``>= 2``; it reaches 2 otherwise only at ``t == e``. One add where ``t < e`` as a compare
    took a subtract, a compare and a select.
    """
    return tl.exp2(xf * scale - lift) + o


@triton.jit
def _sampled_tile(x, start, best_v, best_s, thr, scale, seed, offset, vocab_start, valid,
                  MASKED: tl.constexpr, ALIGNED: tl.constexpr, SALT: tl.constexpr, WIDE_MUL: tl.constexpr):
    """Fold one ``[G, 4]`` tile of a sampled row into the per-lane best, skipping the exact score when no
    element of the tile can beat the program's best so far.

    The exact score ``x * S + G2`` costs two SFU log2 and a near-1 series per element; a bound costs one
    exp2: since ``-log2 u >= log2(e) t`` with ``t = 1 - u`` (exact in fp32), ``x * S + G2 > thr`` needs
    ``t < e = 2^(x S - thr - log2(log2 e))``. ``thr`` is a score already folded at a lower column (the
    best so far); an element failing the test scores below it, so it cannot win: skipping the tile leaves
    the program's result exactly what the full fold gives. A NaN value (NaN bound) and any element while
    ``thr = -inf`` (NaN or ``+inf`` bound) always take the exact path; masked lanes never do.

    The test per element is an add (:func:`_bound_sum`) and a max: a tile is scored when the
    NaN-propagating max of the sums is ``>= 2`` or NaN.
    """
    xf = x.to(tl.float32)
    w = _tile_words(seed, offset, vocab_start, start, x.shape[0], ALIGNED, SALT, WIDE_MUL)
    o = one_plus_top(w)
    d = _bound_sum(xf, scale, _bound_lift(thr), o)
    if MASKED:
        d = tl.where(valid, d, float("-inf"))
    m = nan_max(d, None)
    if (m >= 2.0) | (m != m):
        s = gumbel_score(xf, scale, gumbel2_from_uniform(o - 0.999999940395355224609375))
        best_v, best_s = _fold(s, start, best_v, best_s, valid, MASKED)
        # Compiled, max skips NaN lanes (fmax); interpreted it returns NaN, which only scores every later tile.
        thr = tl.max(best_v)
    return best_v, best_s, thr


@triton.jit
def _sampled_span(row_ptr, col_begin, col_end, scale, seed, offset, vocab_start, BLOCK: tl.constexpr,
                  ALIGNED: tl.constexpr, SALT: tl.constexpr, WIDE_MUL: tl.constexpr, BF16_WORDS: tl.constexpr):
    """Best ``(ordered key, local column)`` of ``x * S + G2`` over the row's columns ``[col_begin, col_end)``:
    full tiles unmasked (vectorized loads), then the ragged tail."""
    G: tl.constexpr = BLOCK // 4
    lanes = (tl.arange(0, G) * 4)[:, None] + tl.arange(0, 4)[None, :]
    best_v = tl.full(lanes.shape, float("-inf"), tl.float32)
    best_s = tl.full(lanes.shape, 0, tl.int32) + col_begin
    thr = float("-inf")
    n_full = (col_end - col_begin) // BLOCK
    for t in range(0, n_full):
        start = col_begin + t * BLOCK
        if BF16_WORDS:
            # bf16 pairs as 32-bit words: bf16 -> fp32 is the word shifted up (even column) or masked (odd), one
            # op per element where the generic conversion takes up to two.
            wd = tl.load((row_ptr + start).to(tl.pointer_type(tl.int32)) + (tl.arange(0, G) * 2)[:, None]
                         + tl.arange(0, 2)[None, :])
            x = tl.interleave((wd << 16).to(tl.float32, bitcast=True), (wd & -65536).to(tl.float32, bitcast=True))
        else:
            x = tl.load(row_ptr + start + lanes)
        best_v, best_s, thr = _sampled_tile(x, start, best_v, best_s, thr, scale, seed, offset, vocab_start, lanes,
                                            False, ALIGNED, SALT, WIDE_MUL)
    tail = col_begin + n_full * BLOCK
    if tail < col_end:
        valid = tail + lanes < col_end
        x = tl.load(row_ptr + tail + lanes, mask=valid, other=float("-inf"))
        best_v, best_s, thr = _sampled_tile(x, tail, best_v, best_s, thr, scale, seed, offset, vocab_start, valid,
                                            True, ALIGNED, SALT, WIDE_MUL)
    # A lane that never took a value stands for its first column (an all -inf span answers col_begin).
    best_c = tl.reshape(best_s + lanes, [BLOCK])
    return block_best(ordered_i32(tl.reshape(best_v, [BLOCK])), best_c, best_c < col_end, 0)


@triton.jit(do_not_specialize=["vocab_start", "num_splits"])
def _shard_select_kernel(
    x_ptr,  # [R, V_local] logits, unit column stride
    temp_ptr,  # [R] fp32 (read only if SAMPLE)
    seed_ptr,  # [R] int64 (read only if SAMPLE)
    offset_ptr,  # [R] int64 (read only if SAMPLE)
    out_ptr,  # [R] int64: selection keys, or ids if OUT_IDS
    slot_ptr,  # [>= R] int64 scratch, EMPTY_KEY between launches (read only if SPLIT)
    count_ptr,  # [>= R] int32 scratch, 0 between launches (read only if SPLIT)
    stride_row,
    n_valid,  # columns of this shard with global id < vocab_size
    vocab_start,
    chunk,  # columns per split program (a multiple of BLOCK; specialized, so split starts stay aligned)
    num_splits,
    BLOCK: tl.constexpr,
    SAMPLE: tl.constexpr,
    SPLIT: tl.constexpr,
    OUT_IDS: tl.constexpr,
    SALT: tl.constexpr,
    ALIGNED: tl.constexpr,  # vocab_start % 4 == 0 (read only if SAMPLE)
    WIDE_MUL: tl.constexpr,  # Philox through 32x32 -> 64-bit multiplies (same words; read only if SAMPLE)
    BF16_WORDS: tl.constexpr,  # bf16 rows read as 32-bit words (4-byte aligned rows; read only if SAMPLE)
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = x_ptr + row.to(tl.int64) * stride_row
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    if SAMPLE:
        t_row = tl.load(temp_ptr + row)
        if t_row > 0.0:
            # The row's one division; T <= 0 rows are greedy: plain values, no noise.
            bk, bc = _sampled_span(row_ptr, col_begin, col_end, gumbel_scale(t_row), tl.load(seed_ptr + row),
                                   tl.load(offset_ptr + row), vocab_start, BLOCK, ALIGNED, SALT, WIDE_MUL,
                                   BF16_WORDS)
        else:
            bk, bc = _greedy_span(row_ptr, col_begin, col_end, BLOCK)
    else:
        bk, bc = _greedy_span(row_ptr, col_begin, col_end, BLOCK)
    key = pack_key(bk, bc.to(tl.int64) + vocab_start)

    if SPLIT:
        # One-launch combine without a spin-wait (the interpreter runs programs one after another):
        # every split program folds its key into the row's scratch slot with an int64 atomic max, then
        # bumps the row's arrival counter. One thread issues both, in this order; the counter's add is
        # acq_rel at GPU scope, so its release orders the (relaxed, fire-and-forget) max before it, and
        # the program that sees count == num_splits - 1 (the last to arrive) acquires every earlier
        # add and so reads a slot that already holds every other split's key. It takes the slot with
        # an exchange that resets it to EMPTY_KEY and resets the counter, leaving the scratch ready for
        # the next launch (and for CUDA-graph replay) without a memset.
        tl.atomic_max(slot_ptr + row, key, sem="relaxed")
        arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            final = tl.atomic_xchg(slot_ptr + row, -9223372036854775808, sem="relaxed")
            final = tl.maximum(final, key)
            tl.atomic_xchg(count_ptr + row, 0, sem="relaxed")
            if OUT_IDS:
                tl.store(out_ptr + row, key_to_id(final))
            else:
                tl.store(out_ptr + row, final)
    else:
        if OUT_IDS:
            tl.store(out_ptr + row, key_to_id(key))
        else:
            tl.store(out_ptr + row, key)


# ----------------------------------------------------------------------------------------------------
# Scratch: per device, grown outside capture only
# ----------------------------------------------------------------------------------------------------
_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
# Outgrown scratch buffers are kept, never freed: a CUDA graph captured while one of them was current
# still reads and writes it on replay (the kernel leaves it reset, so it stays valid for those graphs).
_RETIRED_SCRATCH: list[tuple[torch.Tensor, torch.Tensor]] = []


def _scratch(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots int64 [cap], counts int32 [cap])`` for ``rows`` rows, cached per device.

    Launches that share it must be ordered on one stream (the kernel leaves it reset on exit). When a
    later eager call needs more rows (e.g. a step larger than every captured batch size), a larger buffer
    replaces it for new launches; the old one stays allocated for the graphs that captured it.
    """
    cached = _SCRATCH.get(device)
    if cached is not None and cached[0].numel() >= rows:
        return cached
    if is_capturing(device):
        raise CaptureAllocationError(
            f"shard_select: split scratch for {rows} rows is not allocated yet and a CUDA graph is "
            f"capturing; run one eager call with >= {rows} rows first (warm-up) or pass scratch=")
    cap = max(256, triton.next_power_of_2(rows))
    slots = torch.full((cap,), EMPTY_KEY, dtype=torch.int64, device=device)
    counts = torch.zeros((cap,), dtype=torch.int32, device=device)
    if cached is not None:
        _RETIRED_SCRATCH.append(cached)
    _SCRATCH[device] = (slots, counts)
    return slots, counts


def make_shard_select_scratch(rows: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Caller-owned scratch for :func:`shard_select_keys` (``scratch=``), e.g. for a second stream."""
    device = torch.device(device)
    return (torch.full((rows,), EMPTY_KEY, dtype=torch.int64, device=device),
            torch.zeros((rows,), dtype=torch.int32, device=device))


def default_block(n_valid: int, dtype: torch.dtype, sampled: bool = False) -> int:
    """Columns per tile: greedy ``_TILE_BYTES`` of logits (4096 bf16/fp16, 2048 fp32), sampled
    ``_SAMPLED_TILE_COLUMNS``; less for narrow shards."""
    block = _SAMPLED_TILE_COLUMNS if sampled else _TILE_BYTES // dtype.itemsize  # no tensor per call
    return min(block, max(16, triton.next_power_of_2(max(n_valid, 1))))


def default_warps(block: int, sampled: bool = False) -> int:
    """Warps per program: greedy one per 256 columns (4 to 8); sampled ``_SAMPLED_WARPS`` (fewer for tiles
    of fewer than 32 columns per warp)."""
    if sampled:
        return max(1, min(_SAMPLED_WARPS, block // 128))
    return num_warps_for(block, min_warps=4)


def plan_splits(rows: int, n_valid: int, device: torch.device, block: int, num_splits: int | None = None,
                programs_per_sm: int = _PROGRAMS_PER_SM) -> tuple[int, int]:
    """``(num_splits, chunk)`` for a launch: chunk a multiple of ``block``, ``num_splits * chunk >= n_valid``.

    A schedule only (the key never depends on it). Default: as many programs per row as fit one wave of
    ``programs_per_sm`` resident programs per SM (``rows * num_splits <= programs_per_sm * SMs``, so no
    partial second wave doubles the tail), capped at one tile per program. Few rows get many programs
    of a tile or two each (their loads all in flight at once); many rows get one program per row.
    Depends on shapes only, so a captured graph and its eager warm-up agree.
    """
    tiles = max(1, triton.cdiv(n_valid, block))
    if num_splits is None:
        num_splits = (programs_per_sm * sm_count(device)) // max(rows, 1)
    num_splits = max(1, min(num_splits, tiles))
    chunk = triton.cdiv(tiles, num_splits) * block
    num_splits = max(1, triton.cdiv(n_valid, chunk))
    return num_splits, chunk


# ----------------------------------------------------------------------------------------------------
# Launcher and eager twin
# ----------------------------------------------------------------------------------------------------
def _bf16_words(shard_logits: torch.Tensor) -> bool:
    """Whether a sampled launch reads these logits as 32-bit words of bf16 pairs: bf16 rows that start 4-byte
    aligned (an aligned base and, above one row, an even row stride). The keys are the same either way."""
    return (shard_logits.dtype == torch.bfloat16 and shard_logits.data_ptr() % 4 == 0
            and (shard_logits.shape[0] <= 1 or shard_logits.stride(0) % 2 == 0))


def _validate(shard_logits, vocab_start, vocab_size, temperatures, seeds, offsets, out, out_dtype):
    check_tensor("shard_logits", shard_logits, shape=(None, None), dtype=_SUPPORTED_DTYPES, unit_last_stride=True)
    rows, width = shard_logits.shape
    check_int("vocab_size", vocab_size, lo=1, hi=MAX_VOCAB + 1)  # the int64 key holds ids below 2^32 - 1
    check_int("vocab_start", vocab_start, lo=0, hi=vocab_size)
    if vocab_start + width > MAX_VOCAB + 1:
        raise ValueError(f"shard_logits: expected columns below global id {MAX_VOCAB + 1}, got "
                         f"{vocab_start + width} (vocab_start {vocab_start} + width {width})")
    device = shard_logits.device
    sampled = (temperatures, seeds, offsets)
    if any(t is not None for t in sampled) and any(t is None for t in sampled):
        raise ValueError("temperatures, seeds and offsets: expected all three or none, got "
                         + ", ".join(n for n, t in zip(("temperatures", "seeds", "offsets"), sampled) if t is not None))
    if temperatures is not None:
        # The kernel reads row i at element i: a broadcast (stride-0) or strided view would be read
        # wrongly without any error, so refuse it.
        for name, t, dtype in (("temperatures", temperatures, torch.float32), ("seeds", seeds, torch.int64),
                               ("offsets", offsets, torch.int64)):
            check_tensor(name, t, shape=(rows,), dtype=dtype, device=device, contiguous=True)
    if out is not None:
        check_tensor("out", out, shape=(rows,), dtype=out_dtype, device=device, contiguous=True)


def _check_scratch(scratch, rows: int, device: torch.device) -> None:
    if not isinstance(scratch, tuple) or len(scratch) != 2:
        raise ValueError(f"scratch: expected a (slots, counts) tuple, got {type(scratch).__name__}")
    slots, counts = scratch
    for name, t, dtype in (("scratch slots", slots, torch.int64), ("scratch counts", counts, torch.int32)):
        check_tensor(name, t, dtype=dtype, device=device, contiguous=True)
        if t.dim() != 1 or t.numel() < rows:
            raise ValueError(f"{name}: expected a 1-D tensor of >= {rows} elements, got shape {list(t.shape)}")


def shard_select_keys(
    shard_logits: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    temperatures: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    *,
    salt: int = TARGET_SALT,
    out: torch.Tensor | None = None,
    return_ids: bool = False,
    block_size: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    wide_mul: bool | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reduce each row of ``[R, V_local]`` shard logits to its int64 selection key (one launch).

    Args:
        shard_logits: ``[R, V_local]`` fp32/fp16/bf16, any row stride, unit column stride. Column ``j``
            is global id ``vocab_start + j``; columns with global id ``>= vocab_size`` (padding) never win.
        temperatures, seeds, offsets: ``[R]`` fp32 / int64 / int64, all or none. With them, rows with
            ``T > 0`` select on ``x * div_rn(log2 e, T) + gumbel2_noise(seed, offset, id, salt)`` (keyed
            Gumbel-max in log2 space, :mod:`~tensorrt_llm_ext.kernels.ordered_key`); ``T <= 0`` rows are greedy.
        out: ``[R]`` int64, written in place.
        return_ids: write global ids (``-1`` for a shard with no valid column) instead of keys; use it
            when this rank holds the whole vocabulary (no exchange follows).
        block_size, num_splits, num_warps: the schedule (columns per tile, a power of two >= 16; programs per
            row; warps per program). Default: :func:`default_block`, :func:`plan_splits` (with
            ``_SAMPLED_PROGRAMS_PER_SM`` for a sampled launch) and :func:`default_warps`. The result never
            depends on them. ``wide_mul``: the sampled loop's Philox multiply form (default
            ``_SAMPLED_WIDE_MUL``; the same words either way).
        scratch: ``(slots int64 [>= R] filled with EMPTY_KEY, counts int32 [>= R] zeros)``; the kernel
            restores them. Default: a per-device cache (launches sharing it must be stream-ordered).

    Returns ``out`` (``[R]`` int64). CUDA-graph safe once the cached scratch holds ``R`` rows (any eager
    call with ``>= R`` rows on the device) or with ``scratch=``; ``out=`` avoids the only other allocation.
    """
    _validate(shard_logits, vocab_start, vocab_size, temperatures, seeds, offsets, out, torch.int64)
    if scratch is not None:
        _check_scratch(scratch, shard_logits.shape[0], shard_logits.device)
    if not triton_runs_on(shard_logits):
        # CPU tensors without the Triton interpreter: the eager twin gives the same keys. Logged once.
        info_once("shard_select_keys: CPU tensors without TRITON_INTERPRET=1, using the eager twin",
                  key="shard-select-eager")
        res = shard_select_keys_reference(shard_logits, vocab_start, vocab_size, temperatures, seeds, offsets,
                                          salt=salt, return_ids=return_ids)
        return res if out is None else out.copy_(res)
    rows, width = shard_logits.shape
    n_valid = max(0, min(width, vocab_size - vocab_start))
    sample = temperatures is not None
    if block_size is None:
        block_size = default_block(n_valid, shard_logits.dtype, sample)
    check_int("block_size", block_size, lo=16)
    if block_size & (block_size - 1):
        raise ValueError(f"block_size: expected a power of two >= 16, got {block_size}")
    check_int("salt", salt, lo=0, hi=2**32)
    if num_splits is not None:
        check_int("num_splits", num_splits, lo=1)
    if num_warps is None:
        num_warps = default_warps(block_size, sample)
    check_int("num_warps", num_warps, lo=1, hi=32)
    if num_warps & (num_warps - 1):
        raise ValueError(f"num_warps: expected a power of two <= 32, got {num_warps}")
    device = shard_logits.device
    if out is None:
        out = torch.empty((rows,), dtype=torch.int64, device=device)
    if rows == 0:
        return out
    splits, chunk = plan_splits(rows, n_valid, device, block_size, num_splits,
                                _SAMPLED_PROGRAMS_PER_SM if sample else _PROGRAMS_PER_SM)
    if splits > 1:
        if scratch is None:
            scratch = _scratch(device, rows)
        slots, counts = scratch
    else:
        slots, counts = out, out  # never read: SPLIT is off
    stride_row = shard_logits.stride(0) if rows > 1 else width
    _shard_select_kernel[(rows, splits)](
        shard_logits,
        temperatures if sample else out,
        seeds if sample else out,
        offsets if sample else out,
        out,
        slots,
        counts,
        stride_row,
        n_valid,
        vocab_start,
        chunk,
        splits,
        BLOCK=block_size,
        SAMPLE=sample,
        SPLIT=splits > 1,
        OUT_IDS=return_ids,
        SALT=salt,
        ALIGNED=vocab_start % 4 == 0 or not sample,  # greedy launches: one variant
        WIDE_MUL=bool(_SAMPLED_WIDE_MUL if wide_mul is None else wide_mul) and sample,
        BF16_WORDS=sample and _bf16_words(shard_logits),
        num_warps=num_warps,
    )
    return out


def shard_select_keys_reference(
    shard_logits: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    temperatures: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    *,
    salt: int = TARGET_SALT,
    return_ids: bool = False,
) -> torch.Tensor:
    """Eager twin of :func:`shard_select_keys` (``[R, V_local]`` -> ``[R]`` int64).

    Bit-identical for greedy rows, and for sampled rows under the Triton interpreter (the same fp32 ops,
    numpy's ``log2`` on both sides). On GPU the kernel's ``tl.log2`` is the device approximation: sampled
    ids agree except, rarely, at a float near-tie of the scores.
    """
    _validate(shard_logits, vocab_start, vocab_size, temperatures, seeds, offsets, None, torch.int64)
    rows, width = shard_logits.shape
    device = shard_logits.device
    n_valid = max(0, min(width, vocab_size - vocab_start))
    if n_valid == 0 or rows == 0:
        keys = torch.full((rows,), EMPTY_KEY, dtype=torch.int64, device=device)
    else:
        x = shard_logits[:, :n_valid].float()
        if temperatures is not None:
            x = keyed_gumbel_scores_torch(x, temperatures, seeds, offsets, vocab_start, salt)
        ords = ordered_i32_torch(x).to(torch.int64)
        best = ords.max(dim=1).values
        col = (ords == best[:, None]).to(torch.uint8).argmax(dim=1)
        keys = pack_key_torch(best.to(torch.int32), col + vocab_start)
    return key_to_id_torch(keys) if return_ids else keys
