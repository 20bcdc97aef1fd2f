"""Reference drafter models (TensorRT-LLM-style modules; they depend on the speculative contract only)."""

from tensorrt_llm_ext.models.dspark_drafter import (DSparkDrafter, DSparkDrafterConfig, DSparkDrafterNoFusion,
                                                    full_weight_shapes, generate_full_state_dict,
                                                    resolve_drafter_tp_plan)

__all__ = [
    "DSparkDrafter", "DSparkDrafterConfig", "DSparkDrafterNoFusion", "full_weight_shapes",
    "generate_full_state_dict", "resolve_drafter_tp_plan",
]
