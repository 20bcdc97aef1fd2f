"""The non-speculative decode (issue 36): ``target_only`` steps ``[B, 1]`` rows (what ``serve --no-speculation``
serves), ``reference`` steps the verification's ``[B, K+1]`` block (the lossless reference of ``generate
--check``). Both equal ``transformers``' greedy decode token for token on the tiny checkpoints; only the
reference is compared with the speculative step bit for bit (the other lossless tests)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.requests import Request

transformers = pytest.importorskip("transformers")

from tensorrt_llm_ext.testing.hf_checkpoints import hf_greedy_decode, save_tiny_hf_checkpoint  # noqa: E402

PROMPTS = [[5, 17, 300, 2, 99], [42, 7, 250, 1, 3, 11, 12]]
NEW_TOKENS = 12


def _step_shapes(engine: Engine, mode: str, reqs: list[Request]) -> tuple[list[list[int]], set]:
    """``mode``'s greedy tokens and the ``[B, T]`` shapes of the target forwards its decode steps ran (the
    forwards that start past position 0; prefills start at 0)."""
    shapes, target = set(), engine.target
    real = target.forward

    def spy(ids, positions, *args, **kwargs):
        if int(positions.min()) > 0:
            shapes.add(tuple(ids.shape))
        return real(ids, positions, *args, **kwargs)

    target.forward = spy
    try:
        out = [r.output_ids for r in engine.generate(reqs, mode)[0]]
    finally:
        del target.forward
    return out, shapes


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_target_only_rows_and_the_reference_equal_transformers_greedy(tmp_path, family):
    hf = save_tiny_hf_checkpoint(tmp_path / family, family, seed=3)
    want = [hf_greedy_decode(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert all(len(set(w)) > 3 for w in want), want
    engine = Engine(load_config(model_dir=str(tmp_path / family), **{"max_batch_size": 2, "model.dtype": "float32"}))
    reqs = [Request(list(p), NEW_TOKENS, ignore_eos=True) for p in PROMPTS]
    k1 = engine.draft_len + 1
    with torch.no_grad():
        serving, serving_shapes = _step_shapes(engine, "target_only", reqs)
        reference, reference_shapes = _step_shapes(engine, "reference", reqs)
    assert serving == want and reference == want
    assert {t for _, t in serving_shapes} == {1} and {t for _, t in reference_shapes} == {k1}
    assert engine.slots.num_free == 2 and engine.pages.num_free == engine.pages.num_pages
