"""Checkpoints on disk: a Hugging Face decoder target directory and a DSpark drafter directory.

**Target** (a Hugging Face ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` or
``Qwen3ForCausalLM`` directory): ``config.json`` plus ``model.safetensors`` or a sharded
``model.safetensors.index.json``, tensors under Hugging Face names (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``; a tied head reads ``model.embed_tokens.weight``). :mod:`~tensorrt_llm_ext.models.hf_config`
turns ``config.json`` into the :class:`~tensorrt_llm_ext.models.llama_target.LlamaTargetConfig` that computes
it and refuses by name what no switch covers; ``docs/checkpoints.md`` lists both.

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

Every failure is a :class:`CheckpointError`, one line naming the file and what is wrong: missing, not JSON,
not a readable safetensors file (truncated, empty, offsets past the end), a missing or mis-shaped tensor, a
non-float dtype -- all from the headers, when the config is read, before any work -- or a NaN / inf weight
(one ``isfinite`` pass per tensor at load).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tensorrt_llm_ext.contract import BuildRefusal
from tensorrt_llm_ext.logger import info_once, logger

from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafterConfig
from tensorrt_llm_ext.models.dspark_drafter import full_weight_shapes as drafter_weight_shapes
from tensorrt_llm_ext.models.hf_config import int_field, target_fields
from tensorrt_llm_ext.models.llama_target import LlamaTargetConfig
from tensorrt_llm_ext.models.llama_target import full_weight_shapes as target_weight_shapes

DRAFTER_ARCHITECTURE = "DSparkDrafter"
DRAFTER_FORMAT_VERSION = 1
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# config.json's `torch_dtype` / `dtype` spellings (transformers writes the torch names; older tools the short ones)
_DTYPE_FROM_NAME = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
                    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
                    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class CheckpointError(BuildRefusal):
    """A checkpoint directory that cannot be loaded; the message names the file and the reason."""


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"checkpoint: {path} not found")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint: {path} is not valid JSON ({e})") from None
    except RecursionError:  # the decoder recurses per nesting level; no file here is more than a few deep
        raise CheckpointError(f"checkpoint: {path} is not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _int(cfg: dict, key: str, path: Path, default=None) -> int:
    try:
        return int_field(cfg, key, default)
    except ValueError as e:
        raise CheckpointError(f"checkpoint: {path}: {e}") from None


def default_target_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high layers (the EAGLE-3 choice) for a target without a drafter checkpoint."""
    if num_layers <= 3:
        return list(range(num_layers))
    return sorted(i for i in {1, num_layers // 2 - 1, num_layers - 4} if 0 <= i < num_layers) or [num_layers - 1]


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


def _tokenizer_token_ids(directory: Path) -> dict[str, int | None]:
    """The ids of the tokenizer's ``eos_token`` and ``bos_token``, looked up in ``tokenizer_config.json``'s
    ``added_tokens_decoder``, then ``tokenizer.json``'s added tokens and vocabulary (each file read once)."""
    config_path = directory / "tokenizer_config.json"
    if not config_path.is_file():
        return {"eos_token": None, "bos_token": None}
    tok_cfg = _read_json(config_path)
    wanted = {which: _token_content(tok_cfg.get(which)) for which in ("eos_token", "bos_token")}
    found: dict[str, int] = {}
    decoder = tok_cfg.get("added_tokens_decoder")
    for key, entry in (decoder.items() if isinstance(decoder, dict) else ()):
        if str(key).isdigit():
            found.setdefault(_token_content(entry), int(key))
    tok_path = directory / "tokenizer.json"
    if any(c is not None and c not in found for c in wanted.values()) and tok_path.is_file():
        tok = _read_json(tok_path)
        for entry in tok.get("added_tokens") or ():
            if isinstance(entry, dict) and isinstance(entry.get("id"), int):
                found.setdefault(entry.get("content"), entry["id"])
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            for c in wanted.values():
                if isinstance(vocab.get(c), int):
                    found.setdefault(c, vocab[c])
        elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the index
            for i, entry in enumerate(vocab):
                if isinstance(entry, list) and entry and entry[0] in wanted.values():
                    found.setdefault(entry[0], i)
    out = {}
    for which, content in wanted.items():
        out[which] = None if content is None else found.get(content)
        if content is not None and out[which] is None:
            logger.warning(f"checkpoint: {config_path}: {which}={content!r} has no id in the tokenizer files; "
                           f"the tokenizer's {which} is not used")
    return out


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
    tok = _tokenizer_token_ids(directory)
    if tok["eos_token"] is not None:
        eos.append(tok["eos_token"])
    if bos is None:
        bos = tok["bos_token"]

    max_pos = cfg.get("max_position_embeddings")
    if max_pos is not None and (isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos < 1):
        raise CheckpointError(f"checkpoint: {config_path}: max_position_embeddings must be an integer >= 1, "
                              f"got {max_pos!r}")
    dtype_name = cfg.get("torch_dtype", cfg.get("dtype"))
    if dtype_name is not None and (not isinstance(dtype_name, str) or dtype_name not in _DTYPE_FROM_NAME):
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


# -- weight files: one check for headers (before any work) and for loaded tensors ---------------------------
# safetensors dtype codes -> names; only the float ones load (a model here computes in fp32 / bf16)
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_FLOAT_WEIGHTS = ("float32", "float16", "bfloat16")


def _safetensors_files(directory: Path) -> list[Path]:
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"checkpoint: {index} has no weight_map of tensor name -> file name")
        return [directory / name for name in sorted(set(weight_map.values()))]
    raise CheckpointError(f"checkpoint: {directory} has neither model.safetensors nor model.safetensors.index.json")


def _unreadable(f: Path, e: Exception) -> CheckpointError:
    size = f.stat().st_size
    if size == 0:
        return CheckpointError(f"checkpoint: {f} is empty (0 bytes)")
    # safetensors' own words say which part is broken (header length, header JSON, offsets, coverage)
    return CheckpointError(f"checkpoint: {f} is not a readable safetensors file ({size} bytes: {e})")


def _headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """``name -> (file, shape, dtype name)`` from the safetensors headers only (no tensor data is read)."""
    from safetensors import safe_open

    out = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"checkpoint: {f} not found")
        try:
            entries = {}
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    entry = st.get_slice(name)
                    entries[name] = (f, tuple(entry.get_shape()), _ST_DTYPES.get(entry.get_dtype(), entry.get_dtype()))
        except Exception as e:  # safetensors raises its own error type (or OSError) on a corrupt file
            raise _unreadable(f, e) from None
        _check_no_duplicates(out, entries, f)
        out.update(entries)
    return out


