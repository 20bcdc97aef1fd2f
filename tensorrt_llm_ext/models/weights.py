"""Loading FULL (unsharded) state dicts into TP-sharded models: one check, one loader for every model."""

from __future__ import annotations

import torch
from torch import nn


def check_full_state_dict(owner: str, expected: dict[str, tuple[int, ...]], state_dict: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming every missing, unexpected or mis-shaped entry of ``state_dict``."""
    missing = sorted(set(expected) - set(state_dict))
    extra = sorted(set(state_dict) - set(expected))
    if missing or extra:
        raise ValueError(f"{owner}.load_full_state_dict: missing {missing}, unexpected {extra}")
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != shape:
            raise ValueError(f"{owner}.load_full_state_dict: {name} expected {list(shape)}, "
                             f"got {list(state_dict[name].shape)}")


def load_sharded_modules(model: nn.Module, state_dict: dict[str, torch.Tensor], module_types: tuple[type, ...],
                         dtype: torch.dtype) -> None:
    """Each submodule of ``module_types`` takes its rank's slice of ``<name>.weight`` (and of ``<name>.bias``
    where the state dict has one; a ``Linear`` refuses a missing or unexpected bias) via ``load_weights``."""
    for mod_name, mod in model.named_modules():
        if isinstance(mod, module_types):
            weight = state_dict[f"{mod_name}.weight"].to(dtype)
            bias = state_dict.get(f"{mod_name}.bias")
            if bias is None:
                mod.load_weights(weight)
            else:
                mod.load_weights(weight, bias.to(dtype))
