"""A llama.cpp GGUF file (architecture ``llama``) -> a Hugging Face ``LlamaForCausalLM`` directory.

``trtllm-ext import-gguf FILE DIR`` writes what ``serve DIR`` / ``generate --model DIR`` and ``transformers``
read:

* ``config.json``: a plain ``LlamaForCausalLM`` config from the GGUF metadata (``llama.block_count``,
  ``llama.embedding_length``, ``llama.attention.head_count[_kv]``, ``llama.rope.freq_base``, ...), the head
  tied to the embedding when the file has no ``output.weight``; no ``quantization_config``: the weights are
  written dequantized.
* ``model.safetensors``: every tensor dequantized on the host (``gguf.quants.dequantize``: Q4_0, Q4_1, Q8_0,
  K-quants, F16 ...) under Hugging Face names, in ``--dtype`` (float32 keeps the dequantized values exactly).
  llama.cpp stores ``attn_q`` / ``attn_k`` rows interleaved for its RoPE layout; they are put back in the
  Hugging Face (NeoX half-split) order per head.
* the tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the chat template), converted from the
  GGUF vocabulary by ``transformers`` (``AutoTokenizer`` with ``gguf_file=``; the model itself is not loaded
  through ``transformers``, which would need ``accelerate``).
* ``generation_config.json`` with the EOS / BOS ids of the file.

Llama 3.1 - 3.3 files hold their ``llama3`` RoPE as per-frequency divisors (``rope_freqs.weight``): they become
``config.json``'s ``rope_scaling`` when they are Llama 3's (:func:`_llama3_rope_scaling`).

Refused by name (``ValueError``): another architecture, a tensor this mapping does not know (biases), a RoPE
scaling entry or ``rope_freqs`` divisors of another scaling, a shape that disagrees with the metadata.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from tensorrt_llm_ext.logger import logger

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _require_gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("import-gguf needs the `gguf` package (pip install gguf, pinned in "
                          "requirements-cpu.txt)") from None
    return gguf


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF: metadata {key!r} is missing")
        return default
    return field.contents()


def _count(reader, key: str, default=None) -> int:
    """A size of the metadata: one integer >= 1 (a per-layer array, as some converters write head counts, is
    refused by name, as is a zero that would divide)."""
    v = _field(reader, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"GGUF: metadata {key!r} must be one integer >= 1, got {v!r}")
    return int(v)


def _positive(reader, key: str, default: float) -> float:
    v = _field(reader, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not 0 < v < float("inf"):
        raise ValueError(f"GGUF: metadata {key!r} must be one finite number > 0, got {v!r}")
    return float(v)


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ValueError for an unknown name."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    raise ValueError(f"GGUF: tensor {gguf_name!r} has no Hugging Face Llama counterpart here (known: "
                     f"{', '.join(_TOP_NAMES)}, blk.N.{{{', '.join(_LAYER_NAMES)}}}.weight)")


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows ``(pair i, half h)`` -> ``(half h, pair i)``.

    llama.cpp rotates adjacent pairs ``(2i, 2i+1)``; Hugging Face rotates ``(i, i + D/2)``. The converter that
    wrote the file interleaved each head's rows so that both rotate the same values; this is its inverse.
    """
    out_features = w.shape[0]
    if out_features % (2 * num_heads):
        raise ValueError(f"GGUF: {out_features} q/k rows do not split into {num_heads} heads of even size")
    half = out_features // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


