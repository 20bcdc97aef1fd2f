"""scripts/drafter_throughput.py --profile on the CPU (--tiny): the step's time by group for each loss layout, and the
layouts side by side -- the check that the device call's profile mode runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "drafter_throughput.py"


def test_profile_mode_groups_the_step_by_where_it_runs(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("drafter_throughput", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = "bs=1,anchors=4,steps=1,layers=1"
    monkeypatch.setattr(sys, "argv", ["drafter_throughput.py", str(tmp_path), "--tiny", "--train-seqs", "4",
                                      "--prompt-file", str(tmp_path / "none.jsonl.gz"), "--profile",
                                      "--profile-steps", "1", "--train", f"{cfg},loss=fused", f"{cfg},loss=torch_dedup"])
    assert mod.main() == 0
    res = json.loads((tmp_path / "throughput.json").read_text())
    for key in ("train_0", "train_1"):
        prof = res[key]["profile"]
        assert prof["clock"] == "cpu ops (self time)" and prof["steps"] == 1, prof
        groups = prof["groups_ms"]
        for g in ("teacher_pass", "drafter_forward", "drafter_backward", "optimizer", "loss_gemm_draft_logits",
                  "loss_gemm_teacher_logits", "loss_row_passes"):
            assert groups.get(g, 0) > 0, (key, g, groups)
        assert prof["top"] and all(t["ms"] >= 0 and t["group"] in groups for t in prof["top"])
        assert abs(sum(groups.values()) - prof["total_ms"]) < 0.05 * prof["total_ms"] + 0.1
    summary = res["profile_summary"]
    assert [r["loss"] for r in summary] == ["fused", "torch_dedup"]
    assert all(v == 0 for v in summary[0]["vs_first_ms"].values()) and "loss_row_passes" in summary[1]["vs_first_ms"]


def test_masked_fill_and_length_groups_count_live_blocks(tmp_path, monkeypatch):
    """fill=mask,groups=G (train-drafter's --anchor-fill / --length-groups): the step runs and its block positions
    are the live ones -- fewer than the slots when the anchors outnumber every answer's positions."""
    spec = importlib.util.spec_from_file_location("drafter_throughput", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = "bs=2,anchors=300,steps=1,layers=1,loss=fused"  # answers of 128-256 tokens: at most 255 anchors each
    monkeypatch.setattr(sys, "argv", ["drafter_throughput.py", str(tmp_path), "--tiny", "--train-seqs", "4",
                                      "--prompt-file", str(tmp_path / "none.jsonl.gz"), "--train", cfg,
                                      f"{cfg},fill=mask,groups=2"])
    assert mod.main() == 0
    res = json.loads((tmp_path / "throughput.json").read_text())
    wrap, mask = res["train_0"], res["train_1"]
    assert (wrap["fill"], mask["fill"], mask["groups"]) == ("wrap", "mask", 2)
    # block positions a step (the rates are rounded: within 3 %)
    per_step = {k: r["block_positions_per_s"] / r["steps_per_s"] for k, r in (("wrap", wrap), ("mask", mask))}
    assert abs(per_step["wrap"] / (2 * 300 * 7) - 1) < 0.03
    assert 2 * 127 * 7 * 0.97 <= per_step["mask"] < 2 * 256 * 7 * 1.03
