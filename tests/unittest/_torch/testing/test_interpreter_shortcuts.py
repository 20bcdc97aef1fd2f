"""The interpreter shortcuts the tests install (tensorrt_llm_ext/testing/interpreter.py) change no answer."""

from __future__ import annotations

import numpy as np
import pytest
import triton.language as tl
from triton.runtime import interpreter as ti

from tensorrt_llm_ext.testing.interpreter import cache_block_types, cache_np_dtype_lookup, cache_tensor_shapes

_SCALARS = (tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
            tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv)


def test_cached_np_dtype_lookup_answers_as_the_interpreter_table():
    cache_np_dtype_lookup()
    cached = ti._get_np_dtype
    original = cached.__closure__ and next(c.cell_contents for c in cached.__closure__
                                            if getattr(c.cell_contents, "__name__", "") == "_get_np_dtype")
    assert original is not None and original is not cached  # installed, and the interpreter's own kept
    for t in _SCALARS:
        for ty in (t, tl.block_type(t, [4, 16]), tl.pointer_type(t), tl.block_type(tl.pointer_type(t), [8])):
            for _ in range(2):  # the first answer computed, the second from the cache
                assert cached(ty) == original(ty), ty
    assert cached(tl.bfloat16) == np.dtype(np.uint16) and cached(tl.pointer_type(tl.float32)) == np.dtype(np.uint64)
    with pytest.raises(KeyError):
        cached(tl.void)  # what the table does not hold still raises, as before
    cache_np_dtype_lookup()
    assert ti._get_np_dtype is cached  # once per process


def _triton_own(method):
    """Triton's own method behind an installed shortcut (the tests' conftest installs them at start)."""
    for cell in method.__closure__ or ():
        fn = cell.cell_contents
        if callable(fn) and getattr(fn, "__module__", "") == "triton.language.core":
            return fn
    assert method.__module__ == "triton.language.core", method
    return method


def _fields(b):
    return b.element_ty, [int(d) for d in b.shape], b.numel, b.name, type(b.shape)


def test_cached_block_types_and_tensor_shapes_equal_tritons_own():
    block_init, tensor_init = _triton_own(tl.block_type.__init__), _triton_own(tl.tensor.__init__)
    plain = []
    for elem, shape in ((tl.float32, [4, 16]), (tl.int1, [8]), (tl.bfloat16, [2, 2, 32])):
        b = tl.block_type.__new__(tl.block_type)
        block_init(b, elem, shape)
        t = tl.tensor.__new__(tl.tensor)
        tensor_init(t, None, b)
        plain.append((elem, shape, b, t))
    cache_block_types()
    cache_tensor_shapes()
    assert _triton_own(tl.block_type.__init__) is not tl.block_type.__init__  # installed
    for elem, shape, ref, ref_t in plain:
        for _ in range(2):  # the first construction computes, the second reuses
            for given in (list(shape), tl.tuple(list(shape))):
                b = tl.block_type(elem, given)
                assert _fields(b) == _fields(ref) and b == ref
                t = tl.tensor(None, b)
                assert t.numel == ref_t.numel and [s.value for s in t.shape] == [s.value for s in ref_t.shape] == shape
                assert t.type is b and t.dtype == elem
    ptr = tl.block_type(tl.pointer_type(tl.float32), [16])  # not cached: Triton's path
    assert ptr.numel == 16 and ptr.element_ty == tl.pointer_type(tl.float32)
    assert tl.tensor(None, tl.float32).shape == tl.tuple([]) and tl.tensor(None, tl.float32).numel == 1
    for bad, err in (([3], ValueError), ([1 << 21], ValueError), ([], TypeError)):  # refused as before
        with pytest.raises(err):
            tl.block_type(tl.float32, bad)
