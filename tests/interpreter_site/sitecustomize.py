"""Imported at the start of every Python process the tests start (``tests/conftest.py`` puts this folder first
on their ``PYTHONPATH``): servers, CLI runs and MPI ranks under ``TRITON_INTERPRET=1`` get the interpreter
shortcuts the test process has (:mod:`tensorrt_llm_ext.testing.interpreter`)."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        from tensorrt_llm_ext.testing.interpreter import speed_up_interpreter
    except ImportError:  # a child that cannot import the package (a bare interpreter): nothing to speed up
        pass
    else:
        speed_up_interpreter()
