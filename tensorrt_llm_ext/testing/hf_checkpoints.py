"""Tiny Hugging Face checkpoints written by ``transformers`` itself, for tests that load real directories.

Test support only (``transformers`` and ``tokenizers`` are test dependencies): production code never
imports this module.

* :func:`save_tiny_tokenizer` -- a word-level fast tokenizer (``w3 w17 ...`` <-> ids) with special
  tokens and a chat template, saved with ``save_pretrained`` (``tokenizer.json``, ``tokenizer_config.json``,
  ``chat_template.jinja``).
* :func:`save_tiny_hf_checkpoint` -- a random ``*ForCausalLM`` of one supported family (:data:`TINY_FAMILIES`:
  Llama 3 with ``llama3`` RoPE, Llama with biases and ``linear`` / ``yarn`` RoPE, Mistral, Qwen2, Qwen3),
  optionally with that tokenizer and EOS ids; :func:`save_tiny_llama3_checkpoint` and
  :func:`save_tiny_qwen3_checkpoint` are the two a server test serves with chat. The weights depend on
  ``seed`` and the family only: decode once, then write the same seed again with an ``eos_token_id`` that
  the greedy decode reaches.
* :func:`load_target` and :func:`greedy_decode` -- this project's :class:`LlamaTarget` from such a directory
  and its greedy tokens (prefill, then one token per step through the KV cache); :func:`hf_greedy_decode`
  is the ``transformers`` reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.models.checkpoint import load_llama_state_dict, read_target_config
from tensorrt_llm_ext.models.llama_target import LlamaTarget

# A Llama-3-like template over the tiny tokenizer's special tokens; `add_generation_prompt` opens the
# assistant turn as a real template does.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|> {{ m['role'] }} {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|start|> assistant {% endif %}"
)
# Ids 0..4 of every tiny tokenizer (special), 5..7 the chat roles; the rest of the vocabulary is `w{id}`.
TINY_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|start|>", "<|end|>")
TINY_ROLE_WORDS = ("system", "user", "assistant")


def save_tiny_tokenizer(directory: str | Path, vocab_size: int, *, eos_token: str = "</s>",
                        bos_token: str = "<s>", chat_template: str | None = TINY_CHAT_TEMPLATE):
    """Write a word-level tokenizer of ``vocab_size`` ids into ``directory``; returns the
    ``PreTrainedTokenizerFast``.

    Ids ``0..4`` are :data:`TINY_SPECIAL_TOKENS` (``<unk>``, ``<s>``, ``</s>``, ``<|start|>``, ``<|end|>``),
    ``5..7`` the role words ``system``, ``user``, ``assistant``; id ``i >= 8`` is the word ``w{i}``, so
    ``"w9 w300"`` encodes to ``[9, 300]`` and decodes back. ``chat_template=None`` writes no template; with
    :data:`TINY_CHAT_TEMPLATE` a user turn ``"w9"`` plus the generation prompt is ``[1, 3, 6, 9, 4, 3, 7]``.
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    fixed = TINY_SPECIAL_TOKENS + TINY_ROLE_WORDS
    if vocab_size <= len(fixed):
        raise ValueError(f"save_tiny_tokenizer: vocab_size must exceed {len(fixed)}, got {vocab_size}")
    vocab = {tok: i for i, tok in enumerate(fixed)}
    vocab.update({f"w{i}": i for i in range(len(fixed), vocab_size)})
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


# Sizes shared by the tiny checkpoints: odd vocabulary, hidden 64, 2 layers, GQA 4/2 (TP 2 splits them).
TINY_HF_SIZES = dict(vocab_size=509, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                     rms_norm_eps=1e-5)
# family -> (transformers config class name, config overrides). RoPE contexts are short (32) so that the
# scaling changes the frequencies a 40-token test reaches.
TINY_FAMILIES: dict[str, tuple[str, dict]] = {
    "llama3": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=50000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama_linear_biases": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "llama_yarn": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32))),
    "mistral": ("MistralConfig", dict(sliding_window=None, rope_parameters=dict(rope_type="default",
                                                                                rope_theta=1e6))),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=24)),  # explicit head_dim: q_proj is 96 wide, hidden 64
}


