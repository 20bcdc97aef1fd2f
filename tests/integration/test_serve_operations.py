"""What an operator and a vLLM client expect of ``trtllm-ext serve`` (issue 31, items 3-5), on in-process servers
over the small model: the fields clients send by default accepted with their meaning (and the rest refused by
name), the API key on ``/v1/*``, the metrics vLLM dashboards graph (names, ``model_name``, buckets),
``/tokenize`` / ``/detokenize``, and the vLLM flag spellings."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prom_parser = pytest.importorskip("prometheus_client.parser")

from tensorrt_llm_ext.runtime.requests import Request  # noqa: E402
from tensorrt_llm_ext.testing.hf_checkpoints import save_tiny_tokenizer  # noqa: E402
from tensorrt_llm_ext.testing.server import SMALL_SERVE_CONFIG, start_in_process  # noqa: E402

SMALL = SMALL_SERVE_CONFIG
VOCAB = SMALL["model.target.vocab_size"]
KEY = "sk-test-31"
# The tiny template plus what this file checks: a chat_template_kwargs switch, and tool calls of the history
# rendered from their decoded arguments.
TEMPLATE = ("{{ bos_token }}{% if extra_word %}w11 {% endif %}{% for m in messages %}<|start|> {{ m['role'] }} "
            "{% if m.get('tool_calls') %}w{{ m['tool_calls'][0]['function']['arguments']['n'] }} {% endif %}"
            "{{ m['content'] or '' }} <|end|> {% endfor %}{% if add_generation_prompt %}<|start|> assistant "
            "{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server with a tokenizer, a chat template given as --chat-template would, and an API key."""
    d = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(d, VOCAB)
    srv = start_in_process({**SMALL, "tokenizer": str(d)}, api_key=KEY, chat_template=TEMPLATE)
    yield srv
    srv.stop(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=120, max_retries=0)


def _auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=_auth(), timeout=120)


def _metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else ""): s.value
            for fam in prom_parser.text_string_to_metric_families(text) for s in fam.samples}


def _model_label(extra: dict | None = None) -> str:
    return json.dumps({"model_name": "dspark-embedded", "engine": "0", **(extra or {})}, sort_keys=True)


# -- fields clients send by default --------------------------------------------------------------------------
NO_OPS = {"top_k": -1, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0, "repetition_penalty": 1.0,
          "logit_bias": {}, "best_of": 1, "response_format": {"type": "text"}, "skip_special_tokens": True,
          "spaces_between_special_tokens": True, "user": "u1"}


def test_no_op_sampling_fields_change_nothing(server):
    base = {"prompt": [17, 42, 9], "max_tokens": 6, "temperature": 0.8, "seed": 3}
    plain = _post(server, "/v1/completions", base)
    with_fields = _post(server, "/v1/completions", {**base, **NO_OPS, "top_k": 0})
    assert plain.status_code == 200 and with_fields.status_code == 200, with_fields.text
    assert with_fields.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("skip,spaces,text", [(True, True, "w9 w10"), (False, True, "<s> w9 <|start|> w10"),
                                              (False, False, "<s>w9<|start|>w10")])
def test_skip_special_tokens_and_spaces_between_them(server, skip, spaces, text):
    """The echoed prompt [<s>, w9, <|start|>, w10] decoded under each setting (vLLM's meaning)."""
    r = _post(server, "/v1/completions", {"prompt": [1, 9, 3, 10], "max_tokens": 1, "echo": True,
                                          "skip_special_tokens": skip, "spaces_between_special_tokens": spaces})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == [1, 9, 3, 10] and choice["text"].startswith(text), choice["text"]


