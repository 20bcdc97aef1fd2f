"""One SpecMetadata per worker holds the slot-indexed sampling state every captured step reads."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.speculative.metadata import SpecMetadata


def _meta(**kw):
    args = dict(max_num_requests=8, max_draft_len=3, vocab_size=37, num_seq_slots=11)
    args.update(kw)
    return SpecMetadata(**args)


def test_slot_buffers_are_sized_by_the_slot_pool():
    base = _meta()
    base.prepare()
    # sized by the slot pool, never by a graph's batch size
    assert base.draft_logits.shape == (11, 3, 37) and base.batch_slot_ids.shape == (8,)
    shard = _meta(use_rejection_sampling=False)
    shard.prepare()
    assert shard.draft_logits is None
    q = shard.allocate_draft_logits(19, torch.bfloat16)  # turned on after load, once the layout is known
    assert q.shape == (11, 3, 19) and q.dtype == torch.bfloat16
    assert shard.allocate_draft_logits(19, torch.bfloat16) is q  # the same buffer, not a second one
    with pytest.raises(ValueError, match="already"):
        shard.allocate_draft_logits(37, torch.bfloat16)


def test_prepare_twice_keeps_buffers():
    base = _meta()
    base.prepare()
    ptrs = (base.draft_logits.data_ptr(), base.batch_slot_ids.data_ptr(), base.num_accepted.data_ptr())
    base.draft_logits[1, 0, 0] = 0.5
    base.prepare()
    assert ptrs == (base.draft_logits.data_ptr(), base.batch_slot_ids.data_ptr(), base.num_accepted.data_ptr())
    assert float(base.draft_logits[1, 0, 0]) == 0.5  # not cleared


def test_validation():
    assert _meta(num_seq_slots=0).num_seq_slots == 8
    with pytest.raises(ValueError, match="num_seq_slots"):
        _meta(num_seq_slots=4)
    with pytest.raises(ValueError, match="max_draft_len"):
        _meta(max_draft_len=0)
