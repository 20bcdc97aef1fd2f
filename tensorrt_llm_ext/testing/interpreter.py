"""Shortcuts for the Triton CPU interpreter (``TRITON_INTERPRET=1``) the tests run every kernel under.

The interpreter runs a kernel op by op through Triton's front-end semantics on numpy data, and most of its
time goes to bookkeeping that repeats the same answer: per-op costs, not per-element ones, which is why tiny
test shapes are still slow. :func:`speed_up_interpreter` installs these shortcuts, each once per process:

* :func:`skip_nested_repatching`: a launch (``GridExecutor.__call__``) patches the language modules its
  function's globals name (``tl.add`` and friends become numpy-backed), runs every program, and restores them;
  each call of a nested ``@triton.jit`` helper (``InterpretedFunction.__call__``: Philox rounds, ordered keys,
  tile loops) ran that patch again -- a scan of every member of ``triton.language`` -- for attributes that
  already hold those values (40-50 % of the kernel tests' CPU). Skipped when the helper names no language
  module beyond those already patched in the running launch (one that names another still patches it).
* :func:`cache_np_dtype_lookup`: the interpreter's Triton-to-numpy dtype table, rebuilt on every op.
* :func:`cache_block_types` and :func:`cache_tensor_shapes`: the shape, numel and name every op's result type
  and tensor derive from an (element type, shape) pair the process has already seen.
* :func:`compare_int_tuples_directly`: a shape (``tl.tuple``) compared with a list of ints -- every broadcast
  of a binary op -- without first wrapping the list in a new ``tl.tuple`` and its type.
* :func:`pass_same_typed_operands_through`: a binary op whose two tensors already have the same type (the
  common case) skips the promotion, cast and broadcast steps that would hand both back unchanged; one element
  type in two shapes is only broadcast.
* :func:`compare_scalar_types_directly`: two scalar types compared by name at once (every cast asks).
* :func:`call_language_builtins_directly`: a launch's stand-in for each language builtin calls the function
  itself, not the wrapper that checks for a semantic the stand-in always passes.
* :func:`skip_discarded_overflow_checks`: the overflow check of every 8- to 32-bit integer add, sub and mul,
  whose result the interpreter computes and then drops unless the kernel runs in debug mode.
* :func:`splat_scalars_directly`: a scalar beside a block splat without the two extra block types Triton builds;
  two blocks of one shape (a tile of pointers and its mask) passed without comparing them dimension by dimension.
* :func:`pass_python_numbers_through`: a tensor beside a Python number of no higher kind (``i + 1``, ``x * 0.5``)
  gets the one constant Triton keeps, without the promotion, the discarded first constant and the no-op cast.
* :func:`pass_pointer_offsets_through`: a pointer beside integer offsets goes straight to the broadcast.
* :func:`cache_language_builtins`: the builtins of each language module and class a launch patches, listed once
  at install (not by ``inspect.getmembers`` at every launch).

Measured on 2026-12-04 (CPU seconds, back to back): ``test_vocab_parallel.py`` 40.0 -> 29.3 s from the shape
caches, an interpreted Philox test 22.5 -> 18.6 s from the dtype table alone; later the same day the last four
(scalar types, builtins, overflow checks, the broadcast-only case) took ``test_verification.py``,
``test_vocab_parallel.py`` and ``test_markov_chain.py`` together from 104.1 to 78.5 s; the last three
(splats, Python numbers, pointer offsets) took a kernel / engine sample (a Gumbel test, a lossless engine test,
``test_block_stats.py``) from 15.8-16.3 to 13.7-14.3 CPU s, back to back, the same day.

Test support only: the tests install them (``tests/conftest.py``, and through
``tests/interpreter_site/sitecustomize.py`` in every process they start: servers, CLI runs, MPI ranks). The
first checks that the interpreter's two methods are the ones it was written against and leaves a different
Triton alone (one log line); the caches fall back to Triton's own code for anything they do not know. None
changes what a kernel computes, only how often the interpreter repeats a setup.
"""
from __future__ import annotations

import inspect

from tensorrt_llm_ext.logger import logger

