"""The DSpark Markov chain's per-step kernels: the one-launch fused step (``mode="fused"``), the exact
mode's resolve and select kernels, the Triton helpers both share, and the eager twin of one step.

The chain itself (workspace, stepping, exchange) is orchestrated by
:mod:`tensorrt_llm_ext.speculative.markov_chain`.

Fused step
----------

Per block position ``k`` one launch over a grid (row-tile groups, persistent column programs). Every
program owns all the row tiles (``BLOCK_B = 16`` rows each) of its group -- the whole batch up to
``16 * row_tiles`` rows, so ``markov_w2`` is read ONCE per step at any such B (the measured default,
:data:`FUSED_SCHEDULES`, is ``row_tiles = 1``: each 16-row group streams it again) -- and a
strided set of ``BLOCK_N``-column tiles. A program

1. resolves its rows' previous tokens: the anchor at ``k == 0``, else the id of the row's selection key
   of step ``k-1`` (already reduced over programs by the previous launch's atomics and, on a vocab shard,
   all-reduced over ranks by the pair exchange);
2. per column tile, loads the ``markov_w2`` tile once and, for every row tile, computes the bias in-kernel
   (``bias[b, n] = sum_r w1[prev_b, r] * w2[n, r]``, the whole ``r`` in one fp32-accumulating
   ``16 x r @ r x BLOCK_N`` dot), so no bias tensor touches HBM;
3. rounds the bias to the weights dtype (what ``F.linear`` would return) then to the logits dtype, adds the
   base logits, rounds to the logits dtype, stores the biased tile, keeps a running best key per row and
   finally folds it into the row's step key with one int64 atomic MAX per (program, row).

Two row-tile schedules (constexpr ``H_ONCE``, from the per-B row of :data:`FUSED_SCHEDULES` or ``config=``):

* ``H_ONCE``: the row-tile loop is unrolled; each row tile's ``w1`` rows are gathered once per program
  and stay in registers, and so does each tile's running best (a tuple with one ``[BLOCK_B]`` entry per
  row tile, each in the layout the tile's reduction produced: no layout conversion, no padding). The
  ``w1`` rows are the dot's A operand, replicated in every warp (64 registers per row tile at r = 256 and
  4 warps), so this holds at most :data:`H_ONCE_MAX_ROW_TILES` row tiles.
* otherwise a runtime row-tile loop inside the column loop re-resolves each tile's previous tokens and
  re-gathers its ``w1`` rows per column tile (L1/L2 hits: the whole batch's rows are ``B * r * 2`` bytes)
  and keeps the running best of all row tiles in one ``[ROW_TILES, BLOCK_B]`` register tensor
  (``ROW_TILES`` a power of two >= the group's row tiles) updated with ``tl.where`` per row tile: only
  that tensor is live across the column loop, so register use does not grow with B (an unrolled loop
  spilled at 4+ row tiles: the compiler hoisted the re-gathers).

Both keep the per-program atomics at one per row: per-tile atomics on the same addresses would serialise
on the step key. A batch of more than ``16 * row_tiles`` rows is split into balanced groups of row tiles
(grid axis 0), each group streaming ``markov_w2`` once.

Column order. With ``order="alternate"`` (the default) odd steps scan the column tiles backwards: a
forward step reads its highest tiles last, and those are still in L2 when the next step starts with them.
No value depends on the order: ``combine_best`` and ``block_best`` take the lexicographic maximum of
``(ordered key, -column)`` -- a total order, so the combine is associative and commutative with ties to
the lowest id -- and the atomic MAX of packed keys is the same maximum across programs. Cache hints
(``FusedConfig.cache_hints``: ``evict_last`` on ``markov_w2`` / ``w1`` loads, ``evict_first`` on the
streamed base logits) are schedule-only too; the interpreter ignores them.

Exactness across vocab shards, batch sizes and schedules: the bias of column ``n`` for row ``b`` depends
only on ``w1[prev_b]`` and ``w2[n]``: every tile runs the same instruction sequence over the same shapes
(``BLOCK_B x r @ r x BLOCK_N``; on sm90 one chain of ``mma.sync m16n8k16`` over ``r`` per output element
at every ``BLOCK_N`` and warp count -- a 16-row tile is below wgmma's 64), independent of ``B``, of the
shard width, of the number of programs, of the row-tile schedule and of the column's position in its
tile. Hence a shard's columns are bitwise the columns of the TP-1 run, and a row's result does not depend
on the other rows. ``BLOCK_B`` is fixed (:data:`FUSED_BLOCK_B`); the GPU tests check every schedule of
the table and of ``bench markov`` bit for bit.

Step keys live in a ring of three ``[B]`` slots (``keys[3, max_B]``): launch ``k`` reads slot
``(k-1) % 3``, MAX-es into slot ``k % 3`` and resets slot ``(k+1) % 3`` to ``EMPTY_KEY`` (nobody touches it
during launch ``k``). Slot 0 must be ``EMPTY_KEY`` when a chain starts: the chain's finishing launch
re-establishes that for the next chain.

Interpreter: ``tl.dot`` on bf16 is wrong there, so ``DOT_FP32`` computes the dot as an fp32 broadcast
product summed over r (position-independent too). GPU: ``tl.dot`` on the weights dtype (bf16 tensor
cores; fp32 weights with ``input_precision="ieee"``, never TF32).

Exact mode
----------

The bias is the GEMM ``F.linear`` runs (launched by the chain); these kernels sit around it. Resolve: one
program per row turns the anchor or the step key into the previous token and gathers its ``w1`` row.
Select: grid ``(B, V_local / SELECT_BLOCK)``, add + store + one key MAX per program. Without an exchange
the select launch also resolves the next step: per row, each program counts itself after its key MAX
(acquire-release atomic) and the row's last program reads the finished key, records the token, gathers
``w1[token]`` for the next GEMM and clears the ring slot the next launch uses (the whole ring at the last
step). No program ever waits for another, so the interpreter's one-after-another order is fine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import check_int, num_warps_for
from tensorrt_llm_ext.kernels.ordered_key import (block_best, combine_best, gumbel_noise, gumbel_noise_torch, key_to_id,
                                                  ordered_i32, pack_key, shard_argmax_key_reference)

# Weights dtype codes (constexpr W_KIND): how the fp32 accumulator is rounded to F.linear's output dtype.
W_FP32, W_BF16, W_FP16 = 0, 1, 2


# ----------------------------------------------------------------------------------------------------
# Shared Triton helpers (also used by the exact mode's select kernel)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def round_bf16(x):
    """fp32 -> fp32 holding the bf16 round-to-nearest-even value (torch's cast; NaN -> canonical NaN).

    Integer ops so the interpreter (whose bf16 store truncates) and the GPU agree; the result is exactly
    representable in bf16, so a later ``.to(tl.bfloat16)`` store is exact on both.
    """
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    y = rounded.to(tl.float32, bitcast=True)
    return tl.where(x != x, float("nan"), y)


@triton.jit
def bias_to_logits(acc, W_KIND: tl.constexpr, OUT_BF16: tl.constexpr):
    """fp32 accumulator -> F.linear's output dtype -> logits dtype, returned as fp32."""
    if W_KIND == 1:
        acc = round_bf16(acc)
    elif W_KIND == 2:
        acc = acc.to(tl.float16).to(tl.float32)  # fp16 casts round to nearest even on GPU and interpreter
    if OUT_BF16:
        acc = round_bf16(acc)
    return acc


@triton.jit
def add_in_logits_dtype(base, bias, OUT_BF16: tl.constexpr):
    """``base + bias`` as torch computes it in the logits dtype (fp32 add, one RNE rounding for bf16)."""
    s = base + bias
    if OUT_BF16:
        s = round_bf16(s)
    return s


@triton.jit
def selection_score(s, gid, temp, seed, offset, SAMPLE: tl.constexpr, SALT: tl.constexpr):
    """Greedy: the biased logit. Keyed Gumbel-max rows (temp > 0): ``s / temp + G(seed, offset, gid)``."""
    if SAMPLE:
        g = gumbel_noise(seed, offset, gid, SALT)
        t = tl.where(temp > 0, temp, 1.0)
        noisy = tl.math.div_rn(s, t) + g
        s = tl.where(temp > 0, noisy, s)
    return s


# ----------------------------------------------------------------------------------------------------
# Fused step kernel
# ----------------------------------------------------------------------------------------------------
FUSED_BLOCK_B = 16  # rows per tl.dot: part of the bitwise contract (module docs), never a knob
ORDERS = ("alternate", "same")


@triton.jit
def _gather_w1_rows(w1_ptr, psafe, pvalid, rr, stride_w1, R: tl.constexpr, DOT_FP32: tl.constexpr,
                    EVICT: tl.constexpr):
    """``[BLOCK_B, BLOCK_R]`` rows ``w1[psafe]`` (zero rows where ``pvalid`` is false; fp32 for ``DOT_FP32``)."""
    h = tl.load(w1_ptr + psafe[:, None] * stride_w1 + rr[None, :], mask=pvalid[:, None] & (rr[None, :] < R),
                other=0.0, eviction_policy=EVICT)
    if DOT_FP32:
        h = h.to(tl.float32)
    return h


@triton.jit
def _resolve_rows(anchors_ptr, keys_ptr, rows64, rmask, prev_slot, stride_slot, vocab_size, IS_FIRST: tl.constexpr):
    """Rows' previous tokens (the anchor at k = 0, else the id of step k-1's exchanged key) and the safe
    gather index: invalid ids (padding/dummy anchors) gather a zero w1 row, never out of bounds."""
    if IS_FIRST:
        prev = tl.load(anchors_ptr + rows64, mask=rmask, other=-1).to(tl.int64)
    else:
        prev = key_to_id(tl.load(keys_ptr + prev_slot * stride_slot + rows64, mask=rmask,
                                 other=-9223372036854775808))
    pvalid = rmask & (prev >= 0) & (prev < vocab_size)
    return prev, tl.where(pvalid, prev, 0), pvalid


@triton.jit
def _record_rows(keys_ptr, tokens_ptr, rows64, rmask, prev, k, next_slot, stride_slot, stride_tok,
                 IS_FIRST: tl.constexpr, BLOCK_B: tl.constexpr):
    """Column program 0's bookkeeping: record step k-1's token, clear the slot launch k+1 will MAX into."""
    if not IS_FIRST:
        tl.store(tokens_ptr + rows64 * stride_tok + (k - 1), prev, mask=rmask)
    tl.store(keys_ptr + next_slot * stride_slot + rows64, tl.full([BLOCK_B], -9223372036854775808, tl.int64),
             mask=rmask)


@triton.jit
def _fused_tile(h, w, base_ptr, out_ptr, rows64, rmask, cols, cols64, cmask, col_ok, gid, k,
                stride_bb, stride_bk, stride_ob, stride_ok, temp, seed, off,
                SAMPLE: tl.constexpr, SALT: tl.constexpr, W_KIND: tl.constexpr, OUT_BF16: tl.constexpr,
                DOT_FP32: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BASE_EVICT: tl.constexpr):
    """One ``BLOCK_B x BLOCK_N`` output tile: bias dot, roundings, add, store; returns the tile's best
    ``(ordered key, local column)`` per row.

    ``h [BLOCK_B, BLOCK_R]``, ``w [BLOCK_N, BLOCK_R]`` (both fp32 with ``DOT_FP32``): the same instruction
    sequence for every tile of every batch, shard and program -- the bitwise contract.
    """
    m2 = rmask[:, None] & cmask[None, :]
    base = tl.load(base_ptr + rows64[:, None] * stride_bb + k * stride_bk + cols64[None, :], mask=m2, other=0.0,
                   eviction_policy=BASE_EVICT)
    if DOT_FP32:
        acc = tl.sum(h[:, None, :] * w[None, :, :], axis=2)
    elif W_KIND == 0:
        acc = tl.dot(h, tl.trans(w), input_precision="ieee")
    else:
        acc = tl.dot(h, tl.trans(w))
    bias = bias_to_logits(acc, W_KIND, OUT_BF16)
    s = add_in_logits_dtype(base.to(tl.float32), bias, OUT_BF16)
    tl.store(out_ptr + rows64[:, None] * stride_ob + k * stride_ok + cols64[None, :], s.to(out_ptr.dtype.element_ty),
             mask=m2)
    if SAMPLE:
        zeros = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.int64)
        s = selection_score(s, gid[None, :] + zeros, temp[:, None], seed[:, None] + zeros, off[:, None] + zeros,
                            SAMPLE, SALT)
    # Padded shard columns (gid >= V) never win.
    return block_best(ordered_i32(s), cols[None, :] + tl.zeros([BLOCK_B, BLOCK_N], tl.int32),
                      rmask[:, None] & col_ok[None, :], 1)


