"""An HTTP body's sampling fields become one SamplingParams (``to_sampling_params``), with vLLM's defaults: a body
without a seed is random (a fresh seed each time), the choices of one request draw streams independent of each
other and of neighbouring seeds, and every field is refused by the contract's one rule."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tensorrt_llm_ext.contract import SamplingParams, sampling_problem
from tensorrt_llm_ext.runtime.openai_protocol import ChatCompletionRequest, CompletionRequest


def _body(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": [1, 2], **fields})


def test_every_field_reaches_the_params():
    got = _body(temperature=0.7, top_p=0.9, seed=3, top_k=5, min_p=0.1, presence_penalty=0.5,
                frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={"9": 2, "4": -1.5}).to_sampling_params()
    assert got == SamplingParams(temperature=0.7, top_p=0.9, seed=3, top_k=5, min_p=0.1, presence_penalty=0.5,
                                 frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias=((4, -1.5), (9, 2.0)))
    assert got.processes_logits and got.restricts_top_p
    # -1 and 0 both mean no limit; an empty or null logit_bias is nothing
    plain = _body(seed=1, top_k=-1, logit_bias={}).to_sampling_params()
    assert plain == SamplingParams(seed=1) and not plain.processes_logits
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "seed": 1})
    assert chat.to_sampling_params() == SamplingParams(seed=1)


def test_an_unseeded_body_is_random_and_a_seeded_one_reproducible():
    seeds = {_body(temperature=1.0).to_sampling_params().seed for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert {_body(temperature=1.0, seed=5).to_sampling_params().seed for _ in range(3)} == {5}


def test_choices_are_independent_of_neighbouring_seeds():
    """Seed s's choices 1.. used to be seeds s+1.., so seed 8's choices 0-1 equalled seed 7's 1-2."""
    def seeds(seed: int, n: int = 4) -> list[int]:
        return [SamplingParams(temperature=1.0, seed=seed).for_choice(k).seed for k in range(n)]

    s7, s8 = seeds(7), seeds(8)
    assert s7[0] == 7 and s8[0] == 8  # choice 0 is the request's own seed
    assert len(set(s7 + s8)) == 8 and all(0 <= s < 2**63 for s in s7 + s8)
    assert seeds(2**63 - 1)[0] == 2**63 - 1 and len(set(seeds(2**63 - 1))) == 4  # no overflow at the top
    assert SamplingParams(seed=7).for_choice(2) == SamplingParams(seed=s7[2])  # only the seed changes


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 1.5), ("seed", 2**63), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0),
    ("repetition_penalty", 10**400), ("logit_bias", {"3": 101}),
    # normal in fp32, but a seen logit scaled by them overflowed the sampler (top-p drew a token of probability 0)
    ("repetition_penalty", 1.2e-38), ("repetition_penalty", 1e38),
])
def test_a_bad_field_is_refused_by_the_contract_rule(field, value):
    with pytest.raises(ValidationError) as err:
        _body(**{field: value})
    rule_value = ((3, 101),) if field == "logit_bias" else value
    assert sampling_problem(field, rule_value) in str(err.value)


def test_min_tokens_past_the_default_token_limit_is_refused_not_cut():
    """As vLLM: min_tokens above the token limit is a 400 naming min_tokens, the completions' default limit (16)
    included (was: served, cut to 16 tokens without a word, while max_tokens=16 given was refused)."""
    import json

    from tensorrt_llm_ext.runtime.openai_protocol import (DEFAULT_COMPLETION_MAX_TOKENS, ApiError, ServeLimits,
                                                          parse_body)

    def parse(model, **fields):
        return parse_body(json.dumps(fields).encode(), model, ServeLimits(vocab_size=16, max_model_len=40))

    assert parse(CompletionRequest, prompt=[1], min_tokens=16).token_limit() == DEFAULT_COMPLETION_MAX_TOKENS == 16
    for fields in ({"min_tokens": 17}, {"min_tokens": 17, "max_tokens": 16}, {"min_tokens": 41, "max_tokens": 45}):
        with pytest.raises(ApiError) as err:
            parse(CompletionRequest, prompt=[1], **fields)
        assert err.value.status == 400 and err.value.param == "min_tokens", err.value.message
    assert "default max_tokens" in str(pytest.raises(ApiError, parse, CompletionRequest, prompt=[1],
                                                     min_tokens=17).value)
    assert parse(CompletionRequest, prompt=[1], min_tokens=17, max_tokens=17).token_limit() == 17
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse(ChatCompletionRequest, **chat, min_tokens=39).token_limit() is None  # the room left: at serve
    with pytest.raises(ApiError, match="min_tokens=40 leaves no room for a prompt"):
        parse(ChatCompletionRequest, **chat, min_tokens=40)
    # at serve, the room a chat prompt leaves: min_tokens past it is a 400 too (it was cut to the room left)
    from tensorrt_llm_ext.runtime.server import ServeContext, build_requests

    ctx = ServeContext(loop=None, model_name="m", vocab_size=16, max_seq_len=40)
    body = parse(ChatCompletionRequest, **chat, min_tokens=30)
    assert [(r.max_new_tokens, r.min_tokens) for r in build_requests(ctx, body, [[1] * 10], None)] == [(30, 30)]
    with pytest.raises(ApiError) as err:
        build_requests(ctx, body, [[1] * 11], None)
    assert err.value.param == "min_tokens" and "30 exceeds the 29 tokens" in err.value.message, err.value.message


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
def test_a_number_field_of_another_type_is_one_message(field):
    """A number field (float or int) sent as a string or a bool: one 400 naming the field and the value (it was
    "Input should be a valid integer; FIELD: Input should be a valid number", the union's two members)."""
    import json

    from tensorrt_llm_ext.runtime.openai_protocol import ApiError, ServeLimits, parse_body

    for value, shown in (("x", "'x'"), (True, "True"), ("ab" * 100, "'" + ("ab" * 100)[:59])):
        with pytest.raises(ApiError) as err:
            parse_body(json.dumps({"prompt": [1], field: value}).encode(), CompletionRequest,
                       ServeLimits(vocab_size=16, max_model_len=40))
        assert err.value.status == 400 and err.value.param == field, err.value
        assert err.value.message.startswith(f"{field}: expected a number, got {shown}"), err.value.message
    with pytest.raises(ApiError) as err:  # an integer field says so
        parse_body(json.dumps({"prompt": [1], "n": "x"}).encode(), CompletionRequest,
                   ServeLimits(vocab_size=16, max_model_len=40))
    assert err.value.message == "n: expected an integer, got 'x'" and err.value.param == "n", err.value.message
