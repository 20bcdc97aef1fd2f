"""Faults of ``trtllm-ext serve`` around its output and its open routes (in-process servers on the small model
with a word-level tokenizer larger than the model's vocabulary): stop strings searched off the event loop and
only past ``min_tokens``, a non-streaming client that leaves while tokens arrive fast, the routes left open
under ``--api-key`` bounded, ``/tokenize`` checked against the model's vocabulary."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from tensorrt_llm_ext.runtime import server as server_module  # noqa: E402
from tensorrt_llm_ext.runtime.config import load_config  # noqa: E402
from tensorrt_llm_ext.runtime.engine_loop import LoopState, ServerMetrics  # noqa: E402
from tensorrt_llm_ext.runtime.export import export_model  # noqa: E402
from tensorrt_llm_ext.runtime.scheduler import Event  # noqa: E402
from tensorrt_llm_ext.testing.hf_checkpoints import save_tiny_tokenizer  # noqa: E402
from tensorrt_llm_ext.testing.server import (SMALL_SERVE_CONFIG, free_port, read_raw_answer,  # noqa: E402
                                              start_in_process)

SMALL = SMALL_SERVE_CONFIG
VOCAB = SMALL["model.target.vocab_size"]
KEY = "sk-test"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    export_model(load_config(**SMALL), d)
    save_tiny_tokenizer(d, VOCAB + 40)  # words w{VOCAB}.. map to ids the model does not have
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_in_process({"max_batch_size": 4}, model_dir=str(model_dir), api_key=KEY)
    yield srv
    srv.stop(30)


AUTH = {"Authorization": f"Bearer {KEY}"}


def _complete(server, body):
    r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


async def _health_latencies(c, task) -> list[float]:
    """``/health``'s latency every 50 ms until ``task`` is done (each answer a 200): whether the event loop stays
    free while the server works on ``task``."""
    lat = []
    while not task.done():
        t0 = time.monotonic()
        assert (await c.get("/health")).status_code == 200
        lat.append(time.monotonic() - t0)
        await asyncio.sleep(0.05)
    return lat


def test_a_stop_string_inside_the_first_min_tokens_does_not_stop(server):
    """vLLM's rule: stop strings, like stop ids, are searched only once the output has more than min_tokens
    tokens (was: a stop string ended the request before min_tokens)."""
    body = {"prompt": "w100 w200", "max_tokens": 8, "ignore_eos": True}
    ref = _complete(server, body)
    stop = ref["text"].split()[1]  # a word of the greedy output's second token
    early = _complete(server, {**body, "stop": stop})
    assert early["finish_reason"] == "stop" and len(early["token_ids"]) <= 2, early
    held = _complete(server, {**body, "stop": stop, "min_tokens": 5})
    assert len(held["token_ids"]) >= 5 and held["token_ids"] == ref["token_ids"][:len(held["token_ids"])], held
    # the text is cut consistently: it is a prefix of the reference text and holds no stop past min_tokens
    assert ref["text"].startswith(held["text"])


class _SlowDecode:
    """The served tokenizer, but every decode takes ``delay`` seconds, holding the GIL only briefly (as a long
    output decoded once per stop string per token did)."""

    def __init__(self, tok, delay: float):
        self._tok, self._delay = tok, delay

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._tok.decode(*args, **kwargs)


def test_stop_strings_are_searched_off_the_event_loop(server):
    """While a streamed request's output decodes slowly, /health answers at once (was: decoding and the stop
    search ran on the event loop, so one request with many stop strings froze every client)."""
    ctx = server.context
    real = ctx.tokenizer
    ctx.tokenizer = _SlowDecode(real, 0.4)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=AUTH) as c:
            body = {"prompt": "w100 w200", "max_tokens": 6, "ignore_eos": True, "stream": True,
                    "stop": ["zq1", "zq2"]}

            async def stream():
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    return r.status_code, [ln async for ln in r.aiter_lines() if ln]

            task = asyncio.create_task(stream())
            await asyncio.sleep(0.5)
            lat = await _health_latencies(c, task)
            return await task, lat

    try:
        (status, lines), lat = asyncio.run(run())
    finally:
        ctx.tokenizer = real
    assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    assert len(lat) >= 5 and max(lat) < 0.3, lat


def test_a_non_streaming_answer_is_built_off_the_event_loop(server):
    """A non-streaming answer's log-probabilities decode every token and candidate; while they decode slowly
    /health answers at once, and the answer is the usual JSON (was: built and encoded on the event loop, so a
    5 MB echo + logprobs answer froze every client for 0.8-1.8 s)."""
    ctx = server.context
    real = ctx.tokenizer
    body = {"prompt": "w100 w200", "max_tokens": 2, "ignore_eos": True, "logprobs": 2, "echo": True}
    ref = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert ref.status_code == 200 and ref.headers["content-type"] == "application/json", ref.text
    ctx.tokenizer = _SlowDecode(real, 0.15)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=AUTH) as c:
            task = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.3)
            lat = await _health_latencies(c, task)
            return await task, lat

    try:
        r, lat = asyncio.run(run())
    finally:
        ctx.tokenizer = real
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    got, want = r.json(), ref.json()
    assert got["choices"] == want["choices"] and got["usage"] == want["usage"], (got, want)
    assert len(lat) >= 5 and max(lat) < 0.3, lat


def test_tokenize_checks_ids_against_the_model_vocabulary(server):
    """A word the tokenizer maps past the model's vocabulary: 400 naming the token, as on the completions
    route (was: /tokenize returned the id)."""
    r = httpx.post(server.url + "/tokenize", json={"prompt": f"w9 w{VOCAB + 3}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert f"(id {VOCAB + 3}), outside the model's vocabulary" in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/tokenize", json={"prompt": "w9 w17"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["tokens"][-2:] == [9, 17], ok.text


def test_open_routes_without_the_key_are_bounded_in_size_and_concurrency(server, monkeypatch):
    """With --api-key, /tokenize stays open (vLLM's choice), but a request without the key gets a smaller body
    limit (413 saying so), runs one at a time on its own thread and past a few waiting gets 429, while a key
    holder's request is answered at once (was: 8 MB bodies from anyone, a keyed request delayed by minutes)."""
    monkeypatch.setattr(server_module, "OPEN_MAX_BODY_BYTES", 4096)
    monkeypatch.setattr(server_module, "OPEN_MAX_WAITING", 1)
    big = {"prompt": "w9 " * 2000}
    r = httpx.post(server.url + "/tokenize", json=big, timeout=60)
    assert r.status_code == 413 and "limit of 4096 bytes for a request without the API key" in r.json()["error"][
        "message"], r.text
    keyed = httpx.post(server.url + "/tokenize", json=big, headers=AUTH, timeout=60)
    assert keyed.status_code == 200 and keyed.json()["count"] >= 2000, keyed.text

    ctx = server.context
    real = ctx.tokenizer
    ctx.tokenizer = _SlowEncode(real, 1.0)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            anon = [asyncio.create_task(c.post("/tokenize", json={"prompt": "w9"})) for _ in range(4)]
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            mine = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, headers=AUTH)
            return [await t for t in anon], mine, time.monotonic() - t0

    try:
        anon, mine, took = asyncio.run(run())
    finally:
        ctx.tokenizer = real
    codes = sorted(r.status_code for r in anon)
    assert codes == [200, 200, 429, 429], [r.text for r in anon]
    assert mine.status_code == 200 and took < 5.0, (mine.text, took)