ROPE_FREQS = "rope_freqs.weight"
# Llama 3.1 - 3.3's rope_scaling but `factor` (8 or 32): what llama.cpp's converter turns into rope_freqs.weight
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_rope_scaling(reader, head_dim: int, theta: float) -> dict | None:
    """The ``rope_scaling`` of a Llama 3.x GGUF: llama.cpp stores the ``llama3`` RoPE as per-frequency divisors
    (``rope_freqs.weight``); they are matched against :data:`LLAMA3_ROPE` with the largest divisor as ``factor``.
    None without that tensor (or all divisors 1); ValueError for divisors of another scaling."""
    from tensorrt_llm_ext.kernels.rope import rope_inv_freq
    from tensorrt_llm_ext.modules.rope import RopeScaling, scaled_rope_inv_freq

    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if t is None:
        return None
    gguf = _require_gguf()
    divisors = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(-1)
    if divisors.numel() != head_dim // 2 or not bool(torch.isfinite(divisors).all()) or not divisors.min() > 0:
        raise ValueError(f"GGUF: {ROPE_FREQS} must hold {head_dim // 2} finite divisors > 0 (one per RoPE "
                         f"frequency), got {divisors.numel()} values in [{divisors.min():g}, {divisors.max():g}]")
    if bool((divisors == 1).all()):
        return None
    factor = float(divisors.max())
    scaling = {"rope_type": "llama3", "factor": factor, **LLAMA3_ROPE}
    scaled, _ = scaled_rope_inv_freq(head_dim, theta, RopeScaling(**scaling))
    if not torch.allclose(rope_inv_freq(head_dim, theta) / scaled, divisors, rtol=1e-5, atol=0):
        raise ValueError(f"GGUF: {ROPE_FREQS} (scaled RoPE as per-frequency divisors) is not Llama 3's llama3 RoPE "
                         f"(factor {factor:g}, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings "
                         "8192); another RoPE scaling is not supported")
    return scaling


def read_gguf_config(reader) -> dict:
    """The Hugging Face ``LlamaConfig`` dict of a ``llama`` GGUF file (no quantization entry)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF: general.architecture={arch!r} is not supported (llama only)")
    experts = _field(reader, "llama.expert_count", 0)
    if experts:  # Mixtral's GGUF says llama too
        raise ValueError(f"GGUF: llama.expert_count={experts!r}: mixture-of-experts models are not supported (dense "
                         "Llama only)")
    if "llama.rope.scaling.type" in reader.fields and _field(reader, "llama.rope.scaling.type") not in ("none",):
        raise ValueError(f"GGUF: llama.rope.scaling.type={_field(reader, 'llama.rope.scaling.type')!r} is not "
                         "supported (plain RoPE only)")
    hidden = _count(reader, "llama.embedding_length")
    heads = _count(reader, "llama.attention.head_count")
    kv_heads = _count(reader, "llama.attention.head_count_kv", heads)
    head_dim = _count(reader, "llama.rope.dimension_count", hidden // heads)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if "llama.vocab_size" not in reader.fields and not (tokens is not None and len(tokens.data)):
        raise ValueError("GGUF: neither llama.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size")
    vocab = _count(reader, "llama.vocab_size", len(tokens.data) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    theta = _positive(reader, "llama.rope.freq_base", 10000.0)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": _count(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _count(reader, "llama.block_count"),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": _count(reader, "llama.context_length", 2048),
        "rms_norm_eps": _positive(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": theta, "rope_scaling": _llama3_rope_scaling(reader, head_dim, theta),
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
    }
    if "tokenizer.ggml.bos_token_id" in reader.fields:
        cfg["bos_token_id"] = int(_field(reader, "tokenizer.ggml.bos_token_id"))
    # llama.cpp ends generation at the end-of-turn / end-of-message tokens too (a chat model's turn ends there, not
    # at its EOS): all of them are EOS ids of the directory, the file's EOS first.
    ends = [int(_field(reader, f"tokenizer.ggml.{k}_token_id")) for k in ("eos", "eot", "eom")
            if f"tokenizer.ggml.{k}_token_id" in reader.fields]
    ends = list(dict.fromkeys(ends))
    if ends:
        cfg["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    return cfg


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    return shapes


def _dequantizable(gguf, qtype) -> bool:
    """Whether the installed ``gguf`` dequantizes ``qtype`` (tried on one zero block: no table to keep in step)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    except Exception:  # any other complaint about the zero block: the real data decides
        pass
    return True


def check_tensor_types(reader) -> None:
    """Refuse, before any tensor is dequantized, a file holding a type the installed ``gguf`` cannot dequantize
    (``Q8_1``, ``Q8_K``, integer tensors ...): a ValueError naming the tensors and the type."""
    gguf = _require_gguf()
    verdict: dict = {}
    bad = [t for t in reader.tensors
           if not verdict.setdefault(t.tensor_type, _dequantizable(gguf, t.tensor_type))]
    if bad:
        types = sorted({t.tensor_type.name for t in bad})
        raise ValueError(f"GGUF: {len(bad)} tensor(s) of type {', '.join(types)} cannot be dequantized by the "
                         f"installed gguf package (first: {bad[0].name}); re-quantize the model to a supported type "
                         f"(F32, F16, BF16, Q4_0, Q8_0, the K-quants ...)")


