"""The target-only decode step's bookkeeping kernels (kernels/decode_step.py) vs their eager twins: exactly equal."""

import pytest
import torch

from tensorrt_llm_ext.kernels.decode_step import (decode_step_advance, decode_step_advance_reference,
                                                  decode_step_inputs, decode_step_inputs_reference)
from tensorrt_llm_ext.modules.rope import RopeScaling, RotaryEmbedding

# Triton takes CPU tensors only under the interpreter (CPU machines); on a GPU machine test CUDA.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _state(num_slots: int, width: int, len_dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    slot_tokens = torch.randint(0, 1 << 40, (num_slots, width), generator=g).to(device)
    lengths = torch.randint(0, 1 << 20, (num_slots,), generator=g).to(len_dtype).to(device)
    return g, slot_tokens, lengths


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 5, 300])  # one row, odd, two programs of 256 rows
@pytest.mark.parametrize("slot_dtype,len_dtype", [(torch.int32, torch.int32), (torch.int64, torch.int64),
                                                  (torch.int32, torch.int64)])
def test_decode_step_kernels_equal_the_torch_ops(device, batch, slot_dtype, len_dtype):
    """Random distinct live slots plus padding rows sharing one dummy slot, every column count up to the width:
    inputs equal the gathers, and after the step the lengths and tokens equal index_add_ / index_put_'s."""
    num_slots, width = batch + 3, 8
    g, slot_tokens, lengths = _state(num_slots, width, len_dtype, device, batch)
    slots = torch.randperm(num_slots - 1, generator=g)[:batch]
    dummy = torch.rand(batch, generator=g) < 0.3
    dummy[0] = False  # at least one live row
    slots[dummy] = num_slots - 1  # padding rows share the last slot
    slots, dummy = slots.to(slot_dtype).to(device), dummy.to(device)
    for columns in (1, 3, width):
        tok, pos, cos, sin = decode_step_inputs(slots, slot_tokens, lengths, columns)
        assert cos is None and sin is None
        ref_tok, ref_pos, _, _ = decode_step_inputs_reference(slots, slot_tokens, lengths, columns)
        assert tok.dtype == pos.dtype == torch.int64 and tok.shape == pos.shape == (batch, columns)
        assert torch.equal(tok, ref_tok) and torch.equal(pos, ref_pos)
        assert torch.equal(pos[:, 0], lengths[slots.long()].long())
    new = torch.randint(0, 1 << 40, (batch,), generator=g).to(device)
    new[dummy] = 7  # the padding rows agree on the dummy slot's token (index_put_'s duplicates race otherwise)
    got_len, got_tok = lengths.clone(), slot_tokens.clone()
    decode_step_advance(slots, dummy, new, got_len, got_tok)
    ref_len, ref_tok = lengths.clone(), slot_tokens.clone()
    decode_step_advance_reference(slots, dummy, new, ref_len, ref_tok)
    assert torch.equal(got_len, ref_len) and torch.equal(got_tok, ref_tok)
    live = slots[~dummy].long()
    assert torch.equal(got_len[live], lengths[live] + 1)  # each live slot one token longer
    assert torch.equal(got_len[-1], lengths[-1])  # the padding rows' slot: unchanged length
    assert torch.equal(got_tok[:, 1:], slot_tokens[:, 1:])  # only column 0 moves


@pytest.mark.parametrize("device", DEVICES)
def test_decode_step_out_of_range_slot_and_empty_batch(device):
    """A slot outside the state reads zeros and writes nothing (no device assert in a captured step); a batch of none
    returns empty inputs and changes nothing; bad arguments are refused naming themselves."""
    _, slot_tokens, lengths = _state(4, 3, torch.int32, device, 0)
    slots = torch.tensor([2, 9, -1], dtype=torch.int32, device=device)
    tok, pos, _, _ = decode_step_inputs(slots, slot_tokens, lengths, 2)
    assert torch.equal(tok[0], slot_tokens[2, :2]) and torch.equal(pos[0], lengths[2].long() + torch.arange(2, device=device))
    assert tok[1:].abs().sum() == 0 and torch.equal(pos[1:], torch.arange(2, device=device).expand(2, 2))
    got_len, got_tok = lengths.clone(), slot_tokens.clone()
    decode_step_advance(slots, torch.zeros(3, dtype=torch.bool, device=device),
                        torch.tensor([5, 6, 7], device=device), got_len, got_tok)
    assert got_len[2] == lengths[2] + 1 and got_tok[2, 0] == 5
    assert torch.equal(got_len[[0, 1, 3]], lengths[[0, 1, 3]]) and torch.equal(got_tok[[0, 1, 3]], slot_tokens[[0, 1, 3]])
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    tok, pos, _, _ = decode_step_inputs(empty, slot_tokens, lengths, 3)
    assert tok.shape == pos.shape == (0, 3)
    decode_step_advance(empty, empty.bool(), empty.long(), got_len, got_tok)
    with pytest.raises(ValueError, match="columns"):
        decode_step_inputs(slots, slot_tokens, lengths, 4)
    with pytest.raises(ValueError, match="slot_tokens"):
        decode_step_inputs(slots, slot_tokens.int(), lengths, 1)
    with pytest.raises(ValueError, match="is_dummy"):
        decode_step_advance(slots, torch.zeros(2, dtype=torch.bool, device=device), tok.new_zeros(3), got_len, got_tok)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim,scaling", [(64, None), (128, RopeScaling(rope_type="yarn", factor=4.0,
                                                                             original_max_position_embeddings=512))])
def test_decode_step_rope_rows_equal_the_forwards_cos_sin(device, head_dim, scaling):
    """The RoPE rows gathered from ``cos_sin_table`` are bit for bit ``cos_sin(positions)`` (what the forward computes
    without them), kernel and twin; a position past the table reads its last row."""
    rot = RotaryEmbedding(head_dim, 10000.0, scaling, device=device)
    num_slots, width, table_rows = 6, 8, 300
    _, slot_tokens, lengths = _state(num_slots, width, torch.int32, device, head_dim)
    lengths.copy_(torch.tensor([0, 1, 31, 32, 250, 299], dtype=torch.int32))  # page edges, the table's end
    table = rot.cos_sin_table(table_rows)
    slots = torch.tensor([5, 0, 3, 2, 4, 1], dtype=torch.int32, device=device)
    for columns in (1, width):
        got = decode_step_inputs(slots, slot_tokens, lengths, columns, table)
        ref = decode_step_inputs_reference(slots, slot_tokens, lengths, columns, table)
        assert got.cos.shape == (6, columns, head_dim // 2)
        assert torch.equal(got.cos, ref.cos) and torch.equal(got.sin, ref.sin)
        want_cos, want_sin = rot.cos_sin(got.positions.clamp(max=table_rows - 1))
        assert torch.equal(got.cos, want_cos) and torch.equal(got.sin, want_sin)
        inside = got.positions < table_rows
        cos, sin = rot.cos_sin(got.positions)
        assert torch.equal(got.cos[inside], cos[inside]) and torch.equal(got.sin[inside], sin[inside])
    assert (got.positions >= table_rows).any()  # the last slot's columns ran past the table: its last row
    with pytest.raises(ValueError, match="rope_table"):
        decode_step_inputs(slots, slot_tokens, lengths, 1, (table[0], table[1][:, :3]))
