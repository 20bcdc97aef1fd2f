"""``trtllm-ext serve``: the OpenAI-compatible HTTP app (FastAPI + uvicorn) over the engine loop.

Threads of rank 0: uvicorn's event loop (HTTP) in the main thread, and one
:class:`~tensorrt_llm_ext.runtime.engine_loop.EngineLoop` thread that owns the engine. A body is parsed and
validated once (:mod:`~tensorrt_llm_ext.runtime.openai_protocol`; a bad one answers 400 naming the field and
never reaches the engine), turned into engine requests (one per prompt and choice), queued, and admitted
between engine steps while slots are free.

Stopping: the engine ends a request at its stop ids / the checkpoint's EOS (``ignore_eos`` aside, after
``min_tokens``) or its length; stop strings are matched here on the decoded text (on a worker thread, only the
text new since the last event; like stop ids, only once the output has more than ``min_tokens`` tokens), and
the request is then cancelled in the engine (its slot freed before the next step). ``text``, ``token_ids`` and ``usage`` agree:
the tokens end with the one that completed the stop (string or id), the text ends before the stop string
and shows no stop or EOS token (both unless ``include_stop_str_in_output``).

Failures: a request the engine ends with an error (a value a layer below refused) answers 400 with the
engine's message (500 when it only shared an aborted step), streamed as an error chunk then ``[DONE]``; the
engine serves on. If the engine raises, every request in flight and every new one answers 503, ``/health`` answers
503 and the server exits with :data:`EXIT_ENGINE_FAILED`. SIGTERM / SIGINT / SIGHUP drains: no new connections,
new requests on open connections get 503, in-flight requests finish until ``drain_timeout_s``; whatever still
runs then (a body still arriving included) ends with a 503 error body (or, streaming, an SSE error chunk then
``[DONE]``) and its slot is freed, and the process exits 0. A second SIGTERM / SIGINT during the drain ends every request at once the same
way (503 / error chunk then ``[DONE]``) and the process exits ``128 + signal`` (130 for SIGINT, 143 for
SIGTERM) after at most :data:`FORCED_GRACE_S`.

Slow clients: a connection must complete a request's headers within :data:`HEADER_TIMEOUT_S` and send its body
at :data:`BODY_MIN_RATE` after a grace (408), so silent or dripping clients cannot pile up to the descriptor limit.

Layout (TensorRT-LLM's ``OpenAIServer``): :class:`OpenAIServer` holds the route table (:meth:`OpenAIServer.routes`)
and one method per handler; the answers -- choices, stop strings, log-probabilities, the JSON body or the SSE
stream -- are built by :mod:`~tensorrt_llm_ext.runtime.openai_responses`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /version``, ``GET /metrics`` and ``GET /prometheus/metrics`` (Prometheus text), ``POST /tokenize`` and
``POST /detokenize`` (vLLM's). With an API key every ``/v1/*`` route needs ``Authorization: Bearer <key>``;
``/tokenize`` and ``/detokenize`` stay open (as vLLM's), bounded for a request without the key (a 1 MiB body,
one at a time on a thread of their own, a few waiting, then 429).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import Request as HttpRequest  # module level: FastAPI resolves handler annotations here

from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.runtime.engine_loop import (EngineFailure, EngineLoop, PlanChannel, QueueFull, ServerMetrics,
                                                  Sink, follower_loop)
from tensorrt_llm_ext.runtime.openai_protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                                      DetokenizeRequest, ServeLimits, TokenizeRequest, parse_body)
from tensorrt_llm_ext.runtime.openai_responses import Choice, ChoicesResponse, OutputWorker
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.runtime.tokenizer import byte_table, load_tokenizer, tokenizer_vocab_error  # noqa: F401

__all__ = ["EXIT_ENGINE_FAILED", "EngineLoop", "OpenAIServer", "PlanChannel", "ServeContext", "ServerMetrics",
           "create_app",
           "follower_loop", "load_tokenizer", "run_server", "served_model_name"]

EXIT_ENGINE_FAILED = 3  # the engine (or a rank) failed while serving
FAILURE_GRACE_S = 2.0  # after a failure: answer 503s this long, then exit
SHUTDOWN_GRACE_S = 5.0  # after the drain deadline: time for the 503s to reach their clients
FORCED_GRACE_S = 2.0  # after a second SIGTERM/SIGINT: time for the error chunks to reach their clients
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # serve --max-body-bytes: a larger body answers 413, never parsed
BODY_DRAIN_BYTES = 64 * 1024 * 1024  # an oversized body is read and dropped up to this, so its client gets the 413
PREP_THREADS = 4  # parsing, tokenizing and request building run on these threads, never on the event loop
# With --api-key, /tokenize and /detokenize stay open (vLLM's choice: tools count tokens without the key), but a
# request without the key is bounded: this body size, one at a time on its own thread, a few waiting, the rest 429.
OPEN_MAX_BODY_BYTES = 1024 * 1024
OPEN_MAX_WAITING = 8
TRIM_AFTER_BYTES = 256 * 1024  # after answering a body this large, give freed heap back to the OS (malloc_trim)
# A connection must complete a request's headers this long after it opens or after its last answer (uvicorn
# waits forever: silent or half-sent connections piled up to the descriptor limit, then every accept failed).
HEADER_TIMEOUT_S = 30.0
# A body must arrive at BODY_MIN_RATE bytes/s or faster once its first BODY_GRACE_S have passed (else 408): a
# client sending a byte a second held its connection and handler for as long as it liked.
BODY_GRACE_S = 30.0
BODY_MIN_RATE = 1024


@dataclass
class ServeContext:
    """What the handlers need (built once at start)."""

    loop: EngineLoop
    model_name: str
    vocab_size: int
    max_seq_len: int  # max_model_len: prompt + generated tokens of one request
    tokenizer: Any = None  # a transformers tokenizer, or None (token-id prompts only)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # SIGTERM received: new requests answer 503
    speculative: bool = True  # False (--no-speculation): the target's own decode, which keeps no logits
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    chat_template: str | None = None  # --chat-template: replaces the tokenizer's own
    model_aliases: tuple[str, ...] = ()  # further --served-model-name values, accepted as `model`
    api_key: str | None = None  # --api-key / TLLM_EXT_API_KEY: required on /v1/* routes
    # Log-probability entries' token strings by id, each decoded once (``tokenizer.decode([id])`` is a function of the
    # id): an echoed 2k-token prompt at top 20 names ~42k of them, which were ~42k tokenizer calls on the output thread
    # (every stream waits for it) and are dictionary reads once its ids were seen.
    token_strs: dict = field(default_factory=dict, repr=False)
    token_bytes: dict = field(default_factory=dict, repr=False)  # chat logprobs' `bytes` by id, the same way

    @property
    def limits(self) -> ServeLimits:
        return ServeLimits(self.vocab_size, self.max_seq_len)


def served_model_name(cfg, override: str | None) -> str:
    """``--served-model-name``, else the checkpoint's (its directory's name), else ``dspark-embedded``."""
    if override:
        return override
    facts = cfg.checkpoint_facts
    return "dspark-embedded" if facts is None else facts.model_name


# -- requests ----------------------------------------------------------------------------------------------
def _in_vocab(ctx: ServeContext, ids: list[int], param: str) -> list[int]:
    """Tokenizer output checked against the model's vocabulary (a tokenizer larger than the model is refused
    at start; this names the token if one slips through)."""
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise ApiError(400, f"{param}: the tokenizer gave token {ctx.tokenizer.convert_ids_to_tokens(bad[0])!r} (id "
                            f"{bad[0]}), outside the model's vocabulary [0, {ctx.vocab_size}): the tokenizer does not "
                            f"match the model", param)
    return ids


def _encode_prompts(ctx: ServeContext, body: CompletionRequest) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str) or (p and isinstance(p[0], str)):
        if ctx.tokenizer is None:
            raise ApiError(400, "prompt: text prompts need a tokenizer (the model directory has none); send token "
                                "ids, e.g. \"prompt\": [1, 2, 3]", "prompt")
        texts = [p] if isinstance(p, str) else p
        out = [_in_vocab(ctx, list(ctx.tokenizer.encode(t, add_special_tokens=True)), "prompt") for t in texts]
        for i, ids in enumerate(out):
            # Whitespace alone is no token for a tokenizer that adds no BOS: refused here by name, as an empty
            # token list is at parse (it reached the engine, a 400 naming no field, a 200 when streamed).
            if not ids:
                where = "" if len(texts) == 1 else f" {i}"
                raise ApiError(400, f"prompt{where}: the text {texts[i][:40]!r} has no tokens (the tokenizer gives "
                                    f"none and adds no BOS); send at least one token", "prompt")
        return out
    return [list(x) for x in p] if p and isinstance(p[0], list) else [list(p)]


def _need_tokenizer(ctx: ServeContext, param: str):
    if ctx.tokenizer is None:
        raise ApiError(400, f"{param}: needs a tokenizer, and this model has none (token ids only)", param)
    return ctx.tokenizer


def _template_ids(ctx: ServeContext, messages, add_generation_prompt: bool, tools, template_kwargs,
                  add_special_tokens: bool = False) -> list[int]:
    """``messages`` through the chat template (``--chat-template``, else the tokenizer's) as token ids."""
    tok = ctx.tokenizer
    if not (ctx.chat_template or getattr(tok, "chat_template", None)):  # transformers' tokenizers declare it
        raise ApiError(400, "messages: the model's tokenizer has no chat template (use /v1/completions, or start "
                            "the server with --chat-template)", "messages")
    msgs = [m.template_dict() for m in messages]
    extra = dict(template_kwargs or {})
    if tools:  # only with tool_choice "none" (validated): the template sees the tools, no call is parsed
        extra["tools"] = [t.model_dump() for t in tools]
    try:
        # The tokenizer's own template is left for transformers to pick: named ones (a dict, "default" and
        # "tool_use") are chosen by whether there are tools (given as the argument, a dict was a TypeError: every
        # chat request answered 400).
        text = tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False,
                                       chat_template=ctx.chat_template, **extra)
    except Exception as e:  # the template's own error (for example a role order it refuses)
        raise ApiError(400, f"messages: the chat template refused them: {type(e).__name__}: {e}", "messages") from None
    # The template writes the special tokens (BOS) itself; the tokenizer adds none unless asked.
    return [int(t) for t in tok.encode(text, add_special_tokens=add_special_tokens)]


