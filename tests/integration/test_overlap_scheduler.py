"""The overlap scheduler (step n + 1 launched before step n's tokens are collected) serves exactly the serial
scheduler's tokens: several concurrent requests with different lengths, stop tokens, EOS, sampled, top-p and
penalised rows, logprobs and cancellations mid-stream, more requests than slots; every slot and page is freed after.

On a CPU the step is synchronous, so this runs the overlap code path without concurrency.
"""

from __future__ import annotations

import pytest

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan
from tensorrt_llm_ext.speculative.step_ops import STOCK_OPS
from tensorrt_llm_ext.testing.requests import make_request
from tensorrt_llm_ext.testing.tiny_models import tiny_model

SMALL = tiny_model(**{"model.target.vocab_size": 301, "model.target.capture_layers": [1], "max_batch_size": 3,
                       "max_seq_len": 48, "kv_cache_config.tokens_per_block": 4})


@pytest.fixture(scope="module")
def engine():
    # The eager twins of the model's kernels (the same ops; the Triton interpreter is the slow part, and the
    # scheduling under test does not depend on the op table).
    import tensorrt_llm_ext.kernels.rms_norm as rms

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rms, "triton_runs_on", lambda t: False)
        eng = Engine(load_config(**SMALL))
        eng.drafter.set_attention_backend("eager")
        mp.setattr(eng.worker("speculative"), "ops", STOCK_OPS)
        yield eng


def _serve(engine, mode: str, overlap: bool, requests: dict[int, dict], cancel_after: dict[int, int],
           arrive_at: dict[int, int]) -> dict[int, list]:
    """Drive a scheduler as the server's engine loop does: requests arrive at given plans and are admitted
    while slots are free; ``cancel_after[h] = m``: cancel ``h`` in the plan after it has received ``m`` or
    more tokens (a stop string found by the server). Returns every handle's events in order."""
    sch = Scheduler(engine, mode=mode, overlap=overlap)
    events: dict[int, list] = {h: [] for h in requests}
    waiting, got, cancels, done = [], {h: 0 for h in requests}, set(), set()
    for i in range(400):
        waiting += [h for h in sorted(requests) if arrive_at.get(h, 0) == i]
        admit = []
        while waiting and len(admit) < sch.num_free_slots + len(cancels):
            h = waiting.pop(0)
            admit.append((h, make_request(**requests[h])))
        evs, _ = sch.apply(StepPlan(cancel=sorted(cancels), admit=admit))
        cancels = set()
        for e in evs:
            assert e.handle not in done, f"handle {e.handle} got an event after it finished: {e}"
            events[e.handle].append(e)
            got[e.handle] += len(e.tokens)
            if e.finish_reason is not None:
                done.add(e.handle)
            elif e.handle in cancel_after and got[e.handle] >= cancel_after[e.handle]:
                cancels.add(e.handle)
        if len(done) == len(requests):
            assert not sch.num_active and not sch.in_flight
            return events
    raise AssertionError(f"requests {sorted(set(requests) - done)} never finished")


def _tokens(evs) -> list[int]:
    return [t for e in evs for t in e.tokens]


def _prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j + 1) % 301 for j in range(3 + i % 4)]


class _LaunchSpy:
    """``engine`` with each launched step's slots appended to ``launches``."""

    def __init__(self, inner, launches: list[list[int]]):
        self.inner, self.launches = inner, launches

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch_step(self, slots, mode="speculative"):
        self.launches.append(list(slots))
        return self.inner.launch_step(slots, mode)


@pytest.fixture(scope="module")
def greedy_ids(engine) -> list[int]:
    """The greedy tokens of ``_prompt(2)`` alone (serial; the target's decode, which speculative equals): stop
    tokens met mid-stream are picked from them."""
    return _tokens(_serve(engine, "reference", False, {0: {"prompt_ids": _prompt(2), "max_new_tokens": 10,
                                                             "ignore_eos": True}}, {}, {})[0])


