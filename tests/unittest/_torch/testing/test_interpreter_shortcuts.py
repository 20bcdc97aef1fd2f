"""The interpreter shortcuts the tests install (tensorrt_llm_ext/testing/interpreter.py) change no answer."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import triton.language as tl
from triton.runtime import interpreter as ti

from tensorrt_llm_ext.testing.interpreter import (cache_block_types, cache_language_builtins, cache_np_dtype_lookup, cache_tensor_shapes,
                                                  call_language_builtins_directly, compare_int_tuples_directly,
                                                  compare_scalar_types_directly, pass_pointer_offsets_through,
                                                  pass_python_numbers_through, pass_same_typed_operands_through,
                                                  skip_discarded_overflow_checks, splat_scalars_directly)

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
        if inspect.isfunction(fn) and fn.__module__ == "triton.language.core":
            return fn
    assert method.__module__ == "triton.language.core", method
    return method


def _fields(b):
    return b.element_ty, [int(d) for d in b.shape], b.numel, b.name, type(b.shape)


def test_cached_block_types_and_tensor_shapes_equal_tritons_own():
    block_init, tensor_init = _triton_own(tl.block_type.__init__), _triton_own(tl.tensor.__init__)
    plain = []
    for elem, shape in ((tl.float32, [4, 16]), (tl.int1, [8]), (tl.bfloat16, [2, 2, 32]),
                        (tl.pointer_type(tl.float32), [4, 16]), (tl.pointer_type(tl.int64, 1, True), [8])):
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
    # one shape object for one set of dims, whatever the element type (a tile of pointers and its mask)
    assert tl.block_type(tl.pointer_type(tl.float32), [4, 16]).shape is tl.block_type(tl.int1, [4, 16]).shape
    assert tl.block_type(tl.pointer_type(tl.int64, 1, True), [8]).name == "<['8'], const_pointer<int64>>"
    assert tl.tensor(None, tl.float32).shape == tl.tuple([]) and tl.tensor(None, tl.float32).numel == 1
    for bad, err in (([3], ValueError), ([1 << 21], ValueError), ([], TypeError)):  # refused as before
        with pytest.raises(err):
            tl.block_type(tl.float32, bad)


def test_int_tuple_comparison_answers_as_tritons_own():
    compare_int_tuples_directly()
    own = _triton_own(tl.tuple.__eq__)
    assert own is not tl.tuple.__eq__
    shapes = (tl.tuple([4, 8]), tl.tuple([tl.constexpr(4), tl.constexpr(8)]), tl.tuple([16]))
    others = ([4, 8], [4, 9], [4], [], tl.tuple([4, 8]), [tl.constexpr(4), 8], (4, 8), tl.constexpr([4, 8]))
    for shape in shapes:
        for other in others:
            got, want = shape == other, own(shape, other)
            assert type(got) is type(want) and bool(got) == bool(want), (shape, other)
            assert (shape != other) == (not want)


def _semantic_own(name):
    """Triton's own ``interpreter_semantic.<name>`` behind the shortcuts stacked on it (each keeps the one below)."""
    semantic = ti.interpreter_semantic
    fn = getattr(semantic, name)
    while getattr(fn, "__self__", None) is not semantic:
        fn = next(c.cell_contents for c in fn.__closure__ if callable(c.cell_contents)
                  and getattr(c.cell_contents, "__name__", "") in (name, "checked", "broadcast"))
    assert fn.__name__ == name and fn is not getattr(semantic, name)
    return fn