@triton.jit(do_not_specialize=["B", "k", "vocab_start", "prev_slot", "cur_slot", "next_slot", "offset_k",
                             "n_tiles", "n_progs", "reverse", "group_tiles"])
def _markov_fused_step_kernel(
    base_ptr, w1_ptr, w2_ptr, out_ptr, anchors_ptr, keys_ptr, tokens_ptr,
    temps_ptr, seeds_ptr, offsets_ptr,
    B, v_local, vocab_start, vocab_size, k, prev_slot, cur_slot, next_slot, offset_k, n_tiles, n_progs, reverse,
    group_tiles,
    stride_bb, stride_bk, stride_ob, stride_ok, stride_w1, stride_w2, stride_slot, stride_tok,
    R: tl.constexpr, IS_FIRST: tl.constexpr, SAMPLE: tl.constexpr, SALT: tl.constexpr,
    W_KIND: tl.constexpr, OUT_BF16: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ROW_TILES: tl.constexpr, H_ONCE: tl.constexpr, W_EVICT: tl.constexpr, BASE_EVICT: tl.constexpr,
):
    # Grid (row-tile groups, persistent column programs). A program owns `group_tiles` row tiles of
    # BLOCK_B rows and streams its column tiles; each w2 tile is loaded once and applied to every row tile.
    #   H_ONCE: the row-tile loop is unrolled (ROW_TILES = group_tiles): each tile's previous tokens and
    #     w1 rows are gathered once, before the column loop, and with the running best kept in tuples of
    #     registers (one entry per row tile, in the layout its producer gave it).
    #   else: a runtime row-tile loop inside the column loop (ROW_TILES = a power of two >= group_tiles)
    #     re-resolves each tile's previous tokens and re-gathers its w1 rows per column tile (L1/L2 hits:
    #     B*r*2 bytes in all), and keeps the running best in one [ROW_TILES, BLOCK_B] register tensor,
    #     updated with tl.where; nothing per row tile stays live across the column loop but that tensor.
    # Either way one atomic MAX per (program, row) at the end.
    pid_g = tl.program_id(0)
    pid_n = tl.program_id(1)
    rr = tl.arange(0, BLOCK_R)
    first_row = pid_g * group_tiles * BLOCK_B
    if H_ONCE:
        hs = ()
        temps = ()
        seeds = ()
        offs = ()
        best_ks = ()
        best_cs = ()
        for i in tl.static_range(ROW_TILES):
            rows = first_row + i * BLOCK_B + tl.arange(0, BLOCK_B)
            rmask = rows < B
            rows64 = rows.to(tl.int64)
            prev, psafe, pvalid = _resolve_rows(anchors_ptr, keys_ptr, rows64, rmask, prev_slot, stride_slot,
                                                vocab_size, IS_FIRST)
            _record_rows(keys_ptr, tokens_ptr, rows64, rmask & (pid_n == 0), prev, k, next_slot, stride_slot,
                         stride_tok, IS_FIRST, BLOCK_B)
            hs = hs + (_gather_w1_rows(w1_ptr, psafe, pvalid, rr, stride_w1, R, DOT_FP32, W_EVICT),)
            if SAMPLE:
                temps = temps + (tl.load(temps_ptr + rows64, mask=rmask, other=0.0),)
                seeds = seeds + (tl.load(seeds_ptr + rows64, mask=rmask, other=0),)
                offs = offs + (tl.load(offsets_ptr + rows64, mask=rmask, other=0) + offset_k,)
            best_ks = best_ks + (tl.full([BLOCK_B], -2147483648, tl.int32),)
            best_cs = best_cs + (tl.full([BLOCK_B], 2147483647, tl.int32),)
    else:
        tiles_here = tl.minimum(group_tiles, tl.cdiv(B - first_row, BLOCK_B))
        if pid_n == 0:
            for i in range(0, tiles_here):
                rows = first_row + i * BLOCK_B + tl.arange(0, BLOCK_B)
                rmask = rows < B
                rows64 = rows.to(tl.int64)
                prev, psafe, pvalid = _resolve_rows(anchors_ptr, keys_ptr, rows64, rmask, prev_slot, stride_slot,
                                                    vocab_size, IS_FIRST)
                _record_rows(keys_ptr, tokens_ptr, rows64, rmask, prev, k, next_slot, stride_slot, stride_tok,
                             IS_FIRST, BLOCK_B)
        ti = tl.arange(0, ROW_TILES)
        best_k2 = tl.full([ROW_TILES, BLOCK_B], -2147483648, tl.int32)
        best_c2 = tl.full([ROW_TILES, BLOCK_B], 2147483647, tl.int32)

    for t in range(pid_n, n_tiles, n_progs):
        # reverse = 1 scans the tiles from the end: what the previous step read last (its final round of
        # tiles, still in L2) is read first. No value depends on the order (combine_best is a max).
        tt = t + reverse * (n_tiles - 1 - 2 * t)
        cols = tt * BLOCK_N + tl.arange(0, BLOCK_N)  # int32 local column ids
        cmask = cols < v_local
        cols64 = cols.to(tl.int64)
        gid = cols64 + vocab_start
        col_ok = cmask & (gid < vocab_size)
        w = tl.load(w2_ptr + cols64[:, None] * stride_w2 + rr[None, :], mask=cmask[:, None] & (rr[None, :] < R),
                    other=0.0, eviction_policy=W_EVICT)  # [BLOCK_N, BLOCK_R]: loaded once for every row tile
        if DOT_FP32:
            w = w.to(tl.float32)
        if H_ONCE:
            for i in tl.static_range(ROW_TILES):
                rows = first_row + i * BLOCK_B + tl.arange(0, BLOCK_B)
                if SAMPLE:
                    temp, seed, off = temps[i], seeds[i], offs[i]
                else:
                    temp, seed, off = 0.0, 0, 0
                tk, tc = _fused_tile(hs[i], w, base_ptr, out_ptr, rows.to(tl.int64), rows < B, cols, cols64, cmask,
                                     col_ok, gid, k, stride_bb, stride_bk, stride_ob, stride_ok, temp, seed, off,
                                     SAMPLE, SALT, W_KIND, OUT_BF16, DOT_FP32, BLOCK_B, BLOCK_N, BASE_EVICT)
                bk, bc = combine_best(best_ks[i], best_cs[i], tk, tc)
                best_ks = best_ks[:i] + (bk,) + best_ks[i + 1:]
                best_cs = best_cs[:i] + (bc,) + best_cs[i + 1:]
        else:
            for i in range(0, tiles_here):
                rows = first_row + i * BLOCK_B + tl.arange(0, BLOCK_B)
                rmask = rows < B
                rows64 = rows.to(tl.int64)
                prev, psafe, pvalid = _resolve_rows(anchors_ptr, keys_ptr, rows64, rmask, prev_slot, stride_slot,
                                                    vocab_size, IS_FIRST)
                h = _gather_w1_rows(w1_ptr, psafe, pvalid, rr, stride_w1, R, DOT_FP32, W_EVICT)
                if SAMPLE:
                    temp = tl.load(temps_ptr + rows64, mask=rmask, other=0.0)
                    seed = tl.load(seeds_ptr + rows64, mask=rmask, other=0)
                    off = tl.load(offsets_ptr + rows64, mask=rmask, other=0) + offset_k
                else:
                    temp, seed, off = 0.0, 0, 0
                tk, tc = _fused_tile(h, w, base_ptr, out_ptr, rows64, rmask, cols, cols64, cmask, col_ok, gid, k,
                                     stride_bb, stride_bk, stride_ob, stride_ok, temp, seed, off,
                                     SAMPLE, SALT, W_KIND, OUT_BF16, DOT_FP32, BLOCK_B, BLOCK_N, BASE_EVICT)
                nk, nc = combine_best(best_k2, best_c2, tk[None, :], tc[None, :])
                sel = ti[:, None] == i
                best_k2 = tl.where(sel, nk, best_k2)
                best_c2 = tl.where(sel, nc, best_c2)

    # One atomic MAX per (program, row): the step key is the max over programs (and, after the
    # exchange, over ranks), whatever order the programs finish in.
    if H_ONCE:
        for i in tl.static_range(ROW_TILES):
            rows = first_row + i * BLOCK_B + tl.arange(0, BLOCK_B)
            keys = pack_key(best_ks[i], best_cs[i].to(tl.int64) + vocab_start)
            tl.atomic_max(keys_ptr + cur_slot * stride_slot + rows.to(tl.int64), keys, mask=rows < B)
    else:
        rows2 = first_row + ti[:, None] * BLOCK_B + tl.arange(0, BLOCK_B)[None, :]
        keys2 = pack_key(best_k2, best_c2.to(tl.int64) + vocab_start)
        tl.atomic_max(keys_ptr + cur_slot * stride_slot + rows2.to(tl.int64), keys2,
                      mask=(rows2 < B) & (ti[:, None] < tiles_here))


