"""Training a DSpark drafter on its target by self-distillation (``trtllm-ext train-drafter``)."""
