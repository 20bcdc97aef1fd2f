"""The exact mode of the DSpark Markov chain: the kernels around the bias GEMM.

Per block position the chain (:mod:`tensorrt_llm_ext.speculative.markov_chain`) runs the GEMM
``F.linear`` runs (``torch.mm(h, w2.t(), out=bias)``, hence bitwise the eager bias) between two kernels:

* resolve (:func:`markov_resolve`): one program per row turns the anchor (``k == 0``) or the step key into
  the previous token, records it, resets a key slot and gathers its ``w1`` row into ``h [B, r]``;
* select (:func:`markov_select`): grid ``(B, V_local / SELECT_BLOCK)``, add + store + one key MAX per
  program.

Without an exchange the select launch also resolves the next step ("fold"): per row, each program counts
itself after its key MAX (acquire-release atomic) and the row's last program reads the finished key,
records the token, gathers ``w1[token]`` for the next GEMM and clears the ring slot the next launch uses
(the whole ring at the last step). No program ever waits for another, so the interpreter's
one-after-another order is fine.

Eager twins: :func:`markov_resolve_reference` (previous tokens and gathered rows) and
:func:`markov_select_reference` (biased logits and keys from a given bias); with the GEMM between them they
are :func:`~tensorrt_llm_ext.kernels.markov_step.markov_step_reference`, which the kernels equal bit for
bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import num_warps_for
from tensorrt_llm_ext.kernels.markov_step import add_in_logits_dtype, bias_to_logits, selection_score
from tensorrt_llm_ext.kernels.ordered_key import (block_best, gumbel_scale, key_to_id, key_to_id_torch,
                                                  keyed_gumbel_scores_torch, ordered_i32, pack_key,
                                                  shard_argmax_key_reference)

__all__ = ["SELECT_BLOCK", "markov_resolve", "markov_resolve_reference", "markov_select", "markov_select_reference"]


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
    SAMPLE: tl.constexpr, ALIGNED: tl.constexpr, SALT: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_V: tl.constexpr,
    FOLD: tl.constexpr, LAST_STEP: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Grid (B, column blocks): biased = base[:, k] + bias (logits dtype), store, MAX the block's key into
    ``keys[cur_slot, b]``. With ``FOLD`` the row's last program also resolves step ``k + 1`` (see
    :func:`markov_select`)."""
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
        # Runs of four consecutive columns (BLOCK_V is a multiple of 4): one Philox block per run.
        first_gid = (tl.program_id(1) * BLOCK_V + 4 * tl.arange(0, BLOCK_V // 4)).to(tl.int64)[None, :] + vocab_start
        s = selection_score(s, first_gid, temp > 0, gumbel_scale(temp), seed, off, SAMPLE, ALIGNED, SALT)
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


def markov_resolve(anchors, keys, w1, h, tokens, *, k: int, read_slot: int, reset_slot: int,
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


def markov_select(base, bias, out, keys, temps, seeds, offsets, *, k: int, vocab_start: int,
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
        SAMPLE=sample, ALIGNED=vocab_start % 4 == 0, SALT=salt, OUT_BF16=base.dtype == torch.bfloat16,
        BLOCK_V=SELECT_BLOCK,
        FOLD=fold is not None, LAST_STEP=last_step, BLOCK_R=triton.next_power_of_2(r),
        num_warps=num_warps_for(SELECT_BLOCK, elements_per_warp=512),
    )


def markov_resolve_reference(anchors, keys, markov_w1, *, k: int, vocab_size: int):
    """Eager twin of :func:`markov_resolve`: ``(prev [B] int64, h [B, r])`` -- the anchors at ``k == 0``,
    else the ids of ``keys [B]`` (``-1`` for ``EMPTY_KEY``), and their ``w1`` rows (zero rows for ids
    outside ``[0, vocab_size)``)."""
    prev = anchors.to(torch.int64) if k == 0 else key_to_id_torch(keys)
    valid = (prev >= 0) & (prev < vocab_size)
    h = markov_w1[torch.where(valid, prev, 0)]
    return prev, torch.where(valid[:, None], h, torch.zeros_like(h))


def markov_select_reference(base_k, bias, *, vocab_start: int, vocab_size: int, temperatures=None, seeds=None,
                            offsets=None, salt: int):
    """Eager twin of :func:`markov_select`: ``(biased [B, V_local] logits dtype, keys [B] int64)`` with
    ``biased = base_k + bias.to(logits dtype)`` and the rows' selection keys (keyed Gumbel-max at
    ``offsets`` for rows with ``T > 0``)."""
    biased = base_k + bias.to(base_k.dtype)
    score = biased.float()
    if temperatures is not None:
        score = keyed_gumbel_scores_torch(score, temperatures, seeds, offsets, vocab_start, salt)
    return biased, shard_argmax_key_reference(score, vocab_start, vocab_size)
