"""A checkpoint directory served as a user serves one: EOS from ``config.json`` equals ``transformers``'
``generate`` (also when the EOS lands inside an accepted speculative block), ``ignore_eos`` runs on, the
length limit comes from ``max_position_embeddings``, and chat / text completions / logprobs go through the
``openai`` client on the tokenizer's chat template (one in-process server)."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import torch  # noqa: E402

from tensorrt_llm_ext.runtime.config import load_config  # noqa: E402
from tensorrt_llm_ext.runtime.engine import Engine  # noqa: E402
from tensorrt_llm_ext.runtime.export import export_model  # noqa: E402
from tensorrt_llm_ext.runtime.requests import Request  # noqa: E402
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan  # noqa: E402
from tensorrt_llm_ext.testing.hf_checkpoints import save_tiny_tokenizer  # noqa: E402
from tensorrt_llm_ext.testing.server import KERNEL_LOCK, SMALL_SERVE_CONFIG, start_in_process  # noqa: E402
from tensorrt_llm_ext.testing.requests import make_request

SMALL = SMALL_SERVE_CONFIG
VOCAB = SMALL["model.target.vocab_size"]
SERVE = {"max_batch_size": 4, "model.dtype": "float32"}  # sizes come from the checkpoint
PROMPT = [17, 305, 42, 9]  # the words "w17 w305 w42 w9" (the tiny tokenizer adds no BOS)
MAX_NEW = 16


def _events(engine: Engine, fields: dict) -> list:
    with KERNEL_LOCK:  # the interpreter is not thread-safe: never beside a server's step
        sch = Scheduler(engine)
        events, _ = sch.apply(StepPlan(admit=[(0, make_request(**fields))], run=False))
        while sch.num_active:
            events += sch.apply(StepPlan())[0]
    return events


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The small model exported (max_position_embeddings 40), a tiny tokenizer with a chat template, and
    an ``eos_token_id`` that the greedy decode of PROMPT reaches inside an accepted block (not its last token)."""
    d = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    export_model(load_config(**SMALL), d)
    save_tiny_tokenizer(d, VOCAB)
    cfg = json.loads((d / "config.json").read_text())
    with KERNEL_LOCK:
        engine = Engine(load_config(model_dir=str(d), **SERVE))
    events = _events(engine, dict(prompt_ids=PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True))
    full = [t for e in events for t in e.tokens]
    at, pos = None, 0
    for e in events:
        if e.accepted_len is not None and e.accepted_len >= 2:
            fresh = [j for j, t in enumerate(e.tokens[:-1]) if t not in full[:pos + j] and t > 4]
            if fresh:
                at = pos + fresh[0]
                break
        pos += len(e.tokens)
    assert at is not None, f"no accepted block with a fresh token: {[e.accepted_len for e in events]}"
    cfg["eos_token_id"] = full[at]
    (d / "config.json").write_text(json.dumps(cfg))
    return d, full, at


@pytest.fixture(scope="module")
def engine(checkpoint):
    with KERNEL_LOCK:
        return Engine(load_config(model_dir=str(checkpoint[0]), **SERVE))


def test_eos_from_config_equals_transformers_generate(checkpoint, engine):
    d, full, at = checkpoint
    eos = full[at]
    hf = transformers.LlamaForCausalLM.from_pretrained(d).eval().float()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(PROMPT):].tolist()
    assert ref == full[:at + 1] and ref[-1] == eos  # transformers stops at the EOS
    assert eos in engine.eos_token_ids
    with KERNEL_LOCK:
        results, _ = engine.generate([Request(PROMPT, MAX_NEW), Request(PROMPT, MAX_NEW, ignore_eos=True)])
    assert results[0].output_ids == ref and results[0].finish_reason == "stop"  # generate --model stops too
    assert results[1].output_ids == full and results[1].finish_reason == "length"
    assert engine.slots.num_free == SERVE["max_batch_size"]


def test_max_model_len_from_max_position_embeddings(checkpoint, caplog):
    d, _, _ = checkpoint
    assert load_config(model_dir=str(d), **SERVE).max_seq_len == SMALL["max_seq_len"]  # 40, not the default 160
    assert load_config(model_dir=str(d), max_seq_len=32, **SERVE).max_seq_len == 32
    assert load_config(model_dir=str(d), max_seq_len=64, **SERVE).max_seq_len == 40  # capped, logged


@pytest.fixture(scope="module")
def served(checkpoint):
    d, full, at = checkpoint
    srv = start_in_process(SERVE, model_dir=str(d))
    yield srv, d, full, at
    srv.stop(30)