@pytest.mark.parametrize("mode", ["speculative", "target_only"])
def test_overlap_gives_the_serial_tokens_under_load(engine, greedy_ids, mode):
    eos = sorted(engine.eos_token_ids)
    stop_id = greedy_ids[4]
    reqs = {
        0: {"prompt_ids": _prompt(2), "max_new_tokens": 10, "stop_token_ids": (stop_id,), "ignore_eos": True},
        1: {"prompt_ids": _prompt(1), "max_new_tokens": 3},
        2: {"prompt_ids": _prompt(3), "max_new_tokens": 7, "temperature": 0.8, "seed": 5, "top_p": 0.7},
        3: {"prompt_ids": _prompt(4), "max_new_tokens": 12, "temperature": 1.0, "seed": 2},  # cancelled
        4: {"prompt_ids": _prompt(5), "max_new_tokens": 1},
        5: {"prompt_ids": _prompt(6), "max_new_tokens": 6, "temperature": 1.0, "seed": 9, "frequency_penalty": 0.7,
            "stop_token_ids": tuple(eos), "min_tokens": 2},
        6: {"prompt_ids": _prompt(7), "max_new_tokens": 8, "temperature": 1.0, "seed": 4},  # cancelled
    }
    if mode == "speculative":
        reqs[7] = {"prompt_ids": _prompt(8), "max_new_tokens": 5, "logprobs": 2}
    cancel_after = {3: 4, 6: 1}
    arrive_at = {4: 2, 5: 3, 6: 4}
    serial = _serve(engine, mode, False, reqs, cancel_after, arrive_at)
    overlap = _serve(engine, mode, True, reqs, cancel_after, arrive_at)
    for h in reqs:
        assert overlap[h][-1].finish_reason == serial[h][-1].finish_reason, h
        got, want = _tokens(overlap[h]), _tokens(serial[h])
        if h in cancel_after:
            # A cancellation (a stop string, a disconnect) lands in the plan after the event that asked for it:
            # the serial loop may have delivered that plan's step too (a prefill and a step share a plan), the
            # overlap loop delivers the step one plan later -- its tokens are a prefix, never past the ask.
            assert cancel_after[h] <= len(got) <= len(want) and got == want[:len(got)], h
        else:
            assert got == want, h
    assert _tokens(serial[0]) == greedy_ids[:greedy_ids.index(stop_id) + 1] and serial[0][-1].finish_reason == "stop"
    assert serial[3][-1].finish_reason == "cancelled" and len(_tokens(serial[3])) < 12
    assert len(_tokens(serial[1])) == 3 and len(_tokens(serial[4])) == 1
    if mode == "speculative":
        lp = [x for e in overlap[7] for x in e.logprobs]
        want = [x for e in serial[7] for x in e.logprobs]
        # Request 7 may share its batched prefill with other requests in one run and not in the other: its
        # K/V (and so its logprobs) round like another GEMM shape's (<= 1e-5 here); the top-k ids are the same.
        assert len(lp) == len(_tokens(overlap[7])) == 5 and len(want) == 5
        for (v, top), (v_want, top_want) in zip(lp, want):
            assert v == pytest.approx(v_want, abs=1e-5) and [i for i, _ in top] == [i for i, _ in top_want]
            assert [x for _, x in top] == pytest.approx([x for _, x in top_want], abs=1e-5)
    assert engine.slots.num_free == SMALL["max_batch_size"]
    assert engine.pages.num_free == engine.pages.num_pages


