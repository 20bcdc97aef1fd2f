"""The OpenAI response bodies of ``trtllm-ext serve``: one choice's tokens, text and log-probabilities as the
engine produces them (:class:`Choice`), and one HTTP request's answer built from its choices -- the JSON body or
the SSE stream (:class:`ChoicesResponse`). The app (:class:`~tensorrt_llm_ext.runtime.server.OpenAIServer`) routes
and admits; what an answer looks like lives here.

``ctx`` below is the server's :class:`~tensorrt_llm_ext.runtime.server.ServeContext` (its tokenizer, model name
and engine loop).
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass

from fastapi import Request as HttpRequest

from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.runtime.engine_loop import Aborted, EngineFailure, EngineLoop, Sink, hand_over
from tensorrt_llm_ext.runtime.openai_protocol import ApiError
from tensorrt_llm_ext.runtime.scheduler import Event
from tensorrt_llm_ext.runtime.tokenizer import byte_table

__all__ = ["Choice", "ChoicesResponse", "LOGPROB_FLOOR", "Mailbox", "OutputWorker", "chat_logprobs",
           "completion_logprobs", "decode_text"]

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token outside the top-p set reports this (vLLM's convention)
DISCONNECT_POLL_S = 0.25  # a non-streaming request checks this often whether its client is still there


class Choice:
    """Tokens, log-probabilities and text of one choice, cut at its stop (string or id).

    Text: with a byte-level tokenizer, the output's bytes (the tokenizer's byte table,
    :func:`~tensorrt_llm_ext.runtime.tokenizer.byte_table`) decoded; with any other (SentencePiece's Metaspace and
    byte fallback: Llama 2, Mistral, Gemma), grown token by token as vLLM's incremental detokenizer does: each
    token's text is the decode of a short window (the last tokens already shown, starting with the prompt's last
    few) past the window's own text, added once it ends in a whole character, never rewritten. A whole decode of
    the output alone drops the leading space of its first word ("Hello" + "world") and, with byte fallback,
    turns a run of byte tokens that ends mid-character into one replacement character per byte, so characters
    already streamed vanished from the answer.

    Stop strings are searched for incrementally: each event reads the output's text once and searches only the
    text that is new since the last event (plus the longest stop string's length back, for one that spans
    events), with one precompiled pattern for all of them. As vLLM, a stop string counts only once the output has
    more than ``min_tokens`` tokens, and only if it ends after the text of the first ``min_tokens``."""

    # The prompt tokens an output is decoded after: the shortest suffix of at least the first number whose text
    # has no replacement character, at most the second (vLLM's choice).
    DECODE_CONTEXT = (4, 24)

    DECODE_GUARD = 8  # characters at the end of a decode that a later token may still change (merged bytes)

    def __init__(self, ctx, index: int, prompt_ids: list[int], stops: list[str], include_stop: bool,
                 body=None):
        self.ctx, self.index, self.prompt_ids = ctx, index, prompt_ids
        self.stops, self.include_stop = stops, include_stop
        self.stop_pattern = re.compile("|".join(map(re.escape, stops))) if stops else None
        self.stop_reach = max((len(s) for s in stops), default=0)  # chars a stop string may reach back
        self.min_tokens = body.min_tokens if body is not None else 0
        self.floor: int | None = None  # chars of the first min_tokens tokens' text; a stop must end past it
        self.checked = 0  # chars of the output text already searched (no stop ends before this)
        self.stop_span: tuple[int, int] | None = None  # the stop string's [start, end) in text()
        self.skip_special = body.skip_special_tokens if body is not None else True
        self.spaces_between = body.spaces_between_special_tokens if body is not None else True
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.prompt_logprobs: list | None = None  # echo with logprobs: prompt tokens 1 .. n-1 (the prefill's event)
        self.finish_reason: str | None = None
        self.error: ApiError | None = None  # finish_reason "error": what the engine said, as the HTTP answer
        # The last token is a stop / EOS id: kept in token_ids, and in text only with include_stop_str_in_output
        # (vLLM's rule for stop ids: it leaves the stop token's text out only when that field is false).
        self.stop_token = False
        self.text_sent = 0
        self.tokens_sent = 0
        self.logprobs_sent = 0
        self.text_offset = 0  # streamed completions' logprobs: the text_offset of the next token
        # A byte-level tokenizer's bytes per id: the text of any prefix of the output is its bytes decoded (see
        # prefix_text), so no event decodes the whole output again. None: the text grows token by token (_feed).
        self.table = byte_table(ctx.tokenizer) if ctx.tokenizer is not None and self.skip_special else None
        self._bytes = bytearray()  # with a table: the output's bytes ...
        self._ends: list[int] = []  # ... and where each token's end
        self._text = ""  # without a table: the output's text, grown token by token (see _feed) ...
        self._text_ends: list[int] = []  # ... and where each token's text ends in it
        self._window: list[int] | None = None  # ... the tokens decoded together: the last ones shown, then pending
        self._window_read = 0  # ... window[:_window_read] are shown (or the prompt's), the rest pending
        self._window_text = ""  # ... the text of window[:_window_read]

    def decode(self, tokens: list[int]) -> str | None:
        return decode_text(self.ctx.tokenizer, tokens, self.skip_special, self.spaces_between)

    def prefix_text(self, k: int) -> str | None:
        """The text of the output's first ``k`` tokens."""
        if self.ctx.tokenizer is None:
            return None
        if self.table is None:
            return self._text[:self._text_ends[k - 1]] if k else ""
        return self._bytes[:self._ends[k - 1]].decode("utf-8", "replace") if k else ""

    def _extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        if self.table is None:
            self._feed(tokens)
            return
        table, buf, ends = self.table, self._bytes, self._ends
        for t in tokens:
            if not 0 <= t < len(table):  # an id the tokenizer lacks: its own decode says what it is
                self.table = None
                self._feed(self.tokens)
                return
            buf += table[t]
            ends.append(len(buf))

    def _feed(self, tokens: list[int]) -> None:
        """Without a table: each token's text (vLLM's incremental detokenization). A token whose window decodes
        to text ending in a replacement character (an incomplete character so far) is pending: its text comes
        with the token that completes it."""
        if self.ctx.tokenizer is None:
            return
        if self._window is None:
            ids, (least, most) = self.prompt_ids, self.DECODE_CONTEXT
            context = ids[-least:]
            for n in range(least, min(len(ids), most) + 1):
                if "\ufffd" not in self.decode(ids[-n:]):
                    context = ids[-n:]
                    break
            self._window, self._window_read = list(context), len(context)
            self._window_text = self.decode(context)
        for t in tokens:
            self._window.append(t)
            text = self.decode(self._window)
            if len(text) > len(self._window_text) and not text.endswith("\ufffd"):
                self._text += text[len(self._window_text):]
                del self._window[:self._window_read]
                self._window_read = len(self._window)
                self._window_text = self.decode(self._window)
            self._text_ends.append(len(self._text))

    def _flush(self, final: int) -> None:
        """Without a table, once the choice ended: the text still pending for its first ``final`` tokens, as
        decoded (an incomplete character at the end shows as a replacement character, as a whole decode has it)."""
        pending = len(self._window or ()) - self._window_read
        first_pending = len(self.tokens) - pending
        if self.ctx.tokenizer is None or final <= first_pending:
            return
        end = self._window_read + final - first_pending
        text = self.decode(self._window[:end])
        # Byte fallback decodes a run of byte tokens that is not UTF-8 as one U+FFFD per byte, the run's shown
        # characters included: then the pending tokens' own decode.
        tail = (text[len(self._window_text):] if text.startswith(self._window_text)
                else self.decode(self._window[self._window_read:end]))
        if tail:
            self._text += tail
            self._text_ends[first_pending:] = [len(self._text)] * (len(self.tokens) - first_pending)

    def _truncate(self, m: int) -> None:
        del self.tokens[m:]
        del self.logprobs[m:]
        if self.table is not None:
            del self._ends[m:]
            del self._bytes[self._ends[-1] if self._ends else 0:]
        else:
            del self._text_ends[m:]
            self._text = self._text[:self._text_ends[-1] if self._text_ends else 0]

    def apply(self, e: Event, loop: EngineLoop, handle: int) -> None:
        prev = len(self.tokens)
        self._extend(e.tokens)
        if e.logprobs is not None:
            self.logprobs.extend(e.logprobs)
        if e.prompt_logprobs is not None:
            self.prompt_logprobs = e.prompt_logprobs
        if e.finish_reason is not None:
            self.finish_reason = "stop" if e.finish_reason == "stop" else e.finish_reason
            self.stop_token = e.finish_reason == "stop" and not self.include_stop
            if self.table is None:
                self._flush(len(self.tokens) - 1 if self.stop_token else len(self.tokens))
        if e.finish_reason == "error":
            msg = e.error or "the engine ended the request with an error"
            self.error = (ApiError(400, msg) if e.request_fault
                          else ApiError(500, msg, None, "internal_error"))
        if self.stops and self.finish_reason in (None, "stop", "length") and len(self.tokens) > self.min_tokens:
            self._check_stop_strings(prev, loop, handle)

    def _find_stop(self, text: str) -> re.Match | None:
        """The first stop string in ``text`` that ends past what was searched already and past the min_tokens
        floor."""
        floor = self.floor or 0
        pos = max(0, max(self.checked, floor) + 1 - self.stop_reach)
        while (m := self.stop_pattern.search(text, pos)) is not None:
            if m.end() > floor:
                return m
            pos = m.start() + 1
        return None

    def _check_stop_strings(self, prev: int, loop: EngineLoop, handle: int) -> None:
        if self.floor is None and self.min_tokens > 0:
            self.floor = len(self.prefix_text(self.min_tokens))
        full = self.prefix_text(len(self.tokens))
        hit = self._find_stop(full)
        if hit is None:
            self.checked = max(self.checked, len(full) - self.DECODE_GUARD)
            return
        # A stop in this event's text: the first of its tokens that completes one (an event carries at most
        # the accepted block, so a handful of decodes).
        m = len(self.tokens)
        for k in range(max(prev, self.min_tokens) + 1, len(self.tokens)):
            earlier = self._find_stop(self.prefix_text(k))
            if earlier is not None:
                m, hit = k, earlier
                break
        self._truncate(m)
        self.stop_span = hit.span()
        was_running = self.finish_reason is None
        self.finish_reason, self.stop_token = "stop", False
        if was_running:
            loop.cancel(handle, "stop")

    def text(self) -> str | None:
        """The choice's text so far: the stop string and a stop / EOS token left out unless included."""
        text = self.prefix_text(len(self.tokens) - 1 if self.stop_token else len(self.tokens))
        if text is None or self.stop_span is None:
            return text
        start, end = self.stop_span
        return text[:end] if self.include_stop else text[:start]

    def stream_text(self) -> str | None:
        """The text that can be sent now: while running, hold back what may still become a stop string or
        an incomplete UTF-8 character."""
        text = self.text()
        if text is None or self.finish_reason is not None:
            return text
        # The incomplete character first: a stop string ending in it starts within the hold of the text before it
        # (held back after it, the stop's first character was streamed, then cut from the answer).
        text = text.rstrip("\ufffd")
        hold = max(0, self.stop_reach - 1)
        return text[:max(0, len(text) - hold)]