H_ONCE_MAX_ROW_TILES = 2  # w1 rows kept in registers for at most this many row tiles (r = 256: 255 regs, no spill)


@dataclass(frozen=True)
class FusedConfig:
    """Schedule of the fused step. No field changes a value (module docs): each only decides which
    program computes which tiles, in which order, with which pipeline depth.

    ``block_n``: columns per tile (``16 x r @ r x block_n`` per dot); ``num_warps`` / ``num_stages``:
    Triton launch settings; ``programs``: persistent column programs in all (divided among the row-tile
    groups); ``row_tiles``: the most 16-row tiles one program applies each ``markov_w2`` tile to -- a
    batch of more than ``16 * row_tiles`` rows is split into balanced groups (grid axis 0), each
    streaming ``markov_w2`` once; ``h_once``: gather each row tile's ``w1`` rows once per program and keep
    them in registers (at most :data:`H_ONCE_MAX_ROW_TILES` row tiles), else re-gather them per column
    tile from L1/L2; ``cache_hints``: ``evict_last`` on the ``markov_w2`` / ``w1`` loads and
    ``evict_first`` on the streamed base-logit loads.
    """

    block_n: int
    num_warps: int
    num_stages: int
    programs: int
    row_tiles: int
    h_once: bool
    cache_hints: bool = False

    def __post_init__(self):
        for name, v in (("block_n", self.block_n), ("num_warps", self.num_warps), ("num_stages", self.num_stages),
                        ("programs", self.programs), ("row_tiles", self.row_tiles)):
            check_int(f"FusedConfig.{name}", v, lo=1)
        if self.block_n & (self.block_n - 1) or self.block_n < 16:
            raise ValueError(f"FusedConfig.block_n: expected a power of two >= 16, got {self.block_n}")
        if self.h_once and self.row_tiles > H_ONCE_MAX_ROW_TILES:
            raise ValueError(f"FusedConfig: h_once keeps w1 rows in registers for at most {H_ONCE_MAX_ROW_TILES} "
                             f"row tiles, got row_tiles={self.row_tiles}")

    def describe(self) -> str:
        return (f"n{self.block_n}/w{self.num_warps}/s{self.num_stages}/p{self.programs}/rt{self.row_tiles}/"
                f"{'h1' if self.h_once else 'hN'}{'/ch' if self.cache_hints else ''}")


