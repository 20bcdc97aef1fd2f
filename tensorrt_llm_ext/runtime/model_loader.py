"""Model building for the engine: the target's and the drafter's configs from the runtime config, their FULL
weights (checkpoint directories, ``torch.save`` files or the seeded embedded init) and this rank's models.

Every rank builds the same FULL weights and loads its own slices, so the models are identical at every TP
size. :func:`build_models` is what :class:`~tensorrt_llm_ext.runtime.engine.Engine` calls; ``trtllm-ext
export`` writes :func:`full_state_dicts`.
"""

from __future__ import annotations

import torch

from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.models.checkpoint import load_drafter_state_dict, load_llama_state_dict
from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafter, DSparkDrafterConfig, init_from_target_bigram
from tensorrt_llm_ext.models.dspark_drafter import generate_full_state_dict as generate_drafter_state_dict
from tensorrt_llm_ext.models.llama_target import LlamaTarget, LlamaTargetConfig
from tensorrt_llm_ext.models.llama_target import generate_full_state_dict as generate_target_state_dict
from tensorrt_llm_ext.runtime.config import RuntimeConfig

__all__ = ["build_models", "full_state_dicts", "model_configs", "resolve_dtype"]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def model_configs(config: RuntimeConfig) -> tuple[LlamaTargetConfig, DSparkDrafterConfig]:
    """The target's and the drafter's sizes from the runtime config."""
    t = config.model.target
    tcfg = LlamaTargetConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_layers=t.num_layers,
                             num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                             intermediate_size=t.intermediate_size, capture_layers=tuple(t.capture_layers),
                             rope_theta=t.rope_theta, rms_norm_eps=t.rms_norm_eps,
                             # a checkpoint's family switches (biases, q/k norms, RoPE scaling)
                             **config.target_family)
    d = config.model.drafter
    dcfg = DSparkDrafterConfig(hidden_size=t.hidden_size, target_hidden_size=t.hidden_size,
                               num_capture_layers=len(t.capture_layers), num_layers=d.num_layers,
                               num_heads=d.num_heads, head_dim=d.head_dim, latent_dim=d.latent_dim,
                               intermediate_size=d.intermediate_size, vocab_size=t.vocab_size,
                               markov_rank=config.speculative_config.markov_rank,
                               mask_token_id=config.mask_token_id, rms_norm_eps=t.rms_norm_eps)
    return tcfg, dcfg


def full_state_dicts(config: RuntimeConfig) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The FULL (unsharded) target and drafter weights: from checkpoint directories, ``torch.save`` files,
    or the seeded embedded init -- identical on every rank and at every TP size."""
    m = config.model
    tcfg, dcfg = model_configs(config)
    if m.path:
        target_sd = load_llama_state_dict(m.path, tcfg, m.target.tie_word_embeddings)
    elif m.target_weights:
        target_sd = torch.load(m.target_weights, map_location="cpu", weights_only=True)
    else:
        target_sd = generate_target_state_dict(tcfg, m.seed, torch.float32, m.target.residual_scale)
    if m.drafter_path:
        drafter_sd = load_drafter_state_dict(m.drafter_path, dcfg)
    elif m.drafter_weights:
        drafter_sd = torch.load(m.drafter_weights, map_location="cpu", weights_only=True)
    else:
        drafter_sd = generate_drafter_state_dict(dcfg, m.seed + 1, torch.float32)
        if m.drafter_init == "target_bigram":
            init_from_target_bigram(drafter_sd, target_sd, tcfg.rms_norm_eps)
    return target_sd, drafter_sd


def build_models(config: RuntimeConfig, mapping: Mapping, device: torch.device,
                 weights: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
                 ) -> tuple[LlamaTarget, DSparkDrafter]:
    """The target and the drafter with this rank's slices of the FULL weights (seeded or from files; or
    ``weights`` = the FULL ``(target, drafter)`` state dicts given in memory, e.g. drawn on the device by a
    benchmark of a large shape)."""
    dtype = resolve_dtype(config.model.dtype, device)
    tcfg, dcfg = model_configs(config)
    target = LlamaTarget(tcfg, mapping, dtype=dtype, device=device)
    drafter = DSparkDrafter(dcfg, mapping, dtype=dtype, device=device)
    target_sd, drafter_sd = weights if weights is not None else full_state_dicts(config)
    target.load_full_state_dict(target_sd)
    drafter.load_full_state_dict(drafter_sd)
    attach_confidence_head(drafter, config.model.drafter_path)
    return target, drafter


def attach_confidence_head(drafter, drafter_path) -> bool:
    """Load ``DRAFTER/confidence_head.safetensors`` into ``drafter`` when there is one; a file that cannot be
    read, or whose tensors do not fit this drafter, leaves it without confidences (one warning line; the
    drafts themselves do not depend on the head). Returns whether a head was attached."""
    head = load_confidence_head_file(drafter_path)
    if head is None:
        return False
    try:
        drafter.load_confidence_head(head)
    except ValueError as e:
        logger.warning(f"drafter: {drafter_path}/confidence_head.safetensors does not fit this drafter "
                       f"({_first_line(e)}); serving without confidences")
        return False
    return True


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:120] if lines else type(e).__name__


def load_confidence_head_file(drafter_path) -> dict[str, torch.Tensor] | None:
    """``DRAFTER/confidence_head.safetensors`` when the drafter directory has one (train-drafter writes it)."""
    if not drafter_path:
        return None
    from pathlib import Path

    from safetensors.torch import load_file

    from tensorrt_llm_ext.models.dspark_drafter import CONFIDENCE_HEAD_FILE

    path = Path(drafter_path) / CONFIDENCE_HEAD_FILE
    if not path.is_file():
        return None
    try:
        return load_file(str(path))
    except Exception as e:  # a damaged file: the drafter serves without confidences, said once
        logger.warning(f"drafter: {path} unreadable ({_first_line(e)}); serving without confidences")
        return None
