"""``trtllm-ext serve`` on loopback: a real HTTP client against the server (one shared in-process server;
the SIGTERM tests start and stop their own process, since the signal and the exit code are the point).

The server's outputs are compared with :meth:`Engine.generate` on the same config and prompts (ids
bitwise). Tests run in file order on one server; the last one stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prom_parser = pytest.importorskip("prometheus_client.parser")

from tensorrt_llm_ext.runtime.config import load_config  # noqa: E402
from tensorrt_llm_ext.testing.server import (SMALL_SERVE_CONFIG, reference_outputs,  # noqa: E402
                                             requests_in_flight_then, sample_bodies, start_in_process, start_server)

SMALL = SMALL_SERVE_CONFIG
VOCAB = SMALL["model.target.vocab_size"]
BODIES = sample_bodies(16, VOCAB)
BODIES[3]["stop"] = [7, 11]
LONG = {"prompt": [9, 8, 7], "max_tokens": 8}


def _reference(bodies: list[dict]) -> list[list[int]]:
    return reference_outputs(SMALL, bodies)


@pytest.fixture(scope="module")
def reference():
    return _reference(BODIES + [LONG])


def _start(d, drain_timeout: float = 60, host: str = "127.0.0.1"):
    cfg = d / "small.yaml"
    cfg.write_text(json.dumps(load_config(**SMALL).model_dump(mode="json", exclude_unset=True)))
    return start_server(["--config", str(cfg), "--drain-timeout", str(drain_timeout)], str(d / "server.log"),
                        host=host)


@pytest.fixture(scope="module")
def server():
    srv = start_in_process(SMALL)
    yield srv
    srv.stop(30)


async def _post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300.0) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


def _metrics(url: str) -> dict[str, float]:
    """Samples by name and labels, the ``model_name`` and ``engine`` labels (on every sample) left out of the key."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in prom_parser.text_string_to_metric_families(text):
        for s in fam.samples:
            assert s.labels.get("model_name") == "dspark-embedded" and s.labels.get("engine") == "0", s
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            out[s.name + (json.dumps(labels, sort_keys=True) if labels else "")] = s.value
    return out


def test_concurrent_requests_equal_generate(server, reference):
    """16 concurrent requests over 8 slots: the rest queue and complete; ids equal Engine.generate's."""
    responses = asyncio.run(_post_all(server.url, BODIES))
    assert [r.status_code for r in responses] == [200] * len(BODIES), [r.text for r in responses if r.status_code != 200]
    got = [r.json()["choices"][0]["token_ids"] for r in responses]
    assert got == reference[:len(BODIES)]
    usage = responses[0].json()["usage"]
    assert usage["prompt_tokens"] == len(BODIES[0]["prompt"]) and usage["completion_tokens"] == len(got[0])
    assert responses[3].json()["choices"][0]["finish_reason"] in ("stop", "length")
    m = _metrics(server.url)
    assert m["trtllm_ext_request_success_total" + json.dumps({"finished_reason": "length"})] >= 1
    assert m["trtllm_ext_generation_tokens_total"] >= sum(len(g) for g in got)
    assert m["trtllm_ext_acceptance_length_count"] > 0 and m["trtllm_ext_engine_steps_total"] > 0
    assert "trtllm_ext_num_requests_waiting" in m and "trtllm_ext_step_seconds_count" in m


def test_streaming_chunks_in_order_then_done(server, reference):
    body = {**BODIES[0], "stream": True}
    tokens, finish, done, events = [], None, False, 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                continue
            assert finish is None  # nothing after the finishing chunk but [DONE]
            choice = json.loads(payload)["choices"][0]
            tokens += choice["token_ids"]
            finish = choice["finish_reason"]
            events += 1
    assert done and finish == "length" and tokens == reference[0] and events >= 2


