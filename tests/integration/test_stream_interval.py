"""``stream_interval`` (TensorRT-LLM's field, vLLM's ``--stream-interval``): a stream's tokens go to its response once
that many have gathered since its last chunk, its first token and its end at once. The tokens, their
log-probabilities and the finish are the same as with a chunk per step; only the chunking changes."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")

from tensorrt_llm_ext.runtime.config import ConfigError, load_config  # noqa: E402
from tensorrt_llm_ext.runtime.scheduler import Event  # noqa: E402
from tensorrt_llm_ext.testing.server import SMALL_SERVE_CONFIG, start_in_process  # noqa: E402
from tensorrt_llm_ext.testing.tiny_models import tiny_model  # noqa: E402

INTERVAL = 4
BODY = {"model": "dspark-embedded", "prompt": [5, 17, 42, 9], "max_tokens": 13, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "logprobs": 2}


def test_the_config_takes_stream_interval():
    with pytest.raises(ConfigError, match="stream_interval"):
        load_config(**tiny_model(stream_interval=0))
    cfg = load_config(**tiny_model(stream_interval=INTERVAL))
    assert cfg.stream_interval == INTERVAL and not [f for f, _, _ in cfg.no_effect_fields() if f == "stream_interval"]


def test_merged_events_keep_tokens_logprobs_and_the_end_in_order():
    a = Event(3, [1, 2], accepted_len=2, logprobs=[(-0.1, []), (-0.2, [])], speculative=True)
    b = Event(3, [7], accepted_len=1, logprobs=[(-0.3, [])])
    c = Event(3, [], "cancelled", accepted_len=None)
    m = Event.merged([a, b, c])
    assert (m.handle, m.tokens, m.finish_reason, m.accepted_len, m.speculative) == (3, [1, 2, 7], "cancelled", 3, True)
    assert m.logprobs == [(-0.1, []), (-0.2, []), (-0.3, [])]
    assert Event.merged([Event(1, [4]), Event(1, [5], "length")]).logprobs is None


def _chunks(url: str) -> list[tuple[list[int], int, str | None]]:
    """The stream's chunks: (token ids, log-probabilities given, finish reason)."""
    out = []
    with httpx.stream("POST", url + "/v1/completions", json=BODY, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            out.append((choice["token_ids"], len((choice.get("logprobs") or {}).get("tokens") or []),
                        choice["finish_reason"]))
    return out


@pytest.fixture(scope="module")
def streams():
    got = {}
    for interval in (1, INTERVAL):
        srv = start_in_process({**SMALL_SERVE_CONFIG, "stream_interval": interval})
        try:
            got[interval] = _chunks(srv.url)
            text = httpx.get(srv.url + "/metrics", timeout=10).text
            got[interval, "tokens"] = next(float(line.split()[-1]) for line in text.splitlines()
                                           if line.startswith("trtllm_ext_generation_tokens_total"))
        finally:
            srv.stop(30)
    return got


def test_a_stream_gathers_its_tokens_into_chunks_of_at_least_the_interval(streams):
    every, gathered = streams[1], streams[INTERVAL]
    tokens = [t for c in every for t in c[0]]
    assert [t for c in gathered for t in c[0]] == tokens and len(tokens) == BODY["max_tokens"]
    assert [n for _, n, _ in gathered] == [len(c) for c, _, _ in gathered]  # a log-probability per token
    assert gathered[0][0] == tokens[:1]  # the first token at once
    assert gathered[-1][2] == "length" and every[-1][2] == "length"
    # between the first chunk and the last, every chunk holds at least the interval (the end may hold fewer)
    assert all(len(c) >= INTERVAL for c, _, _ in gathered[1:-1])
    assert len(gathered) < len(every)
    assert streams[1, "tokens"] == streams[INTERVAL, "tokens"]  # every token counted as the engine made it