def test_a_slow_keyless_body_does_not_hold_the_open_routes(server):
    """Keyless clients that send their /tokenize body a byte at a time take no turn and no waiting place while
    they send it: another keyless /tokenize is answered at once (was: the one turn was taken before the body was
    read, so each keyless request waited behind the slow one, for as long as it kept sending)."""
    body = b'{"prompt": "w9 w17"}'
    port = int(server.url.rsplit(":", 1)[1])
    slow = []
    try:
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body[:3])
            slow.append(s)
        time.sleep(0.5)  # both slow requests are reading their bodies
        t0 = time.monotonic()
        r = httpx.post(server.url + "/tokenize", content=body, headers={"content-type": "application/json"},
                       timeout=10)
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["count"] == 2 and took < 3.0, (r.text, took)
        for s in slow:  # the slow ones finish their bodies and are answered too
            s.sendall(body[3:])
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for s in slow:
            s.close()


def test_a_body_still_arriving_at_the_drain_deadline_answers_503(server):
    """The drain deadline (here called directly, as ``run_server``'s timer calls it) answers a request whose
    body is still arriving with the drain's 503 OpenAI error (was: not counted in flight, so the drain waited
    for uvicorn's backstop, which cancelled it: a CancelledError traceback and a plain-text 500)."""
    app_server = _openai_server(server)
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": \"w9")
        time.sleep(0.3)
        t0 = time.monotonic()
        try:
            threading.Thread(target=app_server.end_body_reads, args=("the server is shutting down: a test",)).start()
            got = read_raw_answer(s)
        finally:
            app_server.http_loop.call_soon_threadsafe(app_server.reads_ended.clear)
    assert got.startswith(b"HTTP/1.1 503") and time.monotonic() - t0 < 2.0, got
    assert b'{"error":{"message":"the server is shutting down: a test","type":"service_unavailable"' in got, got
    time.sleep(0.1)
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, headers=AUTH,
                    timeout=60)
    assert ok.status_code == 200, ok.text