def decode_text(tok, tokens: list[int], skip_special_tokens: bool = True,
                spaces_between_special_tokens: bool = True) -> str | None:
    """``tokens`` as text (None without a tokenizer). Special tokens are dropped (``skip_special_tokens``) or
    kept; kept ones are separated from the text beside them by one space when ``spaces_between_special_tokens``
    (vLLM's meaning; ``transformers``' fast tokenizers ignore that argument, so it is applied here)."""
    if tok is None:
        return None
    if skip_special_tokens:
        return tok.decode(tokens, skip_special_tokens=True)
    special = set(getattr(tok, "all_special_ids", ()))
    parts, run = [], []
    for t in tokens:
        if t in special:
            if run:
                parts.append(tok.decode(run))
                run = []
            parts.append(tok.decode([t]))
        else:
            run.append(t)
    if run:
        parts.append(tok.decode(run))
    return (" " if spaces_between_special_tokens else "").join(parts)


def _token_str(ctx, token: int) -> str:
    if ctx.tokenizer is None:
        return f"token_id:{token}"
    s = ctx.token_strs.get(token)
    if s is None:  # two threads may both decode a new id: the same string either way
        s = ctx.token_strs[token] = ctx.tokenizer.decode([token])
    return s


def _lp(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf (outside top-p) and NaN-free by construction


def completion_logprobs(ctx, lps: list, tokens: list[int], text_offset0: int = 0) -> dict:
    """The completions API's ``logprobs`` object; an entry of ``lps`` that is None (an echoed prompt's first
    token, which nothing predicts) is null in ``token_logprobs`` and ``top_logprobs``, as OpenAI writes it."""
    strs = [_token_str(ctx, t) for t in tokens]
    offsets, at = [], text_offset0
    for s in strs:
        offsets.append(at)
        at += len(s)
    return {"tokens": strs, "token_logprobs": [None if e is None else _lp(e[0]) for e in lps],
            "top_logprobs": [None if e is None else {_token_str(ctx, i): _lp(v) for i, v in e[1]} for e in lps],
            "text_offset": offsets}


def echoed_logprobs(ch) -> tuple[list, list[int]]:
    """The log-probabilities and ids of an echoed prompt (``echo`` with ``logprobs``): the prompt's first token
    without one, then each prompt token's."""
    return [None] + list(ch.prompt_logprobs or ()), list(ch.prompt_ids)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token (SentencePiece's <0xE4>)


def _token_bytes(ctx, token: int, s: str) -> list[int]:
    """OpenAI's ``bytes`` of a token: the token's own bytes, so that a character split over tokens joins back (a
    byte token's string is U+FFFD, whose UTF-8 said nothing of it) -- from the byte table (byte-level BPE) or a
    byte-fallback piece; else the UTF-8 of its string. Kept per id, as the strings are."""
    cache = getattr(ctx, "token_bytes", None)
    got = cache.get(token) if cache is not None else None
    if got is None:
        tok, got = ctx.tokenizer, list(s.encode("utf-8"))
        table = byte_table(tok) if tok is not None else None
        if table is not None and 0 <= token < len(table) and table[token]:  # b"": a special token, its string
            got = list(table[token])
        elif "\ufffd" in s and hasattr(tok, "convert_ids_to_tokens"):
            piece = _BYTE_PIECE.fullmatch(tok.convert_ids_to_tokens(token) or "")
            if piece is not None:
                got = [int(piece.group(1), 16)]
        if cache is not None:
            cache[token] = got
    return got


def chat_logprobs(ctx, lps: list, tokens: list[int]) -> dict:
    def entry(t, v):
        s = _token_str(ctx, t)
        return {"token": s, "logprob": _lp(v), "bytes": _token_bytes(ctx, t, s)}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                        for t, (lp, top) in zip(tokens, lps)]}


