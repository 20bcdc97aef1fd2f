"""Faults one client can cause in ``trtllm-ext serve``, answered without hurting the others (one in-process
server on the small model with a word-level tokenizer LARGER than the model's vocabulary, and a small body
limit): a top_p that is 0 in fp32, a request the engine refuses part way, a body over the limit, a slow
tokenization beside other clients, a lone surrogate, a token outside the model's vocabulary."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tensorrt_llm_ext.runtime.config import load_config  # noqa: E402
from tensorrt_llm_ext.runtime.export import export_model  # noqa: E402
from tensorrt_llm_ext.testing.hf_checkpoints import save_tiny_tokenizer  # noqa: E402
from tensorrt_llm_ext.testing.server import (SMALL_SERVE_CONFIG, read_raw_answer, start_in_process,  # noqa: E402
                                              start_server)

SMALL = SMALL_SERVE_CONFIG
VOCAB = SMALL["model.target.vocab_size"]
TOKENIZER_VOCAB = VOCAB + 40  # words w516 .. w555 map to ids the model does not have
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    export_model(load_config(**SMALL), d)
    save_tiny_tokenizer(d, TOKENIZER_VOCAB)
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_in_process({"max_batch_size": 4}, model_dir=str(model_dir), max_body_bytes=LIMIT)
    yield srv
    srv.stop(30)


def _post(server, body, path="/v1/completions", **kw):
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def _stream_lines(server, body) -> list[str]:
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return [ln.removeprefix("data: ") for ln in r.iter_lines() if ln]


def _healthy(server) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = _post(server, {"prompt": [1, 9, 17], "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


def test_top_p_that_is_zero_in_fp32_is_served_and_the_engine_lives(server):
    """1e-46 passes as a double and is 0.0 in fp32 (it killed the engine: every later request 503, exit 3):
    served as the top token, so sampled equals greedy; a temperature that overflows fp32 is a 400."""
    greedy = _post(server, {"prompt": [1, 9, 17], "max_tokens": 3})
    tiny = _post(server, {"prompt": [1, 9, 17], "max_tokens": 3, "temperature": 1.0, "top_p": 1e-46, "seed": 2})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]
    hot = _post(server, {"prompt": [1, 9, 17], "max_tokens": 3, "temperature": 1e39})
    assert hot.status_code == 400 and hot.json()["error"]["param"] == "temperature"
    assert "overflows fp32" in hot.json()["error"]["message"]
    for field, value in (("repetition_penalty", 1e39), ("repetition_penalty", 1e-46), ("top_k", 2**70)):
        r = _post(server, {"prompt": [1, 9, 17], "max_tokens": 3, "temperature": 1.0, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    _healthy(server)


def test_a_request_the_engine_refuses_is_a_400_with_its_message(server):
    """A layer below refusing a request's value in its prefill: that request answers 400 with the message
    (streamed: an error chunk then [DONE]), the server stays healthy (was: 503 for everyone, exit 3)."""
    engine = server.engine
    real = engine.launch_prefill

    def refusing(slots, requests, mode="speculative", starts=None, **kw):
        if any(list(r.prompt_ids) == [4, 4, 4] for r in requests):
            raise ValueError("top_p: expected values in (0, 1], got [0.0]")
        return real(slots, requests, mode, starts, **kw)

    engine.launch_prefill = refusing
    try:
        r = _post(server, {"prompt": [4, 4, 4], "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "refused in its prefill: ValueError: top_p" in err["message"]
        lines = _stream_lines(server, {"prompt": [4, 4, 4], "max_tokens": 2})
        assert lines[-1] == "[DONE]" and "refused in its prefill" in json.loads(lines[-2])["error"]["message"]
    finally:
        del engine.launch_prefill
    _healthy(server)


def test_body_over_the_limit_is_413_in_the_openai_shape(server):
    """By Content-Length and chunked alike: 413, ``param: body``, the client reads the answer; a body just
    under the limit is parsed (here: 400 for its too-long prompt)."""
    big = json.dumps({"prompt": "w9 " * (LIMIT // 3 + 10), "max_tokens": 2}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text
    assert f"limit of {LIMIT} bytes" in r.json()["error"]["message"]

    def chunks():
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413, r.text
    under = json.dumps({"prompt": "w9 " * (LIMIT // 3 - 100), "max_tokens": 2}).encode()
    r = httpx.post(server.url + "/v1/completions", content=under, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text
    _healthy(server)


def test_a_body_over_the_limit_that_waits_for_100_continue_is_refused_before_it_is_sent(server):
    """``Expect: 100-continue`` with a Content-Length past the limit: the 413 comes instead of the go-ahead, so
    the client uploads nothing (was: "100 Continue", the whole body uploaded, then the 413)."""
    import socket

    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Expect: 100-continue\r\nContent-Length: " + str(LIMIT + 1).encode() + b"\r\n\r\n")
        got = read_raw_answer(s)
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    assert b'"param":"body"' in got and f"{LIMIT + 1} bytes exceed".encode() in got, got
    _healthy(server)


def test_a_405_names_the_methods_the_path_takes(server):
    """A 405 carries ``Allow`` (RFC 9110 requires it; a client or proxy learns the method from it), in the
    OpenAI error shape (was: the header dropped by the error handler)."""
    for method, path, allow in (("DELETE", "/health", "GET"), ("POST", "/v1/models", "GET"),
                                ("GET", "/v1/completions", "POST"), ("HEAD", "/metrics", "GET")):
        r = httpx.request(method, server.url + path, timeout=30)
        assert r.status_code == 405 and r.headers.get("allow") == allow, (method, path, r.headers)
        if method != "HEAD":
            assert r.json()["error"]["code"] == 405


def test_a_compressed_body_is_a_415_naming_its_encoding(server):
    """``Content-Encoding: gzip`` (or any coding but identity) is refused naming it, before the body is read (was: a
    400 saying the body is not UTF-8); the server stays healthy."""
    import gzip

    raw = gzip.compress(json.dumps({"prompt": [1, 9, 17], "max_tokens": 2}).encode())
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = httpx.post(server.url + path, content=raw, timeout=30,
                       headers={"content-type": "application/json", "content-encoding": "gzip"})
        assert r.status_code == 415, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "body" and "'gzip'" in err["message"], err
    _healthy(server)


def test_a_body_sent_too_slowly_is_a_408_and_the_connection_closes(server, monkeypatch):
    """A body must arrive at ``BODY_MIN_RATE`` bytes/s after a grace (here 0.5 s and 100 B/s): a stalled one and
    one dripped at 5 B/s both get a 408 naming ``body`` and the connection is closed (was: waited for forever, a
    connection and a handler held as long as the client liked)."""
    import socket

    from tensorrt_llm_ext.runtime import server as server_module

    monkeypatch.setattr(server_module, "BODY_GRACE_S", 0.5)
    monkeypatch.setattr(server_module, "BODY_MIN_RATE", 100)
    port = int(server.url.rsplit(":", 1)[1])
    body = b'{"prompt": [1, 2], "max_tokens": 1}'
    for drip in (False, True):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:3])
            t0 = time.monotonic()
            s.setblocking(False)
            got, i = b"", 3
            while time.monotonic() - t0 < 5:
                if drip and i < len(body) - 1:
                    s.send(body[i:i + 1])
                    i += 1
                time.sleep(0.2)
                try:
                    chunk = s.recv(65536)
                except BlockingIOError:
                    continue
                got += chunk
                if not chunk:
                    break  # closed by the server after its answer
            took = time.monotonic() - t0
        assert got.startswith(b"HTTP/1.1 408") and chunk == b"" and took < 3.0, (drip, got, took)
        assert b'"param":"body"' in got and b"bytes/s or faster" in got, got
    _healthy(server)


class _SlowTokenizer:
    """The served tokenizer, but each text encode takes ``delay`` seconds with the GIL released (as a Rust
    tokenizer on a body of several MB does)."""

    def __init__(self, tok, delay: float):
        self._tok, self._delay = tok, delay

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._tok.encode(*args, **kwargs)


def test_a_slow_tokenization_does_not_stall_other_clients(server):
    """While one text prompt takes 3 s to tokenize, /health and a token-id request answer at once (was: on
    the event loop, every client waited for the tokenizer)."""
    ctx = server.context
    real = ctx.tokenizer
    ctx.tokenizer = _SlowTokenizer(real, 3.0)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            slow = asyncio.create_task(c.post("/v1/completions", json={"prompt": "w9 w17", "max_tokens": 2}))
            await asyncio.sleep(0.3)  # the slow request is being tokenized
            lat = []
            while not slow.done():
                t0 = time.monotonic()
                h = await c.get("/health")
                lat.append(time.monotonic() - t0)
                assert h.status_code == 200
                await asyncio.sleep(0.1)
            t0 = time.monotonic()
            other = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
            return (await slow), lat, other, time.monotonic() - t0

    try:
        slow, lat, other, _ = asyncio.run(run())
    finally:
        ctx.tokenizer = real
    assert slow.status_code == 200 and other.status_code == 200
    assert len(lat) >= 5 and max(lat) < 1.0, lat


def test_lone_surrogate_is_a_400_naming_the_field(server):
    """Valid JSON, not Unicode text: completions answered 500 with a traceback, chat a 400 with a raw
    TypeError. Now both name the field and the character."""
    raw = b'{"prompt": "w9 \\ud800", "max_tokens": 2}'
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "lone UTF-16 surrogate (\\ud800 at character 3)" in r.json()["error"]["message"]
    raw = b'{"messages": [{"role": "user", "content": "w9 \\udc00"}], "max_tokens": 2}'
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "messages.0.content: a lone UTF-16 surrogate" in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", timeout=60, json={"prompt": "w9 \U0001F600", "max_tokens": 1})
    assert ok.status_code == 200, ok.text  # a full pair is text (the word-level tokenizer maps it to <unk>)


def test_token_outside_the_model_vocabulary_is_named(server):
    """A tokenizer larger than the model (refused at start by the CLI, next test): a word mapping past the
    vocabulary answers 400 naming the token (was: 500 "the engine refused a validated request")."""
    r = _post(server, {"prompt": f"w9 w{VOCAB + 3}", "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert f"token 'w{VOCAB + 3}' (id {VOCAB + 3}), outside the model's vocabulary [0, {VOCAB})" in \
        r.json()["error"]["message"]


def test_a_text_prompt_with_no_tokens_is_a_400_naming_the_prompt(server):
    """Whitespace is no token for a tokenizer that adds no BOS: a 400 naming ``prompt`` (which one of a list)
    before anything is queued, streamed or not; a chat template that renders nothing names ``messages`` (was:
    an empty prompt reached the engine, which answered a 400 naming no field -- a 200 with an error chunk when
    streamed)."""
    for body, where in (({"prompt": "   "}, "prompt: "), ({"prompt": ["w9 w17", "\n"]}, "prompt 1: "),
                        ({"prompt": " ", "stream": True}, "prompt: ")):
        r = _post(server, {**body, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert r.json()["error"]["message"].startswith(where) and "has no tokens" in r.json()["error"]["message"]
    ctx = server.context
    real = ctx.chat_template
    ctx.chat_template = "{% for m in messages %} {% endfor %}"
    try:
        r = _post(server, {"messages": [{"role": "user", "content": "w9"}], "max_tokens": 2}, "/v1/chat/completions")
    finally:
        ctx.chat_template = real
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "rendered them as no tokens" in r.json()["error"]["message"]
    _healthy(server)


class _CountingTokenizer:
    """The served tokenizer, counting its text encodes."""

    def __init__(self, tok):
        self._tok, self.encodes = tok, 0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, *args, **kwargs):
        self.encodes += 1
        return self._tok.encode(*args, **kwargs)


def test_more_choices_than_the_server_holds_are_refused_before_any_work(server):
    """Prompts x n past slots + queue is a 400 naming ``prompt`` / ``n`` before a prompt is tokenized or a
    request built (was: a 40 KB body of 8000 prompts at n 128 built a million requests, 10 s and 300 MB, then
    the same 400)."""
    loop = server.context.loop
    most = loop.capacity + loop.max_queue
    ctx = server.context
    real = ctx.tokenizer
    ctx.tokenizer = counting = _CountingTokenizer(real)
    try:
        r = _post(server, {"prompt": ["w9 w17"] * (most + 1), "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert f"{most + 1} choices exceed what the server holds at once ({most} = " in r.json()["error"]["message"]
        r = _post(server, {"prompt": ["w9"] * 40, "n": 128, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert counting.encodes == 0  # refused before any prompt was tokenized
    finally:
        ctx.tokenizer = real
    _healthy(server)


def test_serve_refuses_a_tokenizer_larger_than_the_model_at_start(model_dir, tmp_path):
    """One line naming both sizes and the highest token, exit 2, before any model is built."""
    server = None
    try:
        with pytest.raises(RuntimeError) as e:
            server = start_server([str(model_dir)], str(tmp_path / "serve.log"), start_timeout=120)
    finally:
        if server is not None:
            server.stop(10)
    log = (tmp_path / "serve.log").read_text()
    assert "serve exited with 2" in str(e.value)
    assert (f"error: tokenizer {model_dir}: the tokenizer has 40 token(s) outside the model's vocabulary of {VOCAB} "
            f"ids (the highest: 'w{TOKENIZER_VOCAB - 1}', id {TOKENIZER_VOCAB - 1})") in log
    assert "Traceback" not in log and sum(ln.startswith("error:") for ln in log.splitlines()) == 1, log


def test_second_sigint_during_the_drain_ends_every_stream_cleanly_and_exits_130(tmp_path):
    """SIGINT starts the drain (60 s here); a second SIGINT 0.5 s later ends every request at once: each plain
    request a 200 or a 503 OpenAI error, each stream with an error chunk (or its last chunk) then [DONE]; no
    traceback; exit 130 = 128 + SIGINT (was: streams cut without [DONE], 13 tracebacks, exit 0)."""
    import signal

    from tensorrt_llm_ext.testing.server import requests_in_flight_then

    cfg = tmp_path / "small.yaml"
    cfg.write_text(json.dumps(load_config(**SMALL).model_dump(mode="json", exclude_unset=True)))
    server = start_server(["--config", str(cfg), "--drain-timeout", "60"], str(tmp_path / "server.log"))

    def two_signals():
        server.proc.send_signal(signal.SIGINT)
        threading.Timer(0.5, server.proc.send_signal, (signal.SIGINT,)).start()

    try:
        t0 = time.monotonic()
        results = asyncio.run(requests_in_flight_then(server.url, {"prompt": [5, 6], "max_tokens": 36}, 6,
                                                      two_signals))
        rc = server.wait(60)
        took = time.monotonic() - t0
    finally:
        server.stop(10)
    log = server.log()
    assert rc == 130 and "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert "a second stop signal (SIGINT) during the drain" in log and took < 30
    ended = 0
    for r in results[:6]:
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert "a second stop signal (SIGINT) ended the request" in r.json()["error"]["message"]
            ended += 1
    for lines in results[6:]:
        assert lines[-1] == "[DONE]", lines[-3:]
        last = json.loads(lines[-2])
        if "error" in last:
            assert last["error"]["code"] == 503 and "second stop signal (SIGINT)" in last["error"]["message"]
            ended += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert ended >= 1


def test_sighup_drains_like_sigterm(tmp_path):
    """SIGHUP (the terminal or ssh session that started ``serve`` closed) drains as SIGTERM does, as the TP
    launcher's does: the stream in flight ends with its last chunk (or the drain's error chunk) then [DONE], exit
    0 (was: killed by the signal's default action mid-stream, no [DONE], exit -1). The real app over the stub
    engine (a step every 20 ms, so the stream is still running when the signal comes)."""
    import signal

    from tensorrt_llm_ext.bench.server_process import STUB_SERVE_COMMAND

    server = start_server(["--step-ms", "20"], str(tmp_path / "stub.log"), command=STUB_SERVE_COMMAND)
    try:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": "w9", "max_tokens": 50, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            first = next(ln for ln in lines if ln)
            server.proc.send_signal(signal.SIGHUP)
            rest = [ln for ln in lines if ln]
        rc = server.wait(30)
    finally:
        server.stop(10)
    log = server.log()
    assert first.startswith("data: {") and rest[-1] == "data: [DONE]", (first, rest[-3:])
    assert rc == 0 and "SIGHUP received: draining" in log and "Traceback" not in log, (rc, log[-2000:])


def test_no_ready_line_from_a_server_that_cannot_listen(tmp_path):
    """The ready line is printed once the socket listens, not at the app's start-up (uvicorn runs the lifespan
    before it binds): with the port taken after the CLI's own check, the server exits non-zero without the line a
    script waits for (was: the line, then uvicorn's bind error). The real app over the stub engine."""
    import socket
    import subprocess
    import sys

    from tensorrt_llm_ext.bench.server_process import STUB_SERVE_COMMAND

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, *STUB_SERVE_COMMAND, "--host", "127.0.0.1", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done
    assert "stub server ready" not in done.stdout, done.stdout
    assert "address already in use" in done.stderr.lower(), done.stderr[-2000:]


def test_the_ready_line_comes_once_the_server_listens(tmp_path):
    """Its counterpart: a server that listens prints the line (start_server waits for it), and answers."""
    from tensorrt_llm_ext.bench.server_process import STUB_SERVE_COMMAND

    server = start_server([], str(tmp_path / "stub.log"), command=STUB_SERVE_COMMAND)
    try:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.stop(10)
