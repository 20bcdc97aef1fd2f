"""Whether a worker's target and draft token selection run vocab-parallel: decided once after load.

Every rank walks the same eligibility checks in the same order (so the same collectives); a check whose
input may differ across ranks is agreed (:func:`~tensorrt_llm_ext.distributed.agree_any`), and the first
check that fails anywhere is the logged reason. :class:`VocabParallelSelection` holds the decision.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tensorrt_llm_ext.contract import BuildRefusal
from tensorrt_llm_ext.distributed import agree_any
from tensorrt_llm_ext.kernels.ordered_key import MAX_VOCAB
from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.modules.lm_head import LMHead
from tensorrt_llm_ext.modules.linear import TensorParallelMode
from tensorrt_llm_ext.modules.logits_processor import LogitsProcessor

__all__ = ["SelectionMode", "VocabParallelSelection", "local_draft_failures", "local_target_failures"]


class SelectionMode(str, enum.Enum):
    AUTO = "auto"  # vocab-parallel where eligible, else the gathered path (reason logged)
    ON = "on"  # like AUTO, but an ineligible target is an error instead of a fallback
    OFF = "off"  # always the gathered path


class _Check(enum.Enum):
    """Eligibility checks in the order they are evaluated; the first that fails is the reason."""

    MODE_OFF = "vocab-parallel selection is off (mode='off')"
    TP_ONE = "tp_size == 1: nothing is gathered, nothing to gain"
    ATTENTION_DP = "attention DP: the head is not vocab-sharded over a plain TP group"
    HEAD_NOT_COLUMN = "the LM head is not a COLUMN-parallel LMHead with gather_output"
    HEAD_QUANTIZED = "the LM head is quantized"
    # The policy reads the vocabulary, not the head's padding: a block-aligned head pads its last shard even
    # where vocab % tp == 0, and the kernels mask every padded column by vocab_size.
    HEAD_UNEVEN = "the vocabulary is unevenly sharded (vocab % tp != 0)"
    VOCAB_TOO_LARGE = "vocab >= 2^32 does not fit the int64 selection key"
    CUSTOM_LOGITS_PROCESSOR = "the model has its own logits processor (not the plain LogitsProcessor)"
    DRAFTER_OWN_HEAD = "the drafter does not draft through the target's LM head"


_HEAD_CHECKS = (_Check.HEAD_NOT_COLUMN, _Check.HEAD_QUANTIZED, _Check.HEAD_UNEVEN, _Check.VOCAB_TOO_LARGE)


def _head_failures(lm_head) -> dict[_Check, bool]:
    if not isinstance(lm_head, LMHead):
        return {_Check.HEAD_NOT_COLUMN: True, _Check.HEAD_QUANTIZED: False, _Check.HEAD_UNEVEN: False,
                _Check.VOCAB_TOO_LARGE: False}
    return {
        _Check.HEAD_NOT_COLUMN: lm_head.tp_mode != TensorParallelMode.COLUMN or not lm_head.gather_output,
        _Check.HEAD_QUANTIZED: bool(lm_head.quantized),
        _Check.HEAD_UNEVEN: lm_head.vocab_size % lm_head.tp_size != 0,
        _Check.VOCAB_TOO_LARGE: lm_head.padded_vocab_size > MAX_VOCAB,
    }


def _uniform_failures(mapping: Mapping, mode: str) -> dict[_Check, bool]:
    """The checks both sides start with (their inputs are identical on every rank)."""
    mode = SelectionMode(mode)
    return {
        _Check.MODE_OFF: mode == SelectionMode.OFF,
        _Check.TP_ONE: mapping.tp_size == 1,
        _Check.ATTENTION_DP: mapping.enable_attention_dp,
    }


def local_target_failures(mapping: Mapping, lm_head, logits_processor, *, mode: str = "auto") -> dict[_Check, bool]:
    """This rank's target-side checks (no collective); ``True`` = the check fails here."""
    failures = _uniform_failures(mapping, mode)
    failures.update(_head_failures(lm_head))
    # Exactly the plain class: a subclass may transform the logits.
    failures[_Check.CUSTOM_LOGITS_PROCESSOR] = type(logits_processor) is not LogitsProcessor
    return failures


def local_draft_failures(mapping: Mapping, lm_head, drafter_lm_head, *, mode: str = "auto") -> dict[_Check, bool]:
    """This rank's draft-side checks: the drafter drafts greedily through the target's own (eligible) head."""
    failures = _uniform_failures(mapping, mode)
    failures[_Check.DRAFTER_OWN_HEAD] = drafter_lm_head is None or drafter_lm_head is not lm_head
    failures.update(_head_failures(lm_head))
    return failures


# Checks whose inputs are identical on every rank by construction need no agreement.
_UNIFORM = {_Check.MODE_OFF, _Check.TP_ONE, _Check.ATTENTION_DP}


def _first_agreed_failure(mapping: Mapping, failures: dict[_Check, bool]) -> _Check | None:
    """The first check that fails on ANY rank; every rank walks the same checks, so the same collectives."""
    for check, failed in failures.items():
        if check in _UNIFORM or mapping.tp_size == 1:
            if failed:
                return check
            continue
        if agree_any(mapping, failed):
            return check
    return None


@dataclass(frozen=True)
class VocabParallelSelection:
    """Whether target and draft token selection run vocab-parallel, and why (identical on every rank)."""

    target_enabled: bool
    draft_enabled: bool
    target_reason: str
    draft_reason: str
    tp_size: int = 1

    @classmethod
    def decide(cls, mapping: Mapping, lm_head, logits_processor, *, mode: str = "auto",
               drafter_lm_head=None) -> "VocabParallelSelection":
        """Decide once after load (a few tiny CPU collectives when tp > 1: call on every rank).

        Target side first (plain ``LogitsProcessor`` only), then the draft
        side (only once the drafter has taken over the target's head). ``mode='on'`` raises
        :class:`~tensorrt_llm_ext.contract.BuildRefusal` instead of falling back for the target side.
        """
        mode = SelectionMode(mode)
        t_fail = _first_agreed_failure(mapping, local_target_failures(mapping, lm_head, logits_processor, mode=mode))
        if t_fail is not None and mode == SelectionMode.ON:
            # the user's setting, refused while the engine is built (agreed: every rank alike): one line, exit 2
            raise BuildRefusal(f"vocab-parallel selection forced on (mode='on': speculative_config."
                               f"vocab_parallel_selection / --vocab-parallel) but not possible: {t_fail.value}; "
                               f"use 'auto' (falls back to the gathered path, logged)")
        d_fail = _first_agreed_failure(mapping, local_draft_failures(mapping, lm_head, drafter_lm_head, mode=mode))
        decision = cls(
            target_enabled=t_fail is None,
            draft_enabled=d_fail is None,
            target_reason="eligible" if t_fail is None else t_fail.value,
            draft_reason="eligible" if d_fail is None else d_fail.value,
            tp_size=mapping.tp_size,
        )
        logger.info(decision.describe())
        return decision

    def describe(self) -> str:
        t = "vocab-parallel" if self.target_enabled else f"gathered ({self.target_reason})"
        d = "vocab-parallel" if self.draft_enabled else f"gathered ({self.draft_reason})"
        return f"token selection at tp={self.tp_size}: target {t}; draft {d}"
