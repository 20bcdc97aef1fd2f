"""The Triton CPU interpreter (``TRITON_INTERPRET=1``) without its per-call re-patching of ``triton.language``
and without rebuilding its dtype table on every op (:func:`speed_up_interpreter` installs both).

Under the interpreter a kernel launch (``GridExecutor.__call__``) patches the language modules its function's
globals name (``tl.add`` and friends become numpy-backed), runs every program, and restores them. Each call of
a nested ``@triton.jit`` helper (``InterpretedFunction.__call__``: Philox rounds, ordered keys, tile loops)
runs that same patch again -- a scan of every member of ``triton.language`` -- and never restores it: 40-50 %
of the CPU time of the kernel tests, for attributes that already hold those values. :func:`skip_nested_repatching`
skips the repeat when the helper names no language module beyond those already patched in the running launch
(a helper that names another, e.g. ``triton.language.random``'s ``core``, still patches it, as before).

Test support only: the tests install them (``tests/conftest.py``, and on every MPI rank of their pools). It
checks that the interpreter's two methods are the ones it was written against and leaves a different Triton
alone (one log line); neither changes what a kernel computes, only how often the interpreter repeats a setup.
"""

from __future__ import annotations

import inspect

from tensorrt_llm_ext.logger import logger

__all__ = ["cache_np_dtype_lookup", "skip_nested_repatching", "speed_up_interpreter"]

_INSTALLED: list[bool] = []
_DTYPES_CACHED: list[bool] = []


def speed_up_interpreter() -> None:
    """Both shortcuts below, once per process (the tests' entry point)."""
    skip_nested_repatching()
    cache_np_dtype_lookup()


def cache_np_dtype_lookup() -> None:
    """Memoize the interpreter's ``_get_np_dtype`` (Triton dtype -> numpy dtype of its storage).

    The interpreter calls it on every cast, constant and binary op, and each call builds its 19-entry
    table anew: 7-10 % of an interpreted Philox kernel's CPU time. The answer depends on the dtype's name
    only (``tl.dtype`` compares by name); a block answers for its element type and every pointer is
    ``uint64``, as in the original, which computes each first answer.
    """
    if _DTYPES_CACHED:
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
    _DTYPES_CACHED.append(True)


def skip_nested_repatching() -> bool:
    """Install the shortcut once per process; True when installed (now or before)."""
    if _INSTALLED:
        return _INSTALLED[0]
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
        _INSTALLED.append(False)
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
    _INSTALLED.append(True)
    return True