def _check_no_duplicates(seen: dict, entries: dict, f: Path) -> None:
    """A tensor held by two shards is refused by name: which copy a loader keeps depends on the order it reads the
    files in, and the copies may differ (a shard left from an earlier save)."""
    both = sorted(set(seen) & set(entries))
    if both:
        raise CheckpointError(f"checkpoint: {both[0]} is in both {seen[both[0]][0]} and {f}"
                              f"{f' ({len(both)} tensors held twice)' if len(both) > 1 else ''}")


def _load_tensors(files: list[Path]) -> dict[str, tuple[Path, torch.Tensor]]:
    from safetensors.torch import load_file

    out = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"checkpoint: {f} not found")
        try:
            entries = {name: (f, t) for name, t in load_file(str(f)).items()}
        except Exception as e:
            raise _unreadable(f, e) from None
        _check_no_duplicates(out, entries, f)
        out.update(entries)
    return out


def _check_entries(owner: str, files: list[Path], expected: dict[str, tuple[int, ...]],
                   entries: dict[str, tuple[Path, tuple[int, ...], str]]) -> None:
    """Every ``expected`` name present (file names in the message), with the implied shape and a float dtype."""
    missing = [n for n in expected if n not in entries]
    if missing:
        where = files[0] if len(files) == 1 else files[0].parent
        raise CheckpointError(f"checkpoint: {where}: {owner} tensors missing: {missing[:6]}"
                              f"{' ...' if len(missing) > 6 else ''}")
    for name, shape in expected.items():
        f, got, dtype = entries[name]
        if got != tuple(shape):
            raise CheckpointError(f"checkpoint: {f}: {name} has shape {list(got)}, the config implies {list(shape)}")
        if dtype not in _FLOAT_WEIGHTS:
            raise CheckpointError(f"checkpoint: {f}: {name} is {dtype}; weights must be float32, float16 or "
                                  "bfloat16")


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _check_layer_count(owner: str, files: list[Path], num_layers: int, names) -> None:
    """More layers in the config than the weight files hold is refused before the expected names are listed (one
    set per layer: ``num_hidden_layers: 1000000000`` was gigabytes of names, then a MemoryError)."""
    held = {int(m.group(1)) for n in names if (m := _LAYER_INDEX.search(n))}
    if num_layers > len(held):
        where = files[0] if len(files) == 1 else files[0].parent
        raise CheckpointError(f"checkpoint: {where}: the config has {num_layers} {owner} layers, the weight files "
                              f"hold {len(held)}")


