"""Imported at the start of every Python process the tests start (``tests/conftest.py`` puts this folder first
on their ``PYTHONPATH``): servers, CLI runs and MPI ranks under ``TRITON_INTERPRET=1`` get the interpreter
shortcuts the test process has (:mod:`tensorrt_llm_ext.testing.interpreter`).

They are installed right after the process's first ``import triton`` completes, not here: a process that never
imports Triton (a rank supervisor, a helper script) skips importing it and numpy (0.3 CPU s each)."""

import importlib.abc
import importlib.util
import os
import sys


def _speed_up() -> None:
    try:
        from tensorrt_llm_ext.testing.interpreter import speed_up_interpreter
    except ImportError:  # a child that cannot import the package (a bare interpreter): nothing to speed up
        return
    speed_up_interpreter()


class _AfterTritonImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first lookup of ``triton`` it leaves ``sys.meta_path`` and hands back the
    regular spec with a loader that installs the shortcuts once the package has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != "triton":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _speed_up()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TRITON_INTERPRET") == "1":
    if "triton" in sys.modules:
        _speed_up()
    else:
        sys.meta_path.insert(0, _AfterTritonImport())
