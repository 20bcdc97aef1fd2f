"""The OpenAI fields of ``trtllm-ext serve`` through the ``openai`` client and raw HTTP (one in-process
server on the small token-id model): logprobs against a ``torch.log_softmax`` reference, ``n``, seeds,
``max_completion_tokens``, stop ids inside an accepted speculative block, refused fields naming themselves,
the queue bound under a burst, and requests ended by the drain deadline."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import torch  # noqa: E402

from tensorrt_llm_ext.runtime.config import load_config  # noqa: E402
from tensorrt_llm_ext.runtime.engine import Engine  # noqa: E402
from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.requests import Request  # noqa: E402
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan  # noqa: E402
from tensorrt_llm_ext.testing.server import (KERNEL_LOCK, SMALL_SERVE_CONFIG, requests_in_flight_then,  # noqa: E402
                                              start_in_process)
from tensorrt_llm_ext.testing.requests import make_request

SMALL = SMALL_SERVE_CONFIG
VOCAB = SMALL["model.target.vocab_size"]
SLOTS = SMALL["max_batch_size"]
PROMPT = [17, 305 % VOCAB, 42, 9]


@pytest.fixture(scope="module")
def server():
    srv = start_in_process(SMALL)
    yield srv
    srv.stop(30)


@pytest.fixture(scope="module")
def ref_engine():
    with KERNEL_LOCK:  # the interpreter is not thread-safe: never beside a server's step
        return Engine(load_config(**SMALL))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _events(engine: Engine, fields: dict, mode: str = "speculative") -> list:
    """The scheduler's events for one request alone (prefill, then one event per step)."""
    with KERNEL_LOCK:
        sch = Scheduler(engine, mode=mode)
        events, _ = sch.apply(StepPlan(admit=[(0, make_request(**fields))], run=False))
        while sch.num_active:
            events += sch.apply(StepPlan())[0]
    return events


def _reference_logprobs(engine: Engine, prompt: list[int], out: list[int]):
    """Teacher-forced raw target logits -> ``torch.log_softmax``: ``[n, V]`` (vLLM's default ``logprobs_mode``,
    ``raw_logprobs``: the model's distribution before temperature, top-p and every processing field)."""
    seq = prompt + out[:-1]
    with KERNEL_LOCK:
        engine.pages.allocate(0, engine.pages.max_pages_per_slot)  # slot 0's cache pages, for this forward only
        try:
            hidden = engine.target(torch.tensor([seq]), torch.arange(len(seq))[None],
                                   torch.tensor([0], dtype=torch.int32), engine.state.kv_cache).hidden_states
        finally:
            engine.pages.free(0)
        logits = engine.target.logits(hidden)[len(prompt) - 1:].float()
    return torch.log_softmax(logits, dim=-1)


