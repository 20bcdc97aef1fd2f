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