def _openai_server(server):
    """The :class:`OpenAIServer` behind an in-process server's app (its handlers are its bound methods)."""
    for route in server.uvicorn_server.config.app.routes:
        owner = getattr(getattr(route, "endpoint", None), "__self__", None)
        if owner is not None:
            return owner
    raise AssertionError("no handler of the app is an OpenAIServer method")


class _SlowEncode(_SlowDecode):
    def decode(self, *args, **kwargs):
        return self._tok.decode(*args, **kwargs)

    def encode(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._tok.encode(*args, **kwargs)


class _FastStubLoop:
    """What the handlers use of the engine loop: one token per ``step`` seconds until max_new_tokens."""

    capacity, max_queue, failure = 8, 64, None

    def __init__(self, step: float):
        self.step, self.cancelled, self.finished = step, {}, {}

    def submit(self, reqs, sink):
        for h, f in enumerate(reqs):
            threading.Thread(target=self._run, args=(h, f.max_new_tokens, sink), daemon=True).start()
        return list(range(len(reqs)))

    def _run(self, h, n, sink):
        for i in range(n):
            if h in self.cancelled:
                return
            time.sleep(self.step)
            sink.put(Event(h, [5], "length" if i == n - 1 else None, accepted_len=1))
        self.finished[h] = time.monotonic()

    def cancel(self, h, reason="cancelled"):
        self.cancelled.setdefault(h, time.monotonic())

    def state(self):
        return LoopState(True, 0, 0, 8, 0)


def test_a_non_streaming_client_that_leaves_is_noticed_while_tokens_arrive_fast():
    """Tokens every 0.05 s (GPU step times): the request is cancelled within a second of its client leaving
    (was: checked only when no token came for 0.25 s, so it ran to max_tokens holding its slot)."""
    loop = _FastStubLoop(0.05)
    ctx = server_module.ServeContext(loop=loop, model_name="stub", vocab_size=100, max_seq_len=1000)
    app = server_module.create_app(ctx, ServerMetrics(4, "stub"))
    port = free_port("127.0.0.1")
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on"))
    threading.Thread(target=srv.run, daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.02)
        body = b'{"prompt": [1, 2, 3], "max_tokens": 400}'
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.5)
        left = time.monotonic()
        c.close()
        while time.monotonic() < left + 5 and 0 not in loop.cancelled and 0 not in loop.finished:
            time.sleep(0.02)
        assert 0 in loop.cancelled and 0 not in loop.finished, "the request ran on after its client left"
        assert loop.cancelled[0] - left < 1.0
    finally:
        srv.should_exit = True


def test_a_connection_that_never_completes_its_headers_is_closed(monkeypatch):
    """``serve``'s HTTP protocol closes a connection that sends nothing, or half a request's headers, past the
    header timeout (was: kept forever; enough of them reached the descriptor limit and every accept failed),
    while a keep-alive connection between requests and a request whose answer streams past that timeout are
    served as before."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    monkeypatch.setattr(server_module, "HEADER_TIMEOUT_S", 0.5)
    app = FastAPI()

    @app.get("/slow")
    async def slow():
        async def body():
            for _ in range(4):
                await asyncio.sleep(0.3)
                yield b"x"
        return StreamingResponse(body())

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                        http=server_module.http_protocol(), timeout_keep_alive=30))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        while not srv.started:
            time.sleep(0.02)
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        half = socket.create_connection(("127.0.0.1", port), timeout=5)
        half.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        assert silent.recv(10) == b"" and half.recv(10) == b""  # closed by the server
        assert time.monotonic() - t0 < 3.0
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            first = c.get("/slow")  # streams 1.2 s, past the header timeout
            time.sleep(0.2)
            second = c.get("/slow")  # the same keep-alive connection, still open
        assert first.status_code == second.status_code == 200 and first.content == second.content == b"xxxx"
    finally:
        srv.should_exit = True
        thread.join(10)