class OutputWorker:
    """The one thread that turns the engine's events into answers: it applies each event to its choice (tokens,
    stop strings, text) and renders the SSE bytes, for all streams of an engine step in one pass, then hands the
    results to the event loop in one callback per step (not one per token: each hand-off wakes the loop, and the
    engine thread, the loop and this thread share one interpreter lock). Decoding never runs on the event loop.

    Fed by :func:`~tensorrt_llm_ext.runtime.engine_loop.deliver` (lists of ``(sink, item)``) and by
    :meth:`call` (a function returning such a list, run in order with the events)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="serve-output", daemon=True)
        self._thread.start()

    def put(self, pairs: list) -> None:
        """``[(sink, item)]``: each ``sink.handler(item)`` runs here; what it returns goes to ``sink.queue``."""
        self._queue.put(pairs)

    def call(self, fn) -> None:
        """Run ``fn()`` here, after every item put before; it returns ``[(sink, payload)]`` to hand over."""
        self._queue.put(fn)

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            work = [self._queue.get()]
            while not self._queue.empty():  # whatever else is waiting goes out with the same hand-off
                work.append(self._queue.get_nowait())
            out: dict = {}  # event loop -> [(asyncio queue, payload)]
            for w in work:
                if w is None:
                    _hand_over(out)
                    return
                if callable(w):
                    for sink, payload in self._safely(w, None):
                        out.setdefault(sink.loop, []).append((sink.queue, payload))
                    continue
                for sink, item in w:
                    payload = self._safely(sink.handler, item)
                    if payload is not None:
                        out.setdefault(sink.loop, []).append((sink.queue, payload))
            _hand_over(out)

    @staticmethod
    def _safely(fn, item):
        try:
            return fn() if item is None else fn(item)
        except Exception as e:  # the request's handler raises it on the event loop (the worker serves on)
            logger.exception("serve: building an answer failed")
            return [] if item is None else e


def _hand_over(out: dict) -> None:
    for loop, items in out.items():
        hand_over(loop, items)


class Mailbox:
    """A response's queue on the event loop: what :class:`asyncio.Queue` does for one reader and no bound, at a
    fraction of its cost per item (every stream takes one item per engine step)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.waiter = loop, deque(), None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def empty(self) -> bool:
        return not self.items

    def get_nowait(self):
        return self.items.popleft()

    async def get(self):
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