@dataclass(frozen=True)
class FusedSchedule:
    """One row of the per-B schedule table; ``programs_per_sm`` times the SM count gives ``programs``."""

    max_batch: int | None  # inclusive upper bound of the batch sizes this row covers; None: every larger B
    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    row_tiles: int
    h_once: bool
    cache_hints: bool = False

    def config(self, sms: int) -> FusedConfig:
        return FusedConfig(block_n=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages,
                           programs=self.programs_per_sm * sms, row_tiles=self.row_tiles, h_once=self.h_once,
                           cache_hints=self.cache_hints)


# Per-B schedule of the fused step on CUDA (the first row whose max_batch >= B). Measured on the H200
# (2026-12-01, `trtllm-ext bench markov`, V = 200064, r = 256, K = 7, bf16; docs/markov_chain.md): one
# row tile per group -- every 16 rows stream markov_w2 again, over 4 programs per SM shared by the groups
# -- beat every one-pass schedule at every B: reading the weight once per step and looping over 2-8 row
# tiles inside each program took 436-477 us at B = 32 (vs ~300-330), 707 at 64 (vs ~540) and 1233 at
# 128 (vs ~1030): the in-program row loop serialises what separate groups run in parallel, and at B >= 64
# the step is then bound by the dots (mma.sync, 16-row tiles), not by the weight's bytes.
FUSED_SCHEDULES: tuple[FusedSchedule, ...] = (
    FusedSchedule(None, block_n=64, num_warps=4, num_stages=2, programs_per_sm=4, row_tiles=1, h_once=True),
)
# The interpreter runs programs one after another: few programs, one stage (timing is meaningless there).
INTERPRET_SCHEDULES: tuple[FusedSchedule, ...] = (
    FusedSchedule(16, block_n=64, num_warps=4, num_stages=1, programs_per_sm=3, row_tiles=1, h_once=True),
    FusedSchedule(None, block_n=64, num_warps=4, num_stages=1, programs_per_sm=3, row_tiles=4, h_once=False),
)


