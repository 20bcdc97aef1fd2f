"""logprobs at TP 2 (vocab-parallel head: computed on the shards) with the logits-processing fields, speculative
and target-only, and the prompt's (``prompt_logprobs``, echo with logprobs): the raw model distribution, equal to
TP 1's (1e-4), the same tokens."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.ranks import run_on_ranks
from tensorrt_llm_ext.testing.tiny_models import tiny_model

SMALL = tiny_model(**{"model.target.vocab_size": 302, "model.target.capture_layers": [1], "max_batch_size": 2,
                       "max_seq_len": 32, "speculative_config.max_draft_len": 2, "kv_cache_config.tokens_per_block": 4})
REQUESTS = [dict(prompt_ids=[17, 5, 42, 9], max_new_tokens=4, seed=11, logprobs=3, temperature=0.9, top_k=5,
                 repetition_penalty=1.3, frequency_penalty=0.5, prompt_logprobs=3),
            dict(prompt_ids=[3, 4, 5], max_new_tokens=4, seed=2, logprobs=3, temperature=0.8, min_p=0.2,
                 logit_bias=((7, 5.0), (42, -100.0)), presence_penalty=0.4)]


def _serve(engine, requests: list[dict]) -> list[tuple[list[int], list]]:
    from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan
    from tensorrt_llm_ext.testing.requests import make_request

    out = []
    for mode in ("speculative", "target_only"):
        for fields in requests:
            sch = Scheduler(engine, mode=mode)
            events, _ = sch.apply(StepPlan(admit=[(0, make_request(**dict(fields)))], run=False))
            while sch.num_active:
                events += sch.apply(StepPlan())[0]
            out.append(([t for e in events for t in e.tokens], [lp for e in events for lp in e.logprobs],
                        [lp for e in events for lp in (e.prompt_logprobs or ())]))
    return out


def _on_rank(config: dict, requests: list[dict]):
    from tensorrt_llm_ext.distributed import init_from_mpi
    from tensorrt_llm_ext.runtime.config import parse_config
    from tensorrt_llm_ext.runtime.engine import Engine

    torch.set_num_threads(1)
    engine = Engine(parse_config(config), init_from_mpi(tp_size=2))
    return engine.worker().token_selector.target_head is not None, _serve(engine, requests)


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_tp2_logprobs_with_processing_fields_equal_tp1(mpi_pool_executor):
    from tensorrt_llm_ext.runtime.engine import Engine

    want = _serve(Engine(load_config(**SMALL)), REQUESTS)
    tp2 = load_config(**{**SMALL, "tensor_parallel_size": 2}).model_dump(mode="json")
    ranks = run_on_ranks(mpi_pool_executor, _on_rank, tp2, REQUESTS, timeout=300)
    assert [len(plps) for _, _, plps in want] == [3, 0, 3, 0]  # the first request's prompt, in both modes
    for sharded, got in ranks:
        assert sharded  # the speculative rows' logprobs come from the vocabulary shards
        for (tokens, lps, plps), (want_tokens, want_lps, want_plps) in zip(got, want):
            assert tokens == want_tokens and len(lps) == len(tokens) == 4 and len(plps) == len(want_plps)
            for (c, top), (wc, wtop) in zip(lps + plps, want_lps + want_plps):
                assert [i for i, _ in top] == [i for i, _ in wtop]
                torch.testing.assert_close(torch.tensor([c] + [v for _, v in top]),
                                           torch.tensor([wc] + [v for _, v in wtop]), atol=1e-4, rtol=0)
