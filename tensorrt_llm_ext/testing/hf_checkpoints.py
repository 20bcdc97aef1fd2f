"""Tiny Hugging Face checkpoints written by ``transformers`` itself, for tests that load real directories.

Test support only (``transformers`` and ``tokenizers`` are test dependencies): production code never
imports this module.

* :func:`save_tiny_tokenizer` -- a word-level fast tokenizer (``w3 w17 ...`` <-> ids) with special
  tokens and a chat template, saved with ``save_pretrained`` (``tokenizer.json``, ``tokenizer_config.json``,
  ``chat_template.jinja``).
"""

from __future__ import annotations

from pathlib import Path

# A Llama-3-like template over the tiny tokenizer's special tokens; `add_generation_prompt` opens the
# assistant turn as a real template does.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|> {{ m['role'] }} {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|start|> assistant {% endif %}"
)
# Ids 0..4 of every tiny tokenizer; the rest of the vocabulary is `w{id}`.
TINY_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|start|>", "<|end|>")


def save_tiny_tokenizer(directory: str | Path, vocab_size: int, *, eos_token: str = "</s>",
                        bos_token: str = "<s>", chat_template: str | None = TINY_CHAT_TEMPLATE):
    """Write a word-level tokenizer of ``vocab_size`` ids into ``directory``; returns the
    ``PreTrainedTokenizerFast``.

    Ids ``0..4`` are :data:`TINY_SPECIAL_TOKENS` (``<unk>``, ``<s>``, ``</s>``, ``<|start|>``, ``<|end|>``);
    id ``i >= 5`` is the word ``w{i}``, so ``"w7 w9"`` encodes to ``[7, 9]`` and decodes back.
    ``chat_template=None`` writes no template.
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size <= len(TINY_SPECIAL_TOKENS):
        raise ValueError(f"save_tiny_tokenizer: vocab_size must exceed {len(TINY_SPECIAL_TOKENS)}, got {vocab_size}")
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(TINY_SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with a space
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token=bos_token,
                                                eos_token=eos_token,
                                                additional_special_tokens=["<|start|>", "<|end|>"])
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return fast
