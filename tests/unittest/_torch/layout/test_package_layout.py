"""The package's walls: imports only point down the dependency order, and all Triton code is under kernels/."""

from __future__ import annotations

import ast
from pathlib import Path

import tensorrt_llm_ext

PKG = Path(tensorrt_llm_ext.__file__).parent
# Dependency order: contract <- kernels <- distributed <- modules <- models <- speculative <- runtime <- CLI.
# Base modules (environment, logging, the rank layout, argparse types) sit below everything and import nothing
# above them. Test support sits above everything that ships: only the CLI (its test-list command) and the
# tests import it.
BASE = {"_env", "argtypes", "interpreter", "logger", "mapping"}
LAYER = {"contract": 0, "kernels": 1, "distributed": 2, "modules": 3, "models": 4, "speculative": 5,
         "configs": 6, "runtime": 6, "training": 7, "bench": 7, "selfcheck": 7, "testing": 8, "cli": 9, "__init__": 9}


def _part(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "tensorrt_llm_ext" or len(parts) < 2:
        return None
    return parts[1]


def _layer(part: str) -> int | None:
    """The part's layer; None for a top-level module not placed in the order (it must be placed, not guessed)."""
    return -1 if part in BASE else LAYER.get(part)


def _absolute(rel: Path, module: str | None, level: int) -> str:
    """``from ..x import y`` in ``kernels/k.py`` -> ``tensorrt_llm_ext.x``: level 1 is the file's own folder
    (a package's ``__init__`` included), each further level one folder up."""
    package = ["tensorrt_llm_ext", *rel.parts[:-1]]
    package = package[:len(package) - (level - 1)]
    return ".".join(package + ([module] if module else []))


def _imports(path: Path, rel: Path | None = None):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.module, node.lineno
            else:
                base = _absolute(rel if rel is not None else Path(path.name), node.module, node.level)
                if node.module:
                    yield base, node.lineno
                else:  # from . import x, y: each name is a module of that package
                    for alias in node.names:
                        yield f"{base}.{alias.name}", node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno


def _violations() -> list[str]:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        own = rel.parts[0].removesuffix(".py")
        if _layer(own) is None:
            bad.append(f"{rel}: top-level module {own} has no place in the dependency order")
            continue
        for module, line in _imports(path, rel):
            part = _part(module)
            if part is None or part == own:
                continue
            if _layer(part) is None:
                bad.append(f"{rel}:{line} imports {module} (no such top-level module in the dependency order)")
            elif _layer(part) > _layer(own):
                bad.append(f"{rel}:{line} imports {module} (layer {part} is above {own})")
    return bad


def test_imports_point_down_the_dependency_order():
    assert _violations() == []


def _module_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports, function-local imports included (an
    import deferred into a function still runs the other module's top level: a circle all the same).
    ``from pkg import name`` points at ``pkg.name`` where that is a module, else at ``pkg``."""
    files = {}
    for path in PKG.rglob("*.py"):
        parts = ["tensorrt_llm_ext", *path.relative_to(PKG).with_suffix("").parts]
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        rel = path.relative_to(PKG)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module if node.level == 0 else _absolute(rel, node.module, node.level)
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _circles() -> list[list[str]]:
    """The import circles of the package: its strongly connected components of more than one module, sorted."""
    graph, order, low, stack, on_stack, found = _module_graph(), {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's algorithm
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return sorted(found)


def test_no_import_circle_anywhere():
    """Layers order the top-level parts; inside a part (testing/, speculative/, ...) modules must not import
    each other in a circle either, deferred imports included."""
    assert _circles() == []


def test_the_circle_check_catches_one_inside_a_layer(tmp_path, monkeypatch):
    fake = tmp_path / "tensorrt_llm_ext"
    (fake / "testing").mkdir(parents=True)
    (fake / "testing" / "__init__.py").write_text("")
    monkeypatch.setattr(__import__(__name__, fromlist=["PKG"]), "PKG", fake)
    (fake / "testing" / "a.py").write_text("from tensorrt_llm_ext.testing.b import f\n")
    (fake / "testing" / "b.py").write_text("def f():\n    from . import c\n")
    (fake / "testing" / "c.py").write_text("import tensorrt_llm_ext.testing.d\n")
    (fake / "testing" / "d.py").write_text("x = 1\n")
    assert _circles() == []  # a chain is fine
    (fake / "testing" / "d.py").write_text("def g():\n    from .a import y\n")  # deferred, still a circle
    assert _circles() == [["tensorrt_llm_ext.testing.a", "tensorrt_llm_ext.testing.b", "tensorrt_llm_ext.testing.c",
                           "tensorrt_llm_ext.testing.d"]]


def test_contract_and_kernels_import_nothing_above_them():
    forbidden = ("tensorrt_llm_ext.speculative", "tensorrt_llm_ext.models", "tensorrt_llm_ext.runtime",
                 "tensorrt_llm_ext.modules", "tensorrt_llm_ext.distributed", "tensorrt_llm_ext.testing")
    offenders = []
    for path in [PKG / "contract.py", *sorted((PKG / "kernels").rglob("*.py"))]:
        rel = path.relative_to(PKG)
        offenders += [f"{rel}: {m}" for m, _ in _imports(path, rel) if m.startswith(forbidden)]
    assert offenders == []
    contract_deps = {m for m, _ in _imports(PKG / "contract.py", Path("contract.py"))
                     if m.startswith("tensorrt_llm_ext")}
    assert contract_deps == set()


def test_the_layout_check_catches_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "tensorrt_llm_ext"
    for sub in ("kernels", "models", "bench"):
        (fake / sub).mkdir(parents=True)
    monkeypatch.setattr(__import__(__name__, fromlist=["PKG"]), "PKG", fake)
    (fake / "kernels" / "k.py").write_text("from tensorrt_llm_ext.speculative.x import y\n")
    (fake / "kernels" / "ok.py").write_text("from . import common\nfrom .common import check_tensor\n")
    assert _violations() == ["kernels/k.py:1 imports tensorrt_llm_ext.speculative.x (layer speculative is above "
                             "kernels)"]
    # relative imports resolve to their absolute module: two levels up from kernels/ is the package root
    (fake / "kernels" / "rel.py").write_text("x = 1\nfrom ..runtime.engine import Engine\n")
    # models sit above modules; test support sits above what ships
    (fake / "models" / "m.py").write_text("from tensorrt_llm_ext.modules import linear\n")
    (fake / "bench" / "b.py").write_text("from ..testing.mpi import MpiPool\n")
    upward = [
        "bench/b.py:1 imports tensorrt_llm_ext.testing.mpi (layer testing is above bench)",
        "kernels/k.py:1 imports tensorrt_llm_ext.speculative.x (layer speculative is above kernels)",
        "kernels/rel.py:2 imports tensorrt_llm_ext.runtime.engine (layer runtime is above kernels)",
    ]
    assert _violations() == upward
    # a top-level module outside the order is refused, not given a layer, and so is an import of one
    (fake / "plugins").mkdir()
    (fake / "plugins" / "p.py").write_text("from tensorrt_llm_ext.kernels import common\n")
    (fake / "models" / "uses_plugin.py").write_text("from tensorrt_llm_ext.plugins.p import hook\n")
    assert _violations() == upward + [
        "models/uses_plugin.py:1 imports tensorrt_llm_ext.plugins.p (no such top-level module in the dependency "
        "order)",
        "plugins/p.py: top-level module plugins has no place in the dependency order",
    ]


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
