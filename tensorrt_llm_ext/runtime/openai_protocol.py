"""The OpenAI wire protocol of ``trtllm-ext serve``: request models (one validator per field), the error
object, and body parsing that answers every malformed body with that object.

A request is validated here once, completely: types (strict: ``true`` is not ``1``), ranges, and with the
validation context (:class:`ServeLimits`) the vocabulary and the length limit. What leaves
:func:`parse_body` can be turned into engine requests without another check. Unknown fields are refused
by name, never silently ignored; a known field at a value this server cannot honour (``response_format``
``json_object``, tools with ``tool_choice`` other than ``none``) is refused naming the field and saying why.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import (BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      ValidationInfo, field_validator, model_validator)

from tensorrt_llm_ext.contract import FP32_MAX, FP32_MIN_NORMAL, sampling_problem
from tensorrt_llm_ext.speculative.logits_processing import MAX_LOGIT_BIAS

MAX_TOP_LOGPROBS = 20
MAX_N = 128  # choices per request (each takes a slot; more than the queue holds is a 429 anyway)
MAX_JSON_DEPTH = 64  # deeper bodies (and tool-call arguments) are refused before json.loads recurses
# Stop strings: each is searched for in the new text of every step, so their number and length bound a step's
# work (OpenAI allows 4; vLLM sets no bound, which one request with 200k strings turns into a stalled server).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256


class ApiError(Exception):
    """An OpenAI error response: ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class ServeLimits:
    """What field validation needs to know about the served model (the pydantic validation context)."""

    vocab_size: int
    max_model_len: int


def _limits(info: ValidationInfo) -> ServeLimits | None:
    return info.context.get("limits") if isinstance(info.context, dict) else None


