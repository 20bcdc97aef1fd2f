"""``trtllm-ext export DIR``: the configured model (the embedded seeded one by default) as checkpoint
directories that ``serve DIR`` / ``generate --model DIR`` load back bit for bit (see
:mod:`tensorrt_llm_ext.models.checkpoint` for the formats)."""

from __future__ import annotations

from pathlib import Path

import torch

from tensorrt_llm_ext.models.checkpoint import save_drafter_checkpoint, save_llama_checkpoint
from tensorrt_llm_ext.runtime.config import DRAFTER_SUBDIR, RuntimeConfig
from tensorrt_llm_ext.runtime.model_loader import full_state_dicts, model_configs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def export_model(cfg: RuntimeConfig, directory: str | Path, drafter_directory: str | Path | None = None,
                 dtype: str = "float32") -> list[tuple[str, Path]]:
    """Write the target (Hugging Face Llama) to ``directory`` and the drafter to ``drafter_directory``
    (default ``directory/dspark_drafter``, where loading ``directory`` finds it). Returns what was written."""
    directory = Path(directory)
    drafter_directory = Path(drafter_directory) if drafter_directory is not None else directory / DRAFTER_SUBDIR
    if directory.resolve() == drafter_directory.resolve():  # the drafter's two files would replace the target's
        raise ValueError(f"export: the target and the drafter directory are both {directory}; the drafter needs its "
                         f"own (default {directory / DRAFTER_SUBDIR})")
    for d in (directory, drafter_directory):
        if d.exists() and any(d.glob("*.safetensors")):
            raise ValueError(f"export: {d} already holds a checkpoint; choose an empty directory")
    tcfg, dcfg = model_configs(cfg)
    target_sd, drafter_sd = full_state_dicts(cfg)
    to = _DTYPES[dtype]
    save_llama_checkpoint(directory, tcfg, {k: v.to(to) for k, v in target_sd.items()}, cfg.max_seq_len)
    save_drafter_checkpoint(drafter_directory, dcfg, list(tcfg.capture_layers),
                            {k: v.to(to) for k, v in drafter_sd.items()})
    return [("target", directory), ("drafter", drafter_directory)]
