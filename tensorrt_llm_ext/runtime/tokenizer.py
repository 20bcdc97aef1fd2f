"""The tokenizer a model is served and generated with: a checkpoint directory's (``transformers``), or the one
built in code for the embedded model; and the check that a tokenizer fits the model's vocabulary.

Apart from the server so that ``generate`` (text prompts) needs no HTTP stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorrt_llm_ext.logger import info_once, logger
from tensorrt_llm_ext.models.checkpoint import CheckpointError

if TYPE_CHECKING:
    from tensorrt_llm_ext.runtime.config import RuntimeConfig

__all__ = ["TokenizerError", "byte_table", "load_tokenizer", "resolve_tokenizer", "tokenizer_vocab_error"]


class TokenizerError(CheckpointError):
    """A tokenizer directory whose files ``transformers`` cannot load (one line; the CLI exits 2 as for any other
    refused checkpoint file)."""


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



def _bytes_to_unicode() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's map): character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, moved = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + moved)] = b
            moved += 1
    return chars


_BYTE_TABLES: dict[int, tuple[object, list[bytes] | None]] = {}  # id(tokenizer) -> (tokenizer, its table)
BYTE_TABLE_CHECKS = 24  # random sequences a table is checked on against the tokenizer's own decode


def byte_table(tok) -> list[bytes] | None:
    """For a byte-level BPE ``transformers`` fast tokenizer (GPT-2's decoder: SmolLM2, Llama 3, Qwen, the embedded
    model's), the bytes each id decodes to with ``skip_special_tokens=True`` (``b""`` for a skipped special token),
    so that ``table`` joined over a prefix of the output, decoded as UTF-8 with ``errors="replace"``, is
    ``tok.decode(prefix, skip_special_tokens=True)`` -- without decoding the whole output again per token. None
    for any other tokenizer (the caller decodes), and when the table disagrees with ``tok.decode`` on a few random
    sequences (specials and byte tokens included). Built once per tokenizer object.

    >>> table = byte_table(tok)
    >>> b"".join(table[t] for t in ids).decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=True)
    True
    """
    hit = _BYTE_TABLES.get(id(tok))
    if hit is not None and hit[0] is tok:
        return hit[1]
    table = _build_byte_table(tok)
    _BYTE_TABLES[id(tok)] = (tok, table)
    return table


def _build_byte_table(tok) -> list[bytes] | None:
    import random

    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:
        return None
    # Only the tokenizer objects themselves (a wrapper may decode differently), whose decode is the backend's
    # byte-level decoder and no text clean-up afterwards.
    backend = getattr(tok, "backend_tokenizer", None) if isinstance(tok, PreTrainedTokenizerBase) else None
    if backend is None or type(backend.decoder).__name__ != "ByteLevel" or tok.clean_up_tokenization_spaces:
        return None
    chars = _bytes_to_unicode()
    added = backend.get_added_tokens_decoder()
    table = []
    for i, piece in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))):
        if i in added and added[i].special:
            table.append(b"")
        elif piece is None:
            return None
        elif all(c in chars for c in piece):
            table.append(bytes(chars[c] for c in piece))
        else:  # the decoder keeps a piece it cannot map (an added token's text) as its UTF-8
            table.append(piece.encode("utf-8"))
    rng = random.Random(0)
    extra = sorted(added)
    for _ in range(BYTE_TABLE_CHECKS):
        ids = [rng.randrange(len(table)) for _ in range(rng.randint(1, 24))] + rng.sample(extra, min(2, len(extra)))
        rng.shuffle(ids)
        if b"".join(table[t] for t in ids).decode("utf-8", "replace") != tok.decode(ids, skip_special_tokens=True):
            logger.info("tokenizer: its decode is not plain byte-level BPE; outputs are decoded token by token")
            return None
    return table


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # any one: a tokenizer is there


def has_tokenizer_files(directory: str) -> bool:
    from pathlib import Path

    return any((Path(directory) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(directory: str | None):
    """A transformers tokenizer from ``directory`` when it has one (``tokenizer.json`` or
    ``tokenizer_config.json``), else None (token-id prompts only)."""
    if directory is None or not has_tokenizer_files(directory):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        logger.warning(f"serve: {directory} has a tokenizer but transformers is not installed: token-id prompts only")
        return None
    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # transformers / tokenizers raise KeyError, JSON, OSError, bare Exception ...
        words = " ".join(str(e).split())
        raise TokenizerError(f"tokenizer: {directory}: transformers cannot load it ({type(e).__name__}: "
                             f"{words[:300]}{' ...' if len(words) > 300 else ''})") from None


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
