"""``trtllm-ext serve``: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

Threads of rank 0: uvicorn's event loop (HTTP) in the main thread, and one :class:`EngineLoop` thread that
owns the engine. Requests are validated in the handler (a bad one answers 400 and never reaches the engine),
queued, and admitted between engine steps while slots are free (continuous batching,
:mod:`tensorrt_llm_ext.runtime.scheduler`). Every plan the loop makes (cancel / admit / step) goes through a
:class:`PlanChannel` first: at TP N it is broadcast to every rank over the TP group's gloo group, so all
ranks run the same steps (an idle loop sends an empty plan every ``HEARTBEAT_S``, so a rank blocked waiting
for work never reaches the collective timeout, and a dead peer is noticed within a heartbeat or a step).

If the engine raises (a rank died, a collective timed out), the loop marks the server unhealthy: every
request in flight and every new one answers 503, ``/health`` answers 503, and the server shuts itself down
with exit code :data:`EXIT_ENGINE_FAILED`. SIGTERM drains: uvicorn stops accepting connections, in-flight
requests finish (bounded by ``drain_timeout_s``), then the loop stops the ranks and the process exits 0.

Endpoints: ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import Request as HttpRequest  # module level: FastAPI resolves handler annotations here
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.runtime.requests import Request, RequestError
from tensorrt_llm_ext.runtime.scheduler import Event, Scheduler, StepPlan

HEARTBEAT_S = 0.5
EXIT_ENGINE_FAILED = 3  # the engine (or a rank) failed while serving
FAILURE_GRACE_S = 2.0  # after a failure: answer 503s this long, then exit


# -- request / response models (OpenAI completions) --------------------------------------------------------
class CompletionRequest(BaseModel):
    """``POST /v1/completions`` body. ``prompt``: token ids (``[1, 2, 3]``), a batch of them, or text when the
    model has a tokenizer. ``stop``: token ids, or strings with a tokenizer. Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: list[StrictInt] | list[list[StrictInt]] | StrictStr | list[StrictStr]
    max_tokens: StrictInt = 16
    temperature: StrictFloat = 0.0
    top_p: StrictFloat = 1.0
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | list[StrictInt] | None = None
    stream: StrictBool = False
    n: StrictInt = 1
    user: StrictStr | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