def _finite(owner_entries: dict[str, tuple[Path, torch.Tensor]]) -> None:
    """One ``isfinite`` pass per tensor: a NaN or inf weight is refused by name before it can serve."""
    for name, (f, t) in owner_entries.items():
        # in chunks: the boolean temporary stays small next to an embedding of 10^9 elements
        if not all(bool(torch.isfinite(part).all()) for part in t.reshape(-1).split(1 << 24)):
            bad = sum(int((~torch.isfinite(part)).sum()) for part in t.reshape(-1).split(1 << 24))
            raise CheckpointError(f"checkpoint: {f}: {name} holds {bad} non-finite value(s) (NaN or inf) of "
                                  f"{t.numel()}")


# -- target: Hugging Face Llama, Mistral, Qwen2, Qwen3 ------------------------------------------------------
# Switches of LlamaTargetConfig that the runtime config's model.target does not hold (read_target_family).
FAMILY_FIELDS = ("qkv_bias", "o_proj_bias", "mlp_bias", "qk_norm", "rope_scaling")


def _target_fields(directory: str | Path) -> tuple[Path, dict]:
    if not Path(directory).is_dir():
        raise CheckpointError(f"checkpoint: model directory {directory} not found")
    path = Path(directory) / "config.json"
    try:
        return path, target_fields(_read_json(path))
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint: {path}: {e}") from None


def read_target_config(directory: str | Path) -> tuple[LlamaTargetConfig, bool]:
    """``(LlamaTargetConfig, tie_word_embeddings)`` of a Hugging Face directory (default capture layers)."""
    path, fields = _target_fields(directory)
    tie = fields.pop("tie_word_embeddings")
    try:
        cfg = LlamaTargetConfig(**fields, capture_layers=tuple(default_target_layer_ids(fields["num_layers"])))
    except ValueError as e:
        raise CheckpointError(f"checkpoint: {path}: {e}") from None
    return cfg, tie


def read_target_family(directory: str | Path) -> dict:
    """The family switches of ``DIR/config.json`` (:data:`FAMILY_FIELDS`: biases, q/k norms, RoPE scaling) as
    keyword arguments of :class:`LlamaTargetConfig` -- what :func:`read_llama_config`'s plain dict leaves out.

    Example::

        tcfg = dataclasses.replace(tcfg, **read_target_family(model_dir))  # a Qwen3 target gets qk_norm=True
    """
    cfg, _ = read_target_config(directory)
    return {name: getattr(cfg, name) for name in FAMILY_FIELDS}


def _expected_hf_shapes(cfg: LlamaTargetConfig, tie_word_embeddings: bool, present) -> dict[str, tuple[int, ...]]:
    shapes = {_hf_name(n): s for n, s in target_weight_shapes(cfg).items()}
    if tie_word_embeddings and "lm_head.weight" not in present:
        del shapes["lm_head.weight"]  # the head reads the embedding
    return shapes


@contextlib.contextmanager
def _quantized_weights_named(directory: Path):
    """A weight check that fails on a quantized checkpoint (``quantization_config`` in ``config.json``, MLX's
    ``quantization``: AWQ / GPTQ ``qweight`` in place of ``weight``, FP8, int8 or packed tensors) says so: its own
    line alone (a missing or non-float tensor) reads as a broken download."""
    try:
        yield
    except CheckpointError as e:
        config = _read_json(directory / "config.json")
        key = next((k for k in ("quantization_config", "quantization") if config.get(k)), None)  # MLX: quantization
        if key is None:
            raise
        method = config[key].get("quant_method") if isinstance(config[key], dict) else None
        raise CheckpointError(f"checkpoint: {directory / 'config.json'}: quantized weights ({key}, "
                              f"quant_method={method!r}) are not supported; serve the float checkpoint "
                              f"({str(e).removeprefix('checkpoint: ')})") from None