def fused_schedule(batch_size: int, schedules: tuple[FusedSchedule, ...] = FUSED_SCHEDULES) -> FusedSchedule:
    """The row of ``schedules`` that covers ``batch_size`` (the last row covers every larger B)."""
    for s in schedules:
        if s.max_batch is None or batch_size <= s.max_batch:
            return s
    return schedules[-1]


def fused_config(r: int, interpret: bool, device=None, batch_size: int = 1) -> FusedConfig:
    """The fused step's schedule for ``batch_size`` rows of Markov rank ``r`` (:data:`FUSED_SCHEDULES`;
    the interpreter: :data:`INTERPRET_SCHEDULES`, one "SM").

    ``r`` picks nothing today (the whole ``r`` is one dot); it stays in the signature because a schedule
    measured at r = 256 need not suit another rank.
    """
    if interpret:
        return fused_schedule(batch_size, INTERPRET_SCHEDULES).config(1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return fused_schedule(batch_size).config(sms)


def fused_grid(batch_size: int, v_local: int, config: FusedConfig) -> tuple[int, int, int, int]:
    """``(groups, row_tiles per group, column programs, column tiles)`` of a fused launch."""
    row_tiles = triton.cdiv(batch_size, FUSED_BLOCK_B)
    groups = triton.cdiv(row_tiles, config.row_tiles)
    per_group = triton.cdiv(row_tiles, groups)  # balanced groups: the last one is never mostly empty
    n_tiles = triton.cdiv(v_local, config.block_n)
    n_progs = max(1, min(n_tiles, triton.cdiv(config.programs, groups)))
    return groups, per_group, n_progs, n_tiles


def launch_fused_step(
    base, w1, w2, out, anchors, keys, tokens, temps, seeds, offsets, *,
    vocab_start: int, vocab_size: int, k: int, offset_k: int, salt: int, w_kind: int, out_bf16: bool,
    config: FusedConfig, interpret: bool, order: str = "alternate",
) -> None:
    """Launch step ``k`` of the fused chain (internal; validated by the caller). CUDA-graph safe.

    ``order="alternate"`` scans the column tiles backwards at odd ``k`` (L2 reuse across steps);
    ``"same"`` scans every step forwards. Both give the same values, bit for bit.
    """
    B, _, v_local = base.shape
    r = w1.shape[1]
    sample = temps is not None
    groups, per_group, n_progs, n_tiles = fused_grid(B, v_local, config)
    reverse = 1 if order == "alternate" and k % 2 == 1 else 0
    _markov_fused_step_kernel[(groups, n_progs)](
        base, w1, w2, out, anchors, keys, tokens,
        temps if sample else base, seeds if sample else anchors, offsets if sample else anchors,
        B, v_local, vocab_start, vocab_size, k, (k - 1) % 3, k % 3, (k + 1) % 3, offset_k, n_tiles, n_progs, reverse,
        per_group,
        base.stride(0), base.stride(1), out.stride(0), out.stride(1), w1.stride(0), w2.stride(0),
        keys.stride(0), tokens.stride(0),
        R=r, IS_FIRST=k == 0, SAMPLE=sample, SALT=salt, W_KIND=w_kind, OUT_BF16=out_bf16,
        DOT_FP32=interpret, BLOCK_B=FUSED_BLOCK_B, BLOCK_N=config.block_n,
        BLOCK_R=max(16, triton.next_power_of_2(r)), H_ONCE=config.h_once,
        ROW_TILES=per_group if config.h_once else triton.next_power_of_2(per_group),
        W_EVICT="evict_last" if config.cache_hints else "", BASE_EVICT="evict_first" if config.cache_hints else "",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


# ----------------------------------------------------------------------------------------------------
# Exact mode: resolve (previous token + w1 gather) and select (add + store + key) kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["k", "read_slot", "reset_slot"])
def _markov_resolve_kernel(
    anchors_ptr, keys_ptr, w1_ptr, h_ptr, tokens_ptr, counts_ptr,
    k, read_slot, reset_slot, vocab_size, r, stride_slot, stride_w1, stride_h, stride_tok,
    FROM_ANCHOR: tl.constexpr, GATHER: tl.constexpr, RESET: tl.constexpr, CLEAR_COUNTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program per row: previous token (anchor or step key) -> token record, key reset, w1 gather."""
    b = tl.program_id(0).to(tl.int64)
    one = tl.arange(0, 1)
    if FROM_ANCHOR:
        prev = tl.load(anchors_ptr + b + one).to(tl.int64)
    else:
        prev = key_to_id(tl.load(keys_ptr + read_slot * stride_slot + b + one))
        tl.store(tokens_ptr + b * stride_tok + (k - 1) + one, prev)
    if RESET:
        tl.store(keys_ptr + reset_slot * stride_slot + b + one, tl.full([1], -9223372036854775808, tl.int64))
    if CLEAR_COUNTS:
        # The folded chain's start: a counter left non-zero (a workspace someone scribbled on) would stop
        # the row's last program from ever being recognised; restoring 0 here makes every chain self-clean.
        tl.store(counts_ptr + b + one, tl.zeros([1], tl.int32))
    if GATHER:
        rr = tl.arange(0, BLOCK_R)
        valid = (prev >= 0) & (prev < vocab_size)  # [1]
        safe = tl.where(valid, prev, 0)
        row = tl.load(w1_ptr + safe * stride_w1 + rr, mask=(rr < r) & valid, other=0.0)
        tl.store(h_ptr + b * stride_h + rr, row, mask=rr < r)


@triton.jit(do_not_specialize=["k", "vocab_start", "cur_slot", "next_slot", "n_col_progs"])
def _markov_select_kernel(
    base_ptr, bias_ptr, out_ptr, keys_ptr, temps_ptr, seeds_ptr, offsets_ptr,
    counts_ptr, w1_ptr, h_ptr, tokens_ptr,
    k, v_local, vocab_start, vocab_size, cur_slot, next_slot, n_col_progs, r,
    stride_bb, stride_bk, stride_bias, stride_ob, stride_ok, stride_slot, stride_w1, stride_h, stride_tok,
    SAMPLE: tl.constexpr, SALT: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_V: tl.constexpr,
    FOLD: tl.constexpr, LAST_STEP: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Grid (B, column blocks): biased = base[:, k] + bias (logits dtype), store, MAX the block's key into
    ``keys[cur_slot, b]``. With ``FOLD`` the row's last program also resolves step ``k + 1`` (see
    :func:`launch_exact_select`)."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < v_local
    gid = cols.to(tl.int64) + vocab_start
    base = tl.load(base_ptr + b * stride_bb + k * stride_bk + cols, mask=cmask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + b * stride_bias + cols, mask=cmask, other=0.0).to(tl.float32)
    s = add_in_logits_dtype(base, bias_to_logits(bias, 0, OUT_BF16), OUT_BF16)
    tl.store(out_ptr + b * stride_ob + k * stride_ok + cols, s.to(out_ptr.dtype.element_ty), mask=cmask)
    if SAMPLE:
        temp = tl.load(temps_ptr + b)
        seed = tl.load(seeds_ptr + b)
        off = tl.load(offsets_ptr + b) + k
        zeros = tl.zeros([BLOCK_V], dtype=tl.int64)
        s = selection_score(s, gid, temp, seed + zeros, off + zeros, SAMPLE, SALT)
    best, col = block_best(ordered_i32(s), cols, cmask & (gid < vocab_size), 0)
    key_ptr = keys_ptr + cur_slot * stride_slot + b
    tl.atomic_max(key_ptr, pack_key(best, col.to(tl.int64) + vocab_start))
    if FOLD:
        # "Last program done": the key MAX precedes this program's count (the CTA barrier orders whichever
        # thread issued it before the counting thread; the count's release half publishes it), and the
        # program that takes the count to n_col_progs - 1 acquires every earlier count, hence every key MAX.
        tl.debug_barrier()
        done = tl.atomic_add(counts_ptr + b, 1, sem="acq_rel", scope="gpu")
        if done == n_col_progs - 1:
            # Read the finished key with an atomic (served by L2, never a stale L1 line); MAX with
            # EMPTY_KEY changes nothing.
            final = tl.atomic_max(key_ptr, -9223372036854775808, sem="acquire", scope="gpu")
            prev = key_to_id(final)
            tl.store(tokens_ptr + b * stride_tok + k, prev)
            tl.store(counts_ptr + b, 0)  # the next launch counts from zero (kernel boundary orders it)
            empty = tl.full([], -9223372036854775808, tl.int64)
            if LAST_STEP:
                # Every contribution is in (the count says so): clear the row's whole ring, so the next
                # chain -- exact or fused, which starts on slot 0 -- finds it clean.
                tl.store(keys_ptr + b, empty)
                tl.store(keys_ptr + stride_slot + b, empty)
                tl.store(keys_ptr + 2 * stride_slot + b, empty)
            else:
                # The slot step k + 1 MAX-es into: nobody touches it in this launch (the ring's point).
                tl.store(keys_ptr + next_slot * stride_slot + b, empty)
                rr = tl.arange(0, BLOCK_R)
                valid = (prev >= 0) & (prev < vocab_size)
                safe = tl.where(valid, prev, 0)
                row = tl.load(w1_ptr + safe * stride_w1 + rr, mask=(rr < r) & valid, other=0.0)
                tl.store(h_ptr + b * stride_h + rr, row, mask=rr < r)


SELECT_BLOCK = 2048  # columns per program of the exact mode's select kernel (measured on an H200)


def launch_exact_resolve(anchors, keys, w1, h, tokens, *, k: int, read_slot: int, reset_slot: int,
                         vocab_size: int, gather: bool, counts=None) -> None:
    """Resolve step ``k``'s previous tokens (anchor at ``k == 0``, else the ids of ``keys[read_slot]``), record
    them in ``tokens[:, k-1]``, reset ``keys[reset_slot]`` and, with ``gather``, copy their ``w1`` rows into
    ``h [B, r]`` (zero rows for invalid ids). With ``counts`` (``[>= B]`` int32, the folded select's per-row
    counters) also zero them. Internal (validated by the chain). CUDA-graph safe."""
    B = tokens.shape[0]
    r = w1.shape[1] if gather else 1
    _markov_resolve_kernel[(B,)](
        anchors, keys, w1, h if gather else w1, tokens, tokens if counts is None else counts,
        k, read_slot, reset_slot, vocab_size, r,
        keys.stride(0), w1.stride(0), h.stride(0) if gather else 0, tokens.stride(0),
        FROM_ANCHOR=k == 0, GATHER=gather, RESET=True, CLEAR_COUNTS=counts is not None,
        BLOCK_R=triton.next_power_of_2(r),
    )


def launch_exact_select(base, bias, out, keys, temps, seeds, offsets, *, k: int, vocab_start: int,
                        vocab_size: int, salt: int, cur_slot: int = 0, fold=None, last_step: bool = False) -> None:
    """``out[:, k] = base[:, k] + bias`` (logits dtype) and each row's best key MAX-ed into
    ``keys[cur_slot, :B]`` (``keys`` is the ``[3, max_B]`` ring).

    ``fold=(counts, w1, h, tokens)`` (only when no exchange follows: the keys are final when the launch
    ends) folds the next step's resolve in: each program counts itself in ``counts[b]`` after its key MAX;
    the row's last one reads the finished key, records ``tokens[b, k]``, zeroes ``counts[b]`` and either
    clears ``keys[(cur_slot + 1) % 3, b]`` and gathers ``w1[token]`` into ``h[b]`` (the next GEMM's input)
    or, with ``last_step``, clears the row's whole ring. Internal (validated by the chain). CUDA-graph safe.
    """
    B, _, v_local = base.shape
    sample = temps is not None
    n_col = triton.cdiv(v_local, SELECT_BLOCK)
    if fold is None:
        counts, w1, h, tokens = keys, bias, bias, keys  # unused pointers (FOLD=False)
        r, stride_w1, stride_h, stride_tok = 1, 0, 0, 0
    else:
        counts, w1, h, tokens = fold
        r, stride_w1, stride_h, stride_tok = w1.shape[1], w1.stride(0), h.stride(0), tokens.stride(0)
    _markov_select_kernel[(B, n_col)](
        base, bias, out, keys, temps if sample else bias, seeds if sample else keys, offsets if sample else keys,
        counts, w1, h, tokens,
        k, v_local, vocab_start, vocab_size, cur_slot, (cur_slot + 1) % 3, n_col, r,
        base.stride(0), base.stride(1), bias.stride(0), out.stride(0), out.stride(1), keys.stride(0),
        stride_w1, stride_h, stride_tok,
        SAMPLE=sample, SALT=salt, OUT_BF16=base.dtype == torch.bfloat16, BLOCK_V=SELECT_BLOCK,
        FOLD=fold is not None, LAST_STEP=last_step, BLOCK_R=triton.next_power_of_2(r),
        num_warps=num_warps_for(SELECT_BLOCK, elements_per_warp=512),
    )


def markov_step_reference(base_k, prev, markov_w1, markov_w2, *, vocab_start: int, vocab_size: int,
                          temperatures=None, seeds=None, offsets=None, salt: int):
    """Eager twin of one chain step: ``(biased [B, V_local] logits dtype, keys [B] int64)``.

    ``bias = F.linear(w1[prev], w2)`` (a zero row for invalid ``prev``), ``biased = base_k + bias`` in the
    logits dtype, and each row's selection key over this shard (``torch.argmax`` order; keyed Gumbel-max
    at ``offsets`` for rows with ``T > 0``). The stock chain the upstream worker ran, bit for bit.
    """
    valid = (prev >= 0) & (prev < vocab_size)
    h = markov_w1[torch.where(valid, prev, 0)]
    h = torch.where(valid[:, None], h, torch.zeros_like(h))
    bias = F.linear(h, markov_w2).to(base_k.dtype)
    biased = base_k + bias
    score = biased.float()
    if temperatures is not None:
        gid = torch.arange(base_k.shape[1], device=base_k.device, dtype=torch.int64) + vocab_start
        g = gumbel_noise_torch(seeds[:, None], offsets[:, None], gid[None, :], salt)
        t = temperatures[:, None]
        score = torch.where(t > 0, score / torch.where(t > 0, t, torch.ones_like(t)) + g, score)
    return biased, shard_argmax_key_reference(score, vocab_start, vocab_size)
