"""The front page stays true: docs/index.md links every page of docs/ (and only pages that exist), the README
links the index and defines what it names, and the GPU install line's extras hold what serve and import-gguf
import."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]


def test_docs_index_links_every_page_and_nothing_missing():
    index = (ROOT / "docs" / "index.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+\.md)\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages - linked == set(), f"pages the index does not link: {sorted(pages - linked)}"
    assert linked - pages == set(), f"index links to missing pages: {sorted(linked - pages)}"


def test_readme_opening_says_what_for_whom_and_how_fast():
    readme = (ROOT / "README.md").read_text()
    opening = readme[:readme.index("## The two commands")]
    for needed in ("standalone runtime", "needs no\nTensorRT-LLM", "arXiv 2607.05147", "**DFlash**", "**For**",
                   "### How fast", "docs/index.md"):
        assert needed in opening, needed


def test_gpu_install_extras_hold_what_serve_and_gguf_import():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {k: {re.split(r"[<>=\[ ]", d)[0] for d in v} for k, v in project["optional-dependencies"].items()}
    assert {"fastapi", "uvicorn", "prometheus-client", "safetensors", "transformers"} <= extras["serve"]
    assert {"gguf", "transformers", "safetensors"} <= extras["gguf"]
    deps = {re.split(r"[<>=\[ ]", d)[0] for d in project["dependencies"]}
    assert "torch" in deps and not any(d.startswith("torch==") for d in project["dependencies"])  # keeps yours
    assert "pip install -e '.[serve,gguf]'" in (ROOT / "README.md").read_text()