def _chat_prompt(ctx: ServeContext, body: ChatCompletionRequest) -> list[int]:
    if ctx.tokenizer is None:
        raise ApiError(400, "messages: chat needs a tokenizer with a chat template, and this model has no tokenizer "
                            "(use /v1/completions with token ids)", "messages")
    ids = _in_vocab(ctx, _template_ids(ctx, body.messages, body.add_generation_prompt, body.tools,
                                       body.chat_template_kwargs), "messages")
    if not ids:  # a template that renders these messages as whitespace or nothing
        raise ApiError(400, "messages: the chat template rendered them as no tokens; send at least one token",
                       "messages")
    return ids


def check_model(ctx: ServeContext, model: str | None) -> None:
    """404 (OpenAI's ``model_not_found``) unless ``model`` is None or one of the served names."""
    if model is not None and model != ctx.model_name and model not in ctx.model_aliases:
        raise ApiError(404, f"model: {model!r} is not served here (serving {ctx.model_name!r})", "model",
                       "model_not_found")


def _stop_fields(ctx: ServeContext, body) -> tuple[tuple[int, ...], list[str]]:
    s, ids = body.stop, tuple(body.stop_token_ids or ())
    if s is None or s == []:
        return ids, []
    if isinstance(s, list) and isinstance(s[0], int):
        return ids + tuple(s), []
    if ctx.tokenizer is None:
        raise ApiError(400, "stop: stop strings need a tokenizer; send stop token ids", "stop")
    return ids, [s] if isinstance(s, str) else list(s)


