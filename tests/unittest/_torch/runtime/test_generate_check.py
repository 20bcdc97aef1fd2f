"""``generate --check`` verdicts (``runtime/launch.py::check_reports``) from hand-made rank reports: what the check
compares with rejection sampling at TP > 1 (the served vocab-sharded run against the gathered-verification
reference, tokens and acceptance bitwise), and how the speculation gate's target-only steps are read."""

from __future__ import annotations

from tensorrt_llm_ext.runtime.launch import ModeResult, RankReport, check_reports

TOKENS = [[514, 183, 244, 260], [389, 61, 113, 142]]


def _mode(mode: str, accepted: list[list[int]]) -> ModeResult:
    return ModeResult(mode=mode, outputs=[list(t) for t in TOKENS], finish_reasons=["length"] * 2,
                      errors=[None] * 2, accepted_lens=accepted, num_steps=3, mean_acceptance_length=1.0, wall_s=0.0,
                      outside_top_p=[0, 0] if mode == "speculative" else None)


def _reports(served: list[list[int]], gathered: list[list[int]], gate: bool) -> list[RankReport]:
    results = {"speculative": _mode("speculative", served), "reference": _mode("reference", [[1, 1, 1]] * 2),
               "gathered": _mode("gathered", gathered)}
    return [RankReport(rank=r, results=dict(results), speculation_gate=gate) for r in range(2)]


def test_a_closed_speculation_gate_is_no_check_failure_but_a_real_acceptance_difference_is():
    """Measured with `generate --tp 2 --check --rejection-sampling` and acceptance_window 1: the served run's gate
    closed after the first request (its last step target-only, accepted 1) while the gathered reference, never
    gated, accepted 2: same tokens, "DIFFER on requests []", "check FAILED: outputs differ", exit 1."""
    served, gathered = [[1, 2], [1, 1, 1]], [[1, 2], [1, 1, 2]]
    gated = check_reports(_reports(served, gathered, gate=True), rejection_sampling=True, greedy=[True, True])
    assert gated.ok, gated.lines
    assert "until the speculation gate closed" in gated.lines[0]
    # without a gate the same difference is a failure, named as an acceptance difference
    ungated = check_reports(_reports(served, gathered, gate=False), rejection_sampling=True, greedy=[True, True])
    assert not ungated.ok and "acceptance DIFFERS on requests [1]" in ungated.lines[0]
    # with a gate, a difference before the gate closed (the served run still speculating) stays a failure
    early = check_reports(_reports([[2, 1], [1, 1, 1]], [[1, 2], [1, 1, 1]], gate=True), rejection_sampling=True,
                          greedy=[True, True])
    assert not early.ok and "acceptance DIFFERS on requests [0]" in early.lines[0]
