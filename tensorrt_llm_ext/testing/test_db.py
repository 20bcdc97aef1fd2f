"""Per-platform test lists in TensorRT-LLM's test-db schema, the runner, and the coverage check.

A list file (``test_lists/test-db/<name>.yml``)::

    version: 0.0.1
    l0_dgx_h200:
    - condition:
        ranges: {system_gpu_count: {gte: 2, lte: 4}}
        wildcards: {gpu: ['*h200*'], linux_distribution_name: 'ubuntu*'}
        terms: {stage: pre_merge, backend: pytorch, orchestrator: mpi}
      tests:
      - unittest/_torch/multi_gpu/test_x.py::test_y TIMEOUT (30)

Test ids are relative to ``tests/``; ``TIMEOUT (N)`` is minutes. Machine matching uses the
``system_gpu_count`` range and the ``gpu`` wildcard; other wildcards and terms are carried for
TensorRT-LLM's CI and not matched here.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

_ENTRY = re.compile(r"^(?P<path>[\w./-]+\.py)::(?P<name>[\w\[\]./:-]+?)(?:\s+TIMEOUT\s*\((?P<timeout>\d+)\))?\s*$")
DEFAULT_TIMEOUT_MIN = 10


class ListDbError(ValueError):
    """A malformed list file, an unknown list name, or a bad entry."""


class _Range(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gte: int | None = None
    lte: int | None = None


class Condition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ranges: dict[str, _Range] = Field(default_factory=dict)
    wildcards: dict[str, str | list[str]] = Field(default_factory=dict)
    terms: dict[str, str] = Field(default_factory=dict)

    def matches(self, gpu_name: str, gpu_count: int) -> bool:
        r = self.ranges.get("system_gpu_count")
        if r is not None and ((r.gte is not None and gpu_count < r.gte) or (r.lte is not None and gpu_count > r.lte)):
            return False
        pats = self.wildcards.get("gpu")
        if pats is not None:
            pats = [pats] if isinstance(pats, str) else pats
            if not any(fnmatch.fnmatch(gpu_name.lower(), p.lower()) for p in pats):
                return False
        return True


class ListEntry(BaseModel):
    model_config = ConfigDict(frozen=True)
    path: str  # relative to tests/
    name: str  # test function (optionally Class::method)
    timeout_min: int = DEFAULT_TIMEOUT_MIN

    @property
    def node_id(self) -> str:
        return f"{self.path}::{self.name}"


class Block(BaseModel):
    model_config = ConfigDict(extra="forbid")
    condition: Condition
    tests: list[str]

    @field_validator("tests")
    @classmethod
    def _entries_parse(cls, v: list[str]) -> list[str]:
        for e in v:
            parse_entry(e)
        return v

    def entries(self) -> list[ListEntry]:
        return [parse_entry(e) for e in self.tests]


def parse_entry(text: str) -> ListEntry:
    m = _ENTRY.match(text.strip())
    if not m:
        raise ListDbError(f"bad test entry {text!r}: expected 'path/test_x.py::test_name [TIMEOUT (minutes)]'")
    return ListEntry(path=m["path"], name=m["name"], timeout_min=int(m["timeout"] or DEFAULT_TIMEOUT_MIN))


def load_test_db(db_dir: Path) -> dict[str, list[Block]]:
    """Parse every ``*.yml`` in ``db_dir``; raises :class:`ListDbError` naming the file on bad input."""
    lists: dict[str, list[Block]] = {}
    files = sorted(Path(db_dir).glob("*.yml"))
    if not files:
        raise ListDbError(f"no test-db files in {db_dir}")
    for f in files:
        try:
            data = yaml.safe_load(f.read_text())
        except yaml.YAMLError as e:
            raise ListDbError(f"{f}: not valid YAML: {e}") from None
        if not isinstance(data, dict) or "version" not in data:
            raise ListDbError(f"{f}: expected a mapping with 'version' and list blocks")
        for name, blocks in data.items():
            if name == "version":
                continue
            if not isinstance(blocks, list):
                raise ListDbError(f"{f}: list {name!r} must be a sequence of blocks")
            try:
                parsed = [Block.model_validate(b) for b in blocks]
            except (ValidationError, ListDbError) as e:
                raise ListDbError(f"{f}: list {name!r} is malformed: {e}") from None
            if name in lists:
                raise ListDbError(f"{f}: list {name!r} is defined twice")
            lists[name] = parsed
    return lists


def list_entries(lists: dict[str, list[Block]], name: str) -> list[ListEntry]:
    if name not in lists:
        raise ListDbError(f"unknown test list {name!r}; known: {', '.join(sorted(lists))}")
    return [e for b in lists[name] for e in b.entries()]


def matching_lists(lists: dict[str, list[Block]], gpu_name: str, gpu_count: int) -> list[str]:
    return sorted(n for n, blocks in lists.items() if any(b.condition.matches(gpu_name, gpu_count) for b in blocks))


def collect_test_functions(tests_root: Path) -> set[str]:
    """Every test id ``path::test_fn`` / ``path::TestCls::test_m`` under ``tests_root`` (static, no import)."""
    found: set[str] = set()
    for f in sorted(Path(tests_root).rglob("test_*.py")):
        rel = f.relative_to(tests_root).as_posix()
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                found.add(f"{rel}::{node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("test"):
                        found.add(f"{rel}::{node.name}::{sub.name}")
    return found


def check_lists(tests_root: Path, db_dir: Path) -> tuple[list[str], list[str]]:
    """Return ``(unlisted, dangling)``: tests no list selects, and list entries naming no test."""
    lists = load_test_db(db_dir)
    existing = collect_test_functions(tests_root)
    listed = {e.node_id.split("[")[0] for blocks in lists.values() for b in blocks for e in b.entries()}
    unlisted = sorted(existing - listed)
    dangling = sorted(listed - existing)
    return unlisted, dangling
