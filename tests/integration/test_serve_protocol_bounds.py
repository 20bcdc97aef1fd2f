"""Bounds of the wire protocol, checked on :func:`parse_body` alone (no server, milliseconds): every number
field answers a 400 naming itself for any JSON number, nesting is bounded inside tool-call arguments too,
stop strings and logit_bias entries are bounded."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from tensorrt_llm_ext.runtime.openai_protocol import (MAX_JSON_DEPTH, MAX_STOP_STRING_CHARS,  # noqa: E402
                                                      MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, ApiError, ChatCompletionRequest,
                                                      CompletionRequest, ServeLimits, TokenizeRequest, parse_body)
from tensorrt_llm_ext.speculative.logits_processing import MAX_LOGIT_BIAS  # noqa: E402

LIMITS = ServeLimits(vocab_size=512, max_model_len=256)
# JSON numbers as sent (text): past float range as integers, at its edges, non-finite (Python's json reads them)
NUMBERS = ["1" + "0" * 400, "-1" + "0" * 400, "1" + "0" * 309, "1e308", "-1e308", "1e400", "1e-400", "5e-324",
           str(2**63), str(-2**63 - 1), "NaN", "Infinity", "-Infinity", "0", "-1", "0.5", "1",
           "9" * 5000, "-" + "9" * 5000]  # past Python's 4300-digit int conversion (was: 400 "body: malformed JSON")


def _number_fields(model) -> list[str]:
    import typing

    def has_number(t) -> bool:
        args = typing.get_args(t)
        return any(has_number(a) for a in args) if args else t in (int, float)

    return [n for n, f in model.model_fields.items()
            if has_number(f.annotation) and n not in ("prompt", "stop", "stop_token_ids", "logit_bias")]


def _outcome(raw: str, model, field: str) -> str:
    try:
        parse_body(raw.encode(), model, LIMITS)
    except ApiError as e:
        assert e.status == 400 and e.param == field, (field, raw[:80], e.status, e.param, e.message)
        assert len(e.message) < 400, e.message  # a 400-digit number is described, not echoed
        return "400"
    return "ok"


@pytest.mark.parametrize("model,base", [(CompletionRequest, '"prompt": [1, 2], "max_tokens": 4'),
                                        (ChatCompletionRequest, '"messages": [{"role": "user", "content": "hi"}], '
                                                                '"max_tokens": 4, "logprobs": true')],
                         ids=["completions", "chat"])
def test_every_number_field_answers_ok_or_a_400_naming_itself_for_any_json_number(model, base):
    fields = _number_fields(model)
    assert {"repetition_penalty", "temperature", "top_p", "min_p", "seed", "n"} <= set(fields)
    seen = set()
    for field in fields:
        for num in NUMBERS:
            extra = ', "stream": true' if field == "stream_options" else ""
            seen.add(_outcome("{%s, \"%s\": %s%s}" % (base, field, num, extra), model, field))
        big = "1" + "0" * 400
        seen.add(_outcome('{%s, "logit_bias": {"5": %s}}' % (base, big), model, "logit_bias"))
    assert seen == {"ok", "400"}


def test_tool_call_arguments_nested_past_the_bound_are_a_400_and_a_bound_depth_is_served():
    def body(depth: int) -> bytes:
        args = "[" * depth + "]" * depth
        return json.dumps({"messages": [{"role": "assistant", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}]}).encode()

    for model in (ChatCompletionRequest, TokenizeRequest):
        with pytest.raises(ApiError) as e:
            parse_body(body(100_000), model, LIMITS)
        assert e.value.status == 400 and e.value.param == "messages", e.value.message
        assert f"deeper than {MAX_JSON_DEPTH}" in e.value.message
        msg = parse_body(body(MAX_JSON_DEPTH), model, LIMITS).messages[0]
        assert msg.template_dict()["tool_calls"][0]["function"]["arguments"][0] is not None
    # brackets inside JSON strings are text, not nesting
    text = json.dumps(["[" * 500])
    assert parse_body(json.dumps({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": text}}]}]}).encode(), ChatCompletionRequest, LIMITS)


def test_stop_strings_are_bounded_in_number_and_length():
    ok = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert parse_body(json.dumps({"prompt": [1], "stop": ok}).encode(), CompletionRequest, LIMITS).stop == ok
    for stop, words in (([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], f"at most {MAX_STOP_STRINGS} stop strings"),
                        (["x" * (MAX_STOP_STRING_CHARS + 1)], f"at most {MAX_STOP_STRING_CHARS} characters"),
                        ("x" * (MAX_STOP_STRING_CHARS + 1), f"at most {MAX_STOP_STRING_CHARS} characters")):
        with pytest.raises(ApiError) as e:
            parse_body(json.dumps({"prompt": [1], "stop": stop}).encode(), CompletionRequest, LIMITS)
        assert e.value.status == 400 and e.value.param == "stop" and words in e.value.message, e.value.message


@pytest.mark.parametrize("field", ["stop_token_ids", "stop"])
def test_stop_token_ids_are_bounded_in_number_400_naming_the_field(field):
    ok = [i % 512 for i in range(MAX_STOP_TOKEN_IDS)]
    assert getattr(parse_body(json.dumps({"prompt": [1], field: ok}).encode(), CompletionRequest, LIMITS), field) == ok
    for limits in (LIMITS, None):
        with pytest.raises(ApiError) as e:
            parse_body(json.dumps({"prompt": [1], field: ok + [7]}).encode(), CompletionRequest, limits)
        assert e.value.status == 400 and e.value.param == field, (e.value.param, e.value.message)
        assert f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {MAX_STOP_TOKEN_IDS + 1}" in e.value.message


def test_logit_bias_past_its_bound_or_with_a_duplicate_id_is_a_400_naming_it_at_parse_time():
    full = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS)}
    assert len(parse_body(json.dumps({"prompt": [1], "logit_bias": full}).encode(), CompletionRequest,
                          LIMITS).logit_bias) == MAX_LOGIT_BIAS
    for bias, words in (({str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS} entries"),
                        ({"5": 1.0, "05": 2.0}, "no leading zero")):
        with pytest.raises(ApiError) as e:
            parse_body(json.dumps({"prompt": [1], "logit_bias": bias}).encode(), CompletionRequest, LIMITS)
        assert e.value.status == 400 and e.value.param == "logit_bias" and words in e.value.message, e.value.message


def test_integers_past_pythons_digit_limit_name_their_field():
    """json.loads refuses integers of more than 4300 digits (sys.get_int_max_str_digits): that is a value out of
    range naming its field (was: "body: malformed JSON (... use sys.set_int_max_str_digits() ...)"), a logit_bias
    key of that size too (was: the same Python advice under logit_bias); digits inside a string are text."""
    huge = "9" * 5000
    for raw, field in ((f'{{"prompt": [1, {huge}]}}', "prompt"), (f'{{"prompt": [1], "seed": {huge}}}', "seed"),
                       (f'{{"prompt": "{huge}", "max_tokens": {huge}}}', "max_tokens"),
                       (f'{{"prompt": [1], "logit_bias": {{"{huge}": 1}}}}', "logit_bias")):
        with pytest.raises(ApiError) as err:
            parse_body(raw.encode(), CompletionRequest, LIMITS)
        assert (err.value.status, err.value.param) == (400, field), err.value.message
        assert "sys." not in err.value.message and len(err.value.message) < 200, err.value.message