def _check_against_reference(lp: torch.Tensor, tokens: list[int], chosen: list[float], tops: list[list], k: int):
    """``chosen[i]`` and the top ``k`` of ``tops[i]`` (``[(id, value)]``, ties to the lowest id) against ``lp``."""
    torch.testing.assert_close(torch.tensor(chosen), lp[torch.arange(len(tokens)), torch.tensor(tokens)],
                               atol=1e-4, rtol=0)
    for row, top in enumerate(tops):
        vals, ids = torch.topk(lp[row], k)
        assert [i for i, _ in top] == ids.tolist(), (row, top, ids)
        torch.testing.assert_close(torch.tensor([v for _, v in top]), vals, atol=1e-4, rtol=0)


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 0.9)])
def test_logprobs_and_n_match_log_softmax_reference(client, ref_engine, temperature, top_p):
    """Two choices (``SamplingParams.for_choice`` 0 and 1) with logprobs=3: tokens equal the engine's for those
    seeds; each token's logprob and the top 3 equal ``torch.log_softmax`` of the teacher-forced raw logits
    (1e-4) at every temperature and top-p (vLLM's ``raw_logprobs``)."""
    out = client.completions.create(model="dspark-embedded", prompt=PROMPT, max_tokens=6, n=2, seed=40,
                                    temperature=temperature, top_p=top_p, logprobs=3)
    assert len(out.choices) == 2 and sorted(c.index for c in out.choices) == [0, 1]
    for c in out.choices:
        with KERNEL_LOCK:
            drawn = SamplingParams(temperature=temperature, seed=40, top_p=top_p).for_choice(c.index)
            ref = ref_engine.generate([Request(PROMPT, 6, sampling=drawn)], "reference")[0][0]  # lossless: equal
        tokens = c.to_dict()["token_ids"]
        assert tokens == ref.output_ids and _ids(c.logprobs.tokens) == tokens
        tops = [[(int(k.removeprefix("token_id:")), v) for k, v in top.items()] for top in c.logprobs.top_logprobs]
        _check_against_reference(_reference_logprobs(ref_engine, PROMPT, tokens), tokens,
                                 c.logprobs.token_logprobs, tops, 3)
    assert out.usage.prompt_tokens == len(PROMPT)
    assert out.usage.completion_tokens == sum(len(c.to_dict()["token_ids"]) for c in out.choices)
    if temperature > 0:
        assert out.choices[0].to_dict()["token_ids"] != out.choices[1].to_dict()["token_ids"]


PROCESSED = {"top_k": dict(temperature=0.9, top_k=5), "min_p": dict(temperature=0.9, min_p=0.2),
             "penalties": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
             "logit_bias": dict(logit_bias=((7, 5.0), (42, -100.0)))}


@pytest.mark.parametrize("mode", ["speculative", "target_only"])
@pytest.mark.parametrize("field", list(PROCESSED))
def test_logprobs_with_every_processing_field_and_without_speculation(ref_engine, field, mode):
    """logprobs with top_k / min_p / penalties / logit_bias, speculative and target-only (``--no-speculation``):
    the raw model distribution, equal to ``torch.log_softmax`` of the teacher-forced raw logits (1e-4); the
    tokens are those of the processed request (the same in both modes)."""
    fields = dict(prompt_ids=PROMPT, max_new_tokens=4, seed=11, logprobs=4, **PROCESSED[field])
    events = _events(ref_engine, fields, mode)
    assert events[-1].finish_reason == "length" and all(e.error is None for e in events)
    tokens = [t for e in events for t in e.tokens]
    lps = [lp for e in events for lp in e.logprobs]
    assert len(tokens) == len(lps) == 4
    _check_against_reference(_reference_logprobs(ref_engine, PROMPT, tokens), tokens, [c for c, _ in lps],
                             [top for _, top in lps], 4)
    with KERNEL_LOCK:
        fields.pop("logprobs")
        # speculative: the target's own decode of the processed request, which it equals token for token
        alone = ref_engine.generate([make_request(**fields)], "reference" if mode == "speculative" else mode)[0][0]
    assert alone.output_ids == tokens


def test_logprobs_with_a_processing_field_over_http(client, ref_engine):
    """The server serves logprobs beside a processing field (was: a 400 naming logprobs)."""
    out = client.completions.create(model="dspark-embedded", prompt=PROMPT, max_tokens=4, seed=3, temperature=0.7,
                                    logprobs=2, extra_body={"top_k": 4, "repetition_penalty": 1.2})
    c = out.choices[0]
    tokens = c.to_dict()["token_ids"]
    tops = [[(int(k.removeprefix("token_id:")), v) for k, v in top.items()] for top in c.logprobs.top_logprobs]
    _check_against_reference(_reference_logprobs(ref_engine, PROMPT, tokens), tokens, c.logprobs.token_logprobs,
                             tops, 2)


