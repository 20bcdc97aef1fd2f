"""CUDA-graph views of SpecMetadata share the slot-indexed sampling state with the base metadata."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.speculative.metadata import SpecMetadata


def _meta(**kw):
    args = dict(max_num_requests=8, max_draft_len=3, vocab_size=37, num_seq_slots=11, use_penalties=True)
    args.update(kw)
    return SpecMetadata(**args)


def test_cuda_graph_views_share_slot_buffers():
    base = _meta()
    # views created before the base's first prepare(), as when graph capture is the first forward
    views = [base.create_cuda_graph_metadata(bs) for bs in (1, 2, 4, 8)]
    views[2].prepare()  # a view prepared first must not allocate its own copy
    base.prepare()
    for v in views:
        v.prepare()
        assert v.is_cuda_graph and v.base is base
        assert v.draft_logits is base.draft_logits
        assert v.penalty_state is base.penalty_state
        assert v.batch_slot_ids is base.batch_slot_ids
    # sized by the slot pool, never by a graph's batch size
    assert base.draft_logits.shape == (11, 3, 37)
    shard = _meta(draft_logits_width=19, draft_logits_dtype=torch.bfloat16)
    shard.create_cuda_graph_metadata(2).prepare()
    assert shard.draft_logits.shape == (11, 3, 19) and shard.draft_logits.dtype == torch.bfloat16
    assert base.penalty_state.shape == (11, 37)
    # the drafter writes through one view, the verifier reads through another (and eagerly)
    slot = 10
    probs = torch.softmax(torch.randn(3, 37, generator=torch.Generator().manual_seed(0)), -1)
    views[0].draft_logits[slot] = probs
    views[1].penalty_state[slot, 5] += 2
    assert torch.equal(views[3].draft_logits[slot], probs) and torch.equal(base.draft_logits[slot], probs)
    assert int(views[2].penalty_state[slot, 5]) == 2 and int(base.penalty_state[slot, 5]) == 2


def test_prepare_twice_keeps_buffers():
    base = _meta()
    base.prepare()
    ptrs = (base.draft_logits.data_ptr(), base.penalty_state.data_ptr(), base.draft_tokens.data_ptr())
    base.draft_logits[1, 0, 0] = 0.5
    base.prepare()
    assert ptrs == (base.draft_logits.data_ptr(), base.penalty_state.data_ptr(), base.draft_tokens.data_ptr())
    assert float(base.draft_logits[1, 0, 0]) == 0.5  # not cleared
    view = base.create_cuda_graph_metadata(3)
    assert view is base.create_cuda_graph_metadata(3)  # cached per batch size
    assert view.create_cuda_graph_metadata(3) is view  # a view asks its base
    view.prepare()
    assert view.draft_logits.data_ptr() == ptrs[0] and view.draft_tokens.data_ptr() == ptrs[2]


def test_optional_state_and_validation():
    base = _meta(use_rejection_sampling=False, use_penalties=False)
    base.create_cuda_graph_metadata(2).prepare()
    assert base.draft_logits is None and base.penalty_state is None and base.batch_slot_ids is not None
    assert _meta(num_seq_slots=0).num_seq_slots == 8
    with pytest.raises(ValueError, match="batch_size"):
        _meta().create_cuda_graph_metadata(9)
    with pytest.raises(ValueError, match="num_seq_slots"):
        _meta(num_seq_slots=4)
    with pytest.raises(ValueError, match="max_draft_len"):
        _meta(max_draft_len=0)
