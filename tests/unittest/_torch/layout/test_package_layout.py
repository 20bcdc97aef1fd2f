"""The package's walls: imports only point down the dependency order, and all Triton code is under kernels/."""

from __future__ import annotations

import ast
from pathlib import Path

import tensorrt_llm_ext

PKG = Path(tensorrt_llm_ext.__file__).parent
# Dependency order (DESIGN: contract <- kernels <- distributed <- modules/models <- speculative <- runtime <- CLI).
# Base modules (environment, logging, the rank layout) sit below everything and import nothing above them.
BASE = {"_env", "logger", "mapping"}
LAYER = {"contract": 0, "kernels": 1, "distributed": 2, "modules": 3, "models": 3, "speculative": 4,
         "runtime": 5, "testing": 5, "bench": 6, "cli": 6, "selfcheck": 6, "__init__": 6, "configs": 5, "serve": 6}


def _part(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "tensorrt_llm_ext" or len(parts) < 2:
        return None
    return parts[1]


def _layer(part: str) -> int:
    return -1 if part in BASE else LAYER.get(part, 6)


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno


def _violations() -> list[str]:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        own = rel.parts[0].removesuffix(".py")
        for module, line in _imports(path):
            part = _part(module)
            if part is None or part == own:
                continue
            if _layer(part) > _layer(own):
                bad.append(f"{rel}:{line} imports {module} (layer {part} is above {own})")
    return bad


def test_imports_point_down_the_dependency_order():
    assert _violations() == []


def test_contract_and_kernels_import_nothing_above_them():
    forbidden = ("tensorrt_llm_ext.speculative", "tensorrt_llm_ext.models", "tensorrt_llm_ext.runtime",
                 "tensorrt_llm_ext.modules", "tensorrt_llm_ext.distributed")
    offenders = []
    for path in [PKG / "contract.py", *sorted((PKG / "kernels").rglob("*.py"))]:
        offenders += [f"{path.name}: {m}" for m, _ in _imports(path) if m.startswith(forbidden)]
    assert offenders == []
    contract_deps = {m for m, _ in _imports(PKG / "contract.py") if m.startswith("tensorrt_llm_ext")}
    assert contract_deps == set()


def test_the_layout_check_catches_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "tensorrt_llm_ext"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "k.py").write_text("from tensorrt_llm_ext.speculative.x import y\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["PKG"]), "PKG", fake)
    assert len(_violations()) == 1


def test_every_triton_jit_lives_under_kernels():
    outside = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "kernels":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in node.decorator_list:
                    src = ast.unparse(dec)
                    if src.startswith(("triton.jit", "jit", "triton.autotune")):
                        outside.append(f"{rel}:{node.lineno} {node.name}")
    assert outside == []