def test_a_request_stopped_by_its_step_is_not_advanced_into_the_next(engine, greedy_ids):
    """Overlap: the row of a request that its collected step ended is already in the launched step; its tokens
    there are discarded, its slot is free at once and is served again correctly."""
    calls: list[list[int]] = []
    sch = Scheduler(_LaunchSpy(engine, calls), overlap=True)
    long = {"prompt_ids": _prompt(1), "max_new_tokens": 30, "ignore_eos": True}
    short_ids = greedy_ids
    short = {"prompt_ids": _prompt(2), "max_new_tokens": 10, "ignore_eos": True, "stop_token_ids": (short_ids[2],)}
    evs, _ = sch.apply(StepPlan(admit=[(0, Request(**long)), (1, Request(**short))], run=False))
    got = {0: _tokens([e for e in evs if e.handle == 0]), 1: _tokens([e for e in evs if e.handle == 1])}
    finished_at = None
    for i in range(12):
        evs, _ = sch.apply(StepPlan())
        for e in evs:
            assert not (e.handle == 1 and finished_at is not None), "tokens after the stop reached the client"
            got[e.handle] += e.tokens
            if e.handle == 1 and e.finish_reason is not None:
                assert e.finish_reason == "stop"
                finished_at = i
        if finished_at is not None and i > finished_at + 2:
            break
    assert got[1] == short_ids[:short_ids.index(short_ids[2]) + 1]
    assert engine.slots.num_free == SMALL["max_batch_size"] - 1  # only the long request holds a slot
    slot_of_short = [s for s in calls[0] if s not in calls[-1]]
    assert len(calls[-1]) == 1 and slot_of_short, calls
    # The freed slot serves a new request with the tokens it gets alone.
    again = {"prompt_ids": _prompt(2), "max_new_tokens": 6, "ignore_eos": True}
    evs, _ = sch.apply(StepPlan(cancel=[0], admit=[(2, Request(**again))]))
    out = _tokens([e for e in evs if e.handle == 2])
    while sch.num_active:
        evs, _ = sch.apply(StepPlan())
        out += _tokens([e for e in evs if e.handle == 2])
    assert out == short_ids[:6]
    assert not sch.in_flight and engine.slots.num_free == SMALL["max_batch_size"]
    assert engine.pages.num_free == engine.pages.num_pages


def test_overlap_is_on_by_default_and_off_by_flag_or_config(tmp_path, caplog):
    from tensorrt_llm_ext.cli import build_parser
    from tensorrt_llm_ext.runtime.serve_cli import use_overlap_scheduler

    parser = build_parser()
    assert parser.parse_args(["serve"]).disable_overlap_scheduler is False
    assert parser.parse_args(["serve", "--disable-overlap-scheduler"]).disable_overlap_scheduler is True
    cfg = load_config(**SMALL)
    off = tmp_path / "off.yaml"
    off.write_text("disable_overlap_scheduler: true\n")
    off_cfg = load_config(off)
    assert off_cfg.disable_overlap_scheduler and ("disable_overlap_scheduler", True) not in [
        (p, v) for p, v, _ in off_cfg.no_effect_fields()]
    with caplog.at_level("INFO", logger="tensorrt_llm_ext"):
        assert use_overlap_scheduler(cfg) is True
        assert use_overlap_scheduler(cfg, True) is False and use_overlap_scheduler(off_cfg) is False
        assert use_overlap_scheduler(cfg, log=False) is True
    lines = [r.getMessage() for r in caplog.records if "overlap scheduler" in r.getMessage()]
    assert len(lines) == 3 and "on:" in lines[0] and all("off (" in m for m in lines[1:])


def test_a_step_refused_at_launch_fails_its_requests_and_the_engine_serves_on(engine, greedy_ids):
    """Overlap: a request-level error raised by the launch of step n + 1 still delivers step n's tokens, fails
    the requests of step n + 1 (slots freed, step state reset) and later plans are served exactly."""

    class RefusingLaunch:
        def __init__(self, inner, refuse_call: int):
            self.inner, self.refuse_call, self.calls = inner, refuse_call, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def launch_step(self, slots, mode="speculative"):
            self.calls += 1
            if self.calls == self.refuse_call:
                raise ValueError("a value the step refused")
            return self.inner.launch_step(slots, mode)

    sch = Scheduler(RefusingLaunch(engine, refuse_call=3), overlap=True)
    req = {"prompt_ids": _prompt(2), "max_new_tokens": 10, "ignore_eos": True}
    evs, _ = sch.apply(StepPlan(admit=[(0, Request(**req))], run=False))
    got = _tokens(evs)
    for _ in range(3):
        evs, _ = sch.apply(StepPlan())
        got += _tokens(evs)
    assert evs[-1].finish_reason == "error" and "a value the step refused" in evs[-1].error
    assert got == greedy_ids[:len(got)] and len(got) > 1  # step 1's tokens were delivered before the failure
    assert not sch.num_active and not sch.in_flight and engine.slots.num_free == SMALL["max_batch_size"]
    evs, _ = sch.apply(StepPlan(admit=[(1, Request(**dict(req, max_new_tokens=4)))]))
    out = _tokens(evs)
    while sch.num_active:
        evs, _ = sch.apply(StepPlan())
        out += _tokens(evs)
    assert out == greedy_ids[:4] and engine.pages.num_free == engine.pages.num_pages


