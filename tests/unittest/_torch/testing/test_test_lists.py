"""The test-db lists: every test is listed, every entry exists, bad input is rejected clearly."""

from pathlib import Path

import pytest

from tensorrt_llm_ext.testing.test_db import (ListDbError, check_lists, list_entries, load_test_db,
                                              matching_lists, parse_entry)

ROOT = Path(__file__).resolve().parents[4]


def test_repo_lists_cover_every_test():
    unlisted, dangling = check_lists(ROOT / "tests", ROOT / "test_lists" / "test-db")
    assert unlisted == [], f"tests no list selects (they would never run): {unlisted}"
    assert dangling == [], f"list entries naming no test: {dangling}"
    lists = load_test_db(ROOT / "test_lists" / "test-db")
    assert {"l0_cpu", "l0_h200", "l0_dgx_h200", "l0_b200", "l0_dgx_b200", "l0_gb300_multi_gpus"} <= set(lists)


def _write(tmp_path, tests_src: str, list_src: str):
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_a.py").write_text(tests_src)
    (tmp_path / "db").mkdir()
    (tmp_path / "db" / "l0_x.yml").write_text(list_src)
    return tmp_path / "tests", tmp_path / "db"


LIST = """version: 0.0.1
l0_x:
- condition:
    ranges: {system_gpu_count: {gte: 0, lte: 0}}
  tests:
  - unit/test_a.py::test_one TIMEOUT (5)
  - unit/test_a.py::test_gone
"""


def test_check_catches_unlisted_and_dangling(tmp_path):
    tests, db = _write(tmp_path, "def test_one():\n    pass\n\ndef test_two():\n    pass\n", LIST)
    unlisted, dangling = check_lists(tests, db)
    assert unlisted == ["unit/test_a.py::test_two"]
    assert dangling == ["unit/test_a.py::test_gone"]
    entries = list_entries(load_test_db(db), "l0_x")
    assert [(e.node_id, e.timeout_min) for e in entries] == [("unit/test_a.py::test_one", 5),
                                                             ("unit/test_a.py::test_gone", 10)]


def test_bad_list_input_is_rejected(tmp_path):
    tests, db = _write(tmp_path, "def test_one():\n    pass\n", LIST)
    with pytest.raises(ListDbError, match="unknown test list 'l0_nope'"):
        list_entries(load_test_db(db), "l0_nope")
    (db / "l0_bad.yml").write_text("version: 0.0.1\nl0_bad:\n- condition: {ranges: {x: {gte: 1}}}\n  tests: [nonsense]\n")
    with pytest.raises(ListDbError, match="l0_bad.yml"):
        load_test_db(db)
    (db / "l0_bad.yml").write_text("version: 0.0.1\nl0_bad: [\n")
    with pytest.raises(ListDbError, match="not valid YAML"):
        load_test_db(db)
    with pytest.raises(ListDbError, match="bad test entry"):
        parse_entry("test_x.py test_y")


def test_machine_matching():
    lists = load_test_db(ROOT / "test_lists" / "test-db")
    assert matching_lists(lists, "cpu", 0) == ["l0_cpu"]
    assert matching_lists(lists, "NVIDIA H200", 1) == ["l0_h200"]
    assert matching_lists(lists, "NVIDIA H200", 4) == ["l0_dgx_h200"]
    assert "l0_dgx_b200" in matching_lists(lists, "NVIDIA B200", 8)


def test_runner_without_pytest_timeout(monkeypatch, capsys):
    """The GPU machine has no pytest-timeout: `--timeout` made pytest exit with a usage error before any
    test ran. Without the plugin the flag is left out (each group is bounded by a process timeout)."""
    from tensorrt_llm_ext.testing import runner

    monkeypatch.chdir(ROOT)
    for available in (True, False):
        monkeypatch.setattr(runner, "_has_pytest_timeout", lambda: available)
        assert runner.run_test_list("l0_cpu", dry_run=True) == 0
        cmds = [line for line in capsys.readouterr().out.splitlines() if "pytest" in line]
        assert cmds and all(("--timeout" in c) == available for c in cmds)


def test_runner_spreads_over_xdist_workers_on_cpu(monkeypatch, capsys):
    """On a CPU machine with pytest-xdist each group runs on 2 workers (multi-rank tests in one xdist
    group); --jobs 1, a GPU machine, a caller's own -n or a missing plugin keep one process."""
    import importlib.util

    from tensorrt_llm_ext.testing import runner

    monkeypatch.chdir(ROOT)
    real_find_spec = importlib.util.find_spec

    def cmds(jobs=None, pytest_args=None, cuda=False, xdist=True):
        monkeypatch.setattr(runner, "_has_cuda", lambda: cuda)
        monkeypatch.setattr(runner.os, "cpu_count", lambda: 2)
        monkeypatch.setattr(runner.importlib.util, "find_spec",
                            lambda name: (object() if xdist else None) if name == "xdist" else real_find_spec(name))
        assert runner.run_test_list("l0_cpu", dry_run=True, pytest_args=pytest_args, jobs=jobs) == 0
        return [line for line in capsys.readouterr().out.splitlines() if "-m pytest" in line]

    assert all(" -n 2 --dist loadgroup " in c for c in cmds())
    for kwargs in (dict(jobs=1), dict(cuda=True), dict(xdist=False), dict(pytest_args=["-n", "3"])):
        got = cmds(**kwargs)
        assert got and all("--dist loadgroup" not in c for c in got), kwargs
    assert all(c.endswith("-n 3") for c in cmds(pytest_args=["-n", "3"]))