def read_llama_config(directory: str | Path) -> dict:
    """``DIR/config.json`` of a Hugging Face Llama / Mistral / Qwen2 / Qwen3 -> the fields of ``model.target``
    (plain dict; the family switches are :func:`read_target_family`'s), after checking the weight files'
    headers against them (names, shapes, float dtypes, offsets), so a broken checkpoint is refused in one
    line before any work."""
    cfg, tie = read_target_config(directory)
    files = _safetensors_files(Path(directory))
    headers = _headers(files)
    with _quantized_weights_named(Path(directory)):
        _check_layer_count("target", files, cfg.num_layers, headers)
        _check_entries("target", files, _expected_hf_shapes(cfg, tie, headers), headers)
    fields = {k: v for k, v in vars(cfg).items() if k not in FAMILY_FIELDS}
    return {**fields, "capture_layers": list(cfg.capture_layers), "tie_word_embeddings": tie}


def _hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def load_llama_state_dict(directory: str | Path, cfg: LlamaTargetConfig,
                          tie_word_embeddings: bool | None = None) -> dict[str, torch.Tensor]:
    """The FULL target state dict (this project's names) from a Hugging Face directory.

    Refuses (:class:`CheckpointError`, one line naming the file) a missing or mis-shaped tensor, a dtype
    other than float32 / float16 / bfloat16, a NaN or inf weight, and a ``cfg`` built without the family
    switches this checkpoint needs (:func:`read_target_family`), which would compute another model.
    """
    directory = Path(directory)
    path, fields = _target_fields(directory)
    for name in FAMILY_FIELDS:
        if getattr(cfg, name) != fields[name]:
            raise CheckpointError(f"checkpoint: {path}: this checkpoint needs {name}={fields[name]!r}, the target "
                                  f"was configured with {getattr(cfg, name)!r} (pass read_target_family(DIR))")
    if tie_word_embeddings is None:
        tie_word_embeddings = fields["tie_word_embeddings"]
    files = _safetensors_files(directory)
    raw = _load_tensors(files)
    with _quantized_weights_named(directory):
        _check_layer_count("target", files, cfg.num_layers, raw)
        expected = _expected_hf_shapes(cfg, tie_word_embeddings, raw)
        _check_entries("target", files, expected, {n: (f, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                                   for n, (f, t) in raw.items()})
    used = {n: raw[n] for n in expected}
    unused = sorted(set(raw) - set(used) - {"lm_head.weight"})
    # A stored rotary inv_freq is a buffer the model recomputes (transformers does not use it either); any other
    # unused tensor is a weight this configuration leaves out (a bias config.json does not switch on, a layer past
    # num_hidden_layers): the served model may not be the checkpoint's, so it is a WARNING naming them.
    buffers = [n for n in unused if n.endswith("rotary_emb.inv_freq")]
    weights = [n for n in unused if n not in buffers]
    if buffers:
        info_once(f"checkpoint: {directory}: {len(buffers)} rotary inv_freq buffer(s) not used (recomputed)")
    if weights:
        logger.warning(f"checkpoint: {directory}: {len(weights)} stored tensor(s) not used by the model as "
                       f"configured (check config.json, e.g. attention_bias / mlp_bias / num_hidden_layers): "
                       f"{weights[:6]}{' ...' if len(weights) > 6 else ''}")
    _finite(used)
    sd = {name: used[_hf_name(name)][1] for name in target_weight_shapes(cfg) if _hf_name(name) in used}
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    return sd


def _rope_scaling_entry(scaling) -> dict | None:
    """A :class:`RopeScaling` as the ``rope_scaling`` object of ``config.json`` (the fields its type reads)."""
    if scaling is None:
        return None
    keys = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                     "mscale", "mscale_all_dim", "truncate")}[scaling.rope_type]
    return {"rope_type": scaling.rope_type,
            **{k: getattr(scaling, k) for k in keys if getattr(scaling, k) is not None}}