@dataclass
class _Last:
    """A stream's last bytes (its final chunk, the usage chunk, ``[DONE]``; or an error chunk, ``[DONE]``)."""

    data: bytes


_FINISHED = object()  # a non-streaming request's choices have all finished
DONE_SSE = b"data: [DONE]\n\n"


_json_str = json.encoder.encode_basestring_ascii  # a str as json.dumps writes it (ensure_ascii)


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class ChoicesResponse:
    """One HTTP request's choices while the engine produces them: the JSON body or the SSE stream.

    Its events are handled on the :class:`OutputWorker` (:meth:`on_item`), which owns the choices' state once
    :meth:`attach` ran there; the event loop reads what the worker hands it (SSE bytes, or "finished")."""

    def __init__(self, ctx, rid: str, kind: str, body, output: OutputWorker):
        self.ctx, self.rid, self.kind, self.body, self.output = ctx, rid, kind, body, output
        self.chat = kind == "chat.completion"
        self.want_logprobs = (body.logprobs if not self.chat else body.logprobs_k()) is not None
        self.created = int(time.time())
        loop = asyncio.get_running_loop()
        self.queue = Mailbox(loop)
        self.sink = Sink(loop, self.queue, self.on_item, output)
        self.choices: dict[int, Choice] = {}
        self._attached = False  # worker: attach ran (events before it wait in _early)
        self._early: list = []
        self._closed = False  # worker: the answer's end was handed over; later events are dropped
        self._first: set[int] = set()  # worker: handles whose first chunk is still to come
        self.obj = "chat.completion.chunk" if self.chat else "text_completion"
        # Every chunk is this head, one choice, and "]}": json.dumps of the whole object, written once.
        self._chunk_head = json.dumps(self._head(self.obj))[:-1] + ', "choices": ['

    def start(self, choices: dict[int, Choice]) -> None:
        """The choices of the submitted handles; the worker takes them over after the events already put."""
        self.choices = choices
        self.output.call(self.attach)

    def attach(self) -> list:
        self._attached = True
        self._first = set(self.choices)
        early, self._early = self._early, []
        return [(self.sink, p) for p in (OutputWorker._safely(self.on_item, item) for item in early) if p is not None]

    def running(self) -> bool:
        return any(ch.finish_reason is None for ch in self.choices.values())

    def _apply(self, item) -> Choice | None:
        ch = self.choices.get(item.handle)
        if ch is None or ch.finish_reason is not None:
            return None
        ch.apply(item, self.ctx.loop, item.handle)
        return ch

    def on_item(self, item):
        """On the worker: one engine item -> what the event loop gets (None: nothing yet)."""
        if self._closed:
            return None
        if isinstance(item, (EngineFailure, Aborted)):
            self._closed = True
            return item
        if not self._attached:
            self._early.append(item)
            return None
        ch = self._apply(item)
        if not self.body.stream:
            if ch is not None and not self.running():
                self._closed = True
                return _FINISHED
            return None
        if ch is None:
            return None
        if ch.error is not None:  # the request failed in the engine: its message, then [DONE]
            self._closed = True
            return _Last(_sse(ch.error.body()) + DONE_SSE)
        chunk = f"data: {self._chunk_head}{self._delta_json(ch, item.handle in self._first)}]}}\n\n".encode()
        self._first.discard(item.handle)
        if self.running():
            return chunk
        self._closed = True
        opts = self.body.stream_options
        if opts is not None and opts.include_usage:
            chunk += _sse({**self._head(self.obj), "choices": [], "usage": self.usage()})
        return _Last(chunk + DONE_SSE)

    def usage(self) -> dict:
        # Each prompt once, however many choices it has (OpenAI and vLLM count it so).
        prompt = sum(len(ch.prompt_ids) for ch in self.choices.values() if ch.index % self.body.n == 0)
        completion = sum(len(ch.tokens) for ch in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.ctx.model_name}

    @staticmethod
    def _error(item) -> ApiError:
        if isinstance(item, Aborted):
            return ApiError(503, item.message, None, "service_unavailable")
        return ApiError(503, f"engine failed: {item.message}", None, "service_unavailable")

    def _release(self) -> None:
        for h, ch in self.choices.items():
            if ch.finish_reason is None:
                self.ctx.loop.cancel(h)

    # -- non-streaming ------------------------------------------------------------------------------------
    def _final_choice(self, ch: Choice) -> dict:
        if ch.error is not None:
            raise ch.error
        text = ch.text()
        if not self.chat:
            c = {"index": ch.index, "token_ids": list(ch.tokens), "finish_reason": ch.finish_reason, "logprobs": None}
            prefix = ""
            if self.body.echo:
                prefix = ch.decode(ch.prompt_ids) or ""
                c["prompt_token_ids"] = list(ch.prompt_ids)
            if text is not None:
                c["text"] = prefix + text
            if self.want_logprobs:
                lps, toks = echoed_logprobs(ch) if self.body.echo else ([], [])
                c["logprobs"] = completion_logprobs(self.ctx, lps + ch.logprobs, toks + ch.tokens,
                                                    0 if self.body.echo else len(prefix))
            return c
        c = {"index": ch.index, "message": {"role": "assistant", "content": text or ""},
             "finish_reason": ch.finish_reason, "logprobs": None, "token_ids": list(ch.tokens)}
        if self.want_logprobs:
            c["logprobs"] = chat_logprobs(self.ctx, ch.logprobs, ch.tokens)
        return c

    def final_json(self) -> bytes:
        """The finished answer as JSON bytes (as Starlette's ``JSONResponse`` writes them): the choices' text,
        tokens and log-probabilities, the usage. Raises a failed choice's :class:`ApiError`."""
        choices = [self._final_choice(ch) for ch in sorted(self.choices.values(), key=lambda c: c.index)]
        body = {**self._head(self.kind), "choices": choices, "usage": self.usage()}
        return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

    async def collect(self, http: HttpRequest, off_loop=None):
        """Wait for every choice to finish (a client that leaves cancels them), then answer. The body is built
        and written by ``off_loop(fn)`` (a worker thread), never on the event loop: with ``echo`` and
        ``logprobs`` it holds every prompt token's top candidates, each decoded -- a 5 MB answer stalled every
        other client and stream for 0.8 s, a long prompt's for many seconds."""
        from fastapi.responses import JSONResponse, Response

        try:
            next_check = time.monotonic() + DISCONNECT_POLL_S
            while True:
                # Polled by the clock, not only when no token came: steps faster than the poll would
                # otherwise hide a client that left until max_tokens.
                if time.monotonic() >= next_check:
                    if await http.is_disconnected():
                        return JSONResponse({}, status_code=499)
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                try:
                    item = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
                if item is _FINISHED:
                    break
                if isinstance(item, (EngineFailure, Aborted)):
                    raise self._error(item)
                raise item  # the worker failed on this request
            payload = await off_loop(self.final_json) if off_loop is not None else self.final_json()
            return Response(payload, media_type="application/json")
        finally:
            self._release()

    # -- streaming ----------------------------------------------------------------------------------------
    def _delta(self, ch: Choice, first: bool) -> dict:
        new_tokens = ch.tokens[ch.tokens_sent:]
        new_lps = ch.logprobs[ch.logprobs_sent:len(ch.tokens)]
        ch.tokens_sent, ch.logprobs_sent = len(ch.tokens), len(ch.tokens)
        text = ch.stream_text()
        delta_text = None
        if text is not None:
            delta_text, ch.text_sent = text[ch.text_sent:], max(ch.text_sent, len(text))
        if self.chat:
            delta = {"role": "assistant", "content": delta_text or ""} if first else {"content": delta_text or ""}
            c = {"index": ch.index, "delta": delta, "logprobs": None, "finish_reason": ch.finish_reason,
                 "token_ids": new_tokens}
            if self.want_logprobs:
                c["logprobs"] = chat_logprobs(self.ctx, new_lps, new_tokens)
            return c
        c = {"index": ch.index, "token_ids": new_tokens, "finish_reason": ch.finish_reason, "logprobs": None}
        if first and self.body.echo:
            c["prompt_token_ids"] = list(ch.prompt_ids)
        if delta_text is not None:
            c["text"] = ((ch.decode(ch.prompt_ids) or "") if first and self.body.echo else "") + delta_text
        if self.want_logprobs:
            lps, toks = echoed_logprobs(ch) if first and self.body.echo else ([], [])
            lp = completion_logprobs(self.ctx, lps + new_lps, toks + new_tokens, ch.text_offset)
            if lp["tokens"]:  # the next chunk's offsets continue from here (they restarted at 0 in every chunk)
                ch.text_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
            c["logprobs"] = lp
        return c

    def _delta_json(self, ch: Choice, first: bool) -> str:
        """``json.dumps(self._delta(ch, first))``, written directly for the chunks of every token (no logprobs,
        no echoed prompt): the same characters, a third of the cost."""
        if self.want_logprobs or (not self.chat and first and self.body.echo):
            return json.dumps(self._delta(ch, first))
        ids = ", ".join(map(str, ch.tokens[ch.tokens_sent:]))
        ch.tokens_sent = ch.logprobs_sent = len(ch.tokens)
        text = ch.stream_text()
        delta_text = None
        if text is not None:
            delta_text, ch.text_sent = text[ch.text_sent:], max(ch.text_sent, len(text))
        finish = "null" if ch.finish_reason is None else _json_str(ch.finish_reason)
        if self.chat:
            role = '"role": "assistant", ' if first else ""
            return (f'{{"index": {ch.index}, "delta": {{{role}"content": {_json_str(delta_text or "")}}}, '
                    f'"logprobs": null, "finish_reason": {finish}, "token_ids": [{ids}]}}')
        text_field = "" if delta_text is None else f', "text": {_json_str(delta_text)}'
        return f'{{"index": {ch.index}, "token_ids": [{ids}], "finish_reason": {finish}, "logprobs": null{text_field}}}'

    async def stream(self):
        """SSE: one chunk per engine event with the new tokens, a final chunk per choice, the usage chunk
        (``stream_options.include_usage``), then ``[DONE]``; an error ends with an error chunk then ``[DONE]``.
        Chunks already waiting when the stream wakes go out in one write (the same bytes)."""
        try:
            while True:
                item = await self.queue.get()
                parts = []
                while True:
                    if isinstance(item, bytes):
                        parts.append(item)
                    elif isinstance(item, _Last):
                        yield b"".join(parts) + item.data
                        return
                    elif isinstance(item, (EngineFailure, Aborted)):
                        yield b"".join(parts) + _sse(self._error(item).body()) + DONE_SSE
                        return
                    else:  # the worker failed on this request
                        if parts:
                            yield b"".join(parts)
                        raise item
                    if self.queue.empty():
                        break
                    item = self.queue.get_nowait()
                yield b"".join(parts)
        finally:  # a client that disconnects cancels the stream: free its slots
            self._release()
