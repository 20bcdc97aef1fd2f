"""The server's output path without HTTP: the byte table's text equals the tokenizer's decode, a choice decoded
from it equals one decoded whole (stop strings, min_tokens, the stop token), the SSE bytes equal ``json.dumps`` of
the chunk object, and the engine loop hands a whole step's events over once."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from tensorrt_llm_ext.configs.embedded_tokenizer import build_embedded_tokenizer  # noqa: E402
from tensorrt_llm_ext.runtime.openai_protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from tensorrt_llm_ext.runtime.openai_responses import Choice, ChoicesResponse, _Last  # noqa: E402
from tensorrt_llm_ext.runtime.scheduler import Event  # noqa: E402
from tensorrt_llm_ext.runtime.tokenizer import byte_table  # noqa: E402

VOCAB = 600


@pytest.fixture(scope="module")
def tok():
    return build_embedded_tokenizer(VOCAB)


class _Loop:
    def __init__(self):
        self.cancelled = []

    def cancel(self, handle, reason="cancelled"):
        self.cancelled.append((handle, reason))


def _ctx(tok):
    return SimpleNamespace(tokenizer=tok, model_name="m", loop=_Loop(), token_strs={})


def test_byte_table_text_is_the_tokenizers_decode(tok):
    table = byte_table(tok)
    assert table is not None and byte_table(tok) is table  # built once per tokenizer
    rng = random.Random(3)
    for _ in range(200):  # byte tokens (3..258) split UTF-8 characters; ids 0..2 are specials
        ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        assert b"".join(table[t] for t in ids).decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=True)

    class Wrapped:  # not a tokenizer object: its decode is its own
        def __getattr__(self, name):
            return getattr(tok, name)

    assert byte_table(Wrapped()) is None


@pytest.mark.parametrize("case", ["stop_strings", "min_tokens", "stop_token", "include_stop"])
def test_a_choice_read_from_the_byte_table_equals_one_decoded_whole(tok, case):
    """Event by event, stream_text / tokens / finish of a choice on the byte table equal those of the same choice
    decoded token by token (the path of any other tokenizer), and so does its final text."""
    rng = random.Random(case)
    text_ids = tok.encode("ab cd é€ 😀 stop here, and STOP again. " * 3, add_special_tokens=False)
    stops = {"stop_strings": ["STOP", "é€"], "min_tokens": ["ab"], "stop_token": [], "include_stop": ["here"]}[case]
    for trial in range(6):
        body = CompletionRequest(prompt=[1], max_tokens=64, min_tokens=4 if case == "min_tokens" else 0,
                                 include_stop_str_in_output=case == "include_stop")
        a, b = (Choice(_ctx(tok), 0, [1], stops, body.include_stop_str_in_output, body) for _ in range(2))
        b.table = None
        assert a.table is not None
        ids = text_ids[trial:] + [rng.randrange(3, 259) for _ in range(4)]  # a few raw bytes too
        k = 0
        while k < len(ids) and a.finish_reason is None:
            n = rng.randint(1, 4)  # speculative blocks of several tokens
            last = case == "stop_token" and k + n >= 20
            e = Event(0, ids[k:k + n] + ([2] if last else []), "stop" if last else None, accepted_len=n)
            a.apply(e, a.ctx.loop, 0)
            b.apply(e, b.ctx.loop, 0)
            assert (a.tokens, a.finish_reason, a.stop_span) == (b.tokens, b.finish_reason, b.stop_span)
            # (text() differs only while running: the table's ends with the incomplete character's U+FFFD)
            assert a.stream_text() == b.stream_text()
            k += n
        assert a.text() == b.text()
        assert a.ctx.loop.cancelled == b.ctx.loop.cancelled
        if case != "stop_token":
            assert a.finish_reason == "stop", (case, trial, a.text())


@pytest.mark.parametrize("chat", [False, True])
def test_stream_chunks_are_the_json_of_the_chunk_object(tok, chat):
    """The SSE bytes of each event: ``data: json.dumps(chunk)``, the last one followed by usage and [DONE]."""
    fields = {"max_tokens": 3, "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    body = (ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields) if chat
            else CompletionRequest(prompt=[1], **fields))
    kind = "chat.completion" if chat else "text_completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    ctx = _ctx(tok)
    STEPS = ([300], [3 + ord('"'), 3 + ord("\\"), 3 + ord("\n")], [3 + 0xC3, 3 + 0xA9])  # quote, backslash, newline, é

    class Worker:
        def call(self, fn):
            assert fn() == []

    async def run():
        out = ChoicesResponse(ctx, "id-1", kind, body, Worker())
        out.start({h: Choice(ctx, h, [1], [], False, body) for h in (0, 1)})
        got = []
        for step, ids in enumerate(STEPS):
            for h in (0, 1):
                got.append(out.on_item(Event(h, list(ids), "length" if step == 2 else None, accepted_len=1)))
        return out, got

    out, got = asyncio.run(run())
    head = {"id": "id-1", "object": obj, "created": out.created, "model": "m"}
    texts = ["", ""]
    for i, payload in enumerate(got):
        h, step = i % 2, i // 2
        data = payload.data if isinstance(payload, _Last) else payload
        c = json.loads(data.split(b"\n\n")[0][len(b"data: "):])["choices"][0]
        piece = c["delta"]["content"] if chat else c["text"]
        texts[h] += piece
        finish = "length" if step == 2 else None
        # The chunk object field by field, in the order the server has always written it.
        if chat:
            delta = {"role": "assistant", "content": piece} if step == 0 else {"content": piece}
            want = {"index": h, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": STEPS[step]}
        else:
            want = {"index": h, "token_ids": STEPS[step], "finish_reason": finish, "logprobs": None, "text": piece}
        assert data.startswith(f"data: {json.dumps({**head, 'choices': [want]})}\n\n".encode()), data
    assert texts == [tok.decode(sum(STEPS, []))] * 2 and texts[0].endswith('"\\\né')
    assert not isinstance(got[-2], _Last) and isinstance(got[-1], _Last)
    usage = json.dumps({**head, "choices": [], "usage": out.usage()})
    assert got[-1].data.endswith(f"data: {usage}\n\ndata: [DONE]\n\n".encode())


def test_the_engine_loop_hands_a_step_over_once():
    """A step's events for 8 requests reach the output worker in one list, in order (was: one hand-off each)."""
    from tensorrt_llm_ext.bench.server_process import StubScheduler
    from tensorrt_llm_ext.runtime.engine_loop import EngineLoop, PlanChannel, Sink
    from tensorrt_llm_ext.runtime.requests import Request
    from tensorrt_llm_ext.runtime.serve_metrics import ServerMetrics

    class Worker:
        def __init__(self):
            self.batches = []

        def put(self, pairs):
            self.batches.append([(s.handler, e.handle, e.tokens, e.finish_reason) for s, e in pairs])

    worker = Worker()
    loop = EngineLoop(StubScheduler(8, [10, 11, 12]), PlanChannel(None), ServerMetrics(1), 16, speculative=False)
    sinks = [Sink(None, None, f"r{i}", worker) for i in range(8)]
    for s in sinks:
        loop.submit([Request([1, 2], max_new_tokens=3)], s)
    while loop.scheduler.num_active or not worker.batches:
        plan = loop._next_plan()
        loop._record(plan, *loop.scheduler.apply(plan))
    # The first plan: the 8 prefills' first tokens and a step; the second: the last step.
    assert [len(b) for b in worker.batches] == [16, 8]
    token = [10, 11, 12]
    assert worker.batches[-1] == [(f"r{h}", h, [token[(h * 7 + 2) % 3]], "length") for h in range(8)]
    assert not loop._sinks


