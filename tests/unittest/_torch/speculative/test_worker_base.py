"""The worker base owns forward(): subclasses implement _forward_impl and cannot override forward."""

from __future__ import annotations

import pytest

from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.speculative.worker_base import SpecWorkerBase


def test_subclass_overriding_forward_is_refused():
    with pytest.raises(TypeError, match="must not override forward"):
        class Bad(SpecWorkerBase):  # noqa: F841
            def forward(self, batch_size):
                return {}

            def _forward_impl(self, batch_size):
                return {}


def test_forward_before_post_load_raises_and_selection_is_unset():
    class Good(SpecWorkerBase):
        def _forward_impl(self, batch_size):
            return {"rows": batch_size}

    w = Good(Mapping(), None, None, draft_len=2, max_batch_size=4)
    assert w.selection is None
    with pytest.raises(RuntimeError, match="post_load"):
        w.forward(1)