__all__ = ["cache_block_types", "cache_np_dtype_lookup", "cache_tensor_shapes", "call_language_builtins_directly",
           "compare_int_tuples_directly", "compare_scalar_types_directly", "pass_same_typed_operands_through",
           "pass_python_numbers_through", "skip_discarded_overflow_checks", "skip_nested_repatching",
           "speed_up_interpreter", "splat_scalars_directly"]

_DONE: set[str] = set()  # the shortcuts installed in this process (each installs once)
_REPATCHING_SKIPPED: list[bool] = []  # skip_nested_repatching's answer, once it has decided
_BLOCK_SHAPES: dict[int, object] = {}  # id -> a shape cache_block_types hands out (kept alive: ids stay unique)


def speed_up_interpreter() -> None:
    """The shortcuts below, once per process (the tests' entry point)."""
    skip_nested_repatching()
    cache_np_dtype_lookup()
    cache_block_types()
    cache_tensor_shapes()
    compare_int_tuples_directly()
    pass_same_typed_operands_through()
    compare_scalar_types_directly()
    call_language_builtins_directly()
    skip_discarded_overflow_checks()
    splat_scalars_directly()
    pass_python_numbers_through()
    pass_pointer_offsets_through()
    cache_language_builtins()


def cache_np_dtype_lookup() -> None:
    """Memoize the interpreter's ``_get_np_dtype`` (Triton dtype -> numpy dtype of its storage).

    The interpreter calls it on every cast, constant and binary op, and each call builds its 19-entry
    table anew: 7-10 % of an interpreted Philox kernel's CPU time. The answer depends on the dtype's name
    only (``tl.dtype`` compares by name); a block answers for its element type and every pointer is
    ``uint64``, as in the original, which computes each first answer.
    """
    if "dtypes_cached" in _DONE:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    original = ti._get_np_dtype
    pointer = np.dtype(np.uint64)
    by_name: dict[str, object] = {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        got = by_name.get(tt_dtype.name)
        if got is None:
            got = by_name[tt_dtype.name] = original(tt_dtype)
        return got

    ti._get_np_dtype = get_np_dtype
    _DONE.add("dtypes_cached")


def skip_nested_repatching() -> bool:
    """Install the shortcut once per process; True when installed (now or before)."""
    if _REPATCHING_SKIPPED:
        return _REPATCHING_SKIPPED[0]
    import triton.language as tl
    from triton.runtime import interpreter as ti

    grid_call, nested_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__
    try:
        known = ("patch_scope = _patch_lang(self.fn)" in inspect.getsource(grid_call)
                 and "patch_scope.restore()" in inspect.getsource(grid_call)
                 and "_patch_lang(self.fn)" in inspect.getsource(nested_call))
    except (OSError, TypeError):
        known = False
    if not known:
        logger.info("Triton interpreter: launch / nested-call patching is not the one the test shortcut knows; "
                    "running the interpreter unchanged")
        _REPATCHING_SKIPPED.append(False)
        return False

    languages: dict = {}  # jit function -> ids of the language modules its globals name
    patched: list[set[int]] = []  # per running launch (nested launches stack): language modules patched

    def names(fn) -> frozenset[int]:
        got = languages.get(fn)
        if got is None:
            got = languages[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                            if inspect.ismodule(v) and v in (tl, tl.core))
        return got

    def launch(self, *args, **kwargs):
        patched.append(set(names(self.fn)))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def nested(self, *args, **kwargs):
        if not patched or not names(self.fn) <= patched[-1]:
            if patched:  # patched now, and (as before) left patched until the launch restores the language
                patched[-1] |= names(self.fn)
            return nested_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # the interpreter's own wrapping of a nested call's error
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = nested
    _REPATCHING_SKIPPED.append(True)
    return True


def cache_block_types() -> None:
    """Memoize what ``tl.block_type(element, shape)`` derives from its arguments.

    Every interpreted op builds the block type of its result: the shape unwrapped into a ``tl.tuple``, checked
    (powers of two, at most Triton's numel), its numel and its name -- a fifth of an interpreted kernel's CPU
    time, for a few hundred distinct (element type, shape) pairs. For a scalar or pointer element type (what
    the three depend on is its name) and a shape of plain ints (a list or a ``tl.tuple``), the first
    construction computes them with Triton's own ``__init__``; later ones reuse its shape, numel and name (the
    shape object is shared, by every element type's block of those dims too: nothing in the interpreter writes
    to a block type's shape). Anything else -- constexpr shapes, a shape Triton refuses -- takes the original
    path, which raises as before.
    """
    if "blocks_cached" in _DONE:
        return
    import triton.language as tl

    original = tl.block_type.__init__
    scalar, pointer, triton_tuple = tl.dtype, tl.pointer_type, tl.tuple
    derived: dict[tuple, tuple] = {}
    shapes: dict[tuple, object] = {}  # dims -> the one shape object every element type's block of them shares

    def init(self, element_ty, shape):
        key = None
        dims = shape.values if type(shape) is triton_tuple else shape if type(shape) is list else None
        te = type(element_ty)
        if (te is scalar or te is pointer) and dims is not None and all(type(d) is int for d in dims):
            key = (element_ty.name, *dims)
            got = derived.get(key)
            if got is not None:
                self.element_ty = element_ty
                self.shape, self.numel, self.name = got
                return
        original(self, element_ty, shape)
        if key is not None:
            self.shape = shapes.setdefault(key[1:], self.shape)  # equal values: one object, so `is` finds them equal
            derived[key] = (self.shape, self.numel, self.name)
            _BLOCK_SHAPES[id(self.shape)] = self.shape

    tl.block_type.__init__ = init
    _DONE.add("blocks_cached")


def cache_tensor_shapes() -> None:
    """Memoize what ``tl.tensor(handle, type)`` derives from a block type's shape: its numel and its shape as a
    ``tl.tuple`` of constexprs (built element by element, with the tuple's type, for every interpreted op's
    result). Keyed by the identity of a shape :func:`cache_block_types` handed out (those shapes live for the
    process), or a scalar's (empty) shape; any other type takes Triton's own ``__init__``."""
    if "shapes_cached" in _DONE:
        return
    import triton.language as tl

    original = tl.tensor.__init__
    fields: dict[int, tuple] = {}  # id of a handed-out block shape -> (numel, shape of constexprs)

    def init(self, handle, type):
        shape = type.shape if type.is_block() else None  # a scalar: every scalar has shape () and numel 1
        got = fields.get(id(shape))
        if got is None:
            original(self, handle, type)
            if shape is None or _BLOCK_SHAPES.get(id(shape)) is shape:
                fields[id(shape)] = (self.numel, self.shape)
            return
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        self.numel, self.shape = got

    tl.tensor.__init__ = init
    _DONE.add("shapes_cached")


def compare_int_tuples_directly() -> None:
    """``tl.tuple == other`` for ``other`` a list or ``tl.tuple`` of plain ints: Triton normalizes ``other`` into
    a fresh ``tl.tuple`` (unwrapping constexprs, which plain ints are not, and typing every element) and then
    compares the two value lists; the shortcut compares the value lists at once, with the same result (a
    ``constexpr`` of the list comparison). Anything else takes Triton's own ``__eq__``."""
    if "tuples_compared" in _DONE:
        return
    import triton.language as tl

    original, triton_tuple, constexpr = tl.tuple.__eq__, tl.tuple, tl.constexpr

    def eq(self, other):
        values = other if type(other) is list else other.values if type(other) is triton_tuple else None
        if values is not None and all(type(v) is int for v in values):
            return constexpr(self.values == values)
        return original(self, other)

    tl.tuple.__eq__ = eq
    _DONE.add("tuples_compared")


# Scalar types whose promotion with themselves is themselves (Triton's computation_type_impl: fp64, fp32,
# the integers and bool; fp16 / bf16 too, except for / and %, which promote them to fp32). fp8 is left out.
_SELF_PROMOTING = frozenset(("fp64", "fp32", "fp16", "bf16", "int1", "int8", "int16", "int32", "int64", "uint8",
                             "uint16", "uint32", "uint64"))
_HALF = frozenset(("fp16", "bf16"))


def _install_type_check(name: str, make) -> None:
    """Installs ``make(tl, semantic, original)`` -- a ``checked`` that answers its cases at once and hands the rest
    to ``original``, the interpreter's ``binary_op_type_checking_impl`` as it stands (Triton's own, or the shortcut
    installed before) -- in its place, once per process (``name`` in ``_DONE`` marks it)."""
    if name in _DONE:
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    semantic = ti.interpreter_semantic
    semantic.binary_op_type_checking_impl = make(tl, semantic, semantic.binary_op_type_checking_impl)
    _DONE.add(name)


def pass_same_typed_operands_through() -> None:
    """The interpreter's ``binary_op_type_checking_impl`` for two tensors of one type (the same scalar type, or
    the same block type: one element type and the very shape object :func:`cache_block_types` hands out): Triton
    checks pointer use (none: not pointers), promotes the two types (to that same type, see
    ``_SELF_PROMOTING``), casts each operand to it (a no-op that returns the operand) and broadcasts them (equal
    shapes: both returned as they are) -- so the shortcut returns ``(lhs, rhs)`` at once. One element type in two
    shapes (a scalar beside a block: a loop counter times a tile) goes straight to Triton's broadcast, the one
    step of the four that does anything there. Anything else (a Python number, pointers, two element types,
    fp8, / or % on 16-bit floats) takes Triton's own path."""
    _install_type_check("operands_passed", _same_typed_operands)


def _same_typed_operands(tl, semantic, original):
    tensor, scalar, block = tl.tensor, tl.dtype, tl.block_type

    broadcast = semantic.broadcast_impl_value

    def checked(lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        if type(lhs) is tensor and type(rhs) is tensor:
            a, b = lhs.type, rhs.type
            ea = a.element_ty if type(a) is block else a
            eb = b.element_ty if type(b) is block else b
            if (type(ea) is scalar and type(eb) is scalar and ea.name == eb.name and ea.name in _SELF_PROMOTING
                    and not (div_or_mod and ea.name in _HALF)):
                if a is ea and b is eb or type(a) is block and type(b) is block and a.shape is b.shape:
                    return lhs, rhs
                return broadcast(lhs, rhs)  # a scalar beside a block, or two shapes: Triton's own broadcast
        return original(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    return checked


def compare_scalar_types_directly() -> None:
    """``tl.dtype == other`` for ``other`` a ``tl.dtype`` itself (not a subclass): Triton unwraps ``other`` from a
    constexpr and checks its class before comparing the two names; the shortcut compares the names at once (the
    same answer). Every cast and every type check of an interpreted op asks it. Anything else -- a constexpr,
    a pointer or block type, another object -- takes Triton's own ``__eq__``."""
    if "dtypes_compared" in _DONE:
        return
    import triton.language as tl

    original, scalar = tl.dtype.__eq__, tl.dtype

    def eq(self, other):
        if type(other) is scalar:
            return self.name == other.name
        return original(self, other)

    tl.dtype.__eq__ = eq
    _DONE.add("dtypes_compared")


def call_language_builtins_directly() -> None:
    """The interpreter's stand-in for a language builtin (``tl.load``, ``tl.where``, a tensor's ``__add__``...,
    made by ``_patch_attr`` for every launch): a lambda that copies the keyword arguments without ``_semantic``
    and calls the builtin's wrapper with the interpreter's semantic, which checks that a ``_semantic`` was given
    and calls the function. The shortcut's stand-in calls the wrapped function with that semantic at once (the
    wrapper's check always passes there). A member that is not a builtin wrapper takes Triton's own path."""
    if "builtins_direct" in _DONE:
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    original = ti._patch_attr
    semantic, is_builtin = ti.interpreter_semantic, tl.core.is_builtin

    def patch_attr(obj, name, member, builder, scope):
        fn = getattr(member, "__wrapped__", None)
        if fn is None or not is_builtin(member):
            return original(obj, name, member, builder, scope)

        def direct(*args, **kwargs):
            kwargs["_semantic"] = semantic
            return fn(*args, **kwargs)

        scope.set_attr(obj, name, direct)

    ti._patch_attr = patch_attr
    _DONE.add("builtins_direct")


def skip_discarded_overflow_checks() -> None:
    """The interpreter's ``binary_op_sanitize_overflow_impl`` outside debug mode: for every add, sub and mul of
    8- to 32-bit integers (the interpreter's ``sanitize_overflow`` is on) Triton recomputes the op in int64,
    builds the type's bounds, compares, and hands the condition to ``device_assert`` -- which returns at once
    unless the launch's ``debug`` option is set, so the whole check is computed and dropped (a quarter of an
    interpreted Philox kernel's CPU time). The shortcut returns before computing it when ``debug`` is off, as
    ``device_assert`` would have; with ``debug`` on it runs Triton's own check."""
    if "overflow_skipped" in _DONE:
        return
    from triton.runtime import interpreter as ti

    semantic = ti.interpreter_semantic
    original = semantic.binary_op_sanitize_overflow_impl

    def sanitize(lhs, rhs, binary_op):
        if not semantic.builder.options.debug:
            return None
        return original(lhs, rhs, binary_op)

    semantic.binary_op_sanitize_overflow_impl = sanitize
    _DONE.add("overflow_skipped")


def splat_scalars_directly() -> None:
    """The interpreter's ``broadcast_impl_value`` for a block beside a scalar (a loop counter times a tile, a base
    pointer plus a tile of offsets, a ``tl.where`` on a scalar): Triton builds the scalar's block type, converts it
    ``to_ir`` (another block type, of which the splat reads only the shape) and splats; the shortcut builds the
    block type once (through :func:`cache_block_types`) and hands it to the same ``create_splat``. Two scalars
    come back as they are, as in Triton; two blocks of one shape too (a tile of pointers and its mask: Triton
    compares the shapes, finds them equal and returns both). Anything else -- two blocks of two shapes -- takes Triton's own
    path."""
    if "splats_direct" in _DONE:
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    semantic = ti.interpreter_semantic
    original = semantic.broadcast_impl_value
    tensor, block, scalar, pointer, triple = tl.tensor, tl.block_type, tl.dtype, tl.pointer_type, tl.tuple
    splat = semantic.builder.create_splat

    def broadcast(lhs, rhs):
        a, b = lhs.type, rhs.type
        ta, tb = type(a), type(b)
        if ta is block:
            if tb is scalar or tb is pointer:
                ty = block(b, a.shape)
                return lhs, tensor(splat(ty, rhs.handle), ty)
            if tb is block and (a.shape is b.shape or type(a.shape) is triple and type(b.shape) is triple
                                and a.shape.values == b.shape.values):
                return lhs, rhs
        elif tb is block:
            if ta is scalar or ta is pointer:
                ty = block(a, b.shape)
                return tensor(splat(ty, lhs.handle), ty), rhs
        elif (ta is scalar or ta is pointer) and (tb is scalar or tb is pointer):
            return lhs, rhs
        return original(lhs, rhs)

    semantic.broadcast_impl_value = broadcast
    _DONE.add("splats_direct")


def pass_python_numbers_through() -> None:
    """The interpreter's ``binary_op_type_checking_impl`` for a tensor and a Python ``int`` or ``float`` (``i + 1``,
    ``x * 0.5``: every constant of a kernel's arithmetic): Triton makes a constant of the number's own type (to
    read its kind), promotes, finds the tensor's type (a number of a kind no higher than the tensor's joins it,
    PyTorch-like), checks sign and range, makes the constant again in that type, casts the tensor to its own type
    (a no-op) and broadcasts. Where the number's kind is no higher than the tensor's (an int beside an integer or
    float tensor, a float beside a float tensor), the tensor is not a pointer or fp8, and the range checks pass,
    the shortcut makes the one constant Triton keeps (``scalar_constant`` in the tensor's type) and broadcasts it
    (:func:`splat_scalars_directly`). Anything else -- a negative number beside an unsigned tensor, a number
    out of the type's range, a float beside an integer tensor, ``/`` or ``%`` on 16-bit floats, ``bool``, a
    constexpr, ``arithmetic_check`` off -- takes Triton's own path, which raises or promotes as before."""
    _install_type_check("numbers_passed", _python_numbers)


def _python_numbers(tl, semantic, original):
    tensor, block, scalar = tl.tensor, tl.block_type, tl.dtype
    constant = semantic.scalar_constant
    int_min, int_max = -2**63, 2**64  # what Triton makes a constant of (int32, uint32, int64 or uint64)
    float_kind = tl.float32.kind()

    def joins(ty, number) -> bool:
        # The number's type (Triton's to_tensor_type) is of a kind no higher than the tensor's element type's.
        name = ty.name
        if name not in _SELF_PROMOTING or name == "int1":
            return False
        if type(number) is int:
            if not int_min <= number < int_max:  # not representable: Triton's to_tensor_type raises
                return False
            if ty.is_int():
                return (not (number < 0 and ty.is_int_unsigned())
                        and ty.get_int_min_value() <= number <= ty.get_int_max_value())
            return True  # an int beside a float tensor
        return ty.kind() == float_kind  # a float beside a float tensor

    def checked(lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        if arithmetic_check:
            tl_, tr = type(lhs), type(rhs)
            if tl_ is tensor and (tr is int or tr is float):
                ty = lhs.type
                elem = ty.element_ty if type(ty) is block else ty
                if (type(elem) is scalar and joins(elem, rhs)
                        and not (div_or_mod and elem.name in _HALF)):
                    return semantic.broadcast_impl_value(lhs, constant(rhs, dtype=elem))
            elif tr is tensor and (tl_ is int or tl_ is float):
                ty = rhs.type
                elem = ty.element_ty if type(ty) is block else ty
                if (type(elem) is scalar and joins(elem, lhs)
                        and not (div_or_mod and elem.name in _HALF)):
                    return semantic.broadcast_impl_value(constant(lhs, dtype=elem), rhs)
        return original(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    return checked


def pass_pointer_offsets_through() -> None:
    """The interpreter's ``binary_op_type_checking_impl`` for a pointer (a scalar or a block of them) beside integer
    offsets (a tensor of integers or a Python ``int``) where the op allows a pointer on that side (``ptr + offs``):
    Triton checks the pointer use (an integer beside a pointer passes), skips the promotion (a pointer takes
    none), and broadcasts the two; the shortcut goes straight to the broadcast (a Python ``int`` made a constant
    first, by Triton's own ``to_tensor``). A float or a pointer beside a pointer, or a pointer where the op allows
    none, takes Triton's own path, which raises as before."""
    _install_type_check("pointers_passed", _pointer_offsets)


def _pointer_offsets(tl, semantic, original):
    tensor, block, scalar, pointer = tl.tensor, tl.block_type, tl.dtype, tl.pointer_type
    to_tensor = semantic.to_tensor

    def kind(x):
        # "p": a tensor of pointers, "i": a tensor of integers or a Python int, None: anything else
        t = type(x)
        if t is tensor:
            ty = x.type
            elem = ty.element_ty if type(ty) is block else ty
            te = type(elem)
            if te is pointer:
                return "p"
            if te is scalar and elem.is_int():
                return "i"
            return None
        return "i" if t is int else None

    def checked(lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        if allow_lhs_ptr or allow_rhs_ptr:
            kl, kr = kind(lhs), kind(rhs)
            if kl == "p" and kr == "i" and allow_lhs_ptr or kl == "i" and kr == "p" and allow_rhs_ptr:
                return semantic.broadcast_impl_value(to_tensor(lhs), to_tensor(rhs))
        return original(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    return checked


def cache_language_builtins() -> None:
    """The interpreter's ``_patch_builtin`` (each launch, for ``triton.language``, ``triton.language.core``, their
    ``tensor`` class, ``math`` and the descriptor base): ``inspect.getmembers`` of the module or class -- every
    attribute fetched, sorted -- to find its builtins and patch each. The shortcut lists their builtins once, when
    it is installed (outside any launch: all of them in place), and at each patch takes those still in place, as
    Triton would find them (a member that a running launch already replaced is no builtin to Triton either). Any
    other module or class takes Triton's own path; what a language module gained after the install would not be
    listed (they are complete once imported)."""
    if "builtins_listed" in _DONE:
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    original = ti._patch_builtin
    is_builtin = tl.core.is_builtin
    listed = {id(pkg): (pkg, [(n, m) for n, m in inspect.getmembers(pkg) if is_builtin(m)])
              for pkg in (tl, tl.core, tl.math, tl.tensor, tl.core.tensor, tl.core.tensor_descriptor_base)}

    def patch_builtin(pkg, builder, scope):
        entry = listed.get(id(pkg))
        if entry is None or entry[0] is not pkg:
            return original(pkg, builder, scope)
        patch = ti._patch_attr
        for name, member in entry[1]:
            if getattr(pkg, name, None) is member:
                patch(pkg, name, member, builder, scope)

    patch_builtin.original = original
    ti._patch_builtin = patch_builtin
    _DONE.add("builtins_listed")
