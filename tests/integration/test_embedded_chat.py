"""The embedded default model chats: its tokenizer is built in code (byte-level, ChatML template, exactly the
model's vocabulary), ``serve`` picks it when no directory names one, and the ``openai`` client sees text. Also
the one line that names the drafter a config loads."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tensorrt_llm_ext.configs.embedded_tokenizer import (EMBEDDED_CHAT_TEMPLATE, MIN_EMBEDDED_VOCAB,  # noqa: E402
                                                         build_embedded_tokenizer)
from tensorrt_llm_ext.runtime.config import describe_drafter, load_config  # noqa: E402
from tensorrt_llm_ext.runtime.tokenizer import resolve_tokenizer  # noqa: E402
from tensorrt_llm_ext.testing.server import SMALL_SERVE_CONFIG  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return build_embedded_tokenizer(1536)  # the embedded default's vocabulary


def test_embedded_tokenizer_round_trips_text_and_decodes_every_id(tok):
    vocab = tok.get_vocab()
    assert len(vocab) == 1536 and sorted(vocab.values()) == list(range(1536))
    for text in ("hello world", "The capital of France is Paris.", "Straße, naïve café: 東京 ✓\n\ttabs", ""):
        ids = tok.encode(text)
        assert tok.decode(ids) == text and all(0 <= i < 1536 for i in ids)
    assert len(tok.encode("hello world")) < len("hello world")  # merges, not one id per byte
    out = tok.decode(list(range(1536)), skip_special_tokens=True)  # every id decodes (noise is text too)
    assert isinstance(out, str) and len(out) > 1000
    # Deterministic: built twice, the same vocabulary; sized to any vocabulary that holds every byte.
    assert build_embedded_tokenizer(1536).get_vocab() == vocab
    assert len(build_embedded_tokenizer(MIN_EMBEDDED_VOCAB).get_vocab()) == MIN_EMBEDDED_VOCAB
    with pytest.raises(ValueError, match="at least 259 ids"):
        build_embedded_tokenizer(MIN_EMBEDDED_VOCAB - 1)


def test_embedded_chat_template_is_chatml(tok):
    assert tok.chat_template == EMBEDDED_CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and 2 in ids and tok.decode(ids) == text  # <|im_start|> = 1, <|im_end|> = 2


def test_serve_resolves_the_embedded_tokenizer_only_for_the_embedded_model(tmp_path):
    cfg = load_config(**SMALL_SERVE_CONFIG)
    t = resolve_tokenizer(cfg)
    assert t is not None and len(t.get_vocab()) == SMALL_SERVE_CONFIG["model.target.vocab_size"]
    weights = load_config(**SMALL_SERVE_CONFIG, **{"model.target_weights": str(tmp_path / "w.pt")})
    assert resolve_tokenizer(weights) is None  # someone's own weights: not our tokenizer
    small = load_config(**{**SMALL_SERVE_CONFIG, "model.target.vocab_size": 200})
    assert resolve_tokenizer(small) is None  # too small for every byte: token ids only (logged)


def test_openai_client_chats_with_the_embedded_model():
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from tensorrt_llm_ext.testing.server import start_in_process

    cfg = load_config(**SMALL_SERVE_CONFIG)
    srv = start_in_process(SMALL_SERVE_CONFIG, tokenizer=resolve_tokenizer(cfg))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        chat = client.chat.completions.create(model="dspark-embedded", max_tokens=4,
                                              messages=[{"role": "user", "content": "Hello!"}])
        assert isinstance(chat.choices[0].message.content, str) and chat.choices[0].message.content
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
        done = client.completions.create(model="dspark-embedded", prompt="Once upon a time", max_tokens=3)
        assert isinstance(done.choices[0].text, str) and done.choices[0].text
    finally:
        srv.stop(30)


def test_describe_drafter_names_source_k_and_rank(tmp_path):
    seeded = describe_drafter(load_config(**SMALL_SERVE_CONFIG))
    assert seeded.startswith("drafter: seeded, not trained") and "bigram" in seeded
    assert "K=3" in seeded and "Markov rank r=32" in seeded
    weights = describe_drafter(load_config(**SMALL_SERVE_CONFIG, **{"model.drafter_weights": "/x/d.pt"}))
    assert weights.startswith("drafter: /x/d.pt (a torch.save state dict")


def test_text_prompts_need_no_http_stack():
    # generate's text prompts resolve the tokenizer without importing the server (fastapi is the serve extra).
    import subprocess
    import sys

    code = ("import sys\nfrom tensorrt_llm_ext.runtime.config import load_config\n"
            "from tensorrt_llm_ext.runtime.tokenizer import resolve_tokenizer\n"
            "assert resolve_tokenizer(load_config()) is not None\n"
            "assert 'fastapi' not in sys.modules and 'tensorrt_llm_ext.runtime.server' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_named_chat_templates_are_chosen_by_transformers(tmp_path, tok):
    """A tokenizer with named chat templates (``chat_template`` a dict of "default" and "tool_use", as some
    checkpoints ship them): chat renders with "default", and with "tool_use" when the tools reach the template
    (was: every chat and /tokenize request with messages a 400, "TypeError: unhashable type: 'dict'").
    ``--chat-template`` still replaces them."""
    import transformers

    from tensorrt_llm_ext.runtime.openai_protocol import ChatCompletionRequest
    from tensorrt_llm_ext.runtime.server import ServeContext, _chat_prompt

    tok.chat_template = {"default": EMBEDDED_CHAT_TEMPLATE, "tool_use": "{{ tools|length }} tool\n" + EMBEDDED_CHAT_TEMPLATE}
    tok.save_pretrained(tmp_path)
    tok.chat_template = EMBEDDED_CHAT_TEMPLATE  # the module's fixture, as it was
    named = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(named.chat_template, dict)
    ctx = ServeContext(loop=None, model_name="m", vocab_size=1536, max_seq_len=64, tokenizer=named)
    user = [{"role": "user", "content": "hi"}]
    plain = _chat_prompt(ctx, ChatCompletionRequest(messages=user))
    assert named.decode(plain) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = _chat_prompt(ctx, ChatCompletionRequest(messages=user, tools=tools, tool_choice="none"))
    assert named.decode(with_tools).startswith("1 tool\n<|im_start|>user")
    ctx.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert named.decode(_chat_prompt(ctx, ChatCompletionRequest(messages=user))) == "hi"