def test_a_handle_admitted_again_while_its_old_row_is_in_flight_gets_only_its_own_tokens(engine, greedy_ids):
    """Overlap, handles chosen by the caller: handle 0 stops (its row is already in the launched step n + 1, another
    request keeps the pipeline full) and is admitted at once for a new request. Step n + 1's row for the old request
    is discarded, never delivered to the new one (was: the new request got the stopped one's next token first)."""
    stop = greedy_ids[1]
    first = Request(_prompt(2), 10, stop_token_ids=(stop,), ignore_eos=True)
    again = Request(_prompt(2), 5, ignore_eos=True)  # the same prompt: its tokens are greedy_ids[:5]
    other = Request(_prompt(1), 12, ignore_eos=True)
    sch = Scheduler(engine, mode="reference", overlap=True)
    evs, _ = sch.apply(StepPlan(admit=[(0, first), (1, other)]))
    old = _tokens([e for e in evs if e.handle == 0])
    while not any(e.handle == 0 and e.finish_reason for e in evs):
        evs, _ = sch.apply(StepPlan())
        old += _tokens([e for e in evs if e.handle == 0])
    assert old == greedy_ids[:2] and sch.in_flight  # its row is in the launched step, beside request 1's
    evs, _ = sch.apply(StepPlan(admit=[(0, again)]))
    new = _tokens([e for e in evs if e.handle == 0])
    while sch.num_active or sch.in_flight:
        evs, _ = sch.apply(StepPlan())
        new += _tokens([e for e in evs if e.handle == 0])
    assert new == greedy_ids[:5]
    assert engine.slots.num_free == SMALL["max_batch_size"] and engine.pages.num_free == engine.pages.num_pages


