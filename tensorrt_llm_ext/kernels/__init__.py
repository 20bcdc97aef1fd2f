"""Pure Triton kernels with their eager torch twins (tensors in, tensors out, no hidden state)."""