# -- metrics -----------------------------------------------------------------------------------------------
class ServerMetrics:
    """Prometheus metrics of one server (its own registry)."""

    def __init__(self, draft_len: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        p = "trtllm_ext_"
        self.requests = Counter(p + "requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.rejected = Counter(p + "requests_rejected", "Requests answered 4xx/5xx before reaching the engine",
                                ["status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generated_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.steps = Counter(p + "engine_steps", "Engine steps run", registry=r)
        self.acceptance = Histogram(p + "acceptance_length", "Tokens accepted per request per speculative step",
                                    buckets=[i + 0.5 for i in range(1, draft_len + 1)], registry=r)
        self.step_time = Histogram(p + "step_seconds", "Wall time of one engine step",
                                   buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
                                   registry=r)
        self.batch = Histogram(p + "step_batch_size", "Requests per engine step",
                               buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256], registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a slot", registry=r)
        self.active = Gauge(p + "active_requests", "Requests holding a slot", registry=r)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# -- plan broadcast ------------------------------------------------------------------------------------------
class PlanChannel:
    """Rank 0's plans reach every rank of the TP group (no-op at TP 1)."""

    def __init__(self, mapping=None):
        self.group = None
        if mapping is not None and mapping.tp_size > 1:
            from tensorrt_llm_ext.distributed.communicator import tp_cpu_group

            self.group = tp_cpu_group(mapping)
            self.src = mapping.tp_group[0]

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def exchange(self, plan: StepPlan | None) -> StepPlan:
        """Rank 0 passes its plan, the others None; every rank returns rank 0's plan."""
        if self.group is None:
            return plan
        import torch.distributed as dist

        box = [asdict(plan) if plan is not None else None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        d = box[0]
        return StepPlan(cancel=list(d["cancel"]), admit=[(h, f) for h, f in d["admit"]], run=d["run"], stop=d["stop"])


def follower_loop(scheduler: Scheduler, channel: PlanChannel) -> None:
    """Ranks > 0: apply rank 0's plans until it says stop (an error propagates: the rank exits non-zero)."""
    while True:
        plan = channel.exchange(None)
        if plan.stop:
            return
        scheduler.apply(plan)


# -- the engine loop (rank 0) ------------------------------------------------------------------------------
@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class EngineFailure:
    message: str


class QueueFull(Exception):
    pass


@dataclass
class LoopState:
    """A snapshot for /health."""

    healthy: bool
    active: int
    queued: int
    free_slots: int
    steps: int
    error: str | None = None
    ranks: list[dict] = field(default_factory=list)


class EngineLoop:
    """Owns the scheduler on rank 0; handlers submit requests and cancel them from the event loop."""

    def __init__(self, scheduler: Scheduler, channel: PlanChannel, metrics: ServerMetrics, max_queue: int,
                 ranks: list[dict] | None = None):
        self.scheduler = scheduler
        self.channel = channel
        self.metrics = metrics
        self.max_queue = max_queue
        self.ranks = ranks or []
        self._cond = threading.Condition()
        self._pending: deque[tuple[int, dict, _Sink]] = deque()
        self._sinks: dict[int, _Sink] = {}  # admitted handles
        self._cancel: set[int] = set()
        self._next = 0
        self._stop = False
        self._steps = 0
        self.failure: str | None = None
        self.on_failure = None  # callable, set by the server: shut uvicorn down after the grace period
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- called from handlers -------------------------------------------------------------------------------
    def submit(self, fields: dict, sink: _Sink) -> int:
        with self._cond:
            if self.failure is not None:
                raise EngineFailure(self.failure)
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"{len(self._pending)} requests are waiting (max_queue={self.max_queue})")
            handle = self._next
            self._next += 1
            self._pending.append((handle, fields, sink))
            self.metrics.queue_depth.set(len(self._pending))
            self._cond.notify()
            return handle

    def cancel(self, handle: int) -> None:
        with self._cond:
            self._cancel.add(handle)
            self._cond.notify()

    def state(self) -> LoopState:
        with self._cond:
            return LoopState(self.failure is None, self.scheduler.num_active, len(self._pending),
                             self.scheduler.num_free_slots, self._steps, self.failure, self.ranks)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop (and the other ranks) once the queue is empty; bounded wait."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the loop -----------------------------------------------------------------------------------------
    def _next_plan(self) -> StepPlan | None:
        with self._cond:
            idle = not (self._pending or self._cancel or self.scheduler.num_active or self._stop)
            if idle:
                self._cond.wait(HEARTBEAT_S)
            # Cancelled requests still in the queue never reach the engine.
            if self._cancel and self._pending:
                kept = deque()
                for item in self._pending:
                    if item[0] in self._cancel:
                        self._cancel.discard(item[0])
                        item[2].put(Event(item[0], [], "cancelled"))
                    else:
                        kept.append(item)
                self._pending = kept
            cancel = sorted(h for h in self._cancel if h in self._sinks)
            self._cancel.clear()
            free = self.scheduler.num_free_slots + len(cancel)
            admit = []
            while self._pending and len(admit) < free:
                handle, fields, sink = self._pending.popleft()
                self._sinks[handle] = sink
                admit.append((handle, fields))
            self.metrics.queue_depth.set(len(self._pending))
            stop = self._stop and not self._pending and not self.scheduler.num_active and not admit
            if not (cancel or admit or self.scheduler.num_active or stop):
                return StepPlan(run=False) if self.channel.distributed else None  # heartbeat
            return StepPlan(cancel=cancel, admit=admit, run=True, stop=stop)

    def _run(self) -> None:
        try:
            while True:
                plan = self._next_plan()
                if plan is None:
                    continue
                plan = self.channel.exchange(plan)
                if plan.stop:
                    return
                events, stats = self.scheduler.apply(plan)
                self._record(plan, events, stats)
        except BaseException as e:  # a dead rank, a collective timeout, a bug: fail loudly, never hang
            self._fail(f"{type(e).__name__}: {e}")

    def _record(self, plan: StepPlan, events: list[Event], stats) -> None:
        m = self.metrics
        for _, fields in plan.admit:
            m.prompt_tokens.inc(len(fields["prompt_ids"]))
        if stats.num_rows:
            self._steps += 1
            m.steps.inc()
            m.step_time.observe(stats.step_s)
            m.batch.observe(stats.num_rows)
        for e in events:
            if e.accepted_len is not None:
                m.acceptance.observe(e.accepted_len)
            m.generated_tokens.inc(len(e.tokens))
            if e.finish_reason is not None:
                m.requests.labels(e.finish_reason).inc()
            sink = self._sinks.get(e.handle)
            if sink is not None:
                if e.finish_reason is not None:
                    del self._sinks[e.handle]
                sink.put(e)
        m.active.set(self.scheduler.num_active)

    def _fail(self, message: str) -> None:
        logger.error(f"serve: engine failed, answering 503 and shutting down: {message}")
        with self._cond:
            self.failure = message
            sinks = list(self._sinks.values()) + [s for _, _, s in self._pending]
            self._sinks.clear()
            self._pending.clear()
        for sink in sinks:
            sink.put(EngineFailure(message))
        if self.on_failure is not None:
            self.on_failure()


# -- the app -----------------------------------------------------------------------------------------------
@dataclass
class ServeContext:
    """What the handlers need (built once at start)."""

    loop: EngineLoop
    model_name: str
    vocab_size: int
    max_seq_len: int
    tokenizer: Any = None  # a transformers tokenizer, or None (token-id prompts only)
    created: int = field(default_factory=lambda: int(time.time()))


def _param_of(err: dict) -> str:
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # pydantic names union members (`list[int]`, `str`) in the location; keep the field path only.
    loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "function-after")]
    return ".".join(loc) or "body"


def _encode_prompts(ctx: ServeContext, body: CompletionRequest) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], str)):
        if ctx.tokenizer is None:
            raise ApiError(400, "prompt: text prompts need a tokenizer (the model directory has none); send token "
                                "ids, e.g. \"prompt\": [1, 2, 3]", "prompt")
        texts = [p] if isinstance(p, str) else list(p)
        prompts = [list(ctx.tokenizer.encode(t, add_special_tokens=True)) for t in texts]
    elif isinstance(p, list) and p and isinstance(p[0], list):
        prompts = [list(x) for x in p]
    else:
        prompts = [list(p)]
    for i, ids in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        if not ids:
            raise ApiError(400, f"{where}: empty prompt (at least one token)", "prompt")
        bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
        if bad:
            raise ApiError(400, f"{where}: token ids {bad[:5]} outside the vocabulary [0, {ctx.vocab_size})", "prompt")
    return prompts


