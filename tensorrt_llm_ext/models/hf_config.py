"""A Hugging Face decoder's ``config.json`` -> the :class:`LlamaTargetConfig` fields that compute it.

One model class serves four Hugging Face families; they differ only in switches (``docs/checkpoints.md``):

==========================  =================================================================================
``LlamaForCausalLM``        ``attention_bias`` (q/k/v/o biases), ``mlp_bias``, RoPE scaling (``llama3``...)
``MistralForCausalLM``      the Llama layout, no biases; a sliding window only if it never binds
``Qwen2ForCausalLM``        q/k/v biases (always), no ``o_proj`` bias; no active sliding window
``Qwen3ForCausalLM``        ``q_norm`` / ``k_norm`` (always), ``attention_bias``, explicit ``head_dim``
==========================  =================================================================================

Every family: SiLU MLP, RMSNorm, GQA, NeoX RoPE over the whole head, optionally tied embeddings; RoPE
``default``, ``linear``, ``llama3`` or ``yarn`` (:class:`~tensorrt_llm_ext.modules.rope.RopeScaling`).
Anything else is refused by name with a ``ValueError`` (the checkpoint reader adds the file): another
architecture, another activation, ``dynamic`` / ``longrope`` / per-layer RoPE, partial rotary, a sliding
window that can bind, an MoE layout.
"""

from __future__ import annotations

import math

from tensorrt_llm_ext.modules.rope import RopeScaling

# architectures entry -> model_type, per supported family
FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3"}


def int_field(cfg: dict, key: str, default=None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} must be an integer, got {v!r}")
    return v


def float_field(cfg: dict, key: str, default=None) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, got {v!r}")
    return float(v)


def bool_field(cfg: dict, key: str, default: bool = False) -> bool:
    """A JSON ``true`` / ``false`` (``null`` or absent: ``default``). Strict: the string ``"false"`` is truthy in
    Python, so a switch given as a string would be taken as on -- refused by name instead."""
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false, got {v!r}")
    return v


def _optional_float(cfg: dict, key: str) -> float | None:
    return None if cfg.get(key) is None else float_field(cfg, key)


def _non_negative(cfg: dict, key: str, default: float) -> float:
    v = float_field(cfg, key, default)
    if v < 0:  # a negative epsilon makes the norm of a small row NaN
        raise ValueError(f"{key} must be >= 0, got {v}")
    return v


def family_of(cfg: dict) -> str:
    """The ``model_type`` of a supported family, or a ValueError naming what arrived."""
    arch = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    known = [FAMILIES[a] for a in arch if a in FAMILIES] if isinstance(arch, list) else []
    if known and (model_type is None or model_type == known[0]):
        return known[0]
    if not arch and model_type in FAMILIES.values():
        return model_type
    raise ValueError(f"architectures={arch} model_type={model_type!r} is not supported (supported: "
                     f"{', '.join(FAMILIES)})")


