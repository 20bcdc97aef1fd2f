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
import re
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      ValidationInfo, field_validator, model_validator)

from tensorrt_llm_ext.contract import SamplingParams, fresh_seed, sampling_problem

MAX_TOP_LOGPROBS = 20
MAX_N = 128  # choices per request (each takes a slot; more than the queue holds is a 429 anyway)
MAX_JSON_DEPTH = 64  # deeper bodies (and tool-call arguments) are refused before json.loads recurses
# Stop strings: each is searched for in the new text of every step, so their number and length bound a step's
# work (OpenAI allows 4; vLLM sets no bound, which one request with 200k strings turns into a stalled server).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
# Stop token ids (in `stop` or `stop_token_ids`): each finished-check reads them, so a request's list is bounded
# too (a vocabulary's worth would make every step of every request pay for one body).
MAX_STOP_TOKEN_IDS = 1024
# /v1/completions' max_tokens when a body gives none (OpenAI's and vLLM's default); chat's is the rest of
# max_model_len after the prompt.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class ApiError(Exception):
    """An OpenAI error response: ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers  # HTTP headers of the answer (e.g. Connection: close)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class ServeLimits:
    """What field validation needs to know about the served model (the pydantic validation context)."""

    vocab_size: int
    max_model_len: int


def _limits(info: ValidationInfo) -> ServeLimits | None:
    return info.context.get("limits") if isinstance(info.context, dict) else None


def _check_stop_ids(ids: list[int], info: ValidationInfo) -> None:
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(ids)}")
    _check_ids(ids, "token ids", info)


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
    default_token_limit: ClassVar[int | None] = None  # the token limit of a body without one (None: the room left)

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

    @field_validator("temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty")
    @classmethod
    def _sampling(cls, v, info: ValidationInfo):
        # The SamplingParams rule of the field, in its one wording (None: the field's default; seed None: a
        # fresh seed, see to_sampling_params).
        if v is not None:
            _sampling_rule(info.field_name, v)
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
            _check_stop_ids(v, info)
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
            _check_stop_ids(v, info)
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v, info: ValidationInfo):
        if not v:
            return v
        for key in v:
            if not (key.isascii() and key.isdigit()) or len(key) > 1 and key[0] == "0":
                raise ValueError(f"keys must be token ids as strings (\"123\", no leading zero), got {key[:40]!r}")
            if len(key) > 19:  # past int64, so past every vocabulary (and int() refuses 4300 digits and more)
                raise ValueError(f"token id {key} outside every vocabulary")
        lim = _limits(info)
        _sampling_rule("logit_bias", _bias_pairs(v), lim.vocab_size if lim is not None else None)
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v):
        if v < 0:
            raise ValueError(f"must be >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _across_fields(self, info: ValidationInfo):
        if self.stream_options is not None and not self.stream:
            raise _FieldError("stream_options", "only allowed when stream is true")
        limit = self.token_limit()
        if limit is not None and self.min_tokens > limit:
            # as vLLM: refused, not cut to the limit (the default one included)
            default = "" if self.max_tokens is not None or self.max_completion_tokens is not None else \
                " (the default max_tokens; send max_tokens to raise it)"
            raise _FieldError("min_tokens", f"min_tokens={self.min_tokens} exceeds the token limit {limit}{default}")
        lim = _limits(info)
        if lim is not None and self.min_tokens >= lim.max_model_len:  # a prompt takes one position at least
            raise _FieldError("min_tokens", f"min_tokens={self.min_tokens} leaves no room for a prompt in "
                                            f"max_model_len={lim.max_model_len}")
        if self.best_of is not None and self.best_of < self.n:
            raise _FieldError("best_of", f"must be >= n={self.n}, got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n:
            raise _FieldError("best_of", f"best_of={self.best_of} > n={self.n} is not served (ranking candidates "
                                         f"by log-probability is not implemented); send best_of = n or leave it out")
        return self

    def num_choices(self) -> int:
        """Engine requests this body makes (choices over every prompt)."""
        return self.n

    def to_sampling_params(self) -> SamplingParams:
        """The body's :class:`SamplingParams` (the fields are valid: their validators ran the same rules).

        Fields left out take their defaults (``top_k`` -1 and 0 both mean no limit); a body without a ``seed``
        gets a fresh one (vLLM: an unseeded request is random, so two such requests differ). The choices of a
        request with ``n > 1`` draw with :meth:`SamplingParams.for_choice`.
        """
        def given(value, default):
            return default if value is None else value

        return SamplingParams(
            temperature=float(self.temperature), top_p=float(self.top_p),
            seed=self.seed if self.seed is not None else fresh_seed(), top_k=given(self.top_k, 0),
            min_p=float(given(self.min_p, 0.0)), presence_penalty=float(given(self.presence_penalty, 0.0)),
            frequency_penalty=float(given(self.frequency_penalty, 0.0)),
            repetition_penalty=given(self.repetition_penalty, 1.0),
            logit_bias=tuple((t, float(b)) for t, b in _bias_pairs(self.logit_bias or {})))

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) or ``max_tokens``, else the endpoint's default
        (:attr:`default_token_limit`; None: the rest of ``max_model_len`` after the prompt)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else self.default_token_limit


def _sampling_rule(name: str, value, vocab_size: int | None = None) -> None:
    """The SamplingParams rule of field ``name`` (:func:`~tensorrt_llm_ext.contract.sampling_problem`)."""
    problem = sampling_problem(name, value, vocab_size)
    if problem is not None:
        raise ValueError(problem)


def _top_logprobs_count(v):
    """``logprobs`` (completions) / ``top_logprobs`` (chat): how many candidates to report, 0..20."""
    if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
        raise ValueError(f"must be in [0, {MAX_TOP_LOGPROBS}], got {v}")
    return v


def _bias_pairs(bias: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as SamplingParams holds it: sorted ``(id, bias)`` pairs (the biases as
    sent: the rule compares them, a huge int has no float)."""
    return tuple(sorted((int(t), b) for t, b in bias.items()))