def _stop_tokens(ctx: ServeContext, body: CompletionRequest) -> tuple[tuple[int, ...], list[str]]:
    s = body.stop
    if s is None or s == []:
        return (), []
    if isinstance(s, list) and isinstance(s[0], int):
        bad = [t for t in s if not 0 <= t < ctx.vocab_size]
        if bad:
            raise ApiError(400, f"stop: token ids {bad[:5]} outside the vocabulary [0, {ctx.vocab_size})", "stop")
        return tuple(s), []
    if ctx.tokenizer is None:
        raise ApiError(400, "stop: stop strings need a tokenizer; send stop token ids", "stop")
    return (), [s] if isinstance(s, str) else list(s)


def build_requests(ctx: ServeContext, body: CompletionRequest) -> tuple[list[dict], list[str]]:
    """Validated engine request fields, one per prompt (raises :class:`ApiError` 400 naming the field)."""
    if body.model is not None and body.model != ctx.model_name:
        raise ApiError(404, f"model: {body.model!r} is not served here (serving {ctx.model_name!r})", "model",
                       "model_not_found")
    if body.max_tokens < 1:
        raise ApiError(400, f"max_tokens: must be >= 1, got {body.max_tokens}", "max_tokens")
    if not (body.temperature >= 0):
        raise ApiError(400, f"temperature: must be >= 0, got {body.temperature}", "temperature")
    if not (0.0 < body.top_p <= 1.0):
        raise ApiError(400, f"top_p: must be in (0, 1], got {body.top_p}", "top_p")
    if body.n != 1:
        raise ApiError(400, f"n: only 1 is supported, got {body.n}", "n")
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise ApiError(400, f"seed: must be in [0, 2^63), got {body.seed}", "seed")
    prompts = _encode_prompts(ctx, body)
    stop_ids, stop_strings = _stop_tokens(ctx, body)
    out = []
    for i, ids in enumerate(prompts):
        fields = dict(prompt_ids=ids, max_new_tokens=body.max_tokens, stop_token_ids=stop_ids,
                      temperature=float(body.temperature), seed=(body.seed or 0) + i, top_p=float(body.top_p))
        try:
            Request(**fields).validate(ctx.vocab_size, ctx.max_seq_len)
        except RequestError as e:
            raise ApiError(400, f"max_tokens: {e}", "max_tokens") from None
        out.append(fields)
    return out, stop_strings