def test_max_completion_tokens_and_streamed_usage(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_completion_tokens": 3}, timeout=120)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert len(ch["token_ids"]) == 3 and ch["finish_reason"] == "length"
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": PROMPT, "max_tokens": 5, "stream": True, "logprobs": 1,
                            "stream_options": {"include_usage": True}}) as s:
        for line in s.iter_lines():
            if line:
                chunks.append(line.removeprefix("data: "))
    assert chunks[-1] == "[DONE]"
    body = [json.loads(c) for c in chunks[:-1]]
    assert body[-1]["choices"] == [] and body[-1]["usage"]["completion_tokens"] == 5
    tokens = [t for b in body[:-1] for t in b["choices"][0]["token_ids"]]
    lp_tokens = [t for b in body[:-1] for t in _ids(b["choices"][0]["logprobs"]["tokens"])]
    assert len(tokens) == 5 and lp_tokens == tokens


def test_stop_id_inside_an_accepted_block_cuts_the_block(server, ref_engine):
    """A stop id that is not the last token of its accepted block: the tokens after it are dropped, the
    stop token is the last one, usage counts exactly those, the slot is freed; ``min_tokens`` past it runs on."""
    fields = dict(prompt_ids=PROMPT, max_new_tokens=16)
    events = _events(ref_engine, fields)
    full = [t for e in events for t in e.tokens]
    at, pos = None, 0
    for e in events:
        if e.accepted_len is not None and e.accepted_len >= 2:
            for j, t in enumerate(e.tokens[:-1]):
                if t not in full[:pos + j]:
                    at = pos + j
                    break
        if at is not None:
            break
        pos += len(e.tokens)
    assert at is not None, f"no accepted block of >= 2 tokens with a fresh token: {[e.accepted_len for e in events]}"
    stop = full[at]
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 16, "stop_token_ids": [stop]}).json()
    ch = r["choices"][0]
    assert ch["token_ids"] == full[:at + 1] and ch["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == at + 1
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 16, "stop": [stop], "min_tokens": at + 1}).json()
    later = [i for i, t in enumerate(full) if t == stop and i > at]
    expect = full[:later[0] + 1] if later else full
    assert r["choices"][0]["token_ids"] == expect
    assert httpx.get(server.url + "/health", timeout=10).json()["free_slots"] == SLOTS