def _rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` + ``rope_theta``."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if params is not None and not isinstance(params, dict) or scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_parameters / rope_scaling must be objects, got {params!r} / {scaling!r}")
    d = {**(scaling or {}), **(params or {})}
    if any(isinstance(v, dict) for v in d.values()):
        raise ValueError(f"per-layer-type RoPE parameters ({sorted(d)}) are not supported")
    theta = float_field({"rope_theta": d.get("rope_theta", cfg.get("rope_theta", 10000.0))}, "rope_theta")
    if not theta > 0:  # the inverse frequencies theta ** (-2i / d) are NaN below 0
        raise ValueError(f"rope_theta must be > 0, got {theta}")
    partial = d.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported (RoPE over the whole head only)")
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3", "yarn"):
        raise ValueError(f"rope_type={rope_type!r} is not supported (default, linear, llama3, yarn)")
    original = d.get("original_max_position_embeddings",
                     cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")))
    if isinstance(original, float) and original.is_integer():  # 8192.0: the number transformers computes with
        original = int(original)
    if original is not None and rope_type != "linear":  # a string or a list was a TypeError traceback at build
        original = int_field({"original_max_position_embeddings": original}, "original_max_position_embeddings")
    if rope_type == "yarn" and theta == 1.0:  # its correction range divides by log(rope_theta)
        raise ValueError("rope_theta=1.0 is not supported with rope_type='yarn' (its correction range divides by "
                         "log(rope_theta))")
    factor = d.get("factor")
    if factor is None and rope_type == "yarn" and original:  # as transformers: the context extension ratio
        factor = int_field(cfg, "max_position_embeddings") / original
    try:
        return theta, RopeScaling(
            rope_type=rope_type, factor=float_field({"factor": factor}, "factor"),
            original_max_position_embeddings=None if rope_type == "linear" else original,
            low_freq_factor=float_field(d, "low_freq_factor", 1.0),
            high_freq_factor=float_field(d, "high_freq_factor", 4.0),
            beta_fast=float_field({"beta_fast": d.get("beta_fast") or 32.0}, "beta_fast"),
            beta_slow=float_field({"beta_slow": d.get("beta_slow") or 1.0}, "beta_slow"),
            attention_factor=_optional_float(d, "attention_factor"), mscale=_optional_float(d, "mscale"),
            mscale_all_dim=_optional_float(d, "mscale_all_dim"), truncate=bool_field(d, "truncate", True))
    except ValueError as e:
        raise ValueError(f"rope_scaling {d}: {e}") from None


def _check_sliding_window(cfg: dict, family: str) -> None:
    """Sliding-window attention is not computed here: refuse it wherever it can change a result."""
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"layer_types={sorted(set(layer_types))} is not supported (full attention only)")
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        active = bool_field(cfg, "use_sliding_window") and window is not None
    else:  # Mistral applies any window; one at least as long as the model's context never binds
        max_pos = cfg.get("max_position_embeddings")
        active = window is not None and not (isinstance(max_pos, int) and isinstance(window, int) and window >= max_pos)
    if active:
        raise ValueError(f"sliding_window={window!r} (use_sliding_window={cfg.get('use_sliding_window')!r}, "
                         f"max_position_embeddings={cfg.get('max_position_embeddings')!r}) is not supported "
                         "(full attention only)")


def target_fields(cfg: dict) -> dict:
    """``config.json`` (a dict) -> the keyword arguments of :class:`LlamaTargetConfig` (but ``capture_layers``)
    plus ``tie_word_embeddings``; ValueError naming the first field that is malformed or not supported."""
    family = family_of(cfg)
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (SiLU only)")
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise ValueError("mixture-of-experts layers (num_experts) are not supported")
    _check_sliding_window(cfg, family)
    theta, scaling = _rope(cfg)
    heads = int_field(cfg, "num_attention_heads")
    hidden = int_field(cfg, "hidden_size")
    head_dim = cfg.get("head_dim")
    head_dim = int_field({"head_dim": hidden // heads if head_dim is None and heads > 0 else head_dim}, "head_dim")
    attention_bias = bool_field(cfg, "attention_bias") if family in ("llama", "qwen3") else False
    return {
        "vocab_size": int_field(cfg, "vocab_size"),
        "hidden_size": hidden,
        "num_layers": int_field(cfg, "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": int_field(cfg, "num_key_value_heads", heads),
        "head_dim": head_dim,
        "intermediate_size": int_field(cfg, "intermediate_size"),
        "rope_theta": theta,
        "rms_norm_eps": _non_negative(cfg, "rms_norm_eps", 1e-6),
        "qkv_bias": attention_bias or family == "qwen2",
        "o_proj_bias": attention_bias,
        "mlp_bias": bool_field(cfg, "mlp_bias") if family == "llama" else False,
        "qk_norm": family == "qwen3",
        "rope_scaling": scaling,
        "tie_word_embeddings": bool_field(cfg, "tie_word_embeddings"),
    }
