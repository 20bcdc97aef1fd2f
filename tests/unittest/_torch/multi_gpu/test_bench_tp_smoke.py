"""``trtllm-ext bench tp`` end to end at TP 2: the command launches its own ranks (gloo on CPU, NCCL on GPU),
runs every section at the tiny sizes and writes the tables; the rows and the on-rank checks are asserted
(timings are not: on CPU they are meaningless and printed as '-')."""

from __future__ import annotations

import pytest
import torch


def _table(text: str, title: str) -> list[list[str]]:
    """Body rows (cells stripped) of the Markdown table under ``### <title>``."""
    lines = text.splitlines()
    start = lines.index(f"### {title}")
    rows, seen_header = [], False
    for line in lines[start + 1:]:
        if line.startswith("### "):
            break
        if not line.startswith("|"):
            if seen_header and rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not seen_header:
            seen_header = True  # the header row
            continue
        if set(line.replace("|", "").strip()) <= {"-"}:
            continue  # the separator row
        rows.append(cells)
    return rows


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_bench_tp_smoke_two_ranks(tmp_path):
    from tensorrt_llm_ext.cli import main

    out = tmp_path / "tp.md"
    assert main(["bench", "tp", "--tp", "2", "--quick", "--tiny", "--out", str(out)]) == 0
    text = out.read_text()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    assert f"TP 2, backend {backend}" in text

    sel = _table(text, "bench tp: vocab-parallel vs gathered selection, bf16, TP 2")
    # V, shard width, pad, rows: the LM head's split (whole 1024-id blocks) of an even vocabulary and of one whose
    # last shard is padded, rows 1 and 3.
    assert [r[:4] for r in sel] == [["2048", "1024", "0", "1"], ["2048", "1024", "0", "3"],
                                    ["2003", "1024", "45", "1"], ["2003", "1024", "45", "3"]]
    assert all(r[-1] == "yes" for r in sel), "vocab-parallel ids differ from the gathered path"

    markov = _table(text, "bench tp: vocab-shard Markov chain vs replicated chain, TP 2")
    assert [r[:2] for r in markov] == [["1", "1024"], ["2", "1024"]]
    # The exact shard chain with the exchange drafts the replicated chain's tokens.
    assert all(r[-1].startswith("100.0% /") for r in markov)

    drafter = _table(text, "bench tp: drafter with vs without TP fusion, TP 2")
    assert [r[:3] for r in drafter] == [["context projection", "N=1", "1"], ["context projection", "N=5", "5"],
                                        ["block decode", "B=1, K=3", "3"], ["block decode", "B=2, K=3", "6"]]
    assert "fc_input_split=True, residual_norm_fusion=True" in text  # the fused drafter's plan at TP 2

    if not torch.cuda.is_available():
        assert "CPU gloo smoke run" in text
        assert all(c == "-" for r in sel for c in r[4:-1])
    step = _table(text, "bench tp: whole DSpark step, fused vs stock op table, TP 2")
    assert [r[0] for r in step] == ["1", "2"]
    assert all(r[-1] == "yes" for r in step), "fused and stock op tables disagree"
    assert "target vocab-parallel" in text  # V=516 splits evenly: the fused step selects from shards
    assert "not measured" not in text