class _FieldError(ValueError):
    """A cross-field check that names the field it blames."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: token ids (``[1, 2, 3]``), a batch of them, or text (one or a
    list) when the model has a tokenizer. ``stop``: token ids, or strings with a tokenizer."""

    default_token_limit: ClassVar[int | None] = DEFAULT_COMPLETION_MAX_TOKENS

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
        return _top_logprobs_count(v)

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
            return "\n".join(texts)  # as vLLM: ["Describe", "this"] is two lines, not "Describethis"
        return v

    @model_validator(mode="after")
    def _content_required(self):
        # As OpenAI's schema: only an assistant turn may leave its content out (a turn of tool calls only, or
        # none); a user / system / developer / tool message without one is a malformed request, not an empty turn.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or text parts)")
        return self


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
        return _top_logprobs_count(v)

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
    kinds = {x.get("type") for x in errs}
    if kinds and kinds <= {"float_type", "int_type"} and {_param_of(x) for x in errs} == {param}:
        # a number or integer field given another type: one message naming the value (a float | int union said
        # "Input should be a valid integer; ... Input should be a valid number")
        want = "an integer" if kinds == {"int_type"} else "a number"
        return ApiError(400, f"{param}: expected {want}, got {repr(first.get('input'))[:60]}", top)
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


# A whole string (skipped: digits inside text are text), or an integer past Python's 4300-digit conversion limit.
_STRING_OR_HUGE_INTEGER = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|\d{4301,}')


def _huge_integer(text: str) -> tuple[str, int] | None:
    """The first JSON integer too long for ``json.loads`` (sys.get_int_max_str_digits: 4300): ``(the key it is
    the value of, or inside a list of; "body" at the top, its digit count)``, None when there is none."""
    key = "body"
    for m in _STRING_OR_HUGE_INTEGER.finditer(text):
        token = m.group()
        if token[0] != '"':
            return key, len(token)
        if text[m.end():m.end() + 64].lstrip().startswith(":"):
            try:
                key = json.loads(token)
            except ValueError:
                key = "body"
    return None


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
        # Python converts at most 4300 digits: a value out of range, not malformed JSON (scanned only then)
        if "integer string conversion" in str(e) and (huge := _huge_integer(text)) is not None:
            field, digits = huge
            raise ApiError(400, f"{field}: an integer of {digits} digits is out of range", field) from None
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
