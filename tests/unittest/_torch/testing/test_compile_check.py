"""The compile check itself: planted kernels that do not compile for sm_90 turn it red, naming them; the
spill gate; every launched kernel of the package is in the sweep. (The check on the package's own kernels
is a CI step of its own: ``trtllm-ext compile-check``.)"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import tensorrt_llm_ext
from tensorrt_llm_ext.testing.compile_check import spill_failures
from tensorrt_llm_ext.testing.compile_sweep import ACCEPTED_SPILLS, SWEEP

PKG = Path(tensorrt_llm_ext.__file__).parent

PLANTED = textwrap.dedent('''
    import torch
    import triton
    import triton.language as tl

    from tensorrt_llm_ext.testing.compile_sweep import SweepCase


    @triton.jit
    def _pair(x):
        return x, x.to(tl.int64)


    @triton.jit
    def _retyped_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        # The front-end error of issue 27: `_` is a block before the if and a scalar inside it.
        offs = tl.arange(0, BLOCK)
        a, _ = _pair(tl.load(x_ptr + offs, mask=offs < n, other=0))
        if n > 4:
            b, _ = _pair(tl.load(x_ptr))
            a += b
        tl.store(out_ptr + offs, a, mask=offs < n)


    @triton.jit
    def _too_wide_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)  # BLOCK = 2^21 is past Triton's largest tensor
        tl.store(x_ptr + offs, tl.zeros([BLOCK], tl.float32), mask=offs < n)


    @triton.jit
    def _fine_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(x_ptr + offs, x * 2.0, mask=offs < n)


    def _launch_all():
        x = torch.zeros(64, dtype=torch.int32)
        _retyped_kernel[(1,)](x, x, 64, BLOCK=64)
        y = torch.zeros(64, dtype=torch.float32)
        _too_wide_kernel[(1,)](y, 64, BLOCK=1 << 21)
        _fine_kernel[(1,)](y, 64, BLOCK=64)


    def _launch_fine():
        _fine_kernel[(1,)](torch.zeros(64, dtype=torch.float16), 64, BLOCK=64)


    SWEEP = (
        SweepCase("planted", _launch_all, ("planted_sweep:_retyped_kernel", "planted_sweep:_too_wide_kernel",
                                           "planted_sweep:_fine_kernel")),
        SweepCase("fine", _launch_fine, ("planted_sweep:_fine_kernel",)),
    )
''')


def _check(tmp_path, *args):
    (tmp_path / "planted_sweep.py").write_text(PLANTED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(PKG.parent)]))
    return subprocess.run([sys.executable, "-m", "tensorrt_llm_ext.testing.compile_check", "--sweep-module",
                           "planted_sweep", *args], env=env, capture_output=True, text=True, timeout=300)


def test_planted_front_end_error_and_out_of_range_constexpr_fail_the_check_by_name(tmp_path):
    proc = _check(tmp_path, "--jobs", "1")  # one worker: a second would start torch and Triton again for one kernel
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "compile-check FAILED" in out
    failed = [block for block in out.split("FAILED ")[1:] if " for sm_90 " in block]
    retyped = [b for b in failed if b.startswith("planted_sweep:_retyped_kernel")]
    wide = [b for b in failed if b.startswith("planted_sweep:_too_wide_kernel")]
    assert len(retyped) == 1 and len(wide) == 1, out
    # the specialization (argument types, constexpr values) and the front end's own words
    assert "x_ptr: *i32" in retyped[0] and "BLOCK=64" in retyped[0], retyped[0]
    assert "_" in retyped[0] and "CompilationError" in retyped[0], retyped[0]
    assert "BLOCK=2097152" in wide[0] and "numel" in wide[0], wide[0]
    assert not any(b.startswith("planted_sweep:_fine_kernel") for b in failed), out
    # the kernel that compiles is counted: 2 specializations (fp32 and fp16) of 1 kernel
    assert "sm_90 (triton " in out and "2 specializations of 1 kernels compiled" in out, out


def test_spill_gate_fails_unlisted_spills_in_captured_kernels_only():
    base = {"arch": 90, "accepted_spills": [{"kernel": "m:_accepted_kernel", "when": ["x: *fp32"], "max_bytes": 64,
                                             "reason": "measured, no faster variant"}]}
    row = dict(spec="(x: *fp32) num_warps=4 num_stages=3", case="c", registers=255, spill_loads=0)
    report = dict(base, variants=[
        dict(row, kernel="m:_spilling_kernel", spill_stores=64, captured=True),
        dict(row, kernel="m:_accepted_kernel", spill_stores=64, captured=True),
        dict(row, kernel="m:_accepted_kernel", spill_stores=65, captured=True),  # over the accepted bound
        dict(row, kernel="m:_offline_kernel", spill_stores=64, captured=False),
        dict(row, kernel="m:_clean_kernel", spill_stores=0, captured=True),
    ])
    lines = spill_failures(report)
    assert len(lines) == 2 and lines[0].startswith("SPILL m:_spilling_kernel for sm_90"), lines
    assert "64 B stored" in lines[0] and "255 registers" in lines[0]
    assert lines[1].startswith("SPILL m:_accepted_kernel") and "65 B stored" in lines[1], lines


def test_every_launched_kernel_is_in_the_sweep():
    """A kernel (a ``@triton.jit`` function named ``*_kernel`` under kernels/) that no sweep case names
    would never be compiled by the check."""
    defined = set()
    for path in sorted((PKG / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    ast.unparse(d).startswith("triton.jit") for d in node.decorator_list):
                defined.add(f"tensorrt_llm_ext.kernels.{path.stem}:{node.name}")
    swept = {k for case in SWEEP for k in case.kernels}
    assert defined and defined == swept, (sorted(defined - swept), sorted(swept - defined))
    assert {a.kernel for a in ACCEPTED_SPILLS} <= swept
    assert all(a.reason.strip() and a.when and a.max_bytes > 0 for a in ACCEPTED_SPILLS)


def test_dtypes_select_the_sweeps_floats_and_bad_names_exit_2(tmp_path, monkeypatch):
    """``--dtypes bf16`` (CI's run): every loop of the sweep keeps its bf16 variants only; an unknown name is a usage
    error before any worker starts."""
    import torch

    import tensorrt_llm_ext.testing.compile_sweep as sweep
    from tensorrt_llm_ext.testing.compile_check import _dtypes

    assert sweep._floats(*sweep.FLOATS) == sweep.FLOATS
    monkeypatch.setattr(sweep, "DTYPES", _dtypes("bf16"))
    assert sweep._floats(*sweep.FLOATS) == (torch.bfloat16,)
    assert sweep._floats(torch.float16, torch.float32) == ()
    assert _dtypes("fp32, fp16") == (torch.float32, torch.float16)
    for bad in ("fp8", ","):
        proc = _check(tmp_path, "--dtypes", bad)
        assert proc.returncode == 2 and "compiled" not in proc.stdout, (bad, proc.stdout, proc.stderr)
        assert "--dtypes: expected a comma-separated list of bf16, fp16, fp32" in proc.stderr