def _check_ids(ids: list[int], what: str, info: ValidationInfo) -> None:
    lim = _limits(info)
    if lim is None:
        return
    bad = [t for t in ids if not 0 <= t < lim.vocab_size]
    if bad:
        raise ValueError(f"{what} {bad[:5]} outside the vocabulary [0, {lim.vocab_size})")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # json_schema's own fields; refused below unless type is text

    type: StrictStr

    @field_validator("type")
    @classmethod
    def _type(cls, v):
        if v != "text":
            raise ValueError(f"only {{\"type\": \"text\"}} is served, got {v!r} (no guided decoding: the output "
                             f"is not constrained to JSON)")
        return v


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")  # description, parameters, strict: passed to the chat template

    name: StrictStr


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: ToolFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields completions and chat share (OpenAI's, plus vLLM's ``stop_token_ids`` / ``ignore_eos`` /
    ``min_tokens`` / ``include_stop_str_in_output``)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: StrictFloat = 0.0
    top_p: StrictFloat = 1.0
    seed: StrictInt | None = None
    n: StrictInt = 1
    stop: StrictStr | list[StrictStr] | list[StrictInt] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    best_of: StrictInt | None = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    response_format: ResponseFormat | None = None
    # vLLM's sampling fields with vLLM's / OpenAI's ranges (the engine's logits processing); a field not in
    # SERVED_SAMPLING is refused at any value but its no-op, naming itself.
    top_k: StrictInt | None = None
    min_p: StrictFloat | StrictInt | None = None
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    repetition_penalty: StrictFloat | StrictInt | None = None
    logit_bias: dict[StrictStr, StrictFloat | StrictInt] | None = None

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, v):
        if v is not None and v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    @field_validator("temperature", "top_p", "seed")
    @classmethod
    def _sampling(cls, v, info: ValidationInfo):
        # The request's SamplingParams rules, in their one wording (seed None: the default seed 0; a top_p
        # below the smallest normal fp32 is served as MIN_TOP_P, Request.sampling_top_p).
        problem = None if v is None else sampling_problem(info.field_name, v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if not 1 <= v <= MAX_N:
            raise ValueError(f"must be in [1, {MAX_N}], got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v, info: ValidationInfo):
        if isinstance(v, list) and v and isinstance(v[0], int):
            _check_ids(v, "token ids", info)
        if isinstance(v, str) and v == "" or isinstance(v, list) and any(s == "" for s in v):
            raise ValueError("an empty stop string would stop at once")
        strings = [v] if isinstance(v, str) else v if isinstance(v, list) and v and isinstance(v[0], str) else []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        longest = max(strings, key=len, default="")
        if len(longest) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"a stop string is at most {MAX_STOP_STRING_CHARS} characters, got one of "
                             f"{len(longest)}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v, info: ValidationInfo):
        if v:
            _check_ids(v, "token ids", info)
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v is not None and v < -1:
            raise ValueError(f"must be -1 or 0 (no limit) or a positive count, got {v}")
        if v is not None and v >= 2**63:
            raise ValueError(f"{v} does not fit int64, the engine's type")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v):
        if v is not None and not 0.0 <= v <= 1.0:  # NaN fails too
            raise ValueError(f"must be in [0, 1], got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v):
        if v is not None and not -2.0 <= v <= 2.0:
            raise ValueError(f"must be in [-2, 2], got {v}")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v):
        # Compared, never converted: an int past 1e308 has no float (math.isfinite would raise OverflowError,
        # which pydantic does not turn into a 400).
        if v is not None and not (v > 0 and (isinstance(v, int) or math.isfinite(v))):
            raise ValueError(f"must be a finite number > 0, got {v}")
        if v is not None and not FP32_MIN_NORMAL <= v <= FP32_MAX:  # a divisor: 0 or inf in fp32
            raise ValueError(f"{v} is {'0' if v < 1 else 'inf'} in fp32, the engine's precision (expected "
                             f"{FP32_MIN_NORMAL:.3g} .. {FP32_MAX:.3g})")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v, info: ValidationInfo):
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
        ids = []
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit()) or len(key) > 1 and key[0] == "0":
                raise ValueError(f"keys must be token ids as strings (\"123\", no leading zero), got {key[:40]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
            ids.append(int(key))
        _check_ids(ids, "token ids", info)
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v):
        if v < 0:
            raise ValueError(f"must be >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _across_fields(self):
        if self.stream_options is not None and not self.stream:
            raise _FieldError("stream_options", "only allowed when stream is true")
        if self.seed is not None and self.seed + self.num_choices() - 1 >= 2**63:
            raise _FieldError("seed", f"seed + {self.num_choices() - 1} (one seed per choice) must stay below 2^63, "
                                      f"got seed {self.seed}")
        limit = self.max_completion_tokens or self.max_tokens
        if limit is not None and self.min_tokens > limit:
            raise _FieldError("min_tokens", f"min_tokens={self.min_tokens} exceeds the token limit {limit}")
        if self.best_of is not None and self.best_of < self.n:
            raise _FieldError("best_of", f"must be >= n={self.n}, got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n:
            raise _FieldError("best_of", f"best_of={self.best_of} > n={self.n} is not served (ranking candidates "
                                         f"by log-probability is not implemented); send best_of = n or leave it out")
        for name, value in self.unserved_sampling().items():
            raise _FieldError(name, f"{name}={value} is not served yet: the engine does not implement it, so only "
                                    f"its no-op value ({NO_OP_WORDS[name]}) is accepted")
        return self

    def unserved_sampling(self) -> dict:
        """The sampling fields set to a value other than their no-op that the engine does not implement."""
        return {name: getattr(self, name) for name in NO_OP_SAMPLING
                if name not in SERVED_SAMPLING and not _is_no_op(name, getattr(self, name))}

    def num_choices(self) -> int:
        """Engine requests this body makes (choices over every prompt)."""
        return self.n

    def processing_fields(self) -> dict:
        """The engine request's logits-processing fields (no-op values normalised: ``top_k`` -1 -> 0)."""
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else 0
        return dict(top_k=top_k, min_p=float(self.min_p or 0.0),
                    presence_penalty=float(self.presence_penalty or 0.0),
                    frequency_penalty=float(self.frequency_penalty or 0.0),
                    repetition_penalty=float(self.repetition_penalty if self.repetition_penalty is not None else 1.0),
                    logit_bias={int(t): float(b) for t, b in (self.logit_bias or {}).items()} or None)

    def processes_logits(self) -> bool:
        return any(not _is_no_op(name, getattr(self, name)) for name in NO_OP_SAMPLING)

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) or ``max_tokens``; None: not given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# Each sampling field and the value that leaves the distribution unchanged (vLLM's defaults; top_k 0 and -1
# both mean no limit, logit_bias {} or null nothing, min_p 0 nothing).
NO_OP_SAMPLING = {"top_k": -1, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                  "repetition_penalty": 1.0, "logit_bias": {}}
NO_OP_WORDS = {"top_k": "-1 or 0", "min_p": "0", "presence_penalty": "0", "frequency_penalty": "0",
               "repetition_penalty": "1", "logit_bias": "{} or null"}
# The fields the engine implements (speculative/logits_processing.py); a field missing here is refused at any
# value but its no-op.
SERVED_SAMPLING: frozenset[str] = frozenset(NO_OP_SAMPLING)


def _is_no_op(name: str, value) -> bool:
    if value is None:
        return True
    if name == "top_k":
        return value in (-1, 0)
    if name == "logit_bias":
        return not value
    return value == NO_OP_SAMPLING[name]


class _FieldError(ValueError):
    """A cross-field check that names the field it blames."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: token ids (``[1, 2, 3]``), a batch of them, or text (one or a
    list) when the model has a tokenizer. ``stop``: token ids, or strings with a tokenizer."""

    prompt: list[StrictInt] | list[list[StrictInt]] | StrictStr | list[StrictStr]
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v, info: ValidationInfo):
        items = [v] if isinstance(v, str) or (v and isinstance(v[0], int)) or not v else v
        for i, p in enumerate(items):
            where = "" if len(items) == 1 else f"prompt {i}: "
            if len(p) == 0:
                raise ValueError(f"{where}empty prompt (at least one token)")
            if isinstance(p, list):
                _check_ids(p, f"{where}token ids", info)
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"must be in [0, {MAX_TOP_LOGPROBS}], got {v}")
        return v

    @model_validator(mode="after")
    def _echo(self):
        if self.echo and self.logprobs is not None:
            raise _FieldError("echo", "echo with logprobs would need prompt logprobs, which are not served; "
                                      "send echo or logprobs")
        return self

    def prompts_count(self) -> int:
        p = self.prompt
        return len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1

    def num_choices(self) -> int:
        return self.n * self.prompts_count()


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr
    arguments: StrictStr  # JSON text (OpenAI's shape); given to the chat template as the object it encodes

    @field_validator("arguments")
    @classmethod
    def _arguments(cls, v):
        # Decoded for the chat template (template_dict): bounded like the body, before json.loads recurses.
        if not _json_depth_ok(v):
            raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        return v


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One message. ``tool_calls`` (assistant) and ``tool_call_id`` (tool) of earlier turns are accepted
    whether or not this request gives ``tools``: they are history, rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[dict] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    def template_dict(self) -> dict:
        """The message as chat templates read it: ``tool_calls[].function.arguments`` decoded from JSON
        (templates index and ``tojson`` them as objects), absent fields left out."""
        d = {k: v for k, v in self.model_dump().items() if v is not None}
        for call in d.get("tool_calls") or ():
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except (ValueError, RecursionError):  # depth is bounded at parse; RecursionError is a backstop
                pass  # not JSON: the template sees the text as sent
        return d

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if isinstance(v, list):  # OpenAI content parts: text only here
            texts = []
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"only text content parts are served, got {str(part)[:60]}")
                texts.append(part["text"])
            return "".join(texts)
        return v


