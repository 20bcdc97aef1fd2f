"""``trtllm-ext bench verify --profile``: the launch list of one call (CPU: the interpreter's launches with
counts; GPU: kernels of a captured call under torch.profiler), matching the pipeline's documented shape."""

from __future__ import annotations

import re

import pytest
import torch

from tensorrt_llm_ext.cli import main
from tensorrt_llm_ext.speculative.verification import call_shape


def test_bench_verify_profile_lists_the_launches_of_one_call(capsys):
    assert main(["bench", "verify", "--profile", "--batch-sizes", "1"]) == 0
    text = capsys.readouterr().out
    totals = [int(n) for n in re.findall(r"(\d+) launches per call in all", text)]
    assert totals == [call_shape("rejection_sample", False)[0], call_shape("rejection_sample", True, torch.bfloat16)[0]]
    # the aligned shard of the smoke run (1024 ids at tp 2): one read of the logits
    assert "_rejection_draw_kernel" in text and "_block_stats_kernel" in text and "_block_combine_kernel" in text
    assert "_verify_keys_kernel" not in text and "1 pass(es)" not in text and "one pass(es)" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU smoke run's sizes")
def test_bench_verify_times_the_one_pass_and_the_forced_two_passes(capsys, monkeypatch):
    """The table times the path a rank takes on block-aligned shards (one pass) and, with --two-pass, the forced
    two-pass path on the same rows, in one run (CPU: the smoke sizes, untimed)."""
    from tensorrt_llm_ext.speculative import verification

    seen = []
    real = verification.choose_passes
    monkeypatch.setattr(verification, "choose_passes", lambda p, *a: (seen.append(real(p, *a)), seen[-1])[1])
    assert main(["bench", "verify", "--batch-sizes", "1", "--two-pass", "--no-stock"]) == 0
    text = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) +\| (\d+) +\| (one|two) +\| \d+ +\| (none|top_p) +\| [^|]+\| ([^|]+)\| ([^|]+)\|", text,
                      flags=re.M)
    assert {(r[0], r[1], r[2]) for r in rows} == {("1", "1031", "one"), ("2", "1024", "one")}, text
    assert len(rows) == 8 and "two-pass us" in text, rows  # (CPU: the times print as "-")
    assert "one" in seen and "two" in seen  # both paths ran: the call's own and the forced one


def test_flashinfer_peer_reports_why_it_is_absent():
    """The measured FlashInfer column: a callable where flashinfer imports on CUDA, else a reason (printed in the
    table's notes); here (no flashinfer or no CUDA) the reason names what is missing."""
    from tensorrt_llm_ext.bench.verify import flashinfer_verify

    make, why = flashinfer_verify()
    try:
        import flashinfer  # noqa: F401
        has_fi = torch.cuda.is_available()
    except Exception:
        has_fi = False
    assert (make is not None) == has_fi and (why is None) == has_fi
    if not has_fi:
        assert "CUDA" in why or "does not import" in why


def test_bench_verify_one_pass_stats_times_both_forms(capsys, monkeypatch):
    """``--one-pass-stats``: one row per (tp, B) on the last block-aligned shard, both forms launched (CPU: once
    each under the interpreter, untimed)."""
    from tensorrt_llm_ext.kernels import block_stats, fixed_point_softmax

    launched = []
    for mod, name in ((block_stats, "block_stats"), (fixed_point_softmax, "verify_sums")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, _n=name, **kw: (launched.append(_n), _fn(*a, **kw))[1])
    assert main(["bench", "verify", "--one-pass-stats", "--batch-sizes", "1"]) == 0
    text = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) +\| (\d+) +\| 1 ", text, flags=re.M)
    assert rows == [("1", "4096"), ("2", "2048")]  # smoke: V = 3079, widths 1024 ceil(ceil(V / tp) / 1024)
    assert launched.count("block_stats") >= 2 and launched.count("verify_sums") >= 2


def test_bench_verify_one_pass_stats_sweeps_its_schedules(capsys, monkeypatch):
    """``--stats-configs WARPS/PROGRAMS/PREFETCH``: a row per schedule, each launched with its warps and prefetch
    (WARPS 0: the library's rule, named in the row with the warps it picks); a malformed item is refused."""
    from tensorrt_llm_ext.kernels import block_stats

    seen = []
    fn = block_stats.block_stats
    monkeypatch.setattr(block_stats, "block_stats",
                        lambda *a, **kw: (seen.append((kw["num_warps"], kw["prefetch"])), fn(*a, **kw))[1])
    assert main(["bench", "verify", "--one-pass-stats", "--batch-sizes", "1", "--tp-sizes", "2",
                 "--stats-configs", "4/512/0,2/4096/1,0/512/1"]) == 0
    text = capsys.readouterr().out
    got = re.findall(r"^\| 2 +\| 2048 +\| 1 +\| \d+ +\| ([^|]+?) +\|", text, flags=re.M)
    assert got[:2] == ["4", "2 prefetch"] and re.fullmatch(r"rule: [24] prefetch", got[2]), got
    assert {(4, 0), (2, 1), (None, 1)} <= set(seen)
    with pytest.raises(SystemExit) as exc:  # a usage line naming the flag, exit 2
        main(["bench", "verify", "--one-pass-stats", "--batch-sizes", "1", "--stats-configs", "4/512"])
    assert exc.value.code == 2 and "argument --stats-configs: expected WARPS/PROGRAMS/PREFETCH" in capsys.readouterr().err


def test_random_logits_have_the_asked_scale_and_a_close_draft():
    """--logit-scale: target rows of that standard deviation, draft rows the target's plus half of it as noise."""
    from tensorrt_llm_ext.bench.verify import random_logits

    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 4.0):
        tgt, drf = random_logits(2, 3, 8192, scale, g, "cpu", torch.float32)
        assert tgt.shape == (2, 4, 8192) and drf.shape == (2, 3, 8192)
        assert abs(float(tgt.std()) / scale - 1) < 0.03
        assert abs(float((drf - tgt[:, :3]).std()) / (scale / 2) - 1) < 0.03
