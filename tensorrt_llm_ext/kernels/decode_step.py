"""The target-only decode step's bookkeeping around its forward: one launch before it, one after.

``decode_step_inputs(slot_ids, slot_tokens, lengths, columns, rope_table)``: each row's input tokens and
positions, ``tokens[b, j] = slot_tokens[slot_ids[b], j]`` and ``positions[b, j] = lengths[slot_ids[b]] + j``
(int64), and given the RoPE tables (``RotaryEmbedding.cos_sin_table``: row ``p`` is ``cos_sin(p)`` bit for bit)
their rows at those positions, the forward's ``cos`` / ``sin`` (four more launches when the forward computes them);
``decode_step_advance(slot_ids, is_dummy, new_tokens, lengths, slot_tokens)``: each live row's length grows by one
(``lengths[slot_ids[b]] += 1``) and every row's new token becomes its slot's next input (``slot_tokens[slot_ids[b],
0] = new_tokens[b]``). With torch ops these are eight launches (the slot ids widened, two gathers and an add before
the forward; the live mask negated and converted, ``index_add_`` and ``index_put_`` after it), each a serial step of
the captured graph at ~1.5-2 us on an H200 whatever its size: the step's inputs are a few hundred bytes.

Pure integer moves: the results are the twins' (the torch ops above) exactly. Padding rows (``is_dummy``) may share
one slot: they add nothing to its length, and their tokens race for its ``slot_tokens[slot, 0]`` as ``index_put_``'s
duplicates do (a dummy slot's token is never a request's). Slots outside ``[0, S)`` read zeros and write nothing (no
device assert inside a captured step; the callers pass their own slots).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import check_tensor

__all__ = ["DecodeStepInputs", "decode_step_advance", "decode_step_advance_reference", "decode_step_inputs",
           "decode_step_inputs_reference"]

MAX_BLOCK_ROWS = 256  # rows per program of the advance (one program up to 256 requests)
MAX_INPUT_ROWS = 64  # rows per program of the inputs (a program per row block and column; 64 x 64 RoPE values)


class DecodeStepInputs(NamedTuple):
    tokens: torch.Tensor  # [B, C] int64
    positions: torch.Tensor  # [B, C] int64
    cos: torch.Tensor | None  # [B, C, D/2] fp32 (None without a table)
    sin: torch.Tensor | None


@triton.jit
def _decode_step_inputs_kernel(slot_ptr, tok_ptr, len_ptr, tokens_ptr, pos_ptr, cos_t_ptr, sin_t_ptr, cos_ptr,
                               sin_ptr, num_rows, num_slots, columns, stride_tok, table_rows, half,
                               BLOCK_B: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    j = tl.program_id(1)
    row_ok = rows < num_rows
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    slot_ok = row_ok & (slot >= 0) & (slot < num_slots)
    pos = tl.load(len_ptr + slot, mask=slot_ok, other=0).to(tl.int64) + j
    out = rows.to(tl.int64) * columns + j
    tl.store(tokens_ptr + out, tl.load(tok_ptr + slot * stride_tok + j, mask=slot_ok, other=0), mask=row_ok)
    tl.store(pos_ptr + out, pos, mask=row_ok)
    if ROPE:
        # the table row of each position (the last row past the table: a position no live request reaches, the
        # table covering the cache's positions and a step's columns)
        at = tl.minimum(tl.maximum(pos, 0), table_rows - 1)
        i = tl.arange(0, BLOCK_H)
        mask = row_ok[:, None] & (i < half)[None, :]
        src = at[:, None] * half + i[None, :]
        dst = out[:, None] * half + i[None, :]
        tl.store(cos_ptr + dst, tl.load(cos_t_ptr + src, mask=mask), mask=mask)
        tl.store(sin_ptr + dst, tl.load(sin_t_ptr + src, mask=mask), mask=mask)


@triton.jit
def _decode_step_advance_kernel(slot_ptr, dummy_ptr, new_ptr, len_ptr, tok_ptr, num_rows, num_slots, stride_tok,
                                BLOCK_B: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < num_rows
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    slot_ok = row_ok & (slot >= 0) & (slot < num_slots)
    live = slot_ok & (tl.load(dummy_ptr + rows, mask=row_ok, other=1) == 0)
    length = tl.load(len_ptr + slot, mask=live, other=0)
    tl.store(len_ptr + slot, length + 1, mask=live)  # live rows hold distinct slots
    tl.store(tok_ptr + slot * stride_tok, tl.load(new_ptr + rows, mask=slot_ok, other=0), mask=slot_ok)


def _check_slots(fn: str, slot_ids: torch.Tensor, slot_tokens: torch.Tensor, lengths: torch.Tensor) -> None:
    check_tensor(f"{fn} slot_ids [B]", slot_ids, shape=(None,), dtype=(torch.int32, torch.int64), contiguous=True)
    check_tensor(f"{fn} slot_tokens [S, W]", slot_tokens, shape=(None, None), dtype=torch.int64, device=slot_ids.device,
                 unit_last_stride=True)
    check_tensor(f"{fn} lengths [S]", lengths, shape=(slot_tokens.shape[0],), dtype=(torch.int32, torch.int64),
                 device=slot_ids.device, contiguous=True)


def _check_table(fn: str, rope_table, device) -> tuple[int, int]:
    if rope_table is None:
        return 0, 0
    cos_t, sin_t = rope_table
    check_tensor(f"{fn} rope_table cos [P, D/2]", cos_t, shape=(None, None), dtype=torch.float32, device=device,
                 contiguous=True)
    check_tensor(f"{fn} rope_table sin [P, D/2]", sin_t, shape=tuple(cos_t.shape), dtype=torch.float32,
                 device=device, contiguous=True)
    if cos_t.shape[0] == 0:
        raise ValueError(f"{fn}: rope_table has no rows")
    return cos_t.shape[0], cos_t.shape[1]


def decode_step_inputs(slot_ids: torch.Tensor, slot_tokens: torch.Tensor, lengths: torch.Tensor, columns: int,
                       rope_table: tuple[torch.Tensor, torch.Tensor] | None = None) -> DecodeStepInputs:
    """The rows' input tokens and positions for a ``[B, columns]`` forward (see the module doc).

    Args:
        slot_ids: ``[B]`` int32 / int64 slot of each row.
        slot_tokens: ``[S, W]`` int64 (``columns <= W``): each slot's next input tokens.
        lengths: ``[S]`` int32 / int64: each slot's tokens in the cache (the first column's position).
        columns: the forward's tokens per row.
        rope_table: optional ``(cos, sin)`` fp32 ``[P, D/2]`` (``RotaryEmbedding.cos_sin_table(P)``), P past every
            position a step reaches; a position past it reads row ``P - 1``.

    Returns :class:`DecodeStepInputs` (new tensors; ``cos`` / ``sin`` ``[B, columns, D/2]`` with a table). CUDA-graph
    safe.
    """
    _check_slots("decode_step_inputs", slot_ids, slot_tokens, lengths)
    if not 1 <= columns <= slot_tokens.shape[1]:
        raise ValueError(f"decode_step_inputs: columns must be in [1, {slot_tokens.shape[1]}] (slot_tokens' width), "
                         f"got {columns}")
    table_rows, half = _check_table("decode_step_inputs", rope_table, slot_ids.device)
    b = slot_ids.shape[0]
    tokens = torch.empty(b, columns, dtype=torch.int64, device=slot_ids.device)
    positions = torch.empty_like(tokens)
    cos = sin = None
    if rope_table is not None:
        cos = torch.empty(b, columns, half, dtype=torch.float32, device=slot_ids.device)
        sin = torch.empty_like(cos)
    if b:
        block_b = min(MAX_INPUT_ROWS, triton.next_power_of_2(b))
        _decode_step_inputs_kernel[(triton.cdiv(b, block_b), columns)](
            slot_ids, slot_tokens, lengths, tokens, positions,
            rope_table[0] if cos is not None else tokens, rope_table[1] if cos is not None else tokens,
            cos if cos is not None else tokens, sin if sin is not None else tokens,
            b, slot_tokens.shape[0], columns, slot_tokens.stride(0), table_rows, half,
            BLOCK_B=block_b, ROPE=cos is not None, BLOCK_H=triton.next_power_of_2(max(half, 1)),
            num_warps=1 if cos is None else 4)
    return DecodeStepInputs(tokens, positions, cos, sin)


def decode_step_inputs_reference(slot_ids: torch.Tensor, slot_tokens: torch.Tensor, lengths: torch.Tensor,
                                 columns: int, rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
                                 ) -> DecodeStepInputs:
    """Eager twin of :func:`decode_step_inputs` (slots must lie in ``[0, S)``)."""
    _check_slots("decode_step_inputs_reference", slot_ids, slot_tokens, lengths)
    table_rows, _ = _check_table("decode_step_inputs_reference", rope_table, slot_ids.device)
    slots = slot_ids.long()
    cols = torch.arange(columns, dtype=torch.int64, device=slot_ids.device)
    positions = lengths[slots].long()[:, None] + cols
    cos = sin = None
    if rope_table is not None:
        at = positions.clamp(0, table_rows - 1)
        cos, sin = rope_table[0][at], rope_table[1][at]
    return DecodeStepInputs(slot_tokens[slots, :columns], positions, cos, sin)


def decode_step_advance(slot_ids: torch.Tensor, is_dummy: torch.Tensor, new_tokens: torch.Tensor,
                        lengths: torch.Tensor, slot_tokens: torch.Tensor) -> None:
    """After the step, in place: each live row's slot one token longer, each row's new token its slot's next input.

    Args:
        slot_ids: ``[B]`` int32 / int64; the live rows' slots are distinct.
        is_dummy: ``[B]`` bool: padding rows (their length stays).
        new_tokens: ``[B]`` int64: the step's tokens.
        lengths: ``[S]`` int32 / int64, updated in place.
        slot_tokens: ``[S, W]`` int64, column 0 updated in place.

    CUDA-graph safe.
    """
    _check_slots("decode_step_advance", slot_ids, slot_tokens, lengths)
    b = slot_ids.shape[0]
    check_tensor("decode_step_advance is_dummy [B]", is_dummy, shape=(b,), dtype=torch.bool, device=slot_ids.device,
                 contiguous=True)
    check_tensor("decode_step_advance new_tokens [B]", new_tokens, shape=(b,), dtype=torch.int64,
                 device=slot_ids.device, contiguous=True)
    if b:
        block_b = min(MAX_BLOCK_ROWS, triton.next_power_of_2(b))
        _decode_step_advance_kernel[(triton.cdiv(b, block_b),)](
            slot_ids, is_dummy, new_tokens, lengths, slot_tokens, b, slot_tokens.shape[0], slot_tokens.stride(0),
            BLOCK_B=block_b, num_warps=1)


def decode_step_advance_reference(slot_ids: torch.Tensor, is_dummy: torch.Tensor, new_tokens: torch.Tensor,
                                  lengths: torch.Tensor, slot_tokens: torch.Tensor) -> None:
    """Eager twin of :func:`decode_step_advance` (slots must lie in ``[0, S)``)."""
    _check_slots("decode_step_advance_reference", slot_ids, slot_tokens, lengths)
    slots = slot_ids.long()
    lengths.index_add_(0, slots, (~is_dummy).to(lengths.dtype))  # padding rows may share a slot: they add nothing
    slot_tokens[slots, 0] = new_tokens