def _all_reference_logprobs(engine: Engine, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax rows predicting ``prompt[1:] + out`` (teacher forced from position 0)."""
    return _reference_logprobs(engine, prompt[:1], prompt[1:] + out)


def _tops(top_logprobs: list) -> list[list]:
    return [[(int(k.removeprefix("token_id:")), v) for k, v in top.items()] for top in top_logprobs]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_gives_every_prompt_token_its_logprob(server, ref_engine, stream):
    """The legacy completions API's scoring call (lm-eval's loglikelihood): ``echo`` with ``logprobs`` returns the
    prompt's tokens and then the output's, the first prompt token without a logprob (null), every other one's
    logprob and top 2 equal to ``torch.log_softmax`` of the teacher-forced logits, streamed or not."""
    prompt = PROMPT + [5, 77 % VOCAB, 3, 250 % VOCAB]
    body = {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0.0, "stream": stream}
    if stream:
        tokens, lps, tops, ids = [], [], [], []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                c = json.loads(line[6:])["choices"][0]
                ids += c.get("prompt_token_ids", []) + c["token_ids"]
                tokens += c["logprobs"]["tokens"]
                lps += c["logprobs"]["token_logprobs"]
                tops += c["logprobs"]["top_logprobs"]
        out = ids[len(prompt):]
    else:
        c = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        out = c["token_ids"]
        assert c["prompt_token_ids"] == prompt
        tokens, lps, tops = c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]
        assert c["logprobs"]["text_offset"][0] == 0
    assert len(out) == 3 and _ids(tokens) == prompt + out
    assert lps[0] is None and tops[0] is None
    _check_against_reference(_all_reference_logprobs(ref_engine, prompt, out), prompt[1:] + out, lps[1:],
                             _tops(tops[1:]), 2)


@pytest.mark.parametrize("extra", [{}, {"enable_chunked_prefill": True, "max_num_tokens": 5},
                                   {"kv_cache_config.enable_block_reuse": True, "kv_cache_config.tokens_per_block": 4}])
@pytest.mark.parametrize("mode", ["speculative", "target_only"])
def test_prompt_logprobs_in_the_engine_chunked_and_with_prefix_reuse(ref_engine, extra, mode):
    """Request.prompt_logprobs through the scheduler: one prefill, a prompt in chunks (each chunk's positions
    computed as it runs) and an engine with prefix reuse whose cache already holds the prompt (the request
    prefills it whole all the same): the prompt tokens' logprobs and top 3 equal ``torch.log_softmax`` of the
    teacher-forced logits, the generated tokens those of a plain request."""
    with KERNEL_LOCK:
        eng = Engine(load_config(**{**SMALL, **extra}))
    prompt = [(7 * i + 3) % VOCAB for i in range(13)]
    if extra.get("kv_cache_config.enable_block_reuse"):
        _events(eng, dict(prompt_ids=prompt, max_new_tokens=2), mode)  # the prompt's pages are cached now
        assert eng.pages.num_cached > 0
    hits = eng.pages.prefix_hits
    events = _events(eng, dict(prompt_ids=prompt, max_new_tokens=3, prompt_logprobs=3), mode)
    assert eng.pages.prefix_hits == hits  # looked up nothing: its positions are its own forward's
    assert [e.prompt_logprobs is not None for e in events] == [True] + [False] * (len(events) - 1)
    out = [t for e in events for t in e.tokens]
    plain = [t for e in _events(eng, dict(prompt_ids=prompt, max_new_tokens=3), mode) for t in e.tokens]
    assert out == plain
    lps = events[0].prompt_logprobs
    assert len(lps) == len(prompt) - 1
    ref = _all_reference_logprobs(ref_engine, prompt, out)[:len(prompt) - 1]
    _check_against_reference(ref, prompt[1:], [lp for lp, _ in lps], [top for _, top in lps], 3)


@pytest.mark.parametrize("body,param", [
    ({"prompt": [1], "logprobs": 21}, "logprobs"),
    ({"prompt": [1], "n": 0}, "n"),
    ({"prompt": [1], "temperature": -1.0}, "temperature"),
    ({"prompt": [1], "top_p": 1.5}, "top_p"),
    ({"prompt": [1], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"prompt": [1], "min_tokens": -1}, "min_tokens"),
    ({"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [1], "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"prompt": [1], "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"prompt": [[1, 2], [3]], "seed": 2**63, "temperature": 0.5}, "seed"),
    ({"prompt": [[1]] * 9, "n": 128}, "n"),  # more than slots + queue (8 + 1024) at once: a 400, not a 429
])
def test_refused_fields_name_themselves(client, body, param):
    extra = {k: v for k, v in body.items() if k != "prompt"}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="dspark-embedded", prompt=body["prompt"], extra_body=extra)
    err = e.value.body if "error" not in (e.value.body or {}) else e.value.body["error"]
    assert err["param"] == param and param in err["message"], err


def test_chat_without_tokenizer_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="dspark-embedded", messages=[{"role": "user", "content": "hi"}])
    err = e.value.body if "error" not in (e.value.body or {}) else e.value.body["error"]
    assert err["param"] == "messages" and "tokenizer" in err["message"]


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": [1, 2], "temperature": Infinity}', "temperature"),
    (b'{"prompt": [1, 2], "temperature": 1e400}', "temperature"),
    (b"\x00\xff\xfe garbage", "body"),
    (b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}", "body"),
])
def test_odd_bodies_get_the_openai_error_object(server, raw, param):
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
    assert r.json()["error"]["param"] == param


def test_burst_at_an_idle_server_fills_free_slots_before_the_queue():
    """8 free slots, max_queue 2: 10 simultaneous requests all fit (8 admitted + 2 waiting)."""
    srv = start_in_process(SMALL, max_queue=2)
    try:
        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json={"prompt": [k + 1, 2], "max_tokens": 2})
                                              for k in range(SLOTS + 2)))

        codes = [r.status_code for r in asyncio.run(burst())]
        assert codes == [200] * (SLOTS + 2), codes
    finally:
        srv.stop(30)


def test_queue_bound_counts_waiting_requests_only():
    from tensorrt_llm_ext.runtime.engine_loop import EngineLoop, PlanChannel, QueueFull, ServerMetrics, Sink

    class _Slots:  # an idle engine with 8 free slots; the loop thread is never started
        num_free_slots, num_active = 8, 0

    loop = EngineLoop(_Slots(), PlanChannel(None), ServerMetrics(3), max_queue=4)
    sink = Sink(None, None)
    assert len(loop.submit([Request([1])] * 12, sink)) == 12  # 8 go to free slots, 4 wait
    with pytest.raises(QueueFull):
        loop.submit([Request([1])], sink)


def test_engine_loop_start_shortens_the_interpreter_switch_interval(caplog):
    """The engine thread shares the interpreter lock with the event loop and output threads: starting the loop
    lowers Python's switch interval (5 ms by default) to SERVE_SWITCH_INTERVAL_S and says so once."""
    import sys

    from tensorrt_llm_ext.runtime.engine_loop import (SERVE_SWITCH_INTERVAL_S, EngineLoop, PlanChannel,
                                                      ServerMetrics)

    class _Slots:
        num_free_slots, num_active = 2, 0

    class _NoThread:  # the loop's own thread is not what is tested here
        def start(self):
            pass

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(5e-3)
        loop = EngineLoop(_Slots(), PlanChannel(None), ServerMetrics(3), max_queue=4)
        loop._thread = _NoThread()
        with caplog.at_level("INFO"):
            loop.start()
        assert sys.getswitchinterval() == pytest.approx(SERVE_SWITCH_INTERVAL_S)
        assert sum("switch interval" in r.getMessage() for r in caplog.records) == 1
    finally:
        sys.setswitchinterval(before)