def _randomize(model, seed: int) -> None:
    """Larger than transformers' 0.02 init, so logits are spread and greedy ties are unlikely."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            else:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def save_tiny_hf_checkpoint(directory: str | Path, family: str, *, seed: int = 0, tokenizer: bool = False,
                            chat_template: str | None = TINY_CHAT_TEMPLATE, eos_token_id: int | list[int] | None = None,
                            **overrides):
    """Write a random fp32 ``family`` checkpoint (:data:`TINY_FAMILIES`) with ``save_pretrained``; returns the
    ``transformers`` model (eval mode), the reference of the equality tests.

    ``tokenizer=True`` adds :func:`save_tiny_tokenizer` (with ``chat_template``); ``eos_token_id`` goes into
    ``config.json`` and ``generation_config.json`` (transformers' ``generate`` then stops there);
    ``overrides`` are config fields (``max_position_embeddings=256``, ...).

    Example::

        hf = save_tiny_hf_checkpoint(tmp_path / "q3", "qwen3", tokenizer=True, eos_token_id=2)
    """
    import transformers

    if family not in TINY_FAMILIES:
        raise ValueError(f"save_tiny_hf_checkpoint: family must be one of {sorted(TINY_FAMILIES)}, got {family!r}")
    config_class, family_overrides = TINY_FAMILIES[family]
    fields = {**TINY_HF_SIZES, **family_overrides, **overrides}
    fields.setdefault("bos_token_id", 1 if tokenizer else None)
    config = getattr(transformers, config_class)(**fields, eos_token_id=eos_token_id)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    _randomize(model, seed)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.bos_token_id = fields["bos_token_id"]
    model.save_pretrained(str(directory))
    if tokenizer:
        save_tiny_tokenizer(directory, fields["vocab_size"], chat_template=chat_template)
    return model


def save_tiny_llama3_checkpoint(directory: str | Path, **kwargs):
    """A Llama-3-style tiny checkpoint (``llama3`` RoPE) with the chat tokenizer; EOS ``</s>`` (id 2) by default."""
    return save_tiny_hf_checkpoint(directory, "llama3", **{"tokenizer": True, "eos_token_id": 2, **kwargs})


def save_tiny_qwen3_checkpoint(directory: str | Path, **kwargs):
    """A Qwen3-style tiny checkpoint (q/k norms, explicit head_dim) with the chat tokenizer; EOS id 2 by default."""
    return save_tiny_hf_checkpoint(directory, "qwen3", **{"tokenizer": True, "eos_token_id": 2, **kwargs})


def load_target(directory: str | Path, mapping: Mapping | None = None, dtype: torch.dtype = torch.float32,
                device=None) -> LlamaTarget:
    """This project's target for a Hugging Face directory: its config (family switches included) and its
    rank's slices of the weights."""
    cfg, tie = read_target_config(directory)
    model = LlamaTarget(cfg, mapping, dtype=dtype, device=device)
    model.load_full_state_dict(load_llama_state_dict(directory, cfg, tie))
    return model


def target_logits(model: LlamaTarget, ids: list[int]) -> torch.Tensor:
    """Full-vocabulary logits ``[len(ids), V]`` of one prefill of ``ids`` (slot 0, positions from 0)."""
    cache = model.make_kv_cache(1, len(ids) + 1)
    dev = model.norm.weight.device
    out = model(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None],
                torch.zeros(1, dtype=torch.int32, device=dev), cache)
    return model.logits(out.hidden_states)


@torch.no_grad()
def greedy_decode(model: LlamaTarget, prompt: list[int], num_tokens: int) -> list[int]:
    """``num_tokens`` greedy tokens: one prefill of ``prompt``, then one ``[1, 1]`` step per token (KV cache)."""
    dev = model.norm.weight.device
    cache = model.make_kv_cache(1, len(prompt) + num_tokens + 1)
    slot = torch.zeros(1, dtype=torch.int32, device=dev)
    ids, pos, out = torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev)[None], []
    for _ in range(num_tokens):
        hidden = model(ids, pos, slot, cache).hidden_states
        token = int(model.logits(hidden[-1:]).argmax(-1))
        out.append(token)
        ids, pos = torch.tensor([[token]], device=dev), pos[:, -1:] + 1
    return out


@torch.no_grad()
def hf_greedy_decode(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    """``transformers``' greedy ``generate`` of exactly ``num_tokens`` tokens (EOS ignored)."""
    out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=num_tokens,
                            min_new_tokens=num_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