def hf_llama_config(cfg: LlamaTargetConfig, dtype: torch.dtype, max_position_embeddings: int) -> dict:
    """The Hugging Face config dict of this target: ``LlamaForCausalLM``, or ``Qwen2ForCausalLM`` (q/k/v biases
    without an ``o_proj`` bias) / ``Qwen3ForCausalLM`` (q/k norms), with its biases and RoPE scaling -- a target
    loaded from such a checkpoint is written back as the same model (a plain Llama config over its weights would
    compute another one). ValueError for switches no family here expresses together."""
    if cfg.qk_norm:
        arch, model_type = "Qwen3ForCausalLM", "qwen3"
    elif cfg.qkv_bias and not cfg.o_proj_bias:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    else:
        arch, model_type = "LlamaForCausalLM", "llama"
    out = {
        "architectures": [arch], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": _rope_scaling_entry(cfg.rope_scaling),
        "attention_bias": cfg.o_proj_bias, "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": False, "torch_dtype": _DTYPE_NAMES[dtype],
    }
    if model_type == "qwen2":
        del out["attention_bias"], out["mlp_bias"]  # Qwen2: q/k/v biases always, no o_proj / MLP bias
        out["use_sliding_window"] = False
    # What the reader makes of the written config must be this target, switch for switch.
    read = target_fields(out)
    if any(read[f] != getattr(cfg, f) for f in FAMILY_FIELDS):
        switches = ", ".join(f"{f}={getattr(cfg, f)!r}" for f in FAMILY_FIELDS)
        raise ValueError(f"export: no Hugging Face family served here has these switches together: {switches}")
    return out


def process_umask() -> int:
    """The process's file-creation mask (read by setting and restoring it: the only portable way)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(sd: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``sd`` as a safetensors file, readable as any file this process creates (``0o666`` less the umask).

    ``safetensors`` creates its files owner-only (0600): a checkpoint written by one user and served by another
    (a service account, a shared model directory) would not load. Tensors that share storage (a tied head) are
    written as their own copies (safetensors refuses shared storage)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().clone() for k, v in sd.items()}, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~process_umask())


def save_llama_checkpoint(directory: str | Path, cfg: LlamaTargetConfig, state_dict: dict[str, torch.Tensor],
                          max_position_embeddings: int) -> None:
    """Write ``config.json`` + ``model.safetensors`` under Hugging Face names."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(state_dict.values())).dtype
    (directory / "config.json").write_text(json.dumps(hf_llama_config(cfg, dtype, max_position_embeddings),
                                                      indent=2) + "\n")
    save_safetensors({_hf_name(k): v for k, v in state_dict.items()}, directory / "model.safetensors",
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
    out = {
        "drafter": {"num_layers": _int(cfg, "num_hidden_layers", path),
                    "num_heads": _int(cfg, "num_attention_heads", path),
                    "head_dim": _int(cfg, "head_dim", path), "latent_dim": _int(cfg, "latent_dim", path),
                    "intermediate_size": _int(cfg, "intermediate_size", path)},
        "markov_rank": _int(cfg, "markov_rank", path),
        "mask_token_id": _int(cfg, "mask_token_id", path),
        "target_layer_ids": layers,
        "hidden_size": _int(cfg, "hidden_size", path),
        "vocab_size": _int(cfg, "vocab_size", path),
    }
    try:
        dcfg = DSparkDrafterConfig(hidden_size=out["hidden_size"], target_hidden_size=out["hidden_size"],
                                   num_capture_layers=len(layers), vocab_size=out["vocab_size"],
                                   markov_rank=out["markov_rank"], mask_token_id=out["mask_token_id"], **out["drafter"])
    except ValueError as e:
        raise CheckpointError(f"checkpoint: {path}: {e}") from None
    # The weight file's header against these sizes, before any work (the data is checked at load).
    files = [directory / "model.safetensors"]
    headers = _headers(files)
    _check_layer_count("drafter", files, dcfg.num_layers, headers)
    _check_entries("drafter", files, drafter_weight_shapes(dcfg), headers)
    return out


def load_drafter_state_dict(directory: str | Path, cfg: DSparkDrafterConfig) -> dict[str, torch.Tensor]:
    """The drafter's FULL state dict; the same refusals as :func:`load_llama_state_dict` (shapes, dtypes,
    non-finite values), one line naming the file."""
    files = [Path(directory) / "model.safetensors"]
    raw = _load_tensors(files)
    _check_layer_count("drafter", files, cfg.num_layers, raw)
    expected = drafter_weight_shapes(cfg)
    _check_entries("drafter", files, expected, {n: (f, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                                for n, (f, t) in raw.items()})
    used = {n: raw[n] for n in expected}
    _finite(used)
    return {n: t for n, (_, t) in used.items()}


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
    save_safetensors(state_dict, directory / "model.safetensors", {"format": "pt"})


def target_only_view(model_dir: Path, work: Path) -> Path:
    """A directory of links to ``model_dir``'s files without its drafter: loading it builds the engine's seeded
    (bigram) drafter, so a drafter being trained, half-trained or under comparison is never loaded."""
    view = work / model_dir.name
    view.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not (view / f.name).exists():
            (view / f.name).symlink_to(f.resolve())
    return view
