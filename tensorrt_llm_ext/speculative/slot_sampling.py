"""Per-slot sampling state (the role of vLLM's ``SamplingStates``): a request's
:class:`~tensorrt_llm_ext.contract.SamplingParams` assigned to its slot, and the step variant a batch of slots
needs, answered from those params alone.

:meth:`SlotSampling.assign` is the one place a request's params become slot state: the temperature, seed and
top-p the kernels read per slot (:attr:`SlotSampling.temps` / ``seeds`` / ``top_p`` ``[num_slots]``, fp32 / int64 /
fp32, owned here as vLLM's ``SamplingStates`` owns its tensors), the logits-processing tables
(:class:`~tensorrt_llm_ext.speculative.logits_processing.SlotLogitsProcessors`) and, on the host, each slot's
step-variant facts. Nothing in between re-checks or re-derives them: the params were checked once where the request entered
(``SamplingParams.check``), and the effective values (greedy below ``MIN_TEMPERATURE``, top-p raised to
``MIN_TOP_P``) are the params' own properties.
"""

from __future__ import annotations

import torch

from tensorrt_llm_ext.contract import DSparkState, SamplingParams, fp32_words
from tensorrt_llm_ext.kernels.common import host_to_device
from tensorrt_llm_ext.speculative.logits_processing import SlotLogitsProcessors
from tensorrt_llm_ext.speculative.step_variant import StepVariant

__all__ = ["SlotSampling"]


class SlotSampling:
    """The sampling state of every slot of one worker.

    ``state``: the step state (its slot count and device); ``sampling``: False for a greedy-only worker (it
    refuses sampled params). ``temps`` / ``seeds`` / ``top_p`` ``[num_slots]`` (fp32, 0 = greedy / int64 / fp32,
    1 = no top-p set) are the per-slot values the step reads, allocated once here (before any capture). The logits processors are bound after load (:meth:`bind_processors`: their columns are
    the target head's shard).
    """

    def __init__(self, state: DSparkState, sampling: bool):
        num_slots, dev = state.ctx_lens.shape[0], state.ctx_lens.device
        self.sampling = sampling
        self.temps = torch.zeros(num_slots, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(num_slots, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=dev)
        self.processors: SlotLogitsProcessors | None = None
        self._top_p_rows = [False] * num_slots  # SamplingParams.restricts_top_p per slot, set at assignment

    def bind_processors(self, processors: SlotLogitsProcessors) -> None:
        self.processors = processors

    def assign(self, slots: list[int], params: list[SamplingParams], prompts: list[list[int]],
               idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Give ``slots`` their requests' params (one per slot) and reset their processing counts to the
        prompts'. ``idx``: ``slots`` already on the device as int64 (the caller's copy, so the admission copies
        them once). Returns the rows' ``(temps, seeds, top_p)`` on the device (contiguous ``[R]``: bit for bit
        ``temps[idx]`` ... , without gathering them back). ``ValueError`` for sampled params on a greedy-only
        worker."""
        if len(params) != len(slots):
            raise ValueError(f"SlotSampling.assign: expected one SamplingParams per slot, got {len(params)} for "
                             f"{len(slots)} slots")
        if not self.sampling and any(not p.is_greedy for p in params):
            raise ValueError(f"this worker is greedy-only (sampling=False); got temperatures "
                             f"{[p.temperature for p in params]}")
        dev = self.temps.device
        if idx is None:
            idx = host_to_device(slots, torch.int64, dev)
        # seeds, temperatures and top-ps in one copy: the int64 seeds, then each fp32 field's bits two to an int64
        # word (contract.fp32_words; viewed back as fp32 on the device; a copy each cost ~3 host ops). Each field
        # starts on an even word (16 bytes): the kernels that read them specialize on their pointers' alignment,
        # which would otherwise follow the row count (a kernel build on the first admission of each new parity).
        r, half = len(params), (len(params) + 1) // 2
        seed_words, temp_words = r + r % 2, half + half % 2
        words = host_to_device([p.seed for p in params] + [0] * (r % 2)
                               + fp32_words([p.effective_temperature for p in params]) + [0] * (half % 2)
                               + fp32_words([p.effective_top_p for p in params]), torch.int64, dev)
        seeds = words[:r]
        temps = words[seed_words:seed_words + half].view(torch.float32)[:r]
        top_p = words[seed_words + temp_words:].view(torch.float32)[:r]
        self.temps[idx] = temps
        self.seeds[idx] = seeds
        self.top_p[idx] = top_p
        for slot, p in zip(slots, params):
            self._top_p_rows[slot] = p.restricts_top_p
        self.processors.assign(slots, params, prompts, idx=idx)
        return temps, seeds, top_p

    def restricts_top_p(self, slots: list[int]) -> bool:
        """Whether a row of ``slots`` samples from a top-p set."""
        flags = self._top_p_rows  # from the params at assignment: every step asks, for every row
        return any(flags[s] for s in slots)

    def needs(self, slots: list[int]) -> StepVariant:
        """The cheapest variant that computes every row's distribution for a step over ``slots``: top-p iff a
        row samples from a top-p set, processed iff a row has logits processing, wide top-k iff a row's
        ``top_k`` exceeds the captured top-k width (never captured)."""
        proc = self.processors
        processed = proc is not None and proc.active(slots)
        return StepVariant(top_p=self.restricts_top_p(slots), processed=processed,
                           wide_top_k=processed and self.sampling and proc.wide_top_k(slots))