class _Choice:
    def __init__(self, index: int, prompt_len: int):
        self.index, self.prompt_len = index, prompt_len
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.text_sent = 0


def _text(ctx: ServeContext, tokens: list[int]) -> str | None:
    return ctx.tokenizer.decode(tokens, skip_special_tokens=True) if ctx.tokenizer is not None else None


def _hit_stop_string(ctx: ServeContext, choice: _Choice, stops: list[str]) -> bool:
    if not stops:
        return False
    text = _text(ctx, choice.tokens)
    return any(s in text for s in stops)


def _trim_stop(text: str | None, stops: list[str]) -> str | None:
    if text is None or not stops:
        return text
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text if cut < 0 else text[:cut]


def create_app(ctx: ServeContext, metrics: ServerMetrics, on_ready=None):
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    @asynccontextmanager
    async def lifespan(app):
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="trtllm-ext serve", docs_url=None, redoc_url=None, lifespan=lifespan)

    def error_response(e: ApiError) -> JSONResponse:
        metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = _param_of(first)
        if first.get("type") == "json_invalid":
            return error_response(ApiError(400, f"malformed JSON body: {first.get('msg')}", "body"))
        if first.get("type") == "extra_forbidden":
            return error_response(ApiError(400, f"{param}: unknown field", param))
        if first.get("type") == "missing":
            return error_response(ApiError(400, f"{param}: required", param))
        if param.split(".")[0] in ("prompt", "stop"):  # unions: one message, not one per member
            field_name = param.split(".")[0]
            what = ("token ids (a list of ints, or a list of such lists) or text" if field_name == "prompt"
                    else "stop token ids (a list of ints) or stop strings")
            return error_response(ApiError(400, f"{param}: expected {what}", field_name))
        msgs = sorted({f"{_param_of(e)}: {e.get('msg')}" for e in errs})
        return error_response(ApiError(400, "; ".join(msgs[:4]), param))

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(exc)

    @app.get("/health")
    async def health():
        st = ctx.loop.state()
        body = {"status": "ok" if st.healthy else "unhealthy", **asdict(st)}
        return JSONResponse(body, status_code=200 if st.healthy else 503)

    @app.get("/metrics")
    async def prom():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": ctx.created,
                                            "owned_by": "tensorrt_llm_ext", "max_model_len": ctx.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        if ctx.loop.failure is not None:
            raise ApiError(503, f"engine failed: {ctx.loop.failure}", None, "service_unavailable")
        reqs, stops = build_requests(ctx, body)
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        handles: dict[int, _Choice] = {}
        try:
            for i, fields in enumerate(reqs):
                handles[ctx.loop.submit(fields, sink)] = _Choice(i, len(fields["prompt_ids"]))
        except QueueFull as e:
            for h in handles:
                ctx.loop.cancel(h)
            raise ApiError(429, f"server busy: {e}", None, "rate_limit_exceeded") from None
        except EngineFailure as e:
            raise ApiError(503, f"engine failed: {e.message}", None, "service_unavailable") from None
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        if body.stream:
            return StreamingResponse(_stream(ctx, rid, sink, handles, stops), media_type="text/event-stream")
        return await _collect(ctx, rid, sink, handles, stops, http)

    return app


def _chunk(ctx: ServeContext, rid: str, choices: list[dict]) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name,
            "choices": choices}


def _apply_event(ctx: ServeContext, e: Event, handles: dict[int, _Choice], stops: list[str]) -> _Choice:
    ch = handles[e.handle]
    ch.tokens.extend(e.tokens)
    if e.finish_reason is not None:
        ch.finish_reason = e.finish_reason
    elif _hit_stop_string(ctx, ch, stops):
        ch.finish_reason = "stop"
        ctx.loop.cancel(e.handle)
    return ch