def test_a_new_request_waits_one_plan_while_others_decode_and_a_cancel_there_ends_it():
    """While requests decode, the plan that takes a new request runs their step alone; the next one prefills it.
    A request cancelled in between is answered "cancelled" and never reaches the engine."""
    from tensorrt_llm_ext.bench.server_process import StubScheduler
    from tensorrt_llm_ext.runtime.engine_loop import EngineLoop, PlanChannel, Sink
    from tensorrt_llm_ext.runtime.requests import Request
    from tensorrt_llm_ext.runtime.serve_metrics import ServerMetrics

    events = []

    class Worker:
        def put(self, pairs):
            events.extend((e.handle, e.finish_reason) for _, e in pairs)

    loop = EngineLoop(StubScheduler(4, [10]), PlanChannel(None), ServerMetrics(1), 16, speculative=False)
    sink = Sink(None, None, None, Worker())

    def plan():
        p = loop._next_plan()
        loop._record(p, *loop.scheduler.apply(p))
        return [h for h, _ in p.admit], p.run

    loop.submit([Request([1], max_new_tokens=8)], sink)
    assert plan() == ([0], True)  # nothing decodes yet: admitted at once
    loop.submit([Request([1], max_new_tokens=8)] * 2, sink)
    assert plan() == ([], True) and loop.state().queued == 2  # handle 0's step first
    assert plan() == ([1, 2], True)
    loop.submit([Request([1], max_new_tokens=8)], sink)
    assert plan() == ([], True)
    loop.cancel(3)
    assert plan() == ([], True) and (3, "cancelled") in events and loop.state().queued == 0
    assert 3 not in loop._sinks and loop.scheduler.num_active == 3


