"""The fused step of the DSpark Markov chain (``mode="fused"``): one launch per block position, bias
computed in-kernel, no bias tensor in HBM.

Grid ``(row tiles, persistent column programs)``: program ``(g, p)`` owns the ``BLOCK_B`` rows of row tile
``g`` and the column tiles ``p, p + n_progs, ...`` (``BLOCK_N`` columns each). It

1. resolves its rows' previous tokens: the anchor at ``k == 0``, else the id of the row's selection key
   of step ``k-1`` (reduced over programs by the previous launch's atomics and, on a vocab shard,
   all-reduced over ranks by the pair exchange), and gathers their ``w1`` rows once (zero rows for
   invalid ids: padding / dummy anchors read nothing out of bounds);
2. per column tile loads the ``markov_w2`` tile and computes the bias ``bias[b, n] = sum_r w1[prev_b, r] *
   w2[n, r]`` as one fp32-accumulating ``BLOCK_B x r @ r x BLOCK_N`` dot (the whole ``r``);
3. rounds the bias to the weights dtype (what ``F.linear`` returns) then to the logits dtype, adds the
   base logits, rounds to the logits dtype, stores the biased tile, keeps a running best key per row and
   finally folds it into the row's step key with one int64 atomic MAX per (program, row).

Every 16 (or 64, :attr:`FusedConfig.block_b`) rows stream ``markov_w2`` again. Measured on the H200
(docs/markov_chain.md), that beat every "one pass per step" schedule (one program applying each weight
tile to all row tiles) at every B: the in-program row loop serialised what separate row tiles run in
parallel, so those schedules were removed.

Column order. With ``order="alternate"`` (the default) odd steps scan the column tiles backwards: a
forward step reads its highest tiles last, and those are still in L2 when the next step starts with them.
No value depends on the order: ``combine_best`` and ``block_best`` take the lexicographic maximum of
``(ordered key, -column)`` -- a total order, so the combine is associative and commutative with ties to
the lowest id -- and the atomic MAX of packed keys is the same maximum across programs. Cache hints
(``FusedConfig.cache_hints``) are schedule-only too; the interpreter ignores them.

Exactness across vocab shards, batch sizes and schedules: the bias of column ``n`` for row ``b`` depends
only on ``w1[prev_b]`` and ``w2[n]``: for a given ``block_b`` every tile runs the same instruction sequence
over the same shapes (``BLOCK_B x r @ r x BLOCK_N``), independent of ``B`` (rows past ``B`` are zero
padding of the tile), of the shard width, of the number of programs and of the column's position in its
tile. Hence a shard's columns are bitwise the columns of the TP-1 run, and a row's result does not depend
on the other rows. ``block_b`` is part of that contract (a 64-row tile lowers to other MMA instructions
than a 16-row one), so it is fixed per schedule table, never chosen by B.

Step keys live in a ring of three ``[B]`` slots (``keys[3, max_B]``): launch ``k`` reads slot
``(k-1) % 3``, MAX-es into slot ``k % 3`` and resets slot ``(k+1) % 3`` to ``EMPTY_KEY`` (nobody touches it
during launch ``k``). Slot 0 must be ``EMPTY_KEY`` when a chain starts: the chain's finishing launch
re-establishes that for the next chain.

Interpreter: ``tl.dot`` on bf16 is wrong there, so ``DOT_FP32`` computes the dot as an fp32 broadcast
product summed over r (position-independent too). GPU: ``tl.dot`` on the weights dtype (bf16 tensor
cores; fp32 weights with ``input_precision="ieee"``, never TF32).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import check_int
from tensorrt_llm_ext.kernels.markov_step import add_in_logits_dtype, bias_to_logits, selection_score
from tensorrt_llm_ext.kernels.ordered_key import (block_best, combine_best, gumbel_scale, key_to_id,
                                                  keyed_gumbel_scores_torch, ordered_i32, pack_key,
                                                  shard_argmax_key_reference)

__all__ = ["BLOCK_B_CHOICES", "FUSED_BLOCK_B", "FUSED_SCHEDULES", "INTERPRET_SCHEDULES", "ORDERS", "FusedConfig",
           "FUSED_SMEM_BYTES", "FusedSchedule", "fit_shared_memory", "fused_config", "fused_grid", "fused_schedule", "markov_fused_step",
           "markov_fused_step_reference"]

FUSED_BLOCK_B = 16  # rows per tl.dot of the default table: part of the bitwise contract (module docs)
BLOCK_B_CHOICES = (16, 64)  # 16: mma.sync m16 tiles; 64: a wgmma-sized tile (rows padded at small B)
ORDERS = ("alternate", "same")


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
def _fused_tile(h, w, base_ptr, out_ptr, rows64, rmask, cols, cols64, cmask, col_ok, tile_gid0, k,
                stride_bb, stride_bk, stride_ob, stride_ok, sampled, scale, seed, off,
                SAMPLE: tl.constexpr, ALIGNED: tl.constexpr, SALT: tl.constexpr, W_KIND: tl.constexpr,
                OUT_BF16: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                BASE_EVICT: tl.constexpr):
    """One ``BLOCK_B x BLOCK_N`` output tile: bias dot, roundings, add, store; returns the tile's best
    ``(ordered key, local column)`` per row.

    ``h [BLOCK_B, BLOCK_R]``, ``w [BLOCK_N, BLOCK_R]`` (both fp32 with ``DOT_FP32``): the same instruction
    sequence for every tile of every batch, shard and program -- the bitwise contract. ``tile_gid0``: the
    global id of the tile's first column.
    """
    m2 = rmask[:, None] & cmask[None, :]
    base = tl.load(base_ptr + rows64[:, None] * stride_bb + k * stride_bk + cols64[None, :], mask=m2, other=0.0,
                   eviction_policy=BASE_EVICT)
    if DOT_FP32:
        acc = tl.sum(h[:, None, :] * w[None, :, :], axis=2)
    elif W_KIND == 0:
        # The select keeps the fp32 dot's result a value of its own: Triton's combine pass rewrites dot(a, b) + c
        # into a dot accumulating onto c, rounding at every partial sum instead of once after F.linear.
        acc = tl.where(m2, tl.dot(h, tl.trans(w), input_precision="ieee"), 0.0)
    else:
        acc = tl.dot(h, tl.trans(w))
    bias = bias_to_logits(acc, W_KIND, OUT_BF16)
    s = add_in_logits_dtype(base.to(tl.float32), bias, OUT_BF16)
    tl.store(out_ptr + rows64[:, None] * stride_ob + k * stride_ok + cols64[None, :], s.to(out_ptr.dtype.element_ty),
             mask=m2)
    if SAMPLE:
        # Runs of four consecutive columns (the tile starts on a multiple of BLOCK_N): one Philox block per run.
        first_gid = (tile_gid0 + 4 * tl.arange(0, BLOCK_N // 4).to(tl.int64))[None, :]
        # The 16-row tile shuffles each run's words to its two lanes (JOIN); the 64-row wgmma tile has no
        # registers left for that and lets both lanes compute the run's block (sm_90: 255 registers and
        # ~240 B of spill with JOIN, 235-239 and none without).
        s = selection_score(s, first_gid, sampled[:, None], scale[:, None], seed[:, None], off[:, None], SAMPLE,
                            ALIGNED, SALT, BLOCK_B == 16)
    # Padded shard columns (gid >= V) never win.
    return block_best(ordered_i32(s), cols[None, :] + tl.zeros([BLOCK_B, BLOCK_N], tl.int32),
                      rmask[:, None] & col_ok[None, :], 1)


@triton.jit(do_not_specialize=["B", "k", "vocab_start", "prev_slot", "cur_slot", "next_slot", "offset_k",
                             "n_tiles", "n_progs", "reverse"])
def _markov_fused_step_kernel(
    base_ptr, w1_ptr, w2_ptr, out_ptr, anchors_ptr, keys_ptr, tokens_ptr,
    temps_ptr, seeds_ptr, offsets_ptr,
    B, v_local, vocab_start, vocab_size, k, prev_slot, cur_slot, next_slot, offset_k, n_tiles, n_progs, reverse,
    stride_bb, stride_bk, stride_ob, stride_ok, stride_w1, stride_w2, stride_slot, stride_tok,
    R: tl.constexpr, IS_FIRST: tl.constexpr, SAMPLE: tl.constexpr, ALIGNED: tl.constexpr, SALT: tl.constexpr,
    W_KIND: tl.constexpr, OUT_BF16: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    W_EVICT: tl.constexpr, BASE_EVICT: tl.constexpr,
):
    pid_g = tl.program_id(0)
    pid_n = tl.program_id(1)
    rr = tl.arange(0, BLOCK_R)
    rows = pid_g * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    prev, psafe, pvalid = _resolve_rows(anchors_ptr, keys_ptr, rows64, rmask, prev_slot, stride_slot, vocab_size,
                                        IS_FIRST)
    if pid_n == 0:
        # Column program 0's bookkeeping: record step k-1's token, clear the slot launch k+1 will MAX into.
        if not IS_FIRST:
            tl.store(tokens_ptr + rows64 * stride_tok + (k - 1), prev, mask=rmask)
        tl.store(keys_ptr + next_slot * stride_slot + rows64, tl.full([BLOCK_B], -9223372036854775808, tl.int64),
                 mask=rmask)
    # The rows' w1 rows: the dot's A operand, gathered once per program and kept in registers.
    h = tl.load(w1_ptr + psafe[:, None] * stride_w1 + rr[None, :], mask=pvalid[:, None] & (rr[None, :] < R),
                other=0.0, eviction_policy=W_EVICT)
    if DOT_FP32:
        h = h.to(tl.float32)
    if SAMPLE:
        temp = tl.load(temps_ptr + rows64, mask=rmask, other=0.0)
        sampled = temp > 0
        scale = gumbel_scale(temp)  # one division per row, not per element
        seed = tl.load(seeds_ptr + rows64, mask=rmask, other=0)
        off = tl.load(offsets_ptr + rows64, mask=rmask, other=0) + offset_k
    else:
        sampled, scale, seed, off = rmask, 0.0, 0, 0
    best_k = tl.full([BLOCK_B], -2147483648, tl.int32)
    best_c = tl.full([BLOCK_B], 2147483647, tl.int32)
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
                    other=0.0, eviction_policy=W_EVICT)  # [BLOCK_N, BLOCK_R]
        if DOT_FP32:
            w = w.to(tl.float32)
        tk, tc = _fused_tile(h, w, base_ptr, out_ptr, rows64, rmask, cols, cols64, cmask, col_ok,
                             tt.to(tl.int64) * BLOCK_N + vocab_start, k,
                             stride_bb, stride_bk, stride_ob, stride_ok, sampled, scale, seed, off,
                             SAMPLE, ALIGNED, SALT, W_KIND, OUT_BF16, DOT_FP32, BLOCK_B, BLOCK_N, BASE_EVICT)
        best_k, best_c = combine_best(best_k, best_c, tk, tc)
    # One atomic MAX per (program, row): the step key is the max over programs (and, after the
    # exchange, over ranks), whatever order the programs finish in.
    tl.atomic_max(keys_ptr + cur_slot * stride_slot + rows64, pack_key(best_k, best_c.to(tl.int64) + vocab_start),
                  mask=rmask)


@dataclass(frozen=True)
class FusedConfig:
    """Schedule of the fused step. ``block_b`` fixes the tile shape (part of the bitwise contract: keep it
    one value per table); no other field changes a value -- each only decides which program computes which
    tiles, in which order, with which pipeline depth.

    ``block_n``: columns per tile (``block_b x r @ r x block_n`` per dot); ``num_warps`` / ``num_stages``:
    Triton launch settings; ``programs``: persistent column programs in all (divided among the row
    tiles); ``cache_hints``: ``evict_last`` on the ``markov_w2`` / ``w1`` loads and ``evict_first`` on the
    streamed base-logit loads; ``block_b``: rows per tile, one of :data:`BLOCK_B_CHOICES`.
    """

    block_n: int
    num_warps: int
    num_stages: int
    programs: int
    cache_hints: bool = False
    block_b: int = FUSED_BLOCK_B

    def __post_init__(self):
        for name, v in (("block_n", self.block_n), ("num_warps", self.num_warps), ("num_stages", self.num_stages),
                        ("programs", self.programs)):
            check_int(f"FusedConfig.{name}", v, lo=1)
        if self.block_n & (self.block_n - 1) or self.block_n < 16:
            raise ValueError(f"FusedConfig.block_n: expected a power of two >= 16, got {self.block_n}")
        if self.block_b not in BLOCK_B_CHOICES:
            raise ValueError(f"FusedConfig.block_b: expected one of {BLOCK_B_CHOICES}, got {self.block_b}")

    def describe(self) -> str:
        return (f"b{self.block_b}/n{self.block_n}/w{self.num_warps}/s{self.num_stages}/p{self.programs}"
                f"{'/ch' if self.cache_hints else ''}")


@dataclass(frozen=True)
class FusedSchedule:
    """One row of the per-B schedule table; ``programs_per_sm`` times the SM count gives ``programs``."""

    max_batch: int | None  # inclusive upper bound of the batch sizes this row covers; None: every larger B
    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    cache_hints: bool = False
    block_b: int = FUSED_BLOCK_B

    def config(self, sms: int) -> FusedConfig:
        return FusedConfig(block_n=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages,
                           programs=self.programs_per_sm * sms, cache_hints=self.cache_hints, block_b=self.block_b)


# Per-B schedule of the fused step on CUDA (the first row whose max_batch >= B). Measured on the H200
# (2026-12-01, `trtllm-ext bench markov`, V = 200064, r = 256, K = 7, bf16; docs/markov_chain.md): 16-row
# tiles, 64 columns, 4 warps, 2 stages, 4 programs per SM shared by the row tiles, at every B. The 64-row
# tile (block_b = 64) is built and bitwise tested but not measured yet: it stays out of the table until a
# `bench markov` run on the H200 says where it wins (its rows are one table for all B: never per B).
FUSED_SCHEDULES: tuple[FusedSchedule, ...] = (
    FusedSchedule(None, block_n=64, num_warps=4, num_stages=2, programs_per_sm=4),
)
# The interpreter runs programs one after another: few programs, one stage (timing is meaningless there).
INTERPRET_SCHEDULES: tuple[FusedSchedule, ...] = (
    FusedSchedule(None, block_n=64, num_warps=4, num_stages=1, programs_per_sm=3),
)


def fused_schedule(batch_size: int, schedules: tuple[FusedSchedule, ...] = FUSED_SCHEDULES) -> FusedSchedule:
    """The row of ``schedules`` that covers ``batch_size`` (the last row covers every larger B)."""
    for s in schedules:
        if s.max_batch is None or batch_size <= s.max_batch:
            return s
    return schedules[-1]


# Shared memory a fused tile may pipeline: Hopper's 227 KiB per block less room for the compiler's own scratch.
FUSED_SMEM_BYTES = 200 * 1024


def fit_shared_memory(config: FusedConfig, r: int, elem_bytes: int = 2,
                      budget: int = FUSED_SMEM_BYTES) -> FusedConfig:
    """``config`` with fewer pipeline stages (then narrower column tiles) until the pipelined operand tiles,
    ``num_stages * (block_n + block_b) * BLOCK_R * elem_bytes``, fit ``budget``. The table was measured at
    r = 256; a wide rank (SmolLM2's r = 576 pads to 1024) would ask for more shared memory than an SM has.
    Neither field changes a value (:class:`FusedConfig`), so the bits stay those of the table's tile."""
    block_r = max(16, triton.next_power_of_2(r))

    def need(stages: int, block_n: int) -> int:
        return stages * (block_n + config.block_b) * block_r * elem_bytes

    stages, block_n = config.num_stages, config.block_n
    while stages > 1 and need(stages, block_n) > budget:
        stages -= 1
    while block_n > 16 and need(stages, block_n) > budget:
        block_n //= 2
    if (stages, block_n) == (config.num_stages, config.block_n):
        return config
    return dataclasses.replace(config, num_stages=stages, block_n=block_n)


def fused_config(r: int, interpret: bool, device=None, batch_size: int = 1, elem_bytes: int = 2) -> FusedConfig:
    """The fused step's schedule for ``batch_size`` rows of Markov rank ``r`` (:data:`FUSED_SCHEDULES`;
    the interpreter: :data:`INTERPRET_SCHEDULES`, one "SM"), with its pipeline fitted to shared memory for
    this ``r`` and weight element size (:func:`fit_shared_memory`)."""
    if interpret:
        return fused_schedule(batch_size, INTERPRET_SCHEDULES).config(1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return fit_shared_memory(fused_schedule(batch_size).config(sms), r, elem_bytes)


def fused_grid(batch_size: int, v_local: int, config: FusedConfig) -> tuple[int, int, int]:
    """``(row tiles, column programs per row tile, column tiles)`` of a fused launch."""
    row_tiles = max(1, triton.cdiv(batch_size, config.block_b))
    n_tiles = triton.cdiv(v_local, config.block_n)
    n_progs = max(1, min(n_tiles, triton.cdiv(config.programs, row_tiles)))
    return row_tiles, n_progs, n_tiles


def markov_fused_step(
    base, w1, w2, out, anchors, keys, tokens, temps, seeds, offsets, *,
    vocab_start: int, vocab_size: int, k: int, offset_k: int, salt: int, w_kind: int, out_bf16: bool,
    config: FusedConfig, interpret: bool, order: str = "alternate",
) -> None:
    """Launch step ``k`` of the fused chain: ``out[:, k]`` (biased logits) and ``keys[k % 3, :B]`` (the
    rows' selection keys, MAX-ed); records ``tokens[:, k-1]`` and clears ``keys[(k+1) % 3]``.

    Internal: validated by :class:`~tensorrt_llm_ext.speculative.markov_chain.MarkovChainStepper`.
    CUDA-graph safe. ``order="alternate"`` scans the column tiles backwards at odd ``k`` (L2 reuse across
    steps); ``"same"`` scans every step forwards. Both give the same values, bit for bit.
    """
    B, _, v_local = base.shape
    r = w1.shape[1]
    sample = temps is not None
    row_tiles, n_progs, n_tiles = fused_grid(B, v_local, config)
    reverse = 1 if order == "alternate" and k % 2 == 1 else 0
    _markov_fused_step_kernel[(row_tiles, n_progs)](
        base, w1, w2, out, anchors, keys, tokens,
        temps if sample else base, seeds if sample else anchors, offsets if sample else anchors,
        B, v_local, vocab_start, vocab_size, k, (k - 1) % 3, k % 3, (k + 1) % 3, offset_k, n_tiles, n_progs, reverse,
        base.stride(0), base.stride(1), out.stride(0), out.stride(1), w1.stride(0), w2.stride(0),
        keys.stride(0), tokens.stride(0),
        R=r, IS_FIRST=k == 0, SAMPLE=sample, ALIGNED=vocab_start % 4 == 0, SALT=salt, W_KIND=w_kind, OUT_BF16=out_bf16,
        DOT_FP32=interpret, BLOCK_B=config.block_b, BLOCK_N=config.block_n,
        BLOCK_R=max(16, triton.next_power_of_2(r)),
        W_EVICT="evict_last" if config.cache_hints else "", BASE_EVICT="evict_first" if config.cache_hints else "",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def markov_fused_step_reference(base_k, prev, markov_w1, markov_w2, *, vocab_start: int, vocab_size: int,
                                temperatures=None, seeds=None, offsets=None, salt: int):
    """Eager twin of one fused step (``(biased [B, V_local], keys [B])``): the exact step's arithmetic with
    the bias accumulated in fp32 over the whole ``r`` and rounded once to the weights dtype, as the
    kernel's dot does. Equal to the kernel up to the fp32 sum order of that dot (the kernel's order is
    fixed per tile shape, not torch's), so the biased logits agree within one rounding of the bias and the
    tokens except at near-ties; the kernel's own invariances (B, TP, schedule) are bitwise."""
    valid = (prev >= 0) & (prev < vocab_size)
    h = markov_w1[torch.where(valid, prev, 0)].float()
    h = torch.where(valid[:, None], h, torch.zeros_like(h))
    bias = (h @ markov_w2.float().t()).to(markov_w2.dtype).to(base_k.dtype)
    biased = base_k + bias
    score = biased.float()
    if temperatures is not None:
        score = keyed_gumbel_scores_torch(score, temperatures, seeds, offsets, vocab_start, salt)
    return biased, shard_argmax_key_reference(score, vocab_start, vocab_size)
