"""Requests and their results.

A :class:`Request` is validated against the engine's limits before it gets a slot; a bad request gets a
:class:`RequestError` recorded on ITS result (``finish_reason == "error"``) and never disturbs the other
requests of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorrt_llm_ext.contract import FP32_MAX, FP32_MIN_NORMAL, MIN_TEMPERATURE, MIN_TOP_P, SamplingParams

__all__ = ["FP32_MAX", "FP32_MIN_NORMAL", "MIN_TEMPERATURE", "MIN_TOP_P", "Request", "RequestError", "RequestResult"]


class RequestError(ValueError):
    """A request the engine cannot serve (the message says which field and why)."""


@dataclass(slots=True)  # a misspelt or retired field (request.temperature = ...) fails instead of being ignored
class Request:
    """One generation request.

    ``sampling``: how its tokens are drawn, one :class:`~tensorrt_llm_ext.contract.SamplingParams` from where
    the request entered to the slot that serves it (its rules and its one check; the exact top-p set is
    docs/rejection_sampling.md's, the logits processing docs/token_decision.md's).

    Stopping: a request finishes (``finish_reason == "stop"``) at the first token in ``stop_token_ids`` or,
    unless ``ignore_eos``, in the engine's EOS ids (the checkpoint's); the stop token is the last output
    token and the tokens after it in an accepted speculative block are discarded. Before ``min_tokens``
    tokens no stop token ends the request (it is kept as an ordinary token; nothing is masked).
    ``logprobs`` ``k`` (0..20): also report each emitted token's log-probability and its top ``k``.
    ``prompt_logprobs`` ``k`` (0..20): also report each prompt token's after the first (the completions API's
    ``echo`` with ``logprobs``); such a request prefills its whole prompt (no prefix reuse). Both are reported by the
    step-level API (``serve``'s scheduler events); ``Engine.generate`` refuses them on that request's result.
    """

    prompt_ids: list[int]
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __getitem__(self, name: str):
        """Read-only access by field name (``request["max_new_tokens"]``): the engine loop's ``submit`` once
        carried plain dicts of these fields, and code written against that form (a stand-in loop, a metrics
        hook) keeps reading them. Only the fields; an unknown name is a ``KeyError``, assignment is refused."""
        if not isinstance(name, str) or name not in self.__dataclass_fields__:
            raise KeyError(name)
        return getattr(self, name)

    def validate(self, vocab_size: int, max_seq_len: int) -> None:
        """Raise :class:`RequestError` if this request cannot run under these limits.

        Total over every field value, wrong types included: nothing but a :class:`RequestError` leaves
        it, so the engine can turn any bad field into that request's error and serve the rest.
        """
        try:
            self._validate(vocab_size, max_seq_len)
        except RequestError:
            raise
        except Exception as e:  # a field of a type no check foresaw: still this request's error only
            raise RequestError(f"{self._label()}: invalid request ({type(e).__name__}: {e})") from e

    def _label(self) -> str:
        rid = self.request_id
        return f"request {rid}" if _is_int(rid) else "request"

    def _validate(self, vocab_size: int, max_seq_len: int) -> None:
        rid = self._label()
        if self.request_id is not None and not _is_int(self.request_id):
            raise RequestError(f"{rid}: request_id must be an int or None, got {type(self.request_id).__name__}")
        ids = self.prompt_ids
        # Every admission validates its prompt (twice: queued, then admitted): the common case -- plain ints in range
        # -- in C-level passes (set of types, min, max), the per-token checks only to name what is wrong.
        plain = isinstance(ids, (list, tuple)) and set(map(type, ids)) <= {int}
        if not plain and (not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids)):
            raise RequestError(f"{rid}: prompt_ids must be a list of ints, got {_describe(ids)}")
        if len(ids) == 0:
            raise RequestError(f"{rid}: empty prompt (prompt_ids needs at least one token)")
        if not (plain and min(ids) >= 0 and max(ids) < vocab_size):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"{rid}: prompt_ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise RequestError(f"{rid}: max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if len(ids) + self.max_new_tokens > max_seq_len:
            raise RequestError(f"{rid}: prompt of {len(ids)} tokens + max_new_tokens={self.max_new_tokens} exceeds "
                               f"the cache (max_seq_len={max_seq_len})")
        stop = self.stop_token_ids
        if not isinstance(stop, (list, tuple, set, frozenset)):
            raise RequestError(f"{rid}: stop_token_ids must be a list/tuple of ints, got {_describe(stop)}")
        bad_stop = [t for t in stop if not (_is_int(t) and 0 <= t < vocab_size)]
        if bad_stop:
            raise RequestError(f"{rid}: stop_token_ids {bad_stop[:5]} outside the vocabulary [0, {vocab_size})")
        if not isinstance(self.sampling, SamplingParams):
            raise RequestError(f"{rid}: sampling must be a SamplingParams, got {_describe(self.sampling)}")
        try:
            self.sampling.check(vocab_size)
        except ValueError as e:
            raise RequestError(f"{rid}: {e}") from None
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"{rid}: ignore_eos must be a bool, got {_describe(self.ignore_eos)}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise RequestError(f"{rid}: min_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], "
                               f"got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (_is_int(k) and 0 <= k <= 20):
                raise RequestError(f"{rid}: {name} must be None or an int in [0, 20], got {k!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _describe(v) -> str:
    if isinstance(v, (list, tuple)):
        odd = [t for t in v if not _is_int(t)]
        return f"{type(v).__name__} with {type(odd[0]).__name__} item {odd[0]!r}" if odd else type(v).__name__
    return f"{type(v).__name__} {v!r}"[:80]


@dataclass
class RequestResult:
    """What a request produced. ``output_ids`` excludes the prompt; ``finish_reason`` is ``length``,
    ``stop`` or ``error`` (then ``error`` says why and nothing was generated)."""

    request_id: int
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_steps: int = 0  # generation steps this request took part in (the prefill not counted)
    accepted_lens: list[int] = field(default_factory=list)  # tokens accepted per generation step
    # With Request.logprobs: per output token (its log-probability, [(id, log-probability)] top k).
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens accepted per speculative step (1.0 = no draft accepted); NaN without steps."""
        return sum(self.accepted_lens) / len(self.accepted_lens) if self.accepted_lens else float("nan")
