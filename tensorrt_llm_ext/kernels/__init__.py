"""Every Triton kernel of the package, one op per file with its launcher and eager twin.

Launchers are functions of their tensors (results in ``out=`` buffers or returned), with one declared
exception: :mod:`~tensorrt_llm_ext.kernels.shard_select` keeps a per-device split-scratch buffer (a
documented module-level cache that the kernel leaves reset after every launch; pass ``scratch=`` to own
it), and :mod:`~tensorrt_llm_ext.kernels.latent_block_attention` caches its fp32 RoPE frequency table per
``(head_dim, theta, device)`` and, for context split-K schedules, a per-device fp32 partials buffer (both
built on the first, warm-up call at the largest batch). Shared validation, launch settings and the capture-allocation error live in
:mod:`~tensorrt_llm_ext.kernels.common`.
"""
