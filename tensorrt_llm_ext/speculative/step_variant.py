"""The code path of one decode step, as a CUDA graph freezes it.

A captured graph replays the kernels recorded at capture, whatever the rows hold at replay: a host-side
branch of the step (whether any row samples from a top-p set) is decided once, when the graph is captured.
:class:`StepVariant` names those branches. The worker derives from a step's rows the variant they need
(:meth:`~tensorrt_llm_ext.speculative.dspark_worker.DSparkWorker.step_needs`), the graph runner picks a
captured variant that *covers* it (computes the same distribution for every row) or runs the step eagerly,
and :meth:`~tensorrt_llm_ext.speculative.dspark_worker.DSparkWorker.set_rows` records the variant the step
runs.

The top-p variant covers every step without processed rows: a row with ``top_p = 1`` (or a greedy row) keeps
its whole row in the masked path, so the top-p step computes the default step's distribution for it, at the
cost of the top-p kernels. The default variant covers only steps without a top-p row. A *processed* variant
(a row with logits processing: ``logit_bias``, penalties, ``min_p``, ``top_k``) runs the same processing ops
for every row (identity values for a row without a field, so each row gets its own distribution): a sampling
worker captures one processed graph that also runs top-p (:data:`PROCESSED_TOP_P_VARIANT`, covering every
step), a greedy-only worker :data:`PROCESSED_VARIANT`. The one host fact processing keeps is the top-k exchange
width: a row with ``top_k`` above the captured width needs the *wide top-k* variant, never captured (its
step runs eagerly).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_VARIANT", "PROCESSED_TOP_P_VARIANT", "PROCESSED_VARIANT", "TOP_P_VARIANT", "StepVariant"]


@dataclass(frozen=True)
class StepVariant:
    """One code path of the step (a captured graph computes exactly one).

    ``top_p``: the exact top-p restriction runs for the step's sampled rows (rows with ``top_p = 1`` or
    ``T = 0`` are unchanged by it).
    """

    top_p: bool = False
    processed: bool = False  # the rows' logits processing runs (speculative/logits_processing.py)
    # a row's top_k exceeds the captured top-k exchange width: the exchange is sized by the rows (eager only)
    wide_top_k: bool = False

    def __post_init__(self):
        if self.wide_top_k and not self.processed:
            raise ValueError("StepVariant: wide_top_k is a kind of processed step (processed=True expected)")

    def covers(self, need: "StepVariant") -> bool:
        """Whether running this variant gives every row of a step that needs ``need`` its own distribution."""
        return ((self.top_p or not need.top_p) and (self.processed or not need.processed)
                and (self.wide_top_k or not need.wide_top_k))

    @property
    def cost(self) -> int:
        """Relative cost (the runner prefers the cheapest covering variant)."""
        return int(self.top_p) + 2 * int(self.processed) + 4 * int(self.wide_top_k)

    def __str__(self) -> str:
        names = [n for n, on in (("top-p", self.top_p), ("processed", self.processed),
                                 ("wide-top-k", self.wide_top_k)) if on]
        return "+".join(names) or "default"


DEFAULT_VARIANT = StepVariant(top_p=False)
TOP_P_VARIANT = StepVariant(top_p=True)
PROCESSED_VARIANT = StepVariant(processed=True)
PROCESSED_TOP_P_VARIANT = StepVariant(top_p=True, processed=True)