def build_requests(ctx: ServeContext, body, prompts: list[list[int]], logprobs: int | None,
                   prompt_logprobs: int | None = None) -> list[Request]:
    """Engine requests, one per prompt and choice (choice ``j`` of prompt ``i`` is index ``i * n + j``, drawn
    with ``SamplingParams.for_choice(index)``). The body is validated already; what is checked here is what
    needs the tokenized prompt: its length against ``max_model_len``, and ``min_tokens`` against the token limit
    where that is the room the prompt leaves (400s naming the field)."""
    check_model(ctx, body.model)
    params = body.to_sampling_params()
    stop_ids, _ = _stop_fields(ctx, body)
    out = []
    for i, ids in enumerate(prompts):
        room = ctx.max_seq_len - len(ids)
        if room < 1:
            raise ApiError(400, f"prompt: {len(ids)} tokens leave no room to generate (max_model_len="
                                f"{ctx.max_seq_len})", "prompt")
        limit = body.token_limit()  # the endpoint's default (completions: 16) when the body sets none
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        if limit is None:  # chat: the rest of max_model_len
            limit = room
        if body.min_tokens > limit:  # as vLLM (it was cut to the room left without a word)
            raise ApiError(400, f"min_tokens: {body.min_tokens} exceeds the {limit} tokens this prompt of {len(ids)} "
                                f"tokens can generate (max_model_len={ctx.max_seq_len})", "min_tokens")
        if limit > room:
            raise ApiError(400, f"{param}: prompt of {len(ids)} tokens + {param}={limit} exceeds max_model_len="
                                f"{ctx.max_seq_len}", param)
        for j in range(body.n):
            out.append(Request(prompt_ids=ids, max_new_tokens=limit, stop_token_ids=stop_ids,
                               sampling=params.for_choice(i * body.n + j), ignore_eos=body.ignore_eos,
                               min_tokens=body.min_tokens, logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs))
    return out


