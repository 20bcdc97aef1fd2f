"""A tokenizer for the embedded default model, built in code, so that text prompts and chat work on it.

The embedded model is a seeded random Llama-like target: what it writes is noise, but a newcomer's
``openai`` client should see text and ``/v1/chat/completions`` should answer. This builds a byte-level BPE
tokenizer (``tokenizers``, wrapped as a ``transformers`` fast tokenizer) of exactly the model's vocabulary
size, the same on every machine (no file, no download):

* ids 0..2: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (special);
* ids 3..258: the 256 bytes, in byte order (any text encodes; any id sequence decodes);
* the rest: merges in a fixed order -- a space plus a lowercase letter (``" a"``), two lowercase letters
  (``"ab"``), then a space plus two lowercase letters (``" ab"``) -- as many as the vocabulary holds.

Its chat template is ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``, then ``<|im_start|>assistant\\n``).
The embedded model declares no EOS, so a request ends at its ``max_tokens`` or a stop.
"""

from __future__ import annotations

import string

__all__ = ["EMBEDDED_CHAT_TEMPLATE", "EMBEDDED_SPECIAL_TOKENS", "MIN_EMBEDDED_VOCAB", "build_embedded_tokenizer"]

EMBEDDED_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MIN_EMBEDDED_VOCAB = len(EMBEDDED_SPECIAL_TOKENS) + 256  # the specials and every byte

EMBEDDED_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_symbols() -> list[str]:
    """The printable character byte-level BPE writes for each byte 0..255 (bytes that print as themselves keep
    their character; the others are moved to code points 256 and up, in byte order)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, moved = [], 0
    for b in range(256):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + moved))
            moved += 1
    return symbols


def _merges(space: str, budget: int) -> list[tuple[str, str]]:
    """The first ``budget`` merges of the fixed order (each merge's result is a new token)."""
    letters = string.ascii_lowercase
    merges = [(space, a) for a in letters]
    merges += [(a, b) for a in letters for b in letters]
    merges += [(space + a, b) for a in letters for b in letters]
    return merges[:budget]


def build_embedded_tokenizer(vocab_size: int):
    """A ``transformers`` fast tokenizer of exactly ``vocab_size`` ids with a ChatML chat template.

    Raises ``ValueError`` below :data:`MIN_EMBEDDED_VOCAB` ids (no room for every byte) and ``ImportError``
    without ``transformers``.

    >>> tok = build_embedded_tokenizer(1536)
    >>> tok.decode(tok.encode("hello world"))
    'hello world'
    """
    if vocab_size < MIN_EMBEDDED_VOCAB:
        raise ValueError(f"embedded tokenizer: the vocabulary needs at least {MIN_EMBEDDED_VOCAB} ids (3 special + "
                         f"256 bytes), got {vocab_size}")
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = _byte_symbols()
    vocab = {tok: i for i, tok in enumerate(EMBEDDED_SPECIAL_TOKENS)}
    vocab.update({s: len(EMBEDDED_SPECIAL_TOKENS) + b for b, s in enumerate(symbols)})
    space = symbols[ord(" ")]
    merges = _merges(space, vocab_size - len(vocab))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    if len(vocab) < vocab_size:  # more ids than the fixed merge order names: spare specials, never produced
        vocab.update({f"<|reserved_{i}|>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    reserved = [t for t in vocab if t.startswith("<|reserved_")]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", unk_token=None, pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", *reserved])
    fast.chat_template = EMBEDDED_CHAT_TEMPLATE
    return fast
