"""The target's own non-speculative decode beside the worker: the serving decode, the lossless reference, and
the top-p check.

One decoder, two step shapes (``verify_shaped``):

* ``False``: the serving decode (``serve --no-speculation``, ``Engine.generate(mode="target_only")``): one
  ``[B, 1]`` row per request, what a non-speculative server runs.
* ``True``: the lossless reference (``generate --check``, ``Engine.generate(mode="reference")``): the same decode
  in the speculative step's ``[B, K+1]`` shape (the last token, then K padding columns), so every kernel whose
  reduction order depends on the step shape sees the shape the speculative step's verification sees. Strict
  acceptance keeps exactly the target's tokens of that forward, so the speculative output equals this decode's
  bit for bit; rejection sampling keeps the target's distribution instead, and
  :meth:`ReferenceDecoder.top_p_membership` checks that every sampled token lies in the target's exact top-p set.

The two shapes give the same tokens up to rounding (a ``[B, 1]`` product may sum in another order than a
``[B, K+1]`` one), never bit for bit by construction: only the verify-shaped decode is the bitwise reference.
The decoder reads the worker's models, state and op table but adds nothing to its step.
"""

from __future__ import annotations

import torch

from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.kernels.common import host_to_device
from tensorrt_llm_ext.speculative.logits_processing import SlotLogitsProcessors, record_generated
from tensorrt_llm_ext.speculative.dspark_worker import DSparkWorker
from tensorrt_llm_ext.speculative.vocab_parallel import TARGET_SALT
from tensorrt_llm_ext.speculative.worker_base import nvtx_range

__all__ = ["ReferenceDecoder"]


