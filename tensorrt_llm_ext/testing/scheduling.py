"""Plans driven through a :class:`~tensorrt_llm_ext.runtime.scheduler.Scheduler` on a small eager engine: the tests of
the scheduler's decode switches (the speculation gate, speculation by batch size) share them (test support)."""

from __future__ import annotations

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan
from tensorrt_llm_ext.speculative.step_ops import STOCK_OPS
from tensorrt_llm_ext.testing.requests import make_request
from tensorrt_llm_ext.testing.tiny_models import tiny_model

# A vocabulary of 301, one captured layer, 4 slots of 48 positions in pages of 4.
SMALL = {"model.target.vocab_size": 301, "model.target.capture_layers": [1], "max_batch_size": 4, "max_seq_len": 48,
         "kv_cache_config.tokens_per_block": 4}


def prompt(i: int) -> list[int]:
    """Request ``i``'s prompt: 3 to 6 ids of SMALL's vocabulary, distinct per ``i``."""
    return [(7 * i + 3 * j + 1) % 301 for j in range(3 + i % 4)]


def eager_engine(config: dict) -> Engine:
    """A CPU engine of ``tiny_model(**config)`` on the eager twins (the scheduling under test does not depend on
    the fused kernels; call with the RMSNorm kernel switched off, as the tests' fixtures do)."""
    eng = Engine(load_config(**tiny_model(**config)))
    eng.drafter.set_attention_backend("eager")
    eng.worker("speculative").ops = STOCK_OPS
    return eng


def serve_plans(engine: Engine, requests: dict[int, dict], arrivals: dict[int, tuple[int, ...]], overlap: bool,
                mode: str = "speculative", modes: list[str] | None = None, deferred: list[int] | None = None,
                max_plans: int = 300) -> tuple[dict[int, list[int]], Scheduler]:
    """Apply plans until every request of ``requests`` (handle -> :func:`make_request` fields) has finished by its
    length, admitting at plan ``i`` the handles ``arrivals[i]``; every handle's tokens and the scheduler. ``modes``:
    filled with the mode of every step the engine launched; ``deferred``: per plan, the prefills read a plan later.
    Asserts that nothing is left in flight and every slot and page is free again."""
    sch = Scheduler(engine, mode=mode, overlap=overlap)
    launch = engine.launch_step
    if modes is not None:
        def spy(slots, step_mode="speculative"):
            modes.append(step_mode)
            return launch(slots, step_mode)
        engine.launch_step = spy
    out = {h: [] for h in requests}
    done = set()
    try:
        for i in range(max_plans):
            admit = [(h, make_request(**requests[h])) for h in arrivals.get(i, ())]
            events, stats = sch.apply(StepPlan(admit=admit))
            if deferred is not None:
                deferred.append(stats.deferred_prefills)
            for e in events:
                assert e.finish_reason in (None, "length"), e
                out[e.handle].extend(e.tokens)
                if e.finish_reason:
                    done.add(e.handle)
            if len(done) == len(requests):
                break
    finally:
        if modes is not None:
            del engine.launch_step
    assert done == set(requests) and not sch.num_active and not sch.in_flight
    assert engine.slots.num_free == engine.max_batch_size and engine.pages.num_free == engine.pages.num_pages
    return out, sch


def graphed_engines(config: dict) -> tuple[Engine, Engine]:
    """On CUDA with graphs: an engine of ``tiny_model(**config)`` whose scheduler switches decodes, and a plain
    SMALL one; asserts that making the first's scheduler captured its target-only decode (at start, every rank
    alike: never mid-serving at a switch)."""
    import torch

    dev = torch.device("cuda")
    switching = Engine(load_config(**tiny_model(**config)), device=dev, use_cuda_graph=True)
    plain = Engine(load_config(**tiny_model(**SMALL)), device=dev, use_cuda_graph=True)
    Scheduler(switching, mode="speculative", overlap=True)
    runner = switching._runners.get("target_only")
    assert runner is not None and runner.enabled
    return switching, plain
