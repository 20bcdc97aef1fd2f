"""Test session setup for unit and integration tests: Triton interpreter on CPU, bounded collectives,
MPI pools for multi-rank tests.

TRITON_INTERPRET must be set before any ``@triton.jit`` is evaluated, i.e. before the package's kernel
modules are imported -- which is why it happens here, at conftest import.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The tiny models' GEMMs are ~50x slower with 2 intra-op threads on the 2-core CI machines.
    torch.set_num_threads(1)
# A rank waiting for a peer that died raises instead of hanging (torch.distributed timeout).
os.environ.setdefault("TLLM_EXT_COLLECTIVE_TIMEOUT_S", "60")
# The kernel entry points read their per-row values back and refuse bad ones (opt-in: off in serving).
os.environ.setdefault("TLLM_EXT_CHECK_VALUES", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
# The signal tests send SIGINT / SIGHUP to the processes they start and expect the default reaction (KeyboardInterrupt,
# a drain). A shell that starts the suite in the background (`cmd &`) or under nohup hands it those signals ignored,
# an ignored signal stays ignored through exec, and the servers honour that (nohup's meaning), so those tests hung to
# their timeouts. A no-op handler keeps this process deaf to them as asked and, being a handler, is reset to the
# default in every process it starts; the variable carries the choice into pytest-xdist's workers.
for _sig in (signal.SIGINT, signal.SIGHUP):
    _deaf = f"TLLM_EXT_TESTS_DEAF_{_sig.name}"
    if signal.getsignal(_sig) == signal.SIG_IGN or os.environ.get(_deaf) == "1":
        os.environ[_deaf] = "1"
        signal.signal(_sig, lambda *_: None)
_bindir = os.path.dirname(sys.executable)
os.environ["PATH"] = _bindir + os.pathsep + os.environ.get("PATH", "")

from tensorrt_llm_ext.testing.interpreter import speed_up_interpreter  # noqa: E402
from tensorrt_llm_ext.testing.mpi import MpiPool  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    speed_up_interpreter()
    # ... and in every process the tests start (servers, CLI runs, MPI ranks): interpreter_site/sitecustomize.py
    _site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interpreter_site")
    os.environ["PYTHONPATH"] = os.pathsep.join([_site, *filter(None, [os.environ.get("PYTHONPATH")])])

_POOLS: dict[int, MpiPool] = {}


@pytest.fixture
def mpi_pool_executor(request):
    """An MPI pool of ``request.param`` ranks (default 2), reused across tests until a test breaks it
    (:class:`tensorrt_llm_ext.runtime.ranks.MpiPool`: supervised ranks outside this process's MPI job)."""
    world = getattr(request, "param", 2)
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    pool = _POOLS.get(world)
    if pool is None or pool.broken:
        pool = MpiPool(world).start()
        _POOLS[world] = pool
    yield pool


def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist's ``--dist loadgroup`` (the test-list runner's): every multi-rank test joins one
    group, so they run one after another on one worker (one MPI pool at a time, as without xdist) while the
    other workers take the single-process tests; and the tests of a module that share one of its module-scoped
    fixtures (a trained drafter, a running server, a built engine) join that module's group, so the fixture is
    built once, not once per worker that happens to draw one of them."""
    for item in items:
        if "mpi_pool_executor" in item.fixturenames or "multi_gpu" in item.path.parts:
            item.add_marker(pytest.mark.xdist_group("mpi"))
        elif _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _uses_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the fixtures an item resolves
    if info is None:
        return False
    return any(defs and defs[-1].scope in ("module", "package", "class")
               for defs in info.name2fixturedefs.values())


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.shutdown()
    _POOLS.clear()