class ReferenceDecoder:
    """The target-only decode of a bound :class:`DSparkWorker` (its target, slot state and op table).

    ``verify_shaped``: ``True`` (the lossless reference) steps ``[B, K+1]`` blocks, ``False`` (the serving
    decode) ``[B, 1]`` rows (module doc).

    Usage: ``ref = ReferenceDecoder(worker)``; per admission ``ref.prefill_batch(slots, prompts, ...)``;
    per step ``worker.set_rows(slots, B)`` then ``ref.step(B)``. A slot decoded here holds the reference's
    own state (``ref_lens``, ``slot_tokens[:, 0]``): do not run speculative steps on it in between.
    """

    def __init__(self, worker: DSparkWorker, *, verify_shaped: bool = True):
        if worker.token_selector is None:
            raise RuntimeError("ReferenceDecoder: bind the worker (post_load) first")
        self.worker = worker
        self.step_columns = worker.draft_len + 1 if verify_shaped else 1  # query rows per request of a step
        self.next_tokens = torch.zeros(worker.max_batch_size, dtype=torch.int64, device=worker.device)  # [R]
        # The steps select from full rows: with a sharded worker they need logits processing over the whole
        # vocabulary (the worker's holds its shard's columns only).
        wp = worker.processors
        self.processors = wp if wp.mapping is None else SlotLogitsProcessors(
            wp.num_slots, 0, worker.vocab_size, worker.vocab_size, worker.device)

    def prefill_batch(self, slots: list[int], prompts: list[list[int]], params: list[SamplingParams],
                      starts: list[int] | None = None) -> list[int]:
        """The context phase of several requests (the worker's, nothing drafted): their first tokens (host ints)."""
        return self.launch_prefill_batch(slots, prompts, params, starts).tolist()

    def launch_prefill_batch(self, slots: list[int], prompts: list[list[int]], params: list[SamplingParams],
                             starts: list[int] | None = None) -> torch.Tensor:
        """:meth:`prefill_batch` enqueued: the first tokens ``[R]`` int64 on the device, nothing waited for.
        ``starts``: as :meth:`DSparkWorker.launch_prefill_batch` (positions already written by ``prefill_chunk``)."""
        toks = self.worker.launch_prefill_batch(slots, prompts, params, speculative=False, starts=starts)
        self.take_over_prefill(slots, params, prompts)
        return toks

    def take_over_prefill(self, slots: list[int], params: list[SamplingParams], prompts: list[list[int]]) -> None:
        """Continue ``slots`` -- their worker prefill just launched (``worker.prefill_rows``; a speculative one without
        drafting too, whose stored latents this decode does not read) -- in this decode: the first token's position and id from
        the prefill's device rows, and where this decode keeps its own logits processing, the requests' fields and
        the first token counted. Stream-ordered behind the prefill; nothing read back."""
        w, st = self.worker, self.worker.state
        slots_l, lens, tok = w.prefill_rows  # the worker's device copies of this admission's rows
        if self.processors is not w.processors:
            self.processors.assign(slots, list(params), prompts, idx=slots_l)
            if self.processors.counting(slots):
                self.processors.record(slots, slots_l, tok[:, None],
                                       torch.ones(len(slots), dtype=torch.int32, device=w.device))
        st.ref_lens[slots_l] = lens.to(st.ref_lens.dtype)
        st.slot_tokens[slots_l, 0] = tok.to(st.slot_tokens.dtype)

    def take_over(self, slots: list[int], params: list[SamplingParams], prompts: list[list[int]],
                  outputs: list[list[int]]) -> None:
        """Continue ``slots`` -- decoding speculatively until now -- in this decode (the speculation gate closed):
        the position of each slot's last token becomes this decode's (``ctx_lens``, the speculative step's anchor,
        is ``ref_lens``; ``slot_tokens[:, 0]`` already holds that token, the bonus of its last step). Stream-ordered
        behind any step already launched. Where this decode keeps its own full-vocabulary logits processing (a
        sharded worker), the requests' fields and counts are set from ``prompts`` and ``outputs`` (the tokens out so
        far); otherwise the worker's processing state, which the speculative steps kept, is shared."""
        if not slots:
            return
        w, st = self.worker, self.worker.state
        slots_l = host_to_device(slots, torch.int64, w.device)
        st.ref_lens[slots_l] = st.ctx_lens[slots_l].to(st.ref_lens.dtype)
        if self.processors is w.processors:
            return
        self.processors.assign(slots, list(params), prompts)
        record_generated(self.processors, slots, slots_l, outputs)

    def step(self, batch_size: int) -> torch.Tensor:
        """One non-speculative decode step over the worker's rows ``[0, B)``: ``[B]`` int64 next tokens
        (:meth:`step_outputs`' ``new_tokens``)."""
        return self.step_outputs(batch_size)["new_tokens"]

    def step_outputs(self, batch_size: int) -> dict[str, torch.Tensor]:
        """One non-speculative decode step over the worker's rows ``[0, B)``: ``new_tokens [B]`` int64 and
        ``logits [B, V]``, the target's raw full-vocabulary logits of the step (before any logits processing;
        what ``logprobs`` report), as the speculative step's outputs carry theirs.

        The forward is ``[B, step_columns]``: ``[B, 1]`` for the serving decode; for the lossless reference the
        verification's shape (``[B, K+1]``: the last token then K padding columns at the next positions,
        overwritten by the next step before anyone attends them), so every kernel with a shape-dependent
        reduction order sees the shape it sees in the speculative step. Selection is the gathered path (the
        target's full-vocabulary logits) through the worker's one selection dispatch. CUDA-graph safe.
        """
        w = self.worker
        w.check_rows(batch_size)
        st, ss = w.state, w.slot_sampling
        b = batch_size
        slots = w.slot_ids[:b]
        processed = w.step_processed  # the variant's switch (captured per variant), not the rows'
        slots_l = slots.long() if w.sampling or processed else None
        c = self.step_columns
        with nvtx_range("target_only"):
            # One launch on each side of the forward (each launch a serial step of the graph): the inputs gathered
            # contiguous with RoPE's rows from the worker's table, nothing captured, the state updated in place
            # (kernels/decode_step.py).
            tokens, positions, cos, sin = w.ops.decode_inputs(slots, st.slot_tokens, st.ref_lens, c, w.rope_table)
            out = w.target(tokens, positions, slots, st.kv_cache, capture=False, rope=(cos, sin))
            hidden = out.hidden_states.view(b, c, -1)[:, 0]
            logits = w.target.logits(hidden)
            temps, seeds = (ss.temps[slots_l], ss.seeds[slots_l]) if w.sampling else (None, None)
            offsets = positions[:, 0] + 1 if w.sampling else None

            def process(x, t):
                return self.processors.apply(x, w.step_slots, slots_l, t)
            ids = w.distribution.select(logits, temps, seeds, offsets, TARGET_SALT, self.next_tokens[:b],
                                        process=process if processed else None,
                                        top_p=ss.top_p[slots_l] if w.sampling and w.step_top_p else None)
            if processed:
                live = (~w.is_dummy[:b]).to(torch.int32)
                self.processors.record(w.step_slots, slots_l, ids[:, None], live, live.bool())
            w.ops.decode_advance(slots, w.is_dummy[:b], ids, st.ref_lens, st.slot_tokens)
        return {"new_tokens": ids, "logits": logits}

    def top_p_membership(self, slot: int, prompt_ids: list[int], output_ids: list[int], temperature: float,
                         top_p: float) -> list[bool]:
        """For each emitted token, whether it lies in the target's kept set at its position (eager).

        Teacher-forces ``prompt + output`` through the target on ``slot``, which must hold pages for the whole
        sequence (its KV cache is overwritten: call between requests; :meth:`Engine.top_p_membership` takes a slot
        and its pages for the replay) and evaluates ``top_p_keep`` on the full-vocabulary logits with the request's
        temperature and ``top_p`` (``T = 0`` keeps exactly the first maximum, so a greedy token is checked
        against the argmax). One full-sequence forward: its logits round differently from the step's, so a
        token exactly at the kept set's boundary could in principle flip (fp32: far below any gap here).
        """
        if not output_ids:
            return []
        w = self.worker
        dev = w.device
        seq = list(prompt_ids) + list(output_ids[:-1])
        ids = torch.tensor([seq], dtype=torch.int64, device=dev)
        positions = torch.arange(len(seq), dtype=torch.int64, device=dev)[None]
        out = w.target(ids, positions, torch.tensor([slot], dtype=torch.int32, device=dev), w.state.kv_cache)
        n, m = len(prompt_ids), len(output_ids)
        logits = w.target.logits(out.hidden_states[n - 1:n - 1 + m]).contiguous()
        temps = torch.full((m,), float(temperature), dtype=torch.float32, device=dev)
        keep = w.ops.top_p_keep(logits, torch.full((m,), float(top_p), dtype=torch.float32, device=dev),
                                temperatures=temps)
        toks = torch.tensor(output_ids, dtype=torch.int64, device=dev)
        return keep.gather(1, toks[:, None])[:, 0].cpu().tolist()