# -- the app -----------------------------------------------------------------------------------------------
class ApiKeyGate:
    """ASGI middleware: every ``/v1/*`` request must carry ``Authorization: Bearer <api_key>`` (vLLM's rule:
    ``/health``, ``/metrics``, ``/version``, ``/tokenize`` stay open for probes and scrapers). Anything else
    is a 401 in OpenAI's error shape. A plain ASGI wrapper: no request body is read, streaming is untouched."""

    def __init__(self, app, api_key: str, on_reject=None):
        self.app, self.on_reject, self.api_key = app, on_reject, api_key

    @staticmethod
    def authorized(header: str | bytes, api_key: str) -> bool:
        """Whether an ``Authorization`` header carries ``api_key`` (a constant-time comparison)."""
        import hmac

        got = header.encode("latin-1") if isinstance(header, str) else header
        return hmac.compare_digest(got, f"Bearer {api_key}".encode())

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if (path == "/v1" or path.startswith("/v1/")) and scope.get("method") != "OPTIONS":
            got = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if not self.authorized(got, self.api_key):
                if self.on_reject is not None:
                    self.on_reject()
                why = "no Authorization header" if not got else "the API key does not match"
                err = ApiError(401, f"invalid API key ({why}): send 'Authorization: Bearer <key>' with the key the "
                                    f"server was started with (--api-key or TLLM_EXT_API_KEY)", None,
                               "authentication_error")
                payload = json.dumps(err.body()).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(payload)).encode()),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": payload})
                return
        await self.app(scope, receive, send)


