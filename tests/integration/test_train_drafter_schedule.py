"""How train-drafter spends a step and a time budget: a step's anchors are distinct positions of each sequence (drawn
without replacement, as the paper's sampler), and ``--fit-schedule`` ends the cosine decay at the ``--max-seconds``
budget (a complete run whose last learning rate is ~0) instead of leaving a cut run at a high learning rate."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tensorrt_llm_ext.cli import main
from tensorrt_llm_ext.testing.tiny_models import export_tiny_target
from tensorrt_llm_ext.training.trainer import (TrainConfig, candidate_counts, fitted_lr, length_grouped_batch,
                                               sample_anchors)


def test_anchors_are_distinct_positions_of_the_generated_part():
    prompt_lens = torch.tensor([5, 3, 10, 2])
    lens = torch.tensor([30, 12, 13, 40])  # candidates [prompt_len, len - 2]: 24, 8, 2, 37 positions
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = sample_anchors({"prompt_lens": prompt_lens, "lens": lens}, 8, g)
        assert a.shape == (4, 8)
        assert bool(((a >= prompt_lens[:, None]) & (a <= (lens - 2)[:, None])).all())
        for row, n in zip(a.tolist(), [24, 8, 2, 37]):
            # every candidate at most ceil(8 / n) times: distinct when the sequence has 8 positions or more
            assert max(row.count(x) for x in row) == math.ceil(8 / n), (row, n)
    # and every candidate is drawn (uniform over the generated part, not the first ones only)
    seen = set()
    for _ in range(50):
        seen.update(sample_anchors({"prompt_lens": prompt_lens[:1], "lens": lens[:1]}, 8, g)[0].tolist())
    assert seen == set(range(5, 29))


def test_masked_fill_draws_each_candidate_once_and_leaves_the_other_slots_without_a_block():
    """--anchor-fill mask: a sequence with fewer candidates than --anchors gets each once and the anchor len - 1 in
    its other slots (every block position past the teacher's last); a batch takes at most its widest sequence's
    candidates rounded up to 32 slots; where every sequence has enough, the anchors are wrap's, draw for draw."""
    prompt_lens = torch.tensor([5, 3, 10, 2])
    lens = torch.tensor([30, 12, 13, 40])  # 24, 8, 2, 37 candidates
    n = [24, 8, 2, 37]
    assert candidate_counts(lens, prompt_lens).tolist() == n
    batch = {"prompt_lens": prompt_lens, "lens": lens}
    for anchors in (8, 30, 64):
        a = sample_anchors(batch, anchors, torch.Generator().manual_seed(anchors), fill="mask")
        assert a.shape == (4, min(anchors, 64))  # 37 candidates at most, in slots of ANCHOR_BUCKET (32)
        for row, k, lo, ln in zip(a.tolist(), n, prompt_lens.tolist(), lens.tolist()):
            live = row[:min(k, len(row))]
            assert len(set(live)) == len(live) and all(lo <= x <= ln - 2 for x in live), (row, k)
            assert row[len(live):] == [ln - 1] * (len(row) - len(live))
    wide = {"prompt_lens": prompt_lens[[0, 3]], "lens": lens[[0, 3]]}  # 24 and 37 candidates, 16 anchors
    assert torch.equal(sample_anchors(wide, 16, torch.Generator().manual_seed(1), fill="mask"),
                       sample_anchors(wide, 16, torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError, match="--anchor-fill must be one of wrap, mask"):
        TrainConfig(anchor_fill="drop")
    with pytest.raises(ValueError, match="--length-groups must be an integer"):
        TrainConfig(length_groups=0)


def test_length_groups_batch_similar_lengths_and_draw_every_sequence():
    """--length-groups 1 is the plain draw (the same indices as before the knob); G > 1 takes one of G runs of the
    ranked pool, so a batch's counts are consecutive in it, and every sequence is still drawn about equally often."""
    counts = torch.randint(1, 256, (100,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(length_grouped_batch(counts, 16, 1, torch.Generator().manual_seed(5)),
                       torch.randint(100, (16,), generator=torch.Generator().manual_seed(5)))
    spread_plain, spread_grouped, hits = [], [], torch.zeros(100)
    for step in range(2000):
        g = torch.Generator().manual_seed(step)
        idx = length_grouped_batch(counts, 16, 8, g)
        pool = torch.randint(100, (128,), generator=torch.Generator().manual_seed(step))
        ranked = counts[pool].sort(stable=True).values
        c = counts[idx]
        assert idx.shape == (16,) and any(torch.equal(c, ranked[i * 16:(i + 1) * 16]) for i in range(8))
        hits += torch.bincount(idx, minlength=100)
        spread_grouped.append(int(c.max() - c.min()))
        spread_plain.append(int(counts[pool[:16]].max() - counts[pool[:16]].min()))
    assert sum(spread_grouped) * 4 < sum(spread_plain)  # similar lengths in a batch
    assert float(hits.min()) > 0.6 * float(hits.mean()) and float(hits.max()) < 1.4 * float(hits.mean())


def test_fitted_schedule_follows_the_larger_progress_and_ends_at_zero():
    tc = TrainConfig(steps=1000, warmup=10)
    plain = [min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / 1000)) for s in (0, 5, 100, 600)]
    assert [fitted_lr(s, tc, 0.0) for s in (0, 5, 100, 600)] == pytest.approx(plain)  # no time spent: --steps'
    assert fitted_lr(100, tc, 0.5) == pytest.approx(0.5)  # half the budget spent: half-way down the cosine
    assert fitted_lr(100, tc, 1.0) == pytest.approx(0.0, abs=1e-12)
    assert fitted_lr(900, tc, 0.1) == pytest.approx(fitted_lr(900, tc, 0.0))  # steps ahead of the clock


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    d = export_tiny_target(tmp_path_factory.mktemp("target") / "tiny")
    return d


def _tiny_run_args(d, eval_prompts: int, max_seconds: int) -> list[str]:
    """A train-drafter run of the tiny target bounded by the clock, not by --steps (a 1-layer drafter, K = 3)."""
    return ["train-drafter", str(d), "--num-prompts", "8", "--max-new-tokens", "12", "--gen-batch", "8",
            "--eval-prompts", str(eval_prompts), "--num-layers", "1", "--num-heads", "2", "--head-dim", "8",
            "--latent-dim", "8", "--intermediate-size", "32", "--draft-len", "3", "--batch-seqs", "2", "--anchors",
            "4", "--lr", "3e-3", "--warmup", "2", "--markov-rank", "4", "--no-progress", "--steps", "1000000",
            "--save-every", "1000000", "--max-seconds", str(max_seconds)]


class _Clock:
    """A wall clock of the trainer that advances 0.25 s per reading (the run's length does not hang on the
    machine's load)."""

    def __init__(self):
        self.t = 1000.0

    def time(self):
        self.t += 0.25
        return self.t


def test_fit_schedule_completes_at_the_budget_with_the_learning_rate_decayed(tiny_target, tmp_path, monkeypatch):
    import tensorrt_llm_ext.training.trainer as trainer

    monkeypatch.setattr(trainer, "time", _Clock())
    d = tmp_path / "tiny"
    shutil.copytree(tiny_target, d)
    args = _tiny_run_args(d, eval_prompts=2, max_seconds=30)
    assert main(args + ["--fit-schedule"]) == 0
    s = json.loads((d / "dspark_drafter" / "training.json").read_text())
    assert s["complete"] and 2 <= s["steps_done"] < 1000000 and s["schedule"] == "cosine fitted to --max-seconds"
    top1 = s["train_top1_by_position"]  # the training batches' per-position top-1, beside the held-out one
    assert len(top1) == 3 and all(0.0 <= x <= 1.0 for x in top1)
    assert len(s["held_out_confidence"]["teacher_forced_top1"]) == 3
    state = torch.load(d / "dspark_drafter_work" / "trainer_state.pt", weights_only=True)
    last_lr = state["optimizer"]["param_groups"][0]["lr"]  # the learning rate of the last step taken
    assert last_lr < 0.05 * 3e-3, last_lr
    assert main(args[:1] + ["--fit-schedule", str(d)]) == 2  # it needs the budget it ends at


def test_schedule_seconds_spans_resumed_calls(tiny_target, tmp_path, monkeypatch):
    """``--schedule-seconds``: one fitted cosine over several calls, each cut at ``--max-seconds`` (checkpointed,
    incomplete), resumed until the steps' seconds reach the total (complete, learning rate ~0); a resume with
    another total is refused."""
    import tensorrt_llm_ext.training.trainer as trainer

    monkeypatch.setattr(trainer, "time", _Clock())
    d = tmp_path / "tiny"
    shutil.copytree(tiny_target, d)
    args = _tiny_run_args(d, eval_prompts=0, max_seconds=20) + ["--fit-schedule", "--resume"]
    state_path = d / "dspark_drafter_work" / "trainer_state.pt"
    assert main(args + ["--schedule-seconds", "50"]) == 0
    first = json.loads((d / "dspark_drafter" / "training.json").read_text())
    state = torch.load(state_path, weights_only=True)
    assert not first["complete"] and first["schedule"].startswith("cosine fitted to --schedule-seconds 50")
    assert 0 < state["step_seconds"] < 50 and state["schedule_seconds"] == 50
    mid_lr = state["optimizer"]["param_groups"][0]["lr"]
    assert mid_lr > 0.05 * 3e-3, mid_lr  # cut mid-schedule, not decayed to 0
    assert main(args + ["--schedule-seconds", "60"]) == 2  # the run's schedule is fixed
    for _ in range(4):  # ~15 s of steps per call of 20 s: the total is spent in the third
        assert main(args + ["--schedule-seconds", "50"]) == 0
        last = json.loads((d / "dspark_drafter" / "training.json").read_text())
        if last["complete"]:
            break
    assert last["complete"] and last["step_seconds_total"] >= 50
    state = torch.load(state_path, weights_only=True)
    assert state["step"] > first["steps_done"] > 0
    assert state["optimizer"]["param_groups"][0]["lr"] < 0.05 * 3e-3
    assert main(args[:-2] + ["--schedule-seconds", "50"]) == 2  # without --fit-schedule: refused