def test_requests_running_at_the_drain_deadline_end_with_503_and_free_their_slots(server):
    """What the drain deadline does (EngineLoop.abort_all): plain requests get a 503 error object, streams an
    error chunk then [DONE]; every slot comes back."""
    body = {"prompt": [5, 6], "max_tokens": 36}

    results = asyncio.run(requests_in_flight_then(
        server.url, body, 3, lambda: server.loop.abort_all("the server is shutting down")))
    for r in results[:3]:
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert r.json()["error"]["type"] == "service_unavailable"
    ended = [r for r in results[:3] if r.status_code == 503]
    for lines in results[3:]:
        assert lines[-1] == "[DONE]"
        last = json.loads(lines[-2])
        if "error" in last:
            ended.append(last)
            assert last["error"]["code"] == 503
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert ended  # 36 tokens per request cannot all be done by the first step
    deadline = time.monotonic() + 60
    while httpx.get(server.url + "/health", timeout=10).json()["free_slots"] != SLOTS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(server.url + "/health", timeout=10).json()["free_slots"] == SLOTS


def test_a_client_leaving_mid_body_is_no_error(server):
    """A half-sent body then a closed socket: no traceback in the server, which stays healthy (http_inputs.py)."""
    import logging
    import socket
    from urllib.parse import urlparse

    url = urlparse(server.url)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    uv = logging.getLogger("uvicorn.error")
    uv.addHandler(handler)
    try:
        s = socket.create_connection((url.hostname, url.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\"")
        time.sleep(0.5)
        s.close()
        deadline = time.monotonic() + 2  # the disconnect is handled within milliseconds; a traceback would be too
        while time.monotonic() < deadline and not records:
            time.sleep(0.1)
    finally:
        uv.removeHandler(handler)
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage() for r in records]
    assert httpx.get(server.url + "/health", timeout=10).json()["healthy"]