class OpenAIServer:
    """The OpenAI-compatible app over one engine loop (TensorRT-LLM's ``OpenAIServer``): a route table
    (:meth:`routes`, registered by :meth:`register_routes`) and one method per handler; the answers are built by
    :mod:`~tensorrt_llm_ext.runtime.openai_responses`.

    Parsing, tokenizing and request building run on :data:`PREP_THREADS` threads (a 20 MB body took 15-32 s to
    parse and tokenize: on the event loop that froze every client; here it delays only its own answer), output
    processing (decoding, stop strings, the SSE bytes of every stream of a step) on one
    :class:`~tensorrt_llm_ext.runtime.openai_responses.OutputWorker` thread of its own (a slow prompt never
    delays a stream), and the routes left open without the API key on one more.
    """

    def __init__(self, ctx: ServeContext, metrics: ServerMetrics):
        from concurrent.futures import ThreadPoolExecutor

        from fastapi import FastAPI
        from starlette.exceptions import HTTPException as StarletteHTTPException

        self.ctx, self.metrics = ctx, metrics
        self.prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="serve-prep")
        self.output = OutputWorker()
        if ctx.tokenizer is not None:
            byte_table(ctx.tokenizer)  # built once here, not on the event loop by the first request
        self.open_pool = ThreadPoolExecutor(1, thread_name_prefix="serve-open")
        self.open_running = asyncio.Semaphore(1)  # requests without the key on an open route: one at a time
        self.open_admitted = 0  # ... running or waiting (at most OPEN_MAX_WAITING + 1)
        # Set once the drain deadline passed (or a second stop signal came): a body still arriving then is
        # answered 503 instead of being waited for (see end_body_reads). Made on the serving loop (lifespan).
        self.http_loop: asyncio.AbstractEventLoop | None = None
        self.reads_ended: asyncio.Event | None = None
        self.reads_ended_message = ""
        self.reads_ended_count = 0  # requests answered so (the drain's closing line counts them)
        self.app = FastAPI(title="trtllm-ext serve", docs_url=None, redoc_url=None, openapi_url=None,
                           lifespan=self._lifespan)
        self.app.add_exception_handler(ApiError, self._api_error)
        self.app.add_exception_handler(StarletteHTTPException, self._http_error)
        if ctx.api_key:
            self.app.add_middleware(ApiKeyGate, api_key=ctx.api_key, on_reject=lambda: metrics.rejected(401))
        self.register_routes()

    def routes(self) -> list[tuple[str, str, Any]]:
        """``(method, path, handler)`` of every endpoint."""
        return [
            ("GET", "/health", self.health),
            ("GET", "/version", self.version),
            ("GET", "/metrics", self.prometheus),
            ("GET", "/prometheus/metrics", self.prometheus),  # trtllm-serve's path
            ("GET", "/v1/models", self.models),
            ("POST", "/tokenize", self.tokenize),
            ("POST", "/detokenize", self.detokenize),
            ("POST", "/v1/completions", self.completions),
            ("POST", "/v1/chat/completions", self.chat),
        ]

    def register_routes(self) -> None:
        for method, path, handler in self.routes():
            self.app.add_api_route(path, handler, methods=[method])

    @asynccontextmanager
    async def _lifespan(self, app):
        import anyio.lowlevel

        self.http_loop, self.reads_ended = asyncio.get_running_loop(), asyncio.Event()
        # anyio loads its asyncio backend on first use -- a streamed response's task group -- and that import (7-14 ms
        # on the CPU machine) fell on the first request of the server: loaded here, before the server listens.
        await anyio.lowlevel.checkpoint()
        try:
            yield
        finally:
            for pool in (self.prep, self.open_pool):
                pool.shutdown(wait=False, cancel_futures=True)
            self.output.stop()

    # -- errors ------------------------------------------------------------------------------------------
    def error_response(self, e: ApiError, count: bool = True, headers: dict | None = None):
        from fastapi.responses import JSONResponse

        if count:
            self.metrics.rejected(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def _api_error(self, request, exc: ApiError):
        return self.error_response(exc, headers=exc.headers)

    async def _http_error(self, request, exc):  # 404 / 405: the OpenAI object too
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        # A path nobody serves (a scanner, a typo) is not a rejected request: not counted. Starlette's headers
        # are kept: a 405 must say which methods the path takes (Allow, RFC 9110).
        return self.error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                            None, kind), count=exc.status_code != 404,
                                   headers=exc.headers)

    # -- handlers ----------------------------------------------------------------------------------------
    async def health(self):
        from fastapi.responses import JSONResponse

        st = self.ctx.loop.state()
        body = {"status": "ok" if st.healthy else "unhealthy", **asdict(st)}
        return JSONResponse(body, status_code=200 if st.healthy else 503)

    async def version(self):
        from tensorrt_llm_ext import __version__

        return {"version": __version__}

    async def prometheus(self):
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self):
        ctx = self.ctx
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": ctx.created,
                                            "owned_by": "tensorrt_llm_ext", "max_model_len": ctx.max_seq_len}]}

    async def tokenize(self, http: HttpRequest):
        return await self.answer_off_loop(http, self.tokenize_body)

    async def detokenize(self, http: HttpRequest):
        return await self.answer_off_loop(http, self.detokenize_body)

    async def completions(self, http: HttpRequest):
        from fastapi.responses import Response

        ctx = self.ctx
        body = await self.read_request(http, CompletionRequest)
        if body is None:
            return Response(status_code=499)
        # echo with logprobs: the prompt's tokens carry theirs too (the first one none), as OpenAI's legacy API
        reqs = await self.off_loop(lambda: build_requests(ctx, body, _encode_prompts(ctx, body), body.logprobs,
                                                          body.logprobs if body.echo else None))
        return await self.serve_choices(http, body, reqs, [r.prompt_ids for r in reqs], "text_completion", "cmpl")

    async def chat(self, http: HttpRequest):
        from fastapi.responses import Response

        body = await self.read_request(http, ChatCompletionRequest)
        if body is None:
            return Response(status_code=499)
        prompt = await self.off_loop(_chat_prompt, self.ctx, body)
        reqs = await self.off_loop(build_requests, self.ctx, body, [prompt], body.logprobs_k())
        return await self.serve_choices(http, body, reqs, [prompt] * len(reqs), "chat.completion", "chatcmpl")

    def tokenize_body(self, raw: bytes) -> dict:
        ctx = self.ctx
        body = parse_body(raw, TokenizeRequest, ctx.limits)
        check_model(ctx, body.model)
        tok = _need_tokenizer(ctx, "messages" if body.messages is not None else "prompt")
        if body.messages is not None:
            ids = _template_ids(ctx, body.messages, body.add_generation_prompt, body.tools,
                                body.chat_template_kwargs, add_special_tokens=body.add_special_tokens)
        else:
            ids = list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        ids = _in_vocab(ctx, ids, "messages" if body.messages is not None else "prompt")
        out = {"count": len(ids), "max_model_len": ctx.max_seq_len, "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    def detokenize_body(self, raw: bytes) -> dict:
        body = parse_body(raw, DetokenizeRequest, self.ctx.limits)
        check_model(self.ctx, body.model)
        tok = _need_tokenizer(self.ctx, "tokens")
        return {"prompt": tok.decode(body.tokens)}

    # -- the pieces the handlers share ---------------------------------------------------------------------
    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    def check_available(self) -> None:
        if self.ctx.loop.failure is not None:
            raise ApiError(503, f"engine failed: {self.ctx.loop.failure}", None, "service_unavailable")
        if self.ctx.draining:
            raise ApiError(503, "the server is shutting down", None, "service_unavailable")

    def check_choices(self, body) -> None:
        """400 when the body asks for more choices (prompts x ``n``) than slots + queue hold: no retry could pass,
        so not a 429. Checked before any prompt is tokenized or request built: a 40 KB body of 8000 one-token
        prompts at ``n`` 128 built a million requests (10 s, 300 MB) only to be refused."""
        loop = self.ctx.loop
        most, count = loop.capacity + loop.max_queue, body.num_choices()
        if count > most:
            param = "n" if body.n > 1 else "prompt"
            raise ApiError(400, f"{param}: {count} choices exceed what the server holds at once ({most} = "
                                f"max_batch_size + max_queue); send fewer prompts or a smaller n", param)

    def submit(self, reqs: list[Request], sink: Sink) -> list[int]:
        loop = self.ctx.loop
        try:
            return loop.submit(reqs, sink)
        except QueueFull as e:
            raise ApiError(429, f"server busy: {e}", None, "rate_limit_exceeded") from None
        except EngineFailure as e:
            raise ApiError(503, f"engine failed: {e.message}", None, "service_unavailable") from None

    def end_body_reads(self, message: str) -> None:
        """From any thread (the drain deadline, a second stop signal): every request still receiving its body
        answers 503 with ``message`` now. Such a reader was not counted in flight: the drain waited for uvicorn's
        backstop, which cancelled it (a traceback, a plain-text 500 for the client)."""
        if self.http_loop is None:
            return
        self.reads_ended_message = message
        try:
            self.http_loop.call_soon_threadsafe(self.reads_ended.set)
        except RuntimeError:  # the loop has closed: nobody is reading
            pass

    async def read_body(self, http: HttpRequest, limit: int | None = None, whose: str = "") -> bytes | None:
        """The body, or :class:`ApiError` 413 past ``limit`` (default ``ctx.max_body_bytes``; by
        ``Content-Length`` or as it arrives), or 503 when :meth:`end_body_reads` ends the read; None when the
        client left mid-body."""
        if self.reads_ended is None:  # an app served without its lifespan
            return await self._read_body(http, limit, whose)
        if self.reads_ended.is_set():
            self.reads_ended_count += 1
            raise ApiError(503, self.reads_ended_message, None, "service_unavailable")
        reading = asyncio.ensure_future(self._read_body(http, limit, whose))
        ended = asyncio.ensure_future(self.reads_ended.wait())
        try:
            await asyncio.wait((reading, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
        if not reading.done():
            reading.cancel()
            self.reads_ended_count += 1
            raise ApiError(503, self.reads_ended_message, None, "service_unavailable")
        return reading.result()

    async def _read_body(self, http: HttpRequest, limit: int | None, whose: str) -> bytes | None:
        from starlette.requests import ClientDisconnect

        limit = self.ctx.max_body_bytes if limit is None else limit
        # A compressed body would be read as JSON bytes and refused as "not UTF-8", naming nothing the client can act
        # on. Refused before it is read (the connection closes: the unread body cannot be skipped on it).
        encoding = http.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise ApiError(415, f"body: Content-Encoding {encoding!r} is not served; send the body uncompressed",
                           "body", headers={"connection": "close"})
        declared = http.headers.get("content-length", "")
        declared_size = int(declared) if declared.isdigit() else 0
        too_big = declared_size > limit
        # A client that sent "Expect: 100-continue" waits for the go-ahead (uvicorn sends it on the first read)
        # before it sends the body: past the limit by Content-Length it gets the 413 instead and uploads nothing
        # (curl asks so for a large body; it uploaded the body, up to BODY_DRAIN_BYTES, only to read the 413).
        waiting_for_go_ahead = too_big and http.headers.get("expect", "").lower() == "100-continue"
        chunks, size = [], 0
        start = time.monotonic()
        body = (_no_chunks() if waiting_for_go_ahead else http.stream()).__aiter__()
        try:
            while True:
                allowed = start + BODY_GRACE_S + size / BODY_MIN_RATE - time.monotonic()
                try:
                    chunk = await asyncio.wait_for(body.__anext__(), max(allowed, 0.0))
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    raise ApiError(408, f"body: {size} of {declared or 'an unknown number of'} bytes after "
                                        f"{time.monotonic() - start:.0f} s: a body must arrive at {BODY_MIN_RATE} "
                                        f"bytes/s or faster after its first {BODY_GRACE_S:g} s", "body",
                                   headers={"connection": "close"}) from None
                size += len(chunk)
                if too_big or size > limit:  # from here only drained (not kept), so that the client reads the 413
                    too_big = True
                    chunks.clear()
                    if size > BODY_DRAIN_BYTES:
                        break
                else:
                    chunks.append(chunk)
        except ClientDisconnect:  # the client left mid-body: nobody to answer, nothing to log
            return None
        if too_big:
            why = (f"for a request {whose} (send the key for the server's limit)" if whose
                   else "(serve --max-body-bytes)")
            raise ApiError(413, f"body: {max(size, declared_size)} bytes exceed the server's limit of {limit} bytes "
                                f"{why}", "body")
        return b"".join(chunks)

    async def read_request(self, http: HttpRequest, model):
        """The parsed body (the OpenAI error object on any fault, its choices counted), or None when the client
        left mid-body."""
        self.check_available()
        raw = await self.read_body(http)
        if raw is None:
            return None
        body = await self.off_loop(parse_body, raw, model, self.ctx.limits)
        self.check_choices(body)
        return body

    async def serve_choices(self, http: HttpRequest, body, reqs: list[Request], prompts: list[list[int]],
                            kind: str, prefix: str):
        """Submit one request's choices (``prompts[k]`` is choice k's prompt) and answer: JSON or SSE."""
        from fastapi.responses import StreamingResponse

        ctx = self.ctx
        _, stops = _stop_fields(ctx, body)
        out = ChoicesResponse(ctx, f"{prefix}-{uuid.uuid4().hex[:24]}", kind, body, self.output)
        handles = self.submit(reqs, out.sink)
        out.start({h: Choice(ctx, k, p, stops, body.include_stop_str_in_output, body)
                   for k, (h, p) in enumerate(zip(handles, prompts))})
        if body.stream:
            return StreamingResponse(out.stream(), media_type="text/event-stream")
        return await out.collect(http, lambda render: self.off_loop(self.rendered, render))

    @staticmethod
    def rendered(render) -> bytes:
        """``render()``'s JSON bytes (a finished answer, on a worker thread), freed heap handed back after a
        large one."""
        payload = render()
        if len(payload) >= TRIM_AFTER_BYTES:
            return_freed_memory()
        return payload

    @staticmethod
    def answer(handler, raw: bytes) -> bytes:
        # The JSON is written here too: a long token list rendered on the event loop would stall it.
        payload = json.dumps(handler(raw)).encode()
        if len(raw) >= TRIM_AFTER_BYTES or len(payload) >= TRIM_AFTER_BYTES:
            return_freed_memory()
        return payload

    async def answer_off_loop(self, http: HttpRequest, handler):
        """Read the body (499 if the client left) and answer it with ``handler`` on a worker thread. A request
        without the API key (on a route left open) is bounded: :data:`OPEN_MAX_BODY_BYTES`, one at a time on
        its own thread (the key holders' threads stay free), at most :data:`OPEN_MAX_WAITING` waiting (then
        429). Its body is read before it takes a place or the turn: a client sending its body a byte a second
        held the one turn (and every keyless request behind it) for as long as it liked."""
        from fastapi.responses import Response

        ctx = self.ctx
        if not ctx.api_key or ApiKeyGate.authorized(http.headers.get("authorization", ""), ctx.api_key):
            raw = await self.read_body(http)
            if raw is None:
                return Response(status_code=499)
            return Response(await self.off_loop(self.answer, handler, raw), media_type="application/json")
        raw = await self.read_body(http, min(ctx.max_body_bytes, OPEN_MAX_BODY_BYTES), "without the API key")
        if raw is None:
            return Response(status_code=499)
        if self.open_admitted > OPEN_MAX_WAITING:  # one running, the rest waiting
            raise ApiError(429, f"server busy: {OPEN_MAX_WAITING} requests without the API key are waiting for this "
                                f"route; retry later or send the key", None, "rate_limit_exceeded")
        self.open_admitted += 1
        try:
            async with self.open_running:
                payload = await asyncio.get_running_loop().run_in_executor(self.open_pool, self.answer, handler, raw)
                return Response(payload, media_type="application/json")
        finally:
            self.open_admitted -= 1


async def _no_chunks():
    return
    yield  # an async generator that yields nothing


def http_protocol():
    """uvicorn's HTTP protocol class (h11, or httptools when installed) that closes a connection which has not
    completed a request's headers :data:`HEADER_TIMEOUT_S` after it opened or after its last answer. A request
    in progress (its body arriving, its answer streaming) is never closed by it."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderDeadlineProtocol(AutoHTTPProtocol):
        _header_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm_header_deadline()

        def connection_lost(self, exc):
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_deadline(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
            waiting_since = self.cycle  # a new request's headers make a new cycle

            def expire():
                idle = self.cycle is None or self.cycle.response_complete
                if self.cycle is waiting_since and idle and not self.transport.is_closing():
                    self.transport.close()

            self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, expire)

    return HeaderDeadlineProtocol


def create_app(ctx: ServeContext, metrics: ServerMetrics):
    """The FastAPI app of an :class:`OpenAIServer` over ``ctx``."""
    return OpenAIServer(ctx, metrics).app


def return_freed_memory() -> None:
    """Give the heap that large bodies and token lists freed back to the OS (glibc keeps it otherwise: a few
    large requests left the server at several GB); a no-op where the C library has no ``malloc_trim``."""
    import ctypes
    import ctypes.util

    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a --host value) only accepts connections from this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def http_stack() -> tuple[str, str]:
    """The HTTP parser and event loop uvicorn picks by itself ("auto"): httptools and uvloop where installed (the
    ``serve`` extra; 20 against 26 us of server CPU a streamed token on the stub engine at 32 streams, docs/serving.md),
    else h11 and asyncio's own loop."""
    import importlib.util

    def have(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return ("httptools" if have("httptools") else "h11"), ("uvloop" if have("uvloop") else "asyncio")


def log_http_stack() -> None:
    parser, loop = http_stack()
    if (parser, loop) == ("httptools", "uvloop"):
        logger.info("serve: HTTP parser httptools, event loop uvloop")
    else:
        logger.warning(f"serve: HTTP parser {parser}, event loop {loop}: the server spends ~25 % more CPU a streamed "
                       f"token than with httptools and uvloop (pip install httptools uvloop, the serve extra)")


def run_server(ctx: ServeContext, metrics: ServerMetrics, host: str, port: int, drain_timeout_s: float,
               ready_line: str, access_log: bool = False) -> int:
    """Serve until SIGTERM/SIGINT/SIGHUP (exit 0 after draining; a second one during the drain: ``128 + signal``)
    or an engine failure (:data:`EXIT_ENGINE_FAILED`).
    ``access_log``: uvicorn's one line per HTTP request."""
    import contextlib
    import signal

    import uvicorn

    log_http_stack()
    if not ctx.api_key and not is_loopback(host):
        logger.warning(f"serve: listening on {host}, beyond this machine, without an API key: anyone who can reach "
                       f"port {port} can use the model (set --api-key or TLLM_EXT_API_KEY)")
    drain = {}  # start time and how many requests the deadline ended

    def drain_deadline():
        message = (f"the server is shutting down: the request did not finish within the drain timeout "
                   f"({drain_timeout_s:g} s)")
        openai_server.end_body_reads(message)
        n = ctx.loop.abort_all(message)
        drain["ended"] = n
        if n:
            logger.warning(f"serve: drain timeout ({drain_timeout_s:g} s) passed: ended {n} request(s) with 503")

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # SIGTERM/SIGINT start the drain; uvicorn's own version re-raises the signal after shutdown,
            # which would end a drained server with "killed by SIGTERM" instead of exit code 0. SIGHUP (the
            # terminal or ssh session closed) drains too, as the TP launcher's does (its default action killed
            # the server mid-stream), unless it is ignored (nohup): then it stays ignored.
            from tensorrt_llm_ext.runtime.ranks import stop_signals

            old = {s: signal.signal(s, self.handle_exit) for s in stop_signals()}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

        forced_by: int | None = None  # the second signal, which ended the drain early

        async def startup(self, sockets=None):
            # The ready line once the socket listens, not at the app's start-up (uvicorn runs the lifespan
            # before it binds): a script waiting for the line must not see it from a server that then fails to
            # listen (the port taken after the CLI's check: exit 3, no ready line).
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                print(ready_line, flush=True)

        def handle_exit(self, sig, frame):
            if not ctx.draining:
                ctx.draining = True
                drain["t0"] = time.monotonic()
                st = ctx.loop.state()
                logger.info(f"serve: {signal.Signals(sig).name} received: draining {st.active} running and "
                            f"{st.queued} queued request(s) (new requests answer 503; drain timeout "
                            f"{drain_timeout_s:g} s)")
                timer = threading.Timer(drain_timeout_s, drain_deadline)
                timer.daemon = True
                timer.start()
                super().handle_exit(sig, frame)
            elif self.forced_by is None:
                # Not uvicorn's force exit, which cancels every stream mid-flight (tracebacks, no [DONE]): end
                # each request with its error first (off the signal handler: abort_all takes the loop's lock),
                # then stop waiting for connections after a short grace.
                self.forced_by = sig
                threading.Thread(target=forced_end, args=(sig,), name="serve-forced-end", daemon=True).start()

    def forced_end(sig: int) -> None:
        name = signal.Signals(sig).name
        message = f"the server is shutting down: a second stop signal ({name}) ended the request"
        openai_server.end_body_reads(message)
        n = ctx.loop.abort_all(message)
        logger.warning(f"serve: a second stop signal ({name}) during the drain: ended {n} request(s), exiting "
                       f"{128 + sig}")
        time.sleep(FORCED_GRACE_S)
        server.force_exit = True

    openai_server = OpenAIServer(ctx, metrics)
    app = openai_server.app
    # uvicorn's own bound is a backstop only: the drain deadline above answers every request first.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=access_log,
                            timeout_graceful_shutdown=drain_timeout_s + SHUTDOWN_GRACE_S, lifespan="on",
                            http=http_protocol())
    if access_log:  # uvicorn's access lines are INFO; its other start-up lines stay quiet
        import logging

        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = _Server(config)

    def shutdown_later():
        threading.Timer(FAILURE_GRACE_S, lambda: setattr(server, "should_exit", True)).start()

    ctx.loop.on_failure = shutdown_later

    ctx.loop.start()
    try:
        server.run()
    finally:
        ctx.loop.stop(timeout=drain_timeout_s + 10)
        if "t0" in drain:
            ended = drain.get("ended", 0) + openai_server.reads_ended_count
            logger.info(f"serve: drain finished after {time.monotonic() - drain['t0']:.1f} s: "
                        + (f"{ended} request(s) ended by the drain timeout" if ended
                           else "every request in flight was answered"))
    if ctx.loop.failure is not None:
        return EXIT_ENGINE_FAILED
    if server.forced_by is not None:
        return 128 + server.forced_by
    return 0 if server.started else 2
