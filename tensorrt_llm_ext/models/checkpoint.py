"""Checkpoints on disk: a Hugging Face Llama target directory and a DSpark drafter directory.

**Target** (any Hugging Face ``LlamaForCausalLM`` directory): ``config.json`` plus ``model.safetensors`` or a
sharded ``model.safetensors.index.json``, tensors under Hugging Face names (``model.layers.0.self_attn.q_proj
.weight``, ``lm_head.weight``; a tied head reads ``model.embed_tokens.weight``). What
:class:`~tensorrt_llm_ext.models.llama_target.LlamaTarget` computes is checked against the config before
any weight is read, and what it does not support is refused by name: another architecture, an activation
other than SiLU, RoPE scaling (``rope_scaling`` / a non-default ``rope_parameters.rope_type``), attention or
MLP biases. GQA (``num_key_value_heads``), an explicit ``head_dim``, ``rms_norm_eps``, ``rope_theta`` and
``tie_word_embeddings`` are honoured.

**Drafter** (this project's format, written by ``trtllm-ext export``): ``config.json`` with
``"architectures": ["DSparkDrafter"]``, ``"format_version": 1`` and the sizes --
``hidden_size`` (= the target's), ``vocab_size``, ``num_hidden_layers``, ``num_attention_heads``,
``head_dim``, ``latent_dim``, ``intermediate_size``, ``markov_rank``, ``mask_token_id``,
``target_layer_ids`` (the target layers whose outputs feed it), ``rms_norm_eps``, ``rope_theta`` -- and
``model.safetensors`` with the names of :func:`~tensorrt_llm_ext.models.dspark_drafter.full_weight_shapes`
(``fc.weight``, ``kv_a_proj.weight``, ``layers.{i}.self_attn.k_up_proj.weight``, ``markov_w1``, ...).

**Facts** (:func:`read_checkpoint_facts`): what serving needs besides the weights -- the served name, EOS and
BOS ids (``config.json``, ``generation_config.json``, the tokenizer), ``max_position_embeddings``, the
``torch_dtype`` and whether a tokenizer and a chat template are there.

Every failure is a :class:`CheckpointError` naming the file and what is wrong (missing, not JSON, not a
safetensors file, a missing or mis-shaped tensor).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tensorrt_llm_ext.logger import logger

from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafterConfig
from tensorrt_llm_ext.models.dspark_drafter import full_weight_shapes as drafter_weight_shapes
from tensorrt_llm_ext.models.llama_target import LlamaTargetConfig
from tensorrt_llm_ext.models.llama_target import full_weight_shapes as target_weight_shapes

DRAFTER_ARCHITECTURE = "DSparkDrafter"
DRAFTER_FORMAT_VERSION = 1
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# config.json's `torch_dtype` / `dtype` spellings (transformers writes the torch names; older tools the short ones)
_DTYPE_FROM_NAME = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
                    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
                    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and the reason."""


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"checkpoint: {path} not found")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _int(cfg: dict, key: str, path: Path, default=None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise CheckpointError(f"checkpoint: {path}: {key} must be an integer, got {v!r}")
    return v


def _float(cfg: dict, key: str, path: Path, default=None) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise CheckpointError(f"checkpoint: {path}: {key} must be a number, got {v!r}")
    return float(v)


def default_target_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high layers (the EAGLE-3 choice) for a target without a drafter checkpoint."""
    if num_layers <= 3:
        return list(range(num_layers))
    return sorted({1, num_layers // 2 - 1, num_layers - 4} & set(range(num_layers))) or [num_layers - 1]


# -- facts: what serving needs from a checkpoint besides its weights --------------------------------------
@dataclass(frozen=True)
class CheckpointFacts:
    """What a Hugging Face checkpoint directory says about serving it (read by :func:`read_checkpoint_facts`).

    The embedded default model (no directory) has no facts: no EOS, its own maximum length.
    """

    model_name: str  # default served model name: the directory's name
    eos_token_ids: tuple[int, ...]  # config.json, generation_config.json, then the tokenizer's; () if none
    bos_token_id: int | None
    max_position_embeddings: int | None
    torch_dtype: torch.dtype | None  # config.json `torch_dtype` (transformers >= 5: `dtype`)
    has_tokenizer: bool
    has_chat_template: bool


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _token_ids(value, key: str, path: Path) -> tuple[int, ...]:
    """``eos_token_id`` / ``bos_token_id``: ``null``, an int or a list of ints (each >= 0)."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise CheckpointError(f"checkpoint: {path}: {key} must be a token id >= 0 or a list of them, got {value!r}")
    return tuple(values)


def _token_content(token) -> str | None:
    """A tokenizer_config.json special token: a string or an ``AddedToken`` dict ``{"content": ...}``."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _tokenizer_token_id(directory: Path, which: str) -> int | None:
    """The id of the tokenizer's ``eos_token`` / ``bos_token`` (``which``), looked up in
    ``tokenizer_config.json``'s ``added_tokens_decoder``, then ``tokenizer.json``'s added tokens and vocabulary."""
    config_path = directory / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    tok_cfg = _read_json(config_path)
    content = _token_content(tok_cfg.get(which))
    if content is None:
        return None
    decoder = tok_cfg.get("added_tokens_decoder")
    for key, entry in (decoder.items() if isinstance(decoder, dict) else ()):
        if _token_content(entry) == content and str(key).isdigit():
            return int(key)
    tok_path = directory / "tokenizer.json"
    if tok_path.is_file():
        tok = _read_json(tok_path)
        for entry in tok.get("added_tokens") or ():
            if isinstance(entry, dict) and entry.get("content") == content and isinstance(entry.get("id"), int):
                return entry["id"]
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, dict) and isinstance(vocab.get(content), int):
            return vocab[content]
        if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the index
            for i, entry in enumerate(vocab):
                if isinstance(entry, list) and entry and entry[0] == content:
                    return i
    logger.warning(f"checkpoint: {config_path}: {which}={content!r} has no id in the tokenizer files; "
                   f"the tokenizer's {which} is not used")
    return None


def _has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    config_path = directory / "tokenizer_config.json"
    return config_path.is_file() and bool(_read_json(config_path).get("chat_template"))


def read_checkpoint_facts(directory: str | Path) -> CheckpointFacts:
    """The serving facts of a Hugging Face checkpoint directory (its weights are not read).

    EOS ids are collected in order from ``config.json``, ``generation_config.json`` (either an int or a
    list) and the tokenizer's ``eos_token``, without repeats; ``bos_token_id`` is the first of the same
    three that sets one. Raises :class:`CheckpointError` (one line naming the file) for a missing directory
    or ``config.json``, a file that is not a JSON object, or a malformed id, length or dtype.

    Example::

        facts = read_checkpoint_facts("/models/Llama-3.2-1B-Instruct")
        facts.model_name, facts.eos_token_ids  # ('Llama-3.2-1B-Instruct', (128001, 128008, 128009))
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint: model directory {directory} not found")
    config_path = directory / "config.json"
    cfg = _read_json(config_path)
    gen_path = directory / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}

    eos: list[int] = []
    bos: int | None = None
    for source, path in ((cfg, config_path), (gen, gen_path)):
        eos.extend(_token_ids(source.get("eos_token_id"), "eos_token_id", path))
        ids = _token_ids(source.get("bos_token_id"), "bos_token_id", path)
        if bos is None and ids:
            bos = ids[0]
    tok_eos = _tokenizer_token_id(directory, "eos_token")
    if tok_eos is not None:
        eos.append(tok_eos)
    if bos is None:
        bos = _tokenizer_token_id(directory, "bos_token")

    max_pos = cfg.get("max_position_embeddings")
    if max_pos is not None and (isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos < 1):
        raise CheckpointError(f"checkpoint: {config_path}: max_position_embeddings must be an integer >= 1, "
                              f"got {max_pos!r}")
    dtype_name = cfg.get("torch_dtype", cfg.get("dtype"))
    if dtype_name is not None and dtype_name not in _DTYPE_FROM_NAME:
        raise CheckpointError(f"checkpoint: {config_path}: torch_dtype={dtype_name!r} is not a float dtype this "
                              f"loader reads (float32, float16 or bfloat16)")
    return CheckpointFacts(
        model_name=Path(os.path.abspath(directory)).name,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=bos,
        max_position_embeddings=max_pos,
        torch_dtype=None if dtype_name is None else _DTYPE_FROM_NAME[dtype_name],
        has_tokenizer=any((directory / name).is_file() for name in _TOKENIZER_FILES),
        has_chat_template=_has_chat_template(directory),
    )