def test_logprob_token_strings_are_decoded_once_per_id(tok):
    """The strings of log-probability entries (echoed prompts' and generated tokens', with their top candidates) are
    the tokenizer's ``decode([id])``, each id decoded once per server: a second answer naming the same ids calls the
    tokenizer no more."""
    from tensorrt_llm_ext.runtime.openai_responses import chat_logprobs, completion_logprobs

    calls = []

    class Counting:
        def decode(self, ids):
            calls.append(tuple(ids))
            return tok.decode(ids)

    ctx = SimpleNamespace(tokenizer=Counting(), token_strs={})
    rng = random.Random(5)
    tokens = [rng.randrange(VOCAB) for _ in range(50)]
    lps = [(-1.0, [(rng.randrange(VOCAB), -2.0) for _ in range(5)]) for _ in tokens]
    first = completion_logprobs(ctx, [None] + lps[1:], tokens)
    assert first["tokens"] == [tok.decode([t]) for t in tokens]
    assert first["top_logprobs"][1] == {tok.decode([i]): -2.0 for i, _ in lps[1][1]}
    seen = {t for t in tokens} | {i for _, top in lps[1:] for i, _ in top}
    assert sorted(calls) == sorted((t,) for t in seen)  # one call per distinct id
    n = len(calls)
    assert completion_logprobs(ctx, [None] + lps[1:], tokens) == first
    chat = chat_logprobs(ctx, lps, tokens)
    assert [e["token"] for e in chat["content"]] == first["tokens"]
    assert len(calls) == n + len({i for i, _ in lps[0][1]} - seen)  # only ids not seen before



def _metaspace_tokenizer(vocab_size: int = VOCAB):
    """A Llama 2 / Mistral style tokenizer (SentencePiece's layout in ``tokenizers``): BPE with byte fallback
    (``<0xE4>``), ``▁`` for a space, and the decoder that drops the text's first leading space."""
    import string

    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for c in "▁" + string.ascii_letters + ".,":
        vocab[c] = len(vocab)
    merges = [("▁", a) for a in string.ascii_lowercase]
    vocab.update({"▁" + a: len(vocab) + i for i, a in enumerate(string.ascii_lowercase)})
    vocab.update({f"x{i}": i for i in range(len(vocab), vocab_size)})  # filler pieces up to the model's size
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