async def _collect(ctx, rid, sink, handles, stops, http):
    from fastapi.responses import JSONResponse

    try:
        while any(ch.finish_reason is None for ch in handles.values()):
            try:
                item = await asyncio.wait_for(sink.queue.get(), 0.25)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    return JSONResponse({}, status_code=499)
                continue
            if isinstance(item, EngineFailure):
                raise ApiError(503, f"engine failed: {item.message}", None, "service_unavailable")
            _apply_event(ctx, item, handles, stops)
        choices = []
        for ch in sorted(handles.values(), key=lambda c: c.index):
            if ch.finish_reason == "error":
                raise ApiError(500, "the engine refused a validated request", None, "internal_error")
            c = {"index": ch.index, "token_ids": ch.tokens, "finish_reason": ch.finish_reason, "logprobs": None}
            text = _trim_stop(_text(ctx, ch.tokens), stops)
            if text is not None:
                c["text"] = text
            choices.append(c)
        prompt = sum(ch.prompt_len for ch in handles.values())
        completion = sum(len(ch.tokens) for ch in handles.values())
        return {**_chunk(ctx, rid, choices),
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}
    finally:
        for h, ch in handles.items():
            if ch.finish_reason is None:
                ctx.loop.cancel(h)


async def _stream(ctx, rid, sink, handles, stops):
    """SSE: one chunk per engine event with the new tokens, a final chunk per choice, then ``[DONE]``."""
    try:
        while any(ch.finish_reason is None for ch in handles.values()):
            item = await sink.queue.get()
            if isinstance(item, EngineFailure):
                err = ApiError(503, f"engine failed: {item.message}", None, "service_unavailable")
                yield f"data: {json.dumps(err.body())}\n\n"
                return
            ch = handles.get(item.handle)
            if ch is None or ch.finish_reason is not None:
                continue
            before = len(ch.tokens)
            _apply_event(ctx, item, handles, stops)
            new = ch.tokens[before:]
            c = {"index": ch.index, "token_ids": new, "finish_reason": ch.finish_reason, "logprobs": None}
            if ctx.tokenizer is not None:
                full = _trim_stop(_text(ctx, ch.tokens), stops)
                c["text"], ch.text_sent = full[ch.text_sent:], len(full)
            yield f"data: {json.dumps(_chunk(ctx, rid, [c]))}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # a client that disconnects cancels the stream: free its slots
        for h, ch in handles.items():
            if ch.finish_reason is None:
                ctx.loop.cancel(h)


def load_tokenizer(directory: str | None):
    """A transformers tokenizer from ``directory`` when it has one (``tokenizer.json`` or
    ``tokenizer_config.json``), else None (token-id prompts only)."""
    from pathlib import Path

    if directory is None or not any((Path(directory) / f).is_file()
                                    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        logger.warning(f"serve: {directory} has a tokenizer but transformers is not installed: token-id prompts only")
        return None
    return AutoTokenizer.from_pretrained(directory)


def run_server(ctx: ServeContext, metrics: ServerMetrics, host: str, port: int, drain_timeout_s: float,
               ready_line: str) -> int:
    """Serve until SIGTERM/SIGINT (exit 0 after draining) or an engine failure (:data:`EXIT_ENGINE_FAILED`)."""
    import uvicorn

    import contextlib
    import signal

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # SIGTERM/SIGINT start the drain; uvicorn's own version re-raises the signal after shutdown,
            # which would end a drained server with "killed by SIGTERM" instead of exit code 0.
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    app = create_app(ctx, metrics, on_ready=lambda: print(ready_line, flush=True))
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=drain_timeout_s, lifespan="on")
    server = _Server(config)

    def shutdown_later():
        threading.Timer(FAILURE_GRACE_S, lambda: setattr(server, "should_exit", True)).start()

    ctx.loop.on_failure = shutdown_later

    ctx.loop.start()
    try:
        server.run()
    finally:
        ctx.loop.stop(timeout=drain_timeout_s + 10)
    if ctx.loop.failure is not None:
        return EXIT_ENGINE_FAILED
    return 0 if server.started else 2
