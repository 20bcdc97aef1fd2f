"""The speculation gate: speculation that does not pay for itself is switched off for good (one gate per
:class:`~tensorrt_llm_ext.runtime.scheduler.Scheduler`: ``serve``'s lives as long as the process, ``generate()``'s one
call).

TensorRT-LLM's ``speculative_config.acceptance_window`` / ``acceptance_length_threshold``: every request that
finishes (``stop`` or ``length``) after at least one speculative step gives its mean accepted drafts per step
(the step's accepted tokens less the bonus token, so 0 when no draft is ever accepted); once ``window`` requests
have finished, the mean of the last ``window`` of them is compared with ``threshold`` after every finish, and the
first time it falls below, the gate closes for good: the scheduler then runs the target-only decode for every
request, the running ones included (:meth:`Scheduler._hand_over`). A speculative step costs a drafter pass and a
``[B, K+1]`` verify forward where the target-only decode runs ``[B, 1]``: with a drafter that accepts little, or
traffic it was not trained for, that is slower per token than not speculating at all.

The decision depends only on the tokens (the accepted lengths), never on timing, so every TP rank closes its gate
at the same plan.
"""

from __future__ import annotations

from collections import deque

from tensorrt_llm_ext.logger import logger

__all__ = ["SpeculationGate", "speculation_gate", "speculation_max_concurrency"]


class SpeculationGate:
    """A rolling mean of accepted drafts per step over the last ``window`` finished requests; closed (for good)
    the first time that mean falls below ``threshold``."""

    def __init__(self, window: int, threshold: float):
        if window < 1:
            raise ValueError(f"SpeculationGate: window must be >= 1, got {window}")
        self.window, self.threshold = window, float(threshold)
        self._recent: deque[float] = deque(maxlen=window)
        self.finished = 0  # requests recorded
        self.closed = False
        self.closed_mean: float | None = None  # the rolling mean that closed it

    @property
    def rolling_mean(self) -> float | None:
        """The mean accepted drafts per step of the last ``window`` recorded requests (None before ``window``)."""
        return sum(self._recent) / len(self._recent) if len(self._recent) == self.window else None

    def record(self, accepted: int, steps: int, handle: int | None = None) -> bool:
        """Record a finished request that accepted ``accepted`` tokens (bonus tokens included, as the steps report
        them) over ``steps`` speculative steps; True when this record closes the gate. Nothing is recorded once
        closed, nor for a request that took no speculative step."""
        if self.closed or steps <= 0:
            return False
        self._recent.append(max(0.0, accepted / steps - 1.0))
        self.finished += 1
        mean = self.rolling_mean
        if mean is None or mean >= self.threshold:
            return False
        self.closed, self.closed_mean = True, mean
        logger.warning(f"speculation gate: the last {self.window} finished requests accepted {mean:.3f} drafts per "
                       f"step on average (request {handle} the last), below acceptance_length_threshold "
                       f"{self.threshold:g}: speculation is off for good, every request "
                       f"(the running ones too) decodes target-only")
        return True


def speculation_gate(engine, mode: str) -> SpeculationGate | None:
    """The gate of a scheduler over ``engine`` in ``mode``: configured (``speculative_config.acceptance_window``
    >= 1) and the serving speculative mode only -- the other speculative modes are references of it, never
    switched; None otherwise."""
    spec = engine.config.speculative_config
    if not spec.acceptance_window or mode != "speculative":
        return None
    return SpeculationGate(spec.acceptance_window, spec.acceptance_length_threshold)


def speculation_max_concurrency(engine, mode: str) -> int | None:
    """The ``speculative_config.max_concurrency`` a scheduler over ``engine`` in ``mode`` applies (more requests in
    flight than it: the target-only decode): the serving speculative mode only, as the gate; None otherwise."""
    return engine.config.speculative_config.max_concurrency if mode == "speculative" else None