def _answer(tok, prompt: list[int], blocks: list[list[int]], stream: bool, finish: str = "length", **fields):
    """The text a completion answers for output ``blocks`` (one engine event each): the streamed deltas joined,
    or the final text."""
    body = CompletionRequest(prompt=prompt, max_tokens=64, stream=stream, **fields)
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    ctx = _ctx(tok)

    class Worker:
        def call(self, fn):
            fn()

    async def run():
        out = ChoicesResponse(ctx, "id", "text_completion", body, Worker())
        out.start({0: Choice(ctx, 0, prompt, stops, body.include_stop_str_in_output, body)})
        text = ""
        for i, ids in enumerate(blocks):
            payload = out.on_item(Event(0, ids, finish if i == len(blocks) - 1 else None, accepted_len=len(ids)))
            if stream and payload is not None:
                data = payload.data if isinstance(payload, _Last) else payload
                text += json.loads(data.split(b"\n\n")[0][len(b"data: "):])["choices"][0].get("text", "")
        return text if stream else out.choices[0].text()

    return asyncio.run(run())


def test_a_sentencepiece_output_keeps_its_leading_space_and_its_byte_fallback_characters():
    """A Metaspace / byte-fallback tokenizer (Llama 2, Mistral, Gemma) decodes the output after the prompt's last
    tokens, token by token (vLLM's incremental detokenization): prompt + text reads as the whole decode (was:
    "Hello" + "world", the output's leading space dropped), and a byte-fallback run cut mid-character keeps the
    characters before the cut (was: streamed, then each byte a U+FFFD in the answer)."""
    tok = _metaspace_tokenizer()
    assert byte_table(tok) is None  # not byte-level: the token-by-token path
    prompt = tok.encode("Hello", add_special_tokens=False)
    out = tok.encode(" world, again", add_special_tokens=False)[1:]  # "▁w" "o" "r" ...: a new word first
    assert tok.convert_ids_to_tokens(out[:1]) == ["▁w"]
    blocks = [out[i:i + 2] for i in range(0, len(out), 2)]
    for stream in (False, True):
        assert _answer(tok, prompt, blocks, stream) == " world, again"
    han = tok.encode("中文字", add_special_tokens=False)[1:]  # three characters, 3 byte tokens each
    assert len(han) == 9 and all(tok.convert_ids_to_tokens(t).startswith("<0x") for t in han)
    cut = [han[:4], han[4:8]]  # max_tokens reached inside the third character
    assert _answer(tok, prompt, cut, False) == "中文\ufffd\ufffd"  # the cut character's two bytes, as decoded
    assert _answer(tok, prompt, cut, True) == "中文\ufffd\ufffd"
    # Random outputs (byte tokens among them) in random blocks, with and without stop strings: the streamed
    # deltas add up to the answer.
    rng = random.Random(0)
    for trial in range(40):
        ids = tok.encode("héllo wörld 中文 😀 ok. " * 2, add_special_tokens=False)
        ids = [t if rng.random() > 0.15 else rng.randrange(3, 259) for t in ids]
        blocks, k = [], 0
        while k < len(ids):
            n = rng.randint(1, 4)
            blocks.append(ids[k:k + n])
            k += n
        fields = {"stop": rng.choice(["wörld", "文", "😀 o", "l"])} if trial % 2 else {}
        assert _answer(tok, prompt, blocks, True, **fields) == _answer(tok, prompt, blocks, False, **fields)


def test_a_stop_string_ending_in_a_character_split_across_events_streams_none_of_it(tok):
    """A stop string whose last character arrives byte by byte: its first character is held back with the rest
    (was: the incomplete character counted in the hold, so "é" of "é€" was streamed, then cut from the answer)."""
    prompt = [1]
    text = "abé€ tail"
    ids = tok.encode(text, add_special_tokens=False)
    euro = [3 + b for b in "€".encode()]
    at = ids.index(3 + "é".encode()[0])
    blocks = [ids[:at + 2], euro[:1], euro[1:2], euro[2:], ids[at + 2 + 3:]]
    assert b"".join(byte_table(tok)[t] for b in blocks for t in b).decode() == text
    for include in (False, True):
        want = "abé€" if include else "ab"
        assert _answer(tok, prompt, blocks, False, stop="é€", include_stop_str_in_output=include) == want
        assert _answer(tok, prompt, blocks, True, stop="é€", include_stop_str_in_output=include) == want