def read_gguf_state_dict(reader, cfg: dict, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the file dequantized, under Hugging Face names, q/k rows in Hugging Face order."""
    gguf = _require_gguf()
    check_tensor_types(reader)
    held = {m.group(1) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))}
    if cfg["num_hidden_layers"] > len(held):  # before one expected name per block is listed (10^9: a MemoryError)
        raise ValueError(f"GGUF: metadata 'llama.block_count' is {cfg['num_hidden_layers']}, the file holds "
                         f"{len(held)} block(s)")
    expected = _expected_shapes(cfg)
    # every name is mapped before the first tensor is dequantized: an unknown one (a bias) is refused at once
    names = {t.name: hf_name(t.name) for t in reader.tensors if t.name != ROPE_FREQS}
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # not a weight: read_gguf_config made it the llama3 rope_scaling
            continue
        name = names[t.name]
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        if name not in expected or tuple(w.shape) != expected[name]:
            raise ValueError(f"GGUF: tensor {t.name} ({t.tensor_type.name}) has shape {list(w.shape)}, the metadata "
                             f"implies {list(expected.get(name, ())) or 'no such tensor'}")
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, cfg["num_key_value_heads"])
        out[name] = w.to(dtype)
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ValueError(f"GGUF: tensors missing for the metadata's model: {missing[:6]}")
    return out


class ImportInterrupted(BaseException):
    """SIGTERM or SIGINT during :func:`import_gguf` (a BaseException like ``KeyboardInterrupt``: no error handler
    takes it). The staging directory is gone; ``complete`` is True only when the signal arrived after DIR was in
    place (it is held back during the renames)."""

    def __init__(self, signum: int, complete: bool = False):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum, self.complete = signum, complete


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _stop_signals_raise():
    """SIGTERM / SIGINT raise :class:`ImportInterrupted` inside (SIGTERM's default ends the process at once, past
    every cleanup: a staging directory of tens of GB was left beside DIR); the previous handlers afterwards."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return

    def stop(signum, frame):
        raise ImportInterrupted(signum)

    previous = {s: signal.signal(s, stop) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def import_gguf(gguf_file: str | Path, directory: str | Path, dtype: str = "float32",
                tokenizer: bool = True) -> list[tuple[str, Path]]:
    """Write the Hugging Face directory of a ``llama`` GGUF file; returns ``[(what, path), ...]`` written.
    SIGTERM / SIGINT meanwhile raise :class:`ImportInterrupted`, with nothing left behind."""
    gguf = _require_gguf()
    if dtype not in _DTYPES:
        raise ValueError(f"import-gguf: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise ValueError(f"import-gguf: {gguf_file} not found")
    directory = Path(directory)
    if directory.is_dir():  # before any work; again with the files actually written, before they are moved
        check_no_stale_files(directory, _WRITTEN + (_TOKENIZER_WRITTEN if tokenizer else ()))
    with _stop_signals_raise():
        return _import(gguf, gguf_file, directory, dtype, tokenizer)


def _import(gguf, gguf_file: Path, directory: Path, dtype: str, tokenizer: bool) -> list[tuple[str, Path]]:
    try:
        reader = gguf.GGUFReader(str(gguf_file))
    except Exception as e:  # the reader meets a damaged file with numpy / index / struct errors of its own
        raise ValueError(f"import-gguf: {gguf_file} is not a readable GGUF file ({gguf_file.stat().st_size} bytes, "
                         f"truncated or not GGUF: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                         ) from None
    cfg = read_gguf_config(reader)
    # The tokenizer is converted before the weights: a file whose vocabulary transformers cannot convert is
    # refused at once, not after minutes of dequantization.
    tok = _convert_tokenizer(gguf_file) if tokenizer else None
    sd = read_gguf_state_dict(reader, cfg, _DTYPES[dtype])
    # Everything is written into a temporary directory beside DIR and moved into place once complete: a write
    # that fails (disk full) leaves DIR as it was, never a config.json without its weights.
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.importing-", dir=directory.parent))
    from tensorrt_llm_ext.models.checkpoint import process_umask

    os.chmod(staging, 0o777 & ~process_umask())  # mkdtemp's owner-only mode would become the model directory's
    moved = False
    try:
        written = _write_directory(staging, gguf_file, cfg, sd, dtype, tok)
        if directory.is_dir():
            check_no_stale_files(directory, {f.name for f in staging.iterdir()})
        # The renames run with the stop signals held back: DIR is never left part old, part new.
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            _move_into_place(staging, directory)
            moved = True
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # one held back is raised here
    except BaseException as e:  # an interrupt too: no staging directory is left behind
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, ImportInterrupted):
            e.complete = moved
        if not isinstance(e, Exception) or isinstance(e, (ImportError, ValueError)):
            raise
        raise OSError(f"import-gguf: writing {directory} failed ({type(e).__name__}: {e}); nothing was written "
                      f"there") from None
    return [(what, directory / path.relative_to(staging)) for what, path in written]


def _write_directory(out: Path, gguf_file: Path, cfg: dict, sd: dict[str, torch.Tensor], dtype: str,
                     tokenizer) -> list[tuple[str, Path]]:
    from tensorrt_llm_ext.models.checkpoint import save_safetensors

    cfg["torch_dtype"] = dtype
    written = []
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    written.append(("config", out / "config.json"))
    save_safetensors(sd, out / "model.safetensors", {"format": "pt"})
    written.append(("weights", out / "model.safetensors"))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    written.append(("generation config", out / "generation_config.json"))
    if tokenizer is not None:
        written.extend(_write_tokenizer(tokenizer, gguf_file, out))
    return written


# Files of a model directory that `serve DIR` / `generate --model DIR` read beside the weights: one left from an
# earlier model in DIR, that this import does not write, would be served with the new weights (another tokenizer or
# chat template: wrong text, no error).
SERVED_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json")
# What an import writes (the tokenizer's files as transformers saves them, the chat template if the file has one).
_WRITTEN = ("config.json", "generation_config.json", "model.safetensors")
_TOKENIZER_WRITTEN = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def check_no_stale_files(directory: Path, written) -> None:
    """Refuse to write into a directory holding :data:`SERVED_FILES` that ``written`` (names) would not replace."""
    stale = [name for name in SERVED_FILES if (directory / name).exists() and name not in written]
    if stale:
        raise ValueError(f"import-gguf: {directory} holds {', '.join(stale)} from an earlier model that this import "
                         "would not replace (they would be served with the new weights); remove them or choose an "
                         "empty directory")


def _move_into_place(staging: Path, directory: Path) -> None:
    """``staging`` becomes ``directory`` (one rename when it does not exist or is empty); into an existing
    directory each file is renamed over its old version, and files of other names there stay (none that serving
    reads: :func:`check_no_stale_files`)."""
    if not directory.exists() or (directory.is_dir() and not any(directory.iterdir())):
        os.replace(staging, directory)
        return
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory} exists and is not a directory")
    for f in sorted(staging.iterdir()):
        os.replace(f, directory / f.name)
    staging.rmdir()


def _convert_tokenizer(gguf_file: Path):
    """The GGUF vocabulary as a ``transformers`` tokenizer (its GGUF tokenizer conversion); ValueError naming the
    file and ``--no-tokenizer`` when it cannot be converted (no tokenizer metadata, a tokenizer model it lacks)."""
    from transformers import AutoTokenizer

    try:
        # transformers resolves gguf_file relative to a directory; a copy is avoided by pointing at the parent.
        return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as e:  # transformers raises ValueError, KeyError, ... per converter
        words = " ".join(str(e).split())[:300]
        raise ValueError(f"import-gguf: {gguf_file}: transformers cannot convert its tokenizer ({type(e).__name__}: "
                         f"{words}); --no-tokenizer imports the weights alone") from None


def _write_tokenizer(tok, gguf_file: Path, directory: Path) -> list[tuple[str, Path]]:
    """The converted tokenizer's files (:func:`_convert_tokenizer`) in ``directory``."""
    files = tok.save_pretrained(str(directory))
    if not getattr(tok, "chat_template", None):
        logger.info(f"import-gguf: {gguf_file.name} has no chat template; chat requests will be refused")
    # transformers may write its own generation hints next to ours; ours (from the GGUF ids) stay.
    return [("tokenizer", Path(f)) for f in files if Path(f).name in ("tokenizer.json", "tokenizer_config.json",
                                                                          "chat_template.jinja",
                                                                          "special_tokens_map.json")]
