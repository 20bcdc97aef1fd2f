"""The interpreter shortcuts the tests install (tensorrt_llm_ext/testing/interpreter.py) change no answer."""

from __future__ import annotations

import numpy as np
import pytest
import triton.language as tl
from triton.runtime import interpreter as ti

from tensorrt_llm_ext.testing.interpreter import cache_np_dtype_lookup

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