def test_chat_text_and_logprobs_through_the_openai_client(served, engine):
    srv, d, full, at = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    assert client.models.list().data[0].id == "tiny-llama"
    tok = transformers.AutoTokenizer.from_pretrained(d)
    messages = [{"role": "user", "content": "w17 w42"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with KERNEL_LOCK:
        ref = engine.generate([Request(prompt, 8)], "reference")[0][0]  # what the server's speculative tokens equal
    out = client.chat.completions.create(model="tiny-llama", messages=messages, logprobs=True, top_logprobs=2,
                                         max_completion_tokens=len(ref.output_ids))
    ch = out.choices[0]
    ids = ch.to_dict()["token_ids"]
    assert ids == ref.output_ids and ch.finish_reason == ("stop" if ref.finish_reason == "stop" else "length")
    shown = ids[:-1] if ch.finish_reason == "stop" else ids
    # Decoded after the prompt (vLLM's incremental detokenization): the word-level decoder's space before it.
    assert ch.message.content == " " + tok.decode(shown, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == len(ids)
    assert len(ch.logprobs.content) == len(ids) and all(len(c.top_logprobs) == 2 for c in ch.logprobs.content)
    assert all(c.logprob <= 0 for c in ch.logprobs.content)
    # streaming with usage: the deltas add up to the same content
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=messages, stream=True,
                                                 max_completion_tokens=len(ref.output_ids),
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ch.message.content and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[0].choices[0].delta.role == "assistant"
    # completions on text: the EOS ends it, and is not in the text
    text_prompt = tok.decode(PROMPT)
    c = client.completions.create(model="tiny-llama", prompt=text_prompt, max_tokens=MAX_NEW)
    assert c.choices[0].to_dict()["token_ids"] == full[:at + 1] and c.choices[0].finish_reason == "stop"
    assert text_prompt + c.choices[0].text == tok.decode(PROMPT + full[:at], skip_special_tokens=True)
    assert c.usage.completion_tokens == at + 1
    c = client.completions.create(model="tiny-llama", prompt=text_prompt, max_tokens=MAX_NEW,
                                  extra_body={"ignore_eos": True})
    assert c.choices[0].to_dict()["token_ids"] == full and c.choices[0].finish_reason == "length"


def test_stop_strings_cut_text_tokens_and_usage_alike(served):
    srv, d, full, at = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    text_prompt = tok.decode(PROMPT)
    assert tok.encode(text_prompt) == PROMPT
    stop = tok.decode([full[2]])  # the third generated word
    # vLLM's rule: the output ends with the first token whose text completes the stop string
    first = next(m for m in range(1, len(full) + 1) if stop in tok.decode(full[:m])) - 1
    for include in (False, True):
        for stream in (False, True):
            kw = dict(model="tiny-llama", prompt=text_prompt, max_tokens=MAX_NEW, stop=[stop],
                      extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
            if stream:
                chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                ids = [t for c in chunks if c.choices for t in c.choices[0].to_dict()["token_ids"]]
                finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
                usage = chunks[-1].usage.completion_tokens
            else:
                c = client.completions.create(**kw)
                text, ids = c.choices[0].text, c.choices[0].to_dict()["token_ids"]
                finish, usage = c.choices[0].finish_reason, c.usage.completion_tokens
            assert ids == full[:first + 1] and usage == first + 1 and finish == "stop", (include, stream)
            whole = " " + tok.decode(full[:first + 1], skip_special_tokens=True)  # the text after the prompt's
            want = whole[:whole.find(stop) + (len(stop) if include else 0)]
            assert text == want, (include, stream, text, want)
    assert client.with_options().models.list().data  # the server is still healthy


def test_chat_without_a_template_is_a_clear_400(tmp_path):
    d = tmp_path / "no-template"
    export_model(load_config(**SMALL), d)
    save_tiny_tokenizer(d, VOCAB, chat_template=None)
    srv = start_in_process(SERVE, model_dir=str(d))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="no-template", messages=[{"role": "user", "content": "w5"}])
        err = e.value.body if "error" not in (e.value.body or {}) else e.value.body["error"]
        assert err["param"] == "messages" and "chat template" in err["message"]
    finally:
        srv.stop(30)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_llama3_and_qwen3_checkpoints_serve_chat_eos_and_logprobs(tmp_path, family):
    """A Llama-3-style (llama3 RoPE) and a Qwen3-style (q/k norms, explicit head_dim) tiny checkpoint with a
    chat template: chat through the openai client stops at the checkpoint's EOS exactly where transformers'
    greedy decode reaches it, the content leaves the EOS out, and logprobs equal log_softmax of transformers'
    logits (1e-4)."""
    from tensorrt_llm_ext.testing.hf_checkpoints import hf_greedy_decode, save_tiny_hf_checkpoint

    d = tmp_path / f"tiny-{family}"
    hf = save_tiny_hf_checkpoint(d, family, tokenizer=True, eos_token_id=2)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    messages = [{"role": "system", "content": "w11"}, {"role": "user", "content": "w17 w42"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    free = hf_greedy_decode(hf, prompt, 12)
    at = next(i for i, t in enumerate(free) if i >= 2 and t > 4 and t not in free[:i])
    save_tiny_hf_checkpoint(d, family, tokenizer=True, eos_token_id=free[at])  # same seed: same weights
    srv = start_in_process(SERVE, model_dir=str(d))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        out = client.chat.completions.create(model=d.name, messages=messages, max_completion_tokens=12,
                                             logprobs=True, top_logprobs=3)
    finally:
        srv.stop(30)
    ch = out.choices[0]
    ids = ch.to_dict()["token_ids"]
    assert ids == free[:at + 1] and ch.finish_reason == "stop"
    assert ch.message.content == " " + tok.decode(free[:at], skip_special_tokens=True)  # after "assistant"
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == at + 1
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1:].float()
    ref = torch.log_softmax(logits, -1)
    got = torch.tensor([c.logprob for c in ch.logprobs.content])
    torch.testing.assert_close(got, ref[torch.arange(len(ids)), torch.tensor(ids)], atol=1e-4, rtol=0)
    top = torch.tensor([[t.logprob for t in c.top_logprobs] for c in ch.logprobs.content])
    torch.testing.assert_close(top, torch.topk(ref, 3).values, atol=1e-4, rtol=0)