def test_a_prefill_behind_a_step_is_read_back_a_plan_later(engine, greedy_ids):
    """Overlap: a plan that prefills while requests decode launches the prefill behind the step and reads its first
    tokens back a plan later (the host never waits there for the step in flight), the requests joining the next
    launch at once -- but one whose first token is its last, which sits it out. A first token that is a stop ends
    its request (its row in the launched step discarded); a request asking for logprobs is read back at once (its
    prefill's logits are read now); one cancelled before its first token is read back gets no token. Every request
    gets the tokens it gets alone; every slot and page is free after."""
    launches: list[list[int]] = []
    sch = Scheduler(_LaunchSpy(engine, launches), overlap=True)
    a = make_request(prompt_ids=_prompt(2), max_new_tokens=24, ignore_eos=True)
    evs, _ = sch.apply(StepPlan(admit=[(0, a)], run=False))  # nothing in flight: read back at once
    assert _tokens(evs) == greedy_ids[:1]
    got = {0: _tokens(evs)}
    evs, _ = sch.apply(StepPlan())
    got[0] += _tokens(evs)

    def run(plan):
        evs, stats = sch.apply(plan)
        for e in evs:
            got.setdefault(e.handle, [])
            got[e.handle] += e.tokens
        return evs, stats

    last_token = make_request(prompt_ids=_prompt(2), max_new_tokens=1, ignore_eos=True)
    stops_at_first = make_request(prompt_ids=_prompt(2), max_new_tokens=8, stop_token_ids=(greedy_ids[0],))
    evs, stats = run(StepPlan(admit=[(1, last_token), (2, stops_at_first)]))
    assert {e.handle for e in evs} == {0} and stats.num_prefills == 0  # launched, not read back
    assert stats.deferred_prefills == 2
    slot_of = {h: sch._live[h].slot for h in (1, 2)}
    evs, stats = run(StepPlan())
    ends = {e.handle: e.finish_reason for e in evs if e.finish_reason}
    assert ends == {1: "length", 2: "stop"} and stats.num_prefills == 2
    assert got[1] == greedy_ids[:1] and got[2] == greedy_ids[:1]
    assert slot_of[1] not in launches[-1] and slot_of[2] in launches[-1]  # its row is discarded at the collect
    # logprobs: the first token in the plan that prefills it, with its logprob
    evs, _ = run(StepPlan(admit=[(3, make_request(prompt_ids=_prompt(2), max_new_tokens=3, ignore_eos=True,
                                                   logprobs=1))]))
    first = [e for e in evs if e.handle == 3]
    assert [e.tokens for e in first] == [greedy_ids[:1]] and first[0].logprobs
    # cancelled before its first token is read back: the cancel, no token
    evs, _ = run(StepPlan(admit=[(4, make_request(prompt_ids=_prompt(1), max_new_tokens=6, ignore_eos=True))]))
    assert not [e for e in evs if e.handle == 4]
    evs, _ = run(StepPlan(cancel=[4]))
    assert [(e.tokens, e.finish_reason) for e in evs if e.handle == 4] == [([], "cancelled")]
    while sch.num_active or sch.in_flight:
        evs, _ = run(StepPlan())
        assert not [e for e in evs if e.handle == 4]
    alone = _tokens(_serve(engine, "reference", False, {0: {"prompt_ids": _prompt(2), "max_new_tokens": 24,
                                                            "ignore_eos": True}}, {}, {})[0])
    assert got[0] == alone and got[3] == greedy_ids[:3] and got[4] == []
    assert engine.slots.num_free == SMALL["max_batch_size"] and engine.pages.num_free == engine.pages.num_pages


@pytest.mark.parametrize("mode", ["speculative", "target_only"])
def test_chunked_prompts_arriving_while_others_decode_give_the_serial_tokens(mode):
    """Chunked prefill under the overlap scheduler: prompts longer than a plan's token budget arrive while others
    decode; their chunks run between the steps and their last chunk's prefill is read back a plan later. Every
    request gets the serial loop's tokens; every slot and page is free after."""
    import tensorrt_llm_ext.kernels.rms_norm as rms

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rms, "triton_runs_on", lambda t: False)
        eng = Engine(load_config(**{**SMALL, "enable_chunked_prefill": True, "max_num_tokens": 5}))
        eng.drafter.set_attention_backend("eager")
        mp.setattr(eng.worker("speculative"), "ops", STOCK_OPS)
        long = [(5 * j + 2) % 301 for j in range(13)]
        reqs = {0: {"prompt_ids": _prompt(2), "max_new_tokens": 14, "ignore_eos": True},
                1: {"prompt_ids": long, "max_new_tokens": 6, "ignore_eos": True},
                2: {"prompt_ids": long[3:] + [9], "max_new_tokens": 5, "temperature": 0.9, "seed": 3,
                    "ignore_eos": True},
                3: {"prompt_ids": _prompt(5), "max_new_tokens": 1}}
        arrive_at = {1: 2, 2: 3, 3: 4}
        serial = _serve(eng, mode, False, reqs, {}, arrive_at)
        overlap = _serve(eng, mode, True, reqs, {}, arrive_at)
        for h in reqs:
            assert _tokens(overlap[h]) == _tokens(serial[h]) and len(_tokens(serial[h])) == reqs[h]["max_new_tokens"], h
        assert eng.slots.num_free == SMALL["max_batch_size"] and eng.pages.num_free == eng.pages.num_pages