# -- target: Hugging Face Llama ---------------------------------------------------------------------------
def read_llama_config(directory: str | Path) -> dict:
    """``DIR/config.json`` of a Hugging Face Llama -> the fields of ``model.target`` (plain dict)."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise CheckpointError(f"checkpoint: model directory {directory} not found")
    cfg = _read_json(path)
    arch = cfg.get("architectures") or []
    if "LlamaForCausalLM" not in arch and cfg.get("model_type") != "llama":
        raise CheckpointError(f"checkpoint: {path}: only Llama-architecture targets (LlamaForCausalLM) are "
                              f"supported, got architectures={arch} model_type={cfg.get('model_type')!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"checkpoint: {path}: hidden_act={cfg['hidden_act']!r} is not supported (SiLU only)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise CheckpointError(f"checkpoint: {path}: {key}=true is not supported (bias-free projections only)")
    rope_theta = cfg.get("rope_theta")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):  # transformers >= 5 writes RoPE settings here
        if params.get("rope_type", "default") != "default":
            raise CheckpointError(f"checkpoint: {path}: rope_parameters.rope_type={params['rope_type']!r} is not "
                                  "supported (plain RoPE only)")
        rope_theta = params.get("rope_theta", rope_theta)
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise CheckpointError(f"checkpoint: {path}: rope_scaling={scaling!r} is not supported (plain RoPE only)")
    heads = _int(cfg, "num_attention_heads", path)
    hidden = _int(cfg, "hidden_size", path)
    head_dim = cfg.get("head_dim") or hidden // heads
    num_layers = _int(cfg, "num_hidden_layers", path)
    return {
        "vocab_size": _int(cfg, "vocab_size", path),
        "hidden_size": hidden,
        "num_layers": num_layers,
        "num_heads": heads,
        "num_kv_heads": _int(cfg, "num_key_value_heads", path, heads),
        "head_dim": _int({"head_dim": head_dim}, "head_dim", path),
        "intermediate_size": _int(cfg, "intermediate_size", path),
        "capture_layers": default_target_layer_ids(num_layers),
        "rope_theta": _float({"rope_theta": 10000.0 if rope_theta is None else rope_theta}, "rope_theta", path),
        "rms_norm_eps": _float(cfg, "rms_norm_eps", path, 1e-6),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def _safetensors_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"checkpoint: {index} has no weight_map")
        return [directory / name for name in sorted(set(weight_map.values()))]
    raise CheckpointError(f"checkpoint: {directory} has neither model.safetensors nor model.safetensors.index.json")


def _load_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"checkpoint: {f} not found")
        try:
            out.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error type (or OSError) on a corrupt file
            raise CheckpointError(f"checkpoint: {f} is not a readable safetensors file ({e})") from None
    return out


def _check_shapes(owner: str, where: Path, expected: dict[str, tuple[int, ...]], sd: dict[str, torch.Tensor],
                  rename=lambda n: n) -> None:
    missing = [rename(n) for n in expected if n not in sd]
    if missing:
        raise CheckpointError(f"checkpoint: {where}: {owner} tensors missing: {missing[:6]}"
                              f"{' ...' if len(missing) > 6 else ''}")
    for name, shape in expected.items():
        if tuple(sd[name].shape) != tuple(shape):
            raise CheckpointError(f"checkpoint: {where}: {rename(name)} has shape {list(sd[name].shape)}, "
                                  f"the config implies {list(shape)}")


def _hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def load_llama_state_dict(directory: str | Path, cfg: LlamaTargetConfig,
                          tie_word_embeddings: bool | None = None) -> dict[str, torch.Tensor]:
    """The FULL target state dict (this project's names) from a Hugging Face Llama directory."""
    directory = Path(directory)
    if tie_word_embeddings is None:
        tie_word_embeddings = read_llama_config(directory)["tie_word_embeddings"]
    raw = _load_safetensors(_safetensors_files(directory))
    sd = {}
    for name in target_weight_shapes(cfg):
        hf = _hf_name(name)
        if hf in raw:
            sd[name] = raw[hf]
    if "lm_head.weight" not in sd and tie_word_embeddings and "embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    _check_shapes("target", directory, target_weight_shapes(cfg), sd, _hf_name)
    return sd


def hf_llama_config(cfg: LlamaTargetConfig, dtype: torch.dtype, max_position_embeddings: int) -> dict:
    """A Hugging Face ``LlamaConfig`` dict for this target (transformers reads it as ``LlamaForCausalLM``)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": _DTYPE_NAMES[dtype],
    }


def _save_safetensors(sd: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    # safetensors refuses tensors that share storage (a tied head); each entry is written as its own copy.
    save_file({k: v.detach().contiguous().clone() for k, v in sd.items()}, str(path), metadata=metadata)


def save_llama_checkpoint(directory: str | Path, cfg: LlamaTargetConfig, state_dict: dict[str, torch.Tensor],
                          max_position_embeddings: int) -> None:
    """Write ``config.json`` + ``model.safetensors`` under Hugging Face names."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(state_dict.values())).dtype
    (directory / "config.json").write_text(json.dumps(hf_llama_config(cfg, dtype, max_position_embeddings),
                                                      indent=2) + "\n")
    _save_safetensors({_hf_name(k): v for k, v in state_dict.items()}, directory / "model.safetensors",
                      {"format": "pt"})


# -- drafter: this project's directory format ----------------------------------------------------------------
def read_drafter_config(directory: str | Path) -> dict:
    """``DIR/config.json`` of a DSpark drafter -> ``{"drafter": model.drafter fields, "markov_rank",
    "mask_token_id", "target_layer_ids", "hidden_size", "vocab_size"}``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint: drafter directory {directory} not found")
    path = directory / "config.json"
    cfg = _read_json(path)
    if DRAFTER_ARCHITECTURE not in (cfg.get("architectures") or []):
        raise CheckpointError(f"checkpoint: {path}: not a DSpark drafter (architectures must contain "
                              f"{DRAFTER_ARCHITECTURE!r}, got {cfg.get('architectures')})")
    if cfg.get("format_version") != DRAFTER_FORMAT_VERSION:
        raise CheckpointError(f"checkpoint: {path}: format_version {cfg.get('format_version')!r} is not "
                              f"{DRAFTER_FORMAT_VERSION}")
    layers = cfg.get("target_layer_ids")
    if not isinstance(layers, list) or not layers or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
        raise CheckpointError(f"checkpoint: {path}: target_layer_ids must be a non-empty list of ints, got {layers!r}")
    return {
        "drafter": {"num_layers": _int(cfg, "num_hidden_layers", path), "num_heads": _int(cfg, "num_attention_heads", path),
                    "head_dim": _int(cfg, "head_dim", path), "latent_dim": _int(cfg, "latent_dim", path),
                    "intermediate_size": _int(cfg, "intermediate_size", path)},
        "markov_rank": _int(cfg, "markov_rank", path),
        "mask_token_id": _int(cfg, "mask_token_id", path),
        "target_layer_ids": layers,
        "hidden_size": _int(cfg, "hidden_size", path),
        "vocab_size": _int(cfg, "vocab_size", path),
    }


def load_drafter_state_dict(directory: str | Path, cfg: DSparkDrafterConfig) -> dict[str, torch.Tensor]:
    directory = Path(directory)
    sd = _load_safetensors([directory / "model.safetensors"])
    _check_shapes("drafter", directory, drafter_weight_shapes(cfg), sd)
    return {k: sd[k] for k in drafter_weight_shapes(cfg)}


def save_drafter_checkpoint(directory: str | Path, cfg: DSparkDrafterConfig, target_layer_ids: list[int],
                            state_dict: dict[str, torch.Tensor]) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(state_dict.values())).dtype
    meta = {
        "architectures": [DRAFTER_ARCHITECTURE], "model_type": "dspark_drafter",
        "format_version": DRAFTER_FORMAT_VERSION,
        "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "head_dim": cfg.head_dim, "latent_dim": cfg.latent_dim,
        "intermediate_size": cfg.intermediate_size, "markov_rank": cfg.markov_rank,
        "mask_token_id": cfg.mask_token_id, "target_layer_ids": list(target_layer_ids),
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "torch_dtype": _DTYPE_NAMES[dtype],
    }
    (directory / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    _save_safetensors(state_dict, directory / "model.safetensors", {"format": "pt"})
