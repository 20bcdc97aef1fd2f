"""``trtllm-ext bench target`` on the GPU: every row measured (finite times), the launch counts of the forwards and of
the target-only step, whose bookkeeping runs one launch on each side of its forward (kernels/decode_step.py)."""

import math

import pytest
import torch

from tensorrt_llm_ext.cli import main


def _rows(out: str, first_col: str) -> list[dict[str, str]]:
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_col} "))
    cols = [c.strip() for c in lines[head].strip("|").split("|")]
    rows = []
    for ln in lines[head + 2:]:
        if not ln.startswith("|"):
            break
        rows.append(dict(zip(cols, (c.strip() for c in ln.strip("|").split("|")))))
    return rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_target_gpu_rows_and_step_launches(capsys):
    assert main(["bench", "target", "--shapes", "smollm2-135m", "--spec-shapes", "", "--batch-sizes", "1,8",
                 "--contexts", "256", "--no-attn-configs"]) == 0
    rows = _rows(capsys.readouterr().out, "B")
    assert [r["B"] for r in rows] == ["1", "8"]
    for r in rows:
        for col in ("decode fwd", "verify fwd", "target-only step", "floor", "attn"):
            assert math.isfinite(float(r[col])) and float(r[col]) > 0, (col, r)
        dec, ver, step = (int(n) for n in r["launches dec/ver/step"].split("/"))
        # the step runs its [B, 1] forward without the forward's 4 RoPE launches, then the head and the greedy
        # selection, with its bookkeeping in 2 launches (12 as torch ops): at most the forward's count + 2
        assert 0 < dec <= ver and dec - 4 < step <= dec + 2, r
        # (no timing relation is asserted: the list runs 8 tests at once on one GPU, where a replay's time is noise;
        # the benchmark's numbers are read from its table, docs/target_forward.md)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (no timings) only")
def test_bench_target_cpu_smoke_prints_its_rows_without_numbers(capsys):
    """On a CPU the tiny shape runs every code path of the table (engine, target-only decoder, launch counts) and
    prints its rows with no number in them: nothing is timed without a GPU, and nothing pretends to be."""
    assert main(["bench", "target", "--shapes", "tiny", "--spec-shapes", "", "--batch-sizes", "1,2",
                 "--contexts", "16", "--no-attn-configs"]) == 0
    rows = _rows(capsys.readouterr().out, "B")
    assert [(r["B"], r["C"]) for r in rows] == [("1", "16"), ("2", "16")]
    for r in rows:
        assert all(v == "-" for k, v in r.items() if k not in ("B", "C", "launches dec/ver/step")), r
        assert r["launches dec/ver/step"] == "-/-/-"