def test_bad_requests_answer_400_naming_the_field_and_the_batch_is_unaffected(server, reference):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300.0) as c:
            good = [asyncio.create_task(c.post("/v1/completions", json=b)) for b in BODIES[:4]]
            bad = {
                "prompt": await c.post("/v1/completions", json={"prompt": [], "max_tokens": 3}),
                "prompt ": await c.post("/v1/completions", json={"prompt": [1, VOCAB], "max_tokens": 3}),
                "max_tokens": await c.post("/v1/completions", json={"prompt": [1], "max_tokens": 0}),
                "max_tokens ": await c.post("/v1/completions", json={"prompt": [1], "max_tokens": 200}),
                "frequency_penalty": await c.post("/v1/completions", json={"prompt": [1], "frequency_penalty": 2.5}),
                "body": await c.post("/v1/completions", content=b'{"prompt": [1, 2', 
                                     headers={"content-type": "application/json"}),
                "prompt  ": await c.post("/v1/completions", json={"prompt": [1, 2.7]}),
                "temperature": await c.post("/v1/completions", json={"prompt": [1], "temperature": -1.0}),
            }
            return await asyncio.gather(*good), bad

    good, bad = asyncio.run(run())
    for field, r in bad.items():
        assert r.status_code == 400, (field, r.text)
        err = r.json()["error"]
        assert err["param"] == field.strip() and field.strip() in err["message"], (field, err)
    assert [r.json()["choices"][0]["token_ids"] for r in good] == reference[:4]
    assert httpx.get(server.url + "/health", timeout=10).json()["healthy"]


def test_openai_client(server, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=BODIES[0]["prompt"], max_tokens=BODIES[0]["max_tokens"])
    assert out.choices[0].to_dict()["token_ids"] == reference[0]


def test_disconnect_frees_the_slot(server):
    before = _metrics(server.url).get("trtllm_ext_request_success_total" + json.dumps({"finished_reason": "abort"}), 0)
    with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 36, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = _metrics(server.url)
        cancelled = m.get("trtllm_ext_request_success_total" + json.dumps({"finished_reason": "abort"}), 0)
        if cancelled > before and m["trtllm_ext_num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert cancelled == before + 1
    assert httpx.get(server.url + "/health", timeout=10).json()["free_slots"] == SMALL["max_batch_size"]


def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path, reference):
    server = _start(tmp_path)
    result = {}

    def post():
        result["r"] = httpx.post(server.url + "/v1/completions", json=LONG, timeout=300)

    t = threading.Thread(target=post)
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and httpx.get(server.url + "/health", timeout=10).json()["active"] == 0:
        time.sleep(0.05)
    server.terminate()
    t.join(120)
    assert result["r"].status_code == 200
    assert result["r"].json()["choices"][0]["token_ids"] == reference[-1]
    try:
        assert server.wait(60) == 0, server.log()[-3000:]
    finally:
        server.stop(10)
    log = server.log()
    assert "SIGTERM received: draining 1 running and 0 queued request(s)" in log, log[-3000:]
    assert "drain finished after" in log and "every request in flight was answered" in log, log[-3000:]
    assert "without an API key" not in log  # loopback: no warning
    assert "RuntimeWarning" not in log  # the interpreter's masked-lane arithmetic is not the user's business
    assert "drafter: seeded, not trained (seed " in log and "K=3, Markov rank r=32" in log  # what it loaded
    assert "tokenizer: the embedded model's byte-level tokenizer (516 ids" in log and "tokenizer=yes" in log


def test_sigterm_past_the_drain_timeout_ends_every_request_cleanly_and_exits_0(tmp_path):
    """More in flight than a 1 s drain allows: each request ends as a 200 or a 503 OpenAI error body, each stream
    with [DONE] (after an error chunk when cut), no traceback, exit 0 (replaces repro http_sigterm.py). Listening
    on every interface without a key, the server warns at start."""
    server = _start(tmp_path, drain_timeout=1, host="0.0.0.0")
    body = {"prompt": [5, 6], "max_tokens": 36}

    try:
        results = asyncio.run(requests_in_flight_then(server.url, body, 6, server.terminate))
        rc = server.wait(60)
    finally:
        server.stop(10)
    log = server.log()
    assert rc == 0 and "Traceback" not in log and "Event loop is closed" not in log, log[-3000:]
    ended = 0
    for r in results[:6]:
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert r.json()["error"]["type"] == "service_unavailable" and "drain" in r.json()["error"]["message"]
            ended += 1
    for lines in results[6:]:
        assert lines[-1] == "[DONE]", lines[-3:]
        last = json.loads(lines[-2])
        if "error" in last:
            assert last["error"]["code"] == 503
            ended += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert ended >= 1  # 12 requests of 36 tokens over 8 slots do not finish within 1 s on any machine here
    assert "listening on 0.0.0.0, beyond this machine, without an API key" in log, log[-3000:]
    assert "request(s) ended by the drain timeout" in log, log[-3000:]
