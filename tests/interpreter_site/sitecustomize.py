"""Imported at the start of every Python process the tests start (``tests/conftest.py`` puts this folder first
on their ``PYTHONPATH``): servers, CLI runs and MPI ranks under ``TRITON_INTERPRET=1`` get the interpreter
shortcut the test process has (:mod:`tensorrt_llm_ext.testing.interpreter`)."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        from tensorrt_llm_ext.testing.interpreter import skip_nested_repatching
    except ImportError:  # a child that cannot import the package (a bare interpreter): nothing to speed up
        pass
    else:
        skip_nested_repatching()