def _operand(name, shape):
    dtype = getattr(tl, {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(name, name))
    ty = tl.block_type(dtype, list(shape)) if shape else dtype
    data = np.zeros(shape or (1,), dtype=ti._get_np_dtype(dtype))
    return tl.tensor(ti.TensorHandle(data, dtype), ty)


def test_same_typed_operands_come_back_as_tritons_own_checks_return_them():
    pass_same_typed_operands_through()
    semantic = ti.interpreter_semantic
    checked = semantic.binary_op_type_checking_impl
    own = _semantic_own("binary_op_type_checking_impl")
    names = ("fp64", "fp32", "fp16", "bf16", "int1", "int8", "int32", "int64", "uint8", "uint32")
    for name in names:
        for shape in ((), (4, 16)):
            for div_or_mod in (False, True):
                lhs, rhs = _operand(name, shape), _operand(name, shape)
                got, want = checked(lhs, rhs, div_or_mod=div_or_mod), own(lhs, rhs, div_or_mod=div_or_mod)
                assert [t.type for t in got] == [t.type for t in want], (name, shape, div_or_mod)
                if name in ("fp16", "bf16") and div_or_mod:
                    assert got[0].dtype == tl.float32  # promoted by Triton's own path, as before
                else:
                    assert got[0] is lhs and got[1] is rhs and want[0] is lhs and want[1] is rhs
    # two types or two shapes: Triton's promotion and broadcast
    lhs, rhs = _operand("fp32", (4, 16)), _operand("bf16", (4, 16))
    assert [t.dtype for t in checked(lhs, rhs)] == [tl.float32, tl.float32]
    lhs, rhs = _operand("fp32", (4, 16)), _operand("fp32", (1, 16))
    assert [list(t.shape) for t in checked(lhs, rhs)] == [[4, 16], [4, 16]]
    lhs = _operand("int32", (4,))
    assert checked(lhs, 3)[1].dtype == tl.int32  # a Python number: Triton's path
    # one element type in two shapes (a scalar beside a block, or broadcastable blocks): Triton's broadcast only
    for name in names:
        for ls, rs in (((4, 16), ()), ((), (4, 16)), ((4, 16), (1, 16)), ((1, 16), (4, 1))):
            for div_or_mod in (False, True):
                lhs, rhs = _operand(name, ls), _operand(name, rs)
                got, want = checked(lhs, rhs, div_or_mod=div_or_mod), own(lhs, rhs, div_or_mod=div_or_mod)
                assert [t.type for t in got] == [t.type for t in want], (name, ls, rs, div_or_mod)
                assert all(np.array_equal(g.handle.data, w.handle.data) for g, w in zip(got, want))


def _pointer(shape, elem=tl.float32):
    ty = tl.pointer_type(elem)
    data = np.arange(1, 1 + int(np.prod(shape or (1,))), dtype=np.uint64).reshape(shape or (1,)) * 64
    return tl.tensor(ti.TensorHandle(data, ty), tl.block_type(ty, list(shape)) if shape else ty)


def _same_answer(got_fn, want_fn):
    """Both raise the same exception type, or both return tensors of equal types and bytes."""
    try:
        want = want_fn()
    except Exception as e:  # noqa: BLE001 -- the shortcut must raise what Triton raises
        with pytest.raises(type(e)):
            got_fn()
        return "raised"
    got = got_fn()
    assert [t.type for t in got] == [t.type for t in want]
    assert [t.handle.dtype for t in got] == [t.handle.dtype for t in want]
    assert [t.handle.data.tobytes() for t in got] == [t.handle.data.tobytes() for t in want]
    assert [t.handle.data.shape for t in got] == [t.handle.data.shape for t in want]
    return "returned"


def test_scalars_are_splat_and_equal_shapes_passed_as_tritons_own_broadcast():
    splat_scalars_directly()
    broadcast, own = ti.interpreter_semantic.broadcast_impl_value, _semantic_own("broadcast_impl_value")
    seen = set()
    for a in ("fp32", "bf16", "int32", "int64", "int1", "uint8"):
        for b in ("fp32", "int32", "int1"):
            for ls, rs in (((4, 16), ()), ((), (4, 16)), ((), ()), ((4, 16), (4, 16)), ((16,), (16,)),
                           ((4, 1), (1, 16)), ((16,), (4, 16))):
                lhs, rhs = _operand(a, ls), _operand(b, rs)
                lhs.handle.data[...] = 3  # a splat copies the value
                seen.add(_same_answer(lambda: broadcast(lhs, rhs), lambda: own(lhs, rhs)))
    for ps, os_ in (((), (8,)), ((8,), ()), ((8,), (8,)), ((2, 8), (2, 8)), ((2, 1), (1, 8)), ((), ())):
        ptr, offs = _pointer(ps), _operand("int32", os_)
        seen.add(_same_answer(lambda: broadcast(ptr, offs), lambda: own(ptr, offs)))
        seen.add(_same_answer(lambda: broadcast(offs, ptr), lambda: own(offs, ptr)))
    assert seen == {"returned"}
    lhs, rhs = _operand("fp32", (4, 16)), _operand("fp32", (4, 16))
    assert broadcast(lhs, rhs) == (lhs, rhs)  # one shape: both as they are, as in Triton
    lhs, rhs = _operand("fp32", (4, 16)), _operand("int32", ())
    got = broadcast(lhs, rhs)[1]
    assert got.type == tl.block_type(tl.int32, [4, 16]) and got.handle.data.shape == (4, 16)


_NUMBERS = (0, 1, -1, 3, 127, 128, -129, 255, 256, -32769, 2**31 - 1, 2**31, 2**32, -2**31 - 1, 2**63 - 1, 2**63,
            2**64 - 1, 2**64, -2**63, -2**63 - 1, 0.5, -0.0, 1e-40, 1e39, float("inf"), float("nan"), True, False)


def test_python_numbers_beside_tensors_answer_as_tritons_own():
    pass_python_numbers_through()
    checked, own = ti.interpreter_semantic.binary_op_type_checking_impl, _semantic_own("binary_op_type_checking_impl")
    seen = set()
    for name in ("fp64", "fp32", "fp16", "bf16", "int1", "int8", "uint8", "int16", "int32", "uint32", "int64",
                 "uint64", "float8e5"):
        for shape in ((), (4, 16)):
            x = _operand(name, shape)
            for number in _NUMBERS:
                for div_or_mod in (False, True):
                    for check in (True, False):
                        kw = dict(arithmetic_check=check, div_or_mod=div_or_mod)
                        seen.add(_same_answer(lambda: checked(x, number, **kw), lambda: own(x, number, **kw)))
                        seen.add(_same_answer(lambda: checked(number, x, **kw), lambda: own(number, x, **kw)))
    assert seen == {"returned", "raised"}  # out-of-range and unsigned-negative numbers still raise


def test_pointer_offsets_answer_as_tritons_own():
    pass_pointer_offsets_through()
    checked, own = ti.interpreter_semantic.binary_op_type_checking_impl, _semantic_own("binary_op_type_checking_impl")
    seen = set()
    for ps in ((), (8,), (2, 8)):
        for offs in (*(_operand(n, s) for n in ("int32", "int64", "uint32", "int1", "fp32") for s in ((), (8,), (1, 8))),
                     3, 0, -5, 2**40, 0.5, _pointer(ps), _pointer(ps, tl.int32)):
            ptr = _pointer(ps)
            for allow in ((True, True), (True, False), (False, True), (False, False)):
                kw = dict(allow_lhs_ptr=allow[0], allow_rhs_ptr=allow[1])
                if isinstance(offs, tl.tensor) and offs.type.is_block() and ps and offs.type.shape[-1] != 8:
                    continue
                seen.add(_same_answer(lambda: checked(ptr, offs, **kw), lambda: own(ptr, offs, **kw)))
                seen.add(_same_answer(lambda: checked(offs, ptr, **kw), lambda: own(offs, ptr, **kw)))
    assert seen == {"returned", "raised"}  # a float or a pointer where none is allowed still raises


def test_listed_builtins_patch_what_tritons_getmembers_patches():
    cache_language_builtins()
    cached = ti._patch_builtin
    own = cached.original
    assert own.__module__ == "triton.runtime.interpreter" and own is not cached
    pkgs = (tl, tl.tensor, tl.math, tl.core, tl.core.tensor, tl.core.tensor_descriptor_base)

    def state():
        return [{n: getattr(p, n) for n in dir(p)} for p in pkgs]

    before = state()
    for _ in range(2):  # the first lists, the second reuses the list
        changes = []
        for patch in (own, cached):
            scope = ti._LangPatchScope()
            for pkg in pkgs:  # tl.tensor and tl.core.tensor are one class: patched once, as in a launch
                patch(pkg, ti.interpreter_builder, scope)
            changes.append([(id(obj), name, orig) for obj, name, orig in scope._changes])
            scope.restore()
            assert state() == before  # everything back
        assert changes[0] == changes[1] and len(changes[0]) > 100


def test_scalar_type_comparison_answers_as_tritons_own():
    compare_scalar_types_directly()
    own = _triton_own(tl.dtype.__eq__)
    assert own is not tl.dtype.__eq__
    others = (*_SCALARS, tl.pointer_type(tl.float32), tl.block_type(tl.float32, [4]), tl.constexpr(tl.float32),
              "fp32", None, 3)
    for t in _SCALARS:
        for other in others:
            got, want = t == other, own(t, other)
            assert type(got) is type(want) and got == want, (t, other)
            assert (t != other) == (not want)
    assert len({tl.float32, tl.float32, tl.int32}) == 2  # still hashable as before


def test_builtins_called_directly_answer_as_through_their_wrappers():
    call_language_builtins_directly()
    x, y = _operand("fp32", (4, 16)), _operand("int32", (4, 16))
    scope = ti._LangPatchScope()
    ti._patch_builtin(tl.math, ti.interpreter_builder, scope)
    ti._patch_builtin(tl.tensor, ti.interpreter_builder, scope)
    try:
        assert tl.math.exp.__qualname__.startswith("call_language_builtins_directly")
        got = (tl.math.exp(x), x + y, x.to(tl.bfloat16))
    finally:
        scope.restore()
    want = (tl.math.exp(x, _semantic=ti.interpreter_semantic), x.__add__(y, _semantic=ti.interpreter_semantic),
            x.to(tl.bfloat16, _semantic=ti.interpreter_semantic))
    for g, w in zip(got, want):
        assert g.type == w.type and np.array_equal(g.handle.data, w.handle.data)
    with pytest.raises(ValueError, match="_semantic"):
        tl.math.exp(x)  # restored: the wrapper's check is back outside a launch


def test_overflow_checks_are_skipped_only_where_triton_drops_them():
    import dataclasses

    skip_discarded_overflow_checks()
    semantic = ti.interpreter_semantic
    sanitize = semantic.binary_op_sanitize_overflow_impl
    own = next(c.cell_contents for c in sanitize.__closure__ if getattr(c.cell_contents, "__self__", None) is semantic)
    assert own.__name__ == "binary_op_sanitize_overflow_impl" and own is not sanitize
    big, one = _operand("int32", (4,)), _operand("int32", (4,))
    big.handle.data[:], one.handle.data[:] = 2**31 - 1, 1
    assert not semantic.builder.options.debug  # the interpreter's default
    assert own(big, one, semantic.add) is None and sanitize(big, one, semantic.add) is None  # computed and dropped
    saved = semantic.builder.options
    semantic.builder.options = dataclasses.replace(saved, debug=True)
    try:
        for check in (own, sanitize):  # in debug mode the shortcut runs Triton's check, which catches it
            with pytest.raises(AssertionError, match="int32 overflow detected for operation add"):
                check(big, one, semantic.add)
    finally:
        semantic.builder.options = saved


def test_child_processes_get_the_shortcuts_when_they_import_triton_and_only_then():
    """``tests/interpreter_site/sitecustomize.py`` (on every child's PYTHONPATH): a child that never imports Triton
    (a rank supervisor) does not import it; one that does has the shortcuts installed once the import is done."""
    import os
    import subprocess
    import sys

    site = os.path.join(os.path.dirname(__file__), "..", "..", "..", "interpreter_site")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.path.abspath(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    code = ("import sys, tensorrt_llm_ext.runtime.rank_supervisor; print('triton' in sys.modules)\n"
            "import triton.language\n"
            "from triton.runtime import interpreter as ti\n"
            "print(ti.GridExecutor.__call__.__qualname__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "skip_nested_repatching.<locals>.launch"], out.stdout
