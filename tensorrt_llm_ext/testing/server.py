"""The server in this process for tests (:func:`start_in_process`), and the child-process server of
:mod:`tensorrt_llm_ext.bench.server_process` (re-exported here for the tests).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from tensorrt_llm_ext.bench.server_process import (SMALL_SERVE_CONFIG, ServerProcess, free_port, sample_bodies,
                                                   start_server)
from tensorrt_llm_ext.runtime.scheduler import Scheduler

__all__ = ["KERNEL_LOCK", "SMALL_SERVE_CONFIG", "InProcessServer", "ServerProcess", "free_port", "read_raw_answer",
           "reference_outputs", "requests_in_flight_then", "sample_bodies", "start_in_process", "start_server"]


# The Triton interpreter is not thread-safe: two engines stepping at once in one process (two in-process
# servers, or a server and a test's reference engine) corrupt each other's launches. Every in-process
# server's step holds this lock, and so must a test's own engine work while a server is alive.
KERNEL_LOCK = threading.RLock()


class _SerialScheduler(Scheduler):
    """A :class:`Scheduler` whose plans run under :data:`KERNEL_LOCK` (the one call the engine loop makes that
    steps the engine)."""

    def apply(self, plan):
        with KERNEL_LOCK:
            return super().apply(plan)


@dataclass
class InProcessServer:
    """A server in this process (uvicorn in a thread over an in-process engine): what tests use where the
    subprocess is not the point (no interpreter start, no model build per test module)."""

    url: str
    engine: object
    loop: object
    uvicorn_server: object
    thread: object
    context: object = None  # the handlers' ServeContext

    def stop(self, timeout: float = 30.0) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(timeout)
        self.loop.stop(timeout)


def start_in_process(config_overrides: dict | None = None, *, model_dir: str | None = None, max_queue: int = 1024,
                     start_timeout: float = 60.0, host: str = "127.0.0.1", api_key: str | None = None,
                     chat_template: str | None = None, **context) -> InProcessServer:
    """Engine + scheduler + engine loop + app of ``load_config(model_dir=..., **config_overrides)``, served by
    uvicorn on a free loopback port in a daemon thread; returns once it listens. ``api_key`` and
    ``chat_template``: as ``serve --api-key`` / ``--chat-template`` (the template's text); ``context``: further :class:`ServeContext` fields
    (``max_body_bytes``, ``tokenizer``: default the config's directory's, none for the embedded model)."""
    import uvicorn

    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.server import (EngineLoop, PlanChannel, ServeContext, ServerMetrics, create_app,
                                                 load_tokenizer, served_model_name)

    cfg = load_config(model_dir=model_dir, **(config_overrides or {}))
    with KERNEL_LOCK:
        engine = Engine(cfg)
    name = served_model_name(cfg, None)
    metrics = ServerMetrics(cfg.draft_len, model_name=name, max_model_len=cfg.max_seq_len)
    # The served loop: the overlap scheduler unless the config disables it (as `serve`).
    scheduler = _SerialScheduler(engine, overlap=not cfg.disable_overlap_scheduler)
    loop = EngineLoop(scheduler, PlanChannel(None), metrics, max_queue=max_queue,
                      stream_interval=cfg.stream_interval or 1)
    context.setdefault("tokenizer", load_tokenizer(cfg.tokenizer or cfg.model.path))
    ctx = ServeContext(loop=loop, model_name=name, vocab_size=engine.vocab_size, max_seq_len=cfg.max_seq_len,
                       api_key=api_key, chat_template=chat_template, **context)
    port = free_port(host)
    server = uvicorn.Server(uvicorn.Config(create_app(ctx, metrics), host=host, port=port, log_level="warning",
                                           access_log=False, lifespan="on"))
    loop.start()
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            loop.stop(5)
            raise TimeoutError(f"the in-process server did not start within {start_timeout:.0f}s")
        time.sleep(0.02)
    return InProcessServer(f"http://{host}:{port}", engine, loop, server, thread, ctx)


def reference_outputs(config_overrides: dict, bodies: list[dict]) -> list[list[int]]:
    """What :meth:`Engine.generate` (TP 1, in this process) produces for single-prompt ``bodies``: the target's
    own decode (mode ``reference``), which speculative decoding equals token for token (lossless, greedy and
    seeded sampling alike, under strict acceptance: ``test_dspark_lossless.py``), so a server's speculative tokens
    are held to the target's; under the interpreter it costs 0.3 CPU s where the speculative run took 4.6
    (``test_serve.py``'s 17 bodies, 2026-12-04)."""
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.contract import SamplingParams
    from tensorrt_llm_ext.runtime.requests import Request

    reqs = [Request(prompt_ids=b["prompt"], max_new_tokens=b["max_tokens"], stop_token_ids=tuple(b.get("stop", ())),
                    sampling=SamplingParams(temperature=b.get("temperature", 0.0), seed=b.get("seed", 0)))
            for b in bodies]
    with KERNEL_LOCK:  # an in-process server may be stepping in this process
        results, _ = Engine(load_config(**config_overrides)).generate(reqs, "reference")
    return [r.output_ids for r in results]


async def requests_in_flight_then(url: str, body: dict, n: int, stop) -> list:
    """``n`` plain and ``n`` streamed completions of ``body`` in flight at ``url``; once one is active, call
    ``stop()`` (SIGTERM, a drain deadline, ...). Returns the plain responses, then each stream's SSE data
    lines (``[DONE]`` included)."""
    import asyncio

    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        async def stream():
            lines = []
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line.removeprefix("data: "))
            return lines

        tasks = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(n)]
        tasks += [asyncio.create_task(stream()) for _ in range(n)]
        deadline = time.monotonic() + 120
        while (await c.get("/health")).json()["active"] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop()
        return await asyncio.gather(*tasks)


def read_raw_answer(sock) -> bytes:
    """The bytes of a raw HTTP answer read from ``sock`` up to the end of its OpenAI error body (``}}``) or the
    connection's close (the server-fault tests that write requests by hand)."""
    got = b""
    while b"}}" not in got:
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    return got

