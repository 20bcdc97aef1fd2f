"""The multi-rank test harness: the production launcher (:mod:`tensorrt_llm_ext.runtime.ranks`) under the
names the tests use.

Functions are shipped by value with cloudpickle (test modules are not importable on the ranks) and run on
every rank of an :class:`MpiPool`; a rank that raises is reported with its traceback, one that dies with
its exit code or signal, one that hangs is named after ``timeout`` with its stacks. After any failure the
pool is broken and the ``mpi_pool_executor`` fixture (``tests/conftest.py``) starts a fresh one.
"""

from __future__ import annotations

from tensorrt_llm_ext.runtime.ranks import MpiPool, RankJobError, run_on_ranks

__all__ = ["MpiPool", "RankJobError", "run_on_ranks"]