def test_chat_logprob_bytes_of_a_split_character_join_back_to_it(tok):
    """OpenAI's ``bytes`` of a chat log-probability entry are the token's own bytes: the entries of a character split
    over byte tokens join back to its UTF-8 (was: each one U+FFFD's [239, 191, 189]), for a byte-level tokenizer
    and a byte-fallback one; a special token's are its string's."""
    from tensorrt_llm_ext.runtime.openai_responses import chat_logprobs

    for t in (tok, _metaspace_tokenizer()):
        ids = t.encode("aé€😀", add_special_tokens=False)
        assert len(ids) >= 10  # every non-ASCII character split over byte tokens
        ctx = SimpleNamespace(tokenizer=t, token_strs={}, token_bytes={})
        special = t.convert_tokens_to_ids(t.eos_token or "<|endoftext|>")
        content = chat_logprobs(ctx, [(-1.0, [(i, -1.0)]) for i in ids + [special]], ids + [special])["content"]
        joined = b"".join(bytes(e["bytes"]) for e in content[:-1])
        assert joined.decode("utf-8").endswith("aé€😀"), joined  # (Metaspace: the prompt's leading space first)
        assert [e["top_logprobs"][0]["bytes"] for e in content] == [e["bytes"] for e in content]
        assert content[-1]["bytes"] == list(content[-1]["token"].encode())


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_text_offsets_continue_across_chunks(tok, echo):
    """Completions' streamed ``logprobs.text_offset`` equal the non-streamed answer's (was: each chunk's restarted
    at 0), with and without the echoed prompt."""
    prompt, out = [300, 301], [302, 303, 304, 305, 306]
    blocks = [out[:2], out[2:3], out[3:]]

    class Worker:
        def call(self, fn):
            fn()

    async def run(stream):
        body = CompletionRequest(prompt=prompt, max_tokens=5, logprobs=1, echo=echo, stream=stream)
        ctx = _ctx(tok)
        res = ChoicesResponse(ctx, "id", "text_completion", body, Worker())
        res.start({0: Choice(ctx, 0, prompt, [], False, body)})
        offsets = []
        for i, ids in enumerate(blocks):
            e = Event(0, ids, "length" if i == len(blocks) - 1 else None, accepted_len=len(ids),
                      logprobs=[(-1.0, [(t, -1.0)]) for t in ids], prompt_logprobs=[(-2.0, [(301, -2.0)])] if i == 0 else None)
            payload = res.on_item(e)
            if stream:
                data = payload.data if isinstance(payload, _Last) else payload
                offsets += json.loads(data.split(b"\n\n")[0][len(b"data: "):])["choices"][0]["logprobs"]["text_offset"]
        return offsets if stream else json.loads(res.final_json())["choices"][0]["logprobs"]["text_offset"]

    streamed, whole = asyncio.run(run(True)), asyncio.run(run(False))
    assert len(whole) == len(out) + (len(prompt) if echo else 0) and whole == sorted(set(whole))
    assert streamed == whole


def test_include_stop_str_in_output_keeps_a_stop_ids_text(tok):
    """vLLM's rule: the token of a stop id (``stop_token_ids``, EOS) is left out of the text only when
    ``include_stop_str_in_output`` is false (was: always left out, the field ignored for stop ids); token_ids end
    with it either way. Both tokenizer paths, streamed and not."""
    for t in (tok, _metaspace_tokenizer()):
        prompt = t.encode("so", add_special_tokens=False)
        out = t.encode(" hello world", add_special_tokens=False)[-4:]
        blocks = [out[:2], out[2:]]
        for stream in (False, True):
            shown = _answer(t, prompt, blocks, stream, finish="stop", include_stop_str_in_output=True)
            cut = _answer(t, prompt, blocks, stream, finish="stop")
            assert shown.startswith(cut) and len(shown) > len(cut), (shown, cut)
            assert shown == _answer(t, prompt, blocks, stream)  # the text of every token, as a "length" end