def test_chat_accepts_tools_with_tool_choice_none_history_tool_calls_and_template_kwargs(server, client):
    history = [{"role": "user", "content": "w9"},
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"n": 12}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "w13"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    out = client.chat.completions.create(model="dspark-embedded", messages=history, max_tokens=2, tools=tools,
                                         tool_choice="none", extra_body={"chat_template_kwargs": {"extra_word": True}})
    assert out.choices[0].message.tool_calls is None and out.usage.completion_tokens == 2
    # The prompt the template made: the switch's word, the call's decoded argument, the tool's answer.
    tok = _post(server, "/tokenize", {"messages": history, "chat_template_kwargs": {"extra_word": True}}).json()
    assert tok["tokens"][:2] == [1, 11] and 12 in tok["tokens"] and 13 in tok["tokens"]
    assert out.usage.prompt_tokens == tok["count"]
    plain = _post(server, "/tokenize", {"messages": history}).json()
    assert plain["count"] == tok["count"] - 1
    empty = _post(server, "/v1/chat/completions", {"messages": history[:1], "max_tokens": 1, "tools": [],
                                                   "tool_choice": "none", "response_format": {"type": "text"}})
    assert empty.status_code == 200, empty.text


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": [1], "top_k": -2}, "top_k", "-1 or 0"),
    ({"prompt": [1], "logit_bias": {"7": 300.0}}, "logit_bias", "[-100, 100]"),
    ({"prompt": [1], "logit_bias": {"x": 3.0}}, "logit_bias", "token ids"),
    ({"prompt": [1], "presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"prompt": [1], "best_of": 2}, "best_of", "not served"),
    ({"prompt": [1], "n": 2, "best_of": 1}, "best_of", ">= n"),
    ({"prompt": [1], "response_format": {"type": "json_object"}}, "response_format", "guided"),
    ({"messages": [{"role": "user", "content": "w9"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice", "not served"),
    ({"messages": [{"role": "user", "content": "w9"}], "chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs", "set by the server"),
])
def test_unserved_values_are_refused_naming_the_field(server, body, param, words):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = _post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert words in r.json()["error"]["message"]


def test_sampling_fields_are_served(server):
    """Observable meanings through HTTP (the exactness is tested on the engine and on the shards):
    a +100 bias makes greedy decoding emit that token; top_k 1 at temperature 1 is greedy decoding."""
    base = {"prompt": [17, 42, 9], "max_tokens": 6}
    biased = _post(server, "/v1/completions", {**base, "logit_bias": {"7": 100}})
    assert biased.status_code == 200, biased.text
    assert biased.json()["choices"][0]["token_ids"] == [7] * 6
    greedy = _post(server, "/v1/completions", base).json()["choices"][0]["token_ids"]
    top1 = _post(server, "/v1/completions", {**base, "temperature": 1.0, "top_k": 1, "seed": 5})
    assert top1.json()["choices"][0]["token_ids"] == greedy
    penalised = _post(server, "/v1/completions", {**base, "max_tokens": 12, "logit_bias": {"7": 4},
                                                  "frequency_penalty": 2.0, "presence_penalty": 2.0,
                                                  "repetition_penalty": 3.0}).json()["choices"][0]["token_ids"]
    assert len(set(penalised)) > 1  # the penalties pull against the bias once 7 has been emitted


# -- the API key --------------------------------------------------------------------------------------------
def test_api_key_guards_every_v1_route_only(server, client):
    before = _metrics(server.url).get("trtllm_ext_requests_rejected_total" + _model_label({"status": "401"}), 0)
    for headers in ({}, _auth("wrong"), {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/nowhere")):
            r = httpx.request(method, server.url + path, headers=headers, json={"prompt": [1]}, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert err["code"] == 401 and err["type"] == "authentication_error" and "API key" in err["message"]
    assert _metrics(server.url)["trtllm_ext_requests_rejected_total" + _model_label({"status": "401"})] == before + 9
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path, timeout=30).status_code in (200, 503)
    assert client.models.list().data[0].id == "dspark-embedded"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_loopback_hosts():
    from tensorrt_llm_ext.runtime.server import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "example.com"))


# -- metrics ------------------------------------------------------------------------------------------------
def test_acceptance_buckets_cover_full_acceptance_and_count_per_position():
    from tensorrt_llm_ext.runtime.engine_loop import ServerMetrics

    m = ServerMetrics(3, model_name="m")
    for accepted in (1, 4, 4, 2):  # K = 3: 4 is full acceptance (3 drafts + the bonus token)
        m.speculative_step(accepted)
    text = m.render().decode()
    samples = {s.name + json.dumps(s.labels, sort_keys=True): s.value
               for fam in prom_parser.text_string_to_metric_families(text) for s in fam.samples}

    def get(name, **labels):
        return samples[name + json.dumps({"model_name": "m", "engine": "0", **labels}, sort_keys=True)]

    assert get("trtllm_ext_acceptance_length_bucket", le="3.0") == 2
    assert get("trtllm_ext_acceptance_length_bucket", le="4.0") == 4  # full acceptance in a finite bucket
    assert get("trtllm_ext_spec_decode_num_drafts_total") == 4
    assert get("trtllm_ext_spec_decode_num_draft_tokens_total") == 12
    assert get("trtllm_ext_spec_decode_num_accepted_tokens_total") == 0 + 3 + 3 + 1
    assert [get("trtllm_ext_spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)] \
        == [3, 2, 2]


def test_request_timeline_feeds_vllm_request_metrics():
    """A hand-made timeline: queue, prefill, decode, inference, e2e and the token histograms hold exactly it."""
    from tensorrt_llm_ext.runtime.engine_loop import ServerMetrics

    m = ServerMetrics(2, model_name="m", max_model_len=100)
    m.admitted(7, arrived=10.0, now=10.5, request=Request([1, 2, 3], max_new_tokens=6))
    m.delivered(7, 1, now=11.0)  # the first token: TTFT 1.0, prefill 0.5
    m.delivered(7, 3, now=11.25)  # a speculative step's 3 tokens
    m.delivered(7, 2, now=12.0)
    m.finished(7, "length", now=12.0)
    m.request_finished("cancelled")  # a request that left the queue before it got a slot
    text = m.render().decode()
    samples = {s.name + json.dumps(s.labels, sort_keys=True): s.value
               for fam in prom_parser.text_string_to_metric_families(text) for s in fam.samples}

    def get(name, **labels):
        return samples[name + json.dumps({"model_name": "m", "engine": "0", **labels}, sort_keys=True)]

    expect_sums = {"request_queue_time_seconds": 0.5, "time_to_first_token_seconds": 1.0,
                   "request_prefill_time_seconds": 0.5, "request_decode_time_seconds": 1.0,
                   "request_inference_time_seconds": 1.5, "e2e_request_latency_seconds": 2.0,
                   "inter_token_latency_seconds": 1.0, "time_per_output_token_seconds": 1.0,
                   "request_time_per_output_token_seconds": 0.2,  # 1.0 s over the 5 tokens after the first
                   "request_prompt_tokens": 3, "request_generation_tokens": 6, "request_params_max_tokens": 6}
    for name, total in expect_sums.items():
        assert get(f"trtllm_ext_{name}_sum") == pytest.approx(total), name
    assert get("trtllm_ext_inter_token_latency_seconds_count") == 2
    assert get("trtllm_ext_generation_tokens_total") == 6
    assert get("trtllm_ext_request_success_total", finished_reason="length") == 1
    assert get("trtllm_ext_request_success_total", finished_reason="abort") == 1
    assert get("trtllm_ext_request_success_total", finished_reason="stop") == 0  # every reason's series exists
    assert get("trtllm_ext_request_generation_tokens_bucket", le="5.0") == 0
    assert get("trtllm_ext_request_generation_tokens_bucket", le="10.0") == 1  # vLLM's 1-2-5 buckets
    assert get("trtllm_ext_num_preemptions_total") == 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert get(f"trtllm_ext_{name}") == 0


def test_request_metrics_vllm_names_with_model_name(server):
    async def some():
        async with httpx.AsyncClient(base_url=server.url, headers=_auth(), timeout=300) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json={"prompt": [k + 20, 3], "max_tokens": 5})
                                          for k in range(4)))

    before = _metrics(server.url)
    assert all(r.status_code == 200 for r in asyncio.run(some()))
    httpx.get(server.url + "/no/such/path", timeout=10)  # a 404 of an unknown path is not a rejected request
    m = _metrics(server.url)
    lbl = _model_label()
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"):
        key = f"trtllm_ext_{name}_count" + lbl
        assert m[key] - before.get(key, 0) == 4, name

    def grew(name, labels=None):
        key = f"trtllm_ext_{name}" + _model_label(labels)
        return m[key] - before.get(key, 0)

    assert grew("request_success_total", {"finished_reason": "length"}) == 4
    assert grew("prompt_tokens_total") == 8 and grew("generation_tokens_total") == 20
    assert grew("request_generation_tokens_sum") == 20 and grew("iteration_tokens_total_sum") == 28
    assert m["trtllm_ext_num_requests_running" + lbl] == 0 and m["trtllm_ext_num_requests_waiting" + lbl] == 0
    assert m["trtllm_ext_inter_token_latency_seconds_count" + lbl] > before.get(
        "trtllm_ext_inter_token_latency_seconds_count" + lbl, 0)
    assert 0.0 <= m["trtllm_ext_kv_cache_usage_perc" + lbl] <= 1.0
    assert m["trtllm_ext_spec_decode_num_drafts_total" + lbl] > 0
    assert m["trtllm_ext_step_host_seconds_count" + lbl] > 0  # back-to-back steps of 5-token requests
    # every prefill is in some plan's prefill time: at least one plan prefilled, at most one per request
    assert 1 <= grew("prefill_seconds_count") <= 4 and grew("prefill_seconds_sum") > 0
    assert not any(k.startswith("trtllm_ext_requests_rejected_total") and '"404"' in k for k in m)
    assert all("model_name" in k for k in m if k.startswith("trtllm_ext_") and not k.endswith("_created"))


# -- /tokenize and /detokenize -------------------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(server):
    r = _post(server, "/tokenize", {"prompt": "w9 w300 w17", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == [9, 300, 17] and body["count"] == 3 and body["token_strs"] == ["w9", "w300", "w17"]
    assert body["max_model_len"] == SMALL["max_seq_len"]
    assert _post(server, "/detokenize", {"tokens": [9, 300, 17]}).json() == {"prompt": "w9 w300 w17"}
    bad = _post(server, "/detokenize", {"tokens": [VOCAB]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = _post(server, "/tokenize", {"prompt": "w9", "messages": [{"role": "user", "content": "w9"}]})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    other = _post(server, "/tokenize", {"prompt": "w9", "model": "other"})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    ids = _post(server, "/tokenize", {"prompt": [1, 2, 3]})  # ids are tokens already: say so, not "expected ids"
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"
    assert "/tokenize takes text (a string), got token ids" in ids.json()["error"]["message"]


# -- vLLM flag spellings --------------------------------------------------------------------------------------
def test_vllm_flag_spellings_map_to_the_config(tmp_path):
    import argparse

    from tensorrt_llm_ext.runtime.serve_cli import add_serve_args, config_overrides, read_chat_template

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(["--tensor-parallel-size", "2", "--max-model-len", "64", "--dtype", "float",
                         "--max-num-seqs", "4", "--served-model-name", "a", "b", "--disable-uvicorn-access-log"])
    assert config_overrides(args) == {"tensor_parallel_size": 2, "max_seq_len": 64, "dtype": "float32",
                                      "max_batch_size": 4}
    assert args.served_model_name == ["a", "b"] and args.access_log is False
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "float16"])
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert read_chat_template(str(f)) == TEMPLATE and read_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="--chat-template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


# -- the command line ---------------------------------------------------------------------------------------
def test_bench_help_lists_every_benchmark_with_one_line():
    from tensorrt_llm_ext.bench import BENCHMARK_MODULES
    from tensorrt_llm_ext.bench.harness import load_benchmark
    from tensorrt_llm_ext.cli import bench_usage, main

    text = bench_usage()
    for name in BENCHMARK_MODULES:
        assert [ln for ln in text.splitlines() if ln.split()[:1] == [name]] == \
            [f"  {name:<{max(map(len, BENCHMARK_MODULES))}}  {load_benchmark(name).help}"]
    assert main(["bench", "--help"]) == 0 and main(["bench"]) == 2


def test_generate_progress_without_a_terminal_is_log_lines(monkeypatch, caplog):
    import logging

    from tensorrt_llm_ext.runtime import launch

    monkeypatch.setattr(launch, "PROGRESS_LINE_S", 0.0)
    with caplog.at_level(logging.INFO, logger="tensorrt_llm_ext"):
        bar, update = launch._progress_bar(10, "speculative", True, terminal=False)
        update(4)
        update(6)
        bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "generate: speculative decode of 10 tokens at most"
    assert lines[1].startswith("generate: speculative: 4/10 tokens") and lines[2].startswith("generate: speculative: 10/10")
    assert lines[3].startswith("generate: speculative: 10 tokens in")
    assert launch._progress_bar(10, "x", False) == (None, None)


def test_prefix_caching_over_http_reuses_pages_and_counts_hits():
    """``kv_cache_config.enable_block_reuse`` (``serve --enable-prefix-caching``) end to end: the same prompt
    twice, the second prefilled from the first's cached pages, the same greedy tokens; vLLM's prefix-cache
    counters on /metrics."""
    srv = start_in_process({**SMALL, "kv_cache_config.enable_block_reuse": True, "kv_cache_config.tokens_per_block": 4})
    try:
        prompt = [(7 * i + 3) % VOCAB for i in range(21)]  # 5 whole pages before its last token
        outs = []
        for _ in range(2):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0},
                           timeout=120)
            assert r.status_code == 200, r.text
            outs.append(r.json()["choices"][0]["token_ids"])
        m = _metrics(srv.url)
        assert outs[0] == outs[1] and len(outs[0]) == 5
        assert m["trtllm_ext_prefix_cache_queries_total" + _model_label()] == 2 * len(prompt)
        assert m["trtllm_ext_prefix_cache_hits_total" + _model_label()] == 5 * 4
        assert m["trtllm_ext_prompt_tokens_total" + _model_label()] == 2 * len(prompt) - 5 * 4
    finally:
        srv.stop(30)


def test_prefix_caching_under_load_with_clients_leaving_returns_every_page():
    """Prefix reuse under load: a pool of 30 pages, requests sharing prompt starts (streamed or not, n 1 or 2,
    greedy or sampled, some with logprobs), a tenth of the streams left mid-way: no 5xx, and once all have ended
    the pool is back to no page in use and the server answers."""
    import random

    srv = start_in_process({**SMALL, "kv_cache_config.enable_block_reuse": True, "kv_cache_config.tokens_per_block": 4,
                            "kv_cache_config.max_tokens": 120})
    rng = random.Random(7)
    stems = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(3)]
    failures = []

    async def one(client, i):
        body = {"prompt": rng.choice(stems)[:rng.randint(1, 20)] + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 5))],
                "max_tokens": rng.randint(1, 10), "temperature": rng.choice([0.0, 0.8]), "seed": i,
                "n": rng.choice([1, 1, 2]), "stream": rng.random() < 0.5,
                **({"logprobs": 2} if rng.random() < 0.2 else {})}
        leave = body["stream"] and rng.random() < 0.2
        if body["stream"]:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    if leave:
                        return
                ok = r.status_code == 200
        else:
            r = await client.post("/v1/completions", json=body)
            ok = r.status_code == 200
        if not ok:
            failures.append((r.status_code, body))

    async def main():
        # Idle pooled connections expire before the server's keep-alive (uvicorn's 5 s) would close them: a request
        # sent on a connection the server closes at that instant is HTTP/1.1's keep-alive race (a ReadError), not
        # what this test is about; it met a loaded CI machine between the waves.
        limits = httpx.Limits(keepalive_expiry=1.0)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as client:
            for wave in range(2):
                await asyncio.gather(*(one(client, wave * 100 + i) for i in range(16)))

    try:
        asyncio.run(main())
        assert not failures, failures
        deadline = time.monotonic() + 30
        while _metrics(srv.url)["trtllm_ext_num_requests_running" + _model_label()] and time.monotonic() < deadline:
            time.sleep(0.1)  # the streams that left are noticed at their next token
        m = _metrics(srv.url)
        assert m["trtllm_ext_num_requests_running" + _model_label()] == 0
        assert m["trtllm_ext_kv_cache_usage_perc" + _model_label()] == 0.0
        assert m["trtllm_ext_prefix_cache_hits_total" + _model_label()] > 0
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        srv.stop(30)