# apply_chat_template arguments the server sets itself: chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "add_generation_prompt", "tokenize",
                                      "return_dict", "return_tensors", "chat_template", "padding", "truncation"})


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` through the tokenizer's chat template."""

    messages: list[ChatMessage]
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: list[Tool] | None = None
    tool_choice: StrictStr | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if not v:
            raise ValueError("at least one message")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"must be in [0, {MAX_TOP_LOGPROBS}], got {v}")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _chat_template_kwargs(cls, v):
        clash = sorted(set(v or ()) & RESERVED_TEMPLATE_KWARGS)
        if clash:
            raise ValueError(f"{clash} are set by the server (use the request's own fields: messages, tools, "
                             f"add_generation_prompt)")
        return v

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise _FieldError("top_logprobs", "needs logprobs: true")
        choice = self.tool_choice
        if choice is not None and choice not in ("none", "auto", "required") and not isinstance(choice, dict):
            raise _FieldError("tool_choice", f"expected \"none\", \"auto\", \"required\" or a named function, "
                                             f"got {choice!r}")
        if self.tools and choice != "none":
            raise _FieldError("tool_choice", f"tool calls are not served (no tool-call parser): with tools, send "
                                             f"tool_choice \"none\" (the tools then reach the chat template only), "
                                             f"got {choice if choice is not None else 'auto (the default)'!r}")
        if not self.tools and choice not in (None, "none", "auto"):
            raise _FieldError("tool_choice", f"{choice!r} needs tools, and tool calls are not served")
        return self

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# -- errors ------------------------------------------------------------------------------------------------
_UNION_TAGS = ("str", "int", "function-after", "function-before", "list", "bool", "float")


def _param_of(err: dict) -> str:
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # pydantic names union members (`list[int]`, `str`) in the location; keep the field path only.
    loc = [x for x in loc if not any(c in x for c in "[]") and x not in _UNION_TAGS]
    return ".".join(loc) or "body"


_UNION_WORDS = {"prompt": "token ids (a list of ints, or a list of such lists) or text",
                "stop": "stop token ids (a list of ints) or stop strings"}


_LONG_NUMBER = re.compile(r"\d{24,}")


def _shorten_numbers(message: str) -> str:
    """A huge JSON integer echoed in a message is described by its size, not written out in full."""
    return _LONG_NUMBER.sub(lambda m: f"<an integer of {len(m.group())} digits>", message)


def validation_error(e: ValidationError) -> ApiError:
    """The first problem of a pydantic error as a 400 naming its field."""
    err = _validation_error(e)
    err.message = _shorten_numbers(err.message)
    return err


def _validation_error(e: ValidationError) -> ApiError:
    errs = e.errors()
    first = errs[0] if errs else {}
    param = _param_of(first)
    ctx_err = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_err, _FieldError):
        return ApiError(400, str(ctx_err), ctx_err.param)
    kind = first.get("type")
    if kind == "extra_forbidden":
        return ApiError(400, f"{param}: unknown field", param)
    if kind == "missing":
        return ApiError(400, f"{param}: required", param)
    top = param.split(".")[0]
    if kind == "value_error":
        return ApiError(400, f"{param}: {first.get('msg', '').removeprefix('Value error, ')}", top)
    if top in _UNION_WORDS:  # unions: one message, not one per member
        return ApiError(400, f"{param}: expected {_UNION_WORDS[top]}", top)
    msgs = sorted({f"{_param_of(x)}: {x.get('msg')}" for x in errs})
    return ApiError(400, "; ".join(msgs[:4]), top)


# A whole string (skipped; the unrolled form scans its runs at C speed), or a bracket.
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def _json_depth_ok(text: str) -> bool:
    """Nesting depth of ``[`` / ``{`` outside strings stays within :data:`MAX_JSON_DEPTH` (one regex scan;
    unterminated strings and unbalanced brackets are json.loads' to refuse)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:  # most bodies: no scan at all
        return True
    depth = 0
    for m in _JSON_TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        elif c in "]}":
            depth -= 1
    return True


def _lone_surrogate(data, path: str = "") -> tuple[str, str, int] | None:
    """The first string in ``data`` (keys included) holding a lone UTF-16 surrogate -- valid JSON (``"\\ud800"``)
    but no Unicode text, which a tokenizer cannot encode: ``(field path, the surrogate, its index)``."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")  # refuses exactly the surrogates, at C speed
        except UnicodeEncodeError as e:
            return path or "body", data[e.start], e.start
        return None
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        where = f"{path}.{k}" if path else str(k)
        hit = _lone_surrogate(k, where) if isinstance(k, str) else None
        hit = hit or _lone_surrogate(v, where)
        if hit:
            return hit
    return None


def parse_body(raw: bytes, model: type[BaseModel], limits: ServeLimits | None = None) -> BaseModel:
    """Raw HTTP body -> a validated request model, or :class:`ApiError` 400 (OpenAI's error object) for a
    body that is not UTF-8, not JSON, nested deeper than :data:`MAX_JSON_DEPTH`, not an object, holding a lone
    surrogate in a string, or invalid."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"body: not UTF-8 ({e.reason} at byte {e.start})", "body") from None
    if not text.strip():
        raise ApiError(400, "body: empty (expected a JSON object)", "body")
    if not _json_depth_ok(text):
        raise ApiError(400, f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels", "body")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"body: malformed JSON ({e})", "body") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(data).__name__}", "body")
    if "\\u" in text and (bad := _lone_surrogate(data)) is not None:  # only a \u escape can make one
        where, c, i = bad
        raise ApiError(400, f"{where}: a lone UTF-16 surrogate (\\u{ord(c):04x} at character {i}) is not Unicode "
                            f"text; send the character's full surrogate pair or its UTF-8", where.split(".")[0])
    try:
        return model.model_validate(data, context={"limits": limits})
    except ValidationError as e:
        raise validation_error(e) from None


# -- /tokenize and /detokenize (vLLM's endpoints) ----------------------------------------------------------
class TokenizeRequest(BaseModel):
    """``POST /tokenize``: ``prompt`` (text) or ``messages`` (through the chat template), as vLLM serves it."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_prompt(cls, v):
        # Not the completions' union message ("token ids ... or text"): here only text is tokenized.
        if v is not None and not isinstance(v, str):
            got = "token ids" if isinstance(v, list) else type(v).__name__
            raise _FieldError("prompt", f"/tokenize takes text (a string), got {got}; token ids are tokens already "
                                        f"(/detokenize turns them into text)")
        return v

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise _FieldError("prompt", "send exactly one of prompt (text) and messages")
        if self.add_special_tokens is None:
            self.add_special_tokens = self.prompt is not None
        clash = sorted(set(self.chat_template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if clash:
            raise _FieldError("chat_template_kwargs", f"{clash} are set by the server")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: ``tokens`` -> ``{"prompt": text}``."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: list[StrictInt]

    @field_validator("tokens")
    @classmethod
    def _tokens(cls, v, info: ValidationInfo):
        _check_ids(v, "token ids", info)
        return v
