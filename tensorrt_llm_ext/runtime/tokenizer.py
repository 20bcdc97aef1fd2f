"""The tokenizer a model is served and generated with: a checkpoint directory's (``transformers``), or the one
built in code for the embedded model; and the check that a tokenizer fits the model's vocabulary.

Apart from the server so that ``generate`` (text prompts) needs no HTTP stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorrt_llm_ext.logger import info_once, logger

if TYPE_CHECKING:
    from tensorrt_llm_ext.runtime.config import RuntimeConfig

__all__ = ["load_tokenizer", "resolve_tokenizer", "tokenizer_vocab_error"]


def tokenizer_vocab_error(tokenizer, vocab_size: int) -> str | None:
    """One line when ``tokenizer`` has ids the model's vocabulary lacks (a mismatched pair: text mapping to
    them could never be served), else None."""
    vocab = tokenizer.get_vocab()  # added tokens included
    top = max(vocab.values(), default=-1)
    if top < vocab_size:
        return None
    name = next(t for t, i in vocab.items() if i == top)
    over = sum(1 for i in vocab.values() if i >= vocab_size)
    return (f"the tokenizer has {over} token(s) outside the model's vocabulary of {vocab_size} ids (the highest: "
            f"{name!r}, id {top}); serve the tokenizer that belongs to the model")



def load_tokenizer(directory: str | None):
    """A transformers tokenizer from ``directory`` when it has one (``tokenizer.json`` or
    ``tokenizer_config.json``), else None (token-id prompts only)."""
    from pathlib import Path

    if directory is None or not any((Path(directory) / f).is_file()
                                    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        logger.warning(f"serve: {directory} has a tokenizer but transformers is not installed: token-id prompts only")
        return None
    return AutoTokenizer.from_pretrained(directory)


def resolve_tokenizer(cfg: RuntimeConfig, directory: str | None = None):
    """The tokenizer ``serve`` / ``generate`` use: ``directory`` (``--tokenizer``), else the config's
    ``tokenizer``, else the model directory's; for the embedded seeded model, the tokenizer built in code for
    its vocabulary (:mod:`tensorrt_llm_ext.configs.embedded_tokenizer`: byte-level, ChatML template). None
    (token-id prompts only) when there is none; every choice is logged once."""
    directory = directory or cfg.tokenizer or cfg.model.path
    if directory is not None:
        tok = load_tokenizer(directory)
        info_once(f"tokenizer: {directory}" if tok is not None else f"tokenizer: none in {directory} (token-id "
                  f"prompts only)", key="tokenizer")
        return tok
    if cfg.model.target_weights is not None:
        info_once("tokenizer: none (model.target_weights has no tokenizer: token-id prompts only; --tokenizer DIR "
                  "sets one)", key="tokenizer")
        return None
    from tensorrt_llm_ext.configs.embedded_tokenizer import build_embedded_tokenizer

    vocab = cfg.model.target.vocab_size
    try:
        tok = build_embedded_tokenizer(vocab)
    except (ImportError, ValueError) as e:
        info_once(f"tokenizer: none for the embedded model ({e}): token-id prompts only", key="tokenizer")
        return None
    info_once(f"tokenizer: the embedded model's byte-level tokenizer ({vocab} ids, ChatML chat template; the seeded "
              f"model writes noise, and it has no EOS: requests end at max_tokens or a stop)", key="tokenizer")
    return tok
