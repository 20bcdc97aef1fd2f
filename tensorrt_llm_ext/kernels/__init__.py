"""Every Triton kernel of the package, one op per file with its launcher and eager twin.

Launchers are functions of their tensors (results in ``out=`` buffers or returned), with one declared
exception: :mod:`~tensorrt_llm_ext.kernels.shard_select` keeps a per-device split-scratch buffer (a
documented module-level cache that the kernel leaves reset after every launch; pass ``scratch=`` to own
it). Shared validation, launch settings and the capture-allocation error live in
:mod:`~tensorrt_llm_ext.kernels.common`.
"""
