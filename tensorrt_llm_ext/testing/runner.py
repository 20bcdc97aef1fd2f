"""``trtllm-ext test-list``: run a test-db list with pytest, honouring each entry's TIMEOUT."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.testing.test_db import (list_entries, load_test_db, matching_lists)


def repo_root() -> Path:
    """The source tree (lists and tests are not installed with the package)."""
    here = Path(__file__).resolve()
    for p in [Path.cwd(), *here.parents]:
        if (p / "test_lists" / "test-db").is_dir() and (p / "tests").is_dir():
            return p
    raise FileNotFoundError("run from the tensorrt_llm_ext source tree (test_lists/ and tests/ not found)")


def machine() -> tuple[str, int]:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.get_device_name(0), torch.cuda.device_count()
    return "cpu", 0


def run_test_list(name: str | None, dry_run: bool = False, pytest_args: list[str] | None = None,
                  jobs: int | None = None) -> int:
    """Run the list ``name`` (default: the lists matching this machine), one pytest per TIMEOUT group.

    ``jobs``: pytest-xdist workers per group (``None``: one per CPU core, at most 2, on a machine without
    a GPU when pytest-xdist is installed; ``0`` or ``1``: one process). Multi-rank tests share one xdist
    group (``tests/conftest.py``), so they run one after another on one worker while the others take the
    single-process tests. GPU machines run one process: the tests there share the device.
    """
    root = repo_root()
    lists = load_test_db(root / "test_lists" / "test-db")
    if name is None:
        gpu, count = machine()
        names = matching_lists(lists, gpu, count)
        if not names:
            logger.error(f"no test list matches this machine ({gpu}, {count} GPUs)")
            return 2
        logger.info(f"lists matching this machine ({gpu}, {count} GPUs): {', '.join(names)}")
    else:
        names = [name]
    by_timeout: dict[int, list[str]] = defaultdict(list)
    for n in names:
        for e in list_entries(lists, n):
            ids = by_timeout[e.timeout_min]
            node = f"tests/{e.node_id}"
            if node not in ids:
                ids.append(node)
    rc = 0
    env = dict(os.environ)
    if not _has_cuda():
        env.setdefault("TRITON_INTERPRET", "1")
    per_test = _has_pytest_timeout()
    if not per_test:
        # The GPU machine has pytest but no registry to install pytest-timeout from: passing --timeout
        # there would make pytest exit with a usage error before running any test.
        logger.warning("pytest-timeout is not installed: each entry's TIMEOUT bounds its whole group of tests "
                       "(entries x minutes) instead of each test")
    workers = _xdist_workers(jobs, pytest_args or [])
    for timeout_min, ids in sorted(by_timeout.items()):
        limit = ["--timeout", str(timeout_min * 60)] if per_test else []
        spread = ["-n", str(workers), "--dist", "loadgroup"] if workers > 1 else []
        cmd = [sys.executable, "-m", "pytest", "-q", *limit, *spread, *ids, *(pytest_args or [])]
        if dry_run:
            print(f"# TIMEOUT {timeout_min} min, {len(ids)} tests")
            print(" ".join(cmd))
            continue
        try:
            rc = subprocess.call(cmd, cwd=root, env=env,
                                 timeout=None if per_test else timeout_min * 60 * len(ids)) or rc
        except subprocess.TimeoutExpired:
            logger.error(f"tests with TIMEOUT ({timeout_min}) ran past {timeout_min * len(ids)} min: stopped")
            rc = 1
    return rc


def _xdist_workers(jobs: int | None, pytest_args: list[str]) -> int:
    """Workers per pytest run: ``jobs`` if given, else one per core (at most 2) on a CPU-only machine with
    pytest-xdist; 1 when the caller passes its own ``-n`` or xdist is missing (logged)."""
    if any(a == "-n" or a.startswith(("-n=", "--numprocesses")) for a in pytest_args):
        return 1
    has_xdist = importlib.util.find_spec("xdist") is not None
    if jobs is None:
        jobs = 1 if _has_cuda() else min(2, os.cpu_count() or 1)
    if jobs > 1 and not has_xdist:
        logger.info(f"pytest-xdist is not installed: running the tests in one process (asked for {jobs})")
        return 1
    if jobs > 1:
        logger.info(f"running each group on {jobs} pytest-xdist workers (multi-rank tests on one of them)")
    return max(1, jobs)


def _has_pytest_timeout() -> bool:
    return importlib.util.find_spec("pytest_timeout") is not None


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
