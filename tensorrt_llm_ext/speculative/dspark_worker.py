"""The one-model DSpark worker: one speculative decode step, CUDA-graph capturable per batch size.

Per generation step over rows ``[0, B)`` (``B`` = a CUDA-graph batch size; padding rows are dummies on
the dummy slot), shape letters as in :mod:`~tensorrt_llm_ext.contract`:

1. ``block table``: decode the KV manager's encoded page offsets (:func:`decode_block_table`).
2. ``target``: verify ``[anchor, d_0 .. d_{K-1}]`` of every row at positions ``ctx_len .. ctx_len+K``
   (tokens and ``ctx_len`` are read per slot on the device) -> final hidden ``[B*(K+1), H]`` + captured
   features ``[B*(K+1), F]``.
3. ``selection``: the target's token for every verified position, from this rank's vocab shard with the
   pair exchange when bound vocab-parallel, else from the gathered logits; greedy rows ``argmax``,
   sampled rows keyed Gumbel-max with ``(seed, offset = absolute position of the token)``.
4. ``tail``: :func:`strict_accept` (or, with ``use_rejection_sampling``, :func:`rejection_sample` against
   the draft logits stored per slot by the previous step, see :mod:`.rejection_verifier`) -> :func:`paged_latent_step` (bonus token, block ids, latent
   destinations, ``ctx_len`` advance, the block's :class:`DraftBlockPlacement`) -> the drafter's context
   latents of the verified positions, stored by :func:`store_context_latents` (accepted ones only).
5. ``draft``: the drafter's block decode -> base draft logits through the shared LM head (its shard when
   the draft side is vocab-parallel) -> ``chain``: the :class:`MarkovChain` -> the next K drafts
   (greedy: the draft most likely to equal the target's token, sampled or not; with rejection sampling,
   sampled rows draw keyed Gumbel-max at their temperature (times ``draft_temperature_scale``) with Philox offset =
   the absolute position of the drafted token, and the biased logits (divided by that scale) are stored per slot as
   the draft distribution).

The token the target picks at absolute position ``p`` depends only on the sequence before ``p`` and the
request's ``(seed, p)``; strict acceptance keeps exactly the target's tokens, so the output equals the
target's own decode (:class:`~tensorrt_llm_ext.speculative.reference_decoder.ReferenceDecoder`, same step
shape) bit for bit. Rejection
sampling keeps the target's distribution instead (greedy rows stay strict acceptance, bit for bit).

Top-p (a request's ``SamplingParams.top_p``, assigned to its slot by :class:`SlotSampling`): sampled rows
select from the target's exact top-p set (:func:`top_p_keep`, on the shards when bound vocab-parallel), in the
step, in prefill and in the reference decode alike. Whether a step runs the top-p path is its :class:`StepVariant`, a host-side fact
fixed by :meth:`set_rows` (by default the variant the rows need, :meth:`step_needs`); CUDA graphs capture
each variant of :attr:`step_variants` and the graph runner replays one that covers the rows
(:mod:`tensorrt_llm_ext.runtime.cuda_graph`).

Logits processing (the ``SamplingParams`` fields ``logit_bias``, penalties, ``min_p``, ``top_k``;
:mod:`.logits_processing`): the target's logits are processed on the shards before selection, before
rejection-sampling verification, and in prefill and the reference decode alike, so the processed distribution
is the one speculation preserves; a step runs it only when one of its rows has a processed field (another
host-side fact: the processed variant, captured like the others; the ops are the same whatever the rows hold,
see :mod:`.logits_processing`).

No allocation through a launcher, no host sync and no data-dependent Python branch inside the step:
``forward(B)`` can be captured once per ``B`` (see :mod:`tensorrt_llm_ext.runtime.cuda_graph`).
"""

from __future__ import annotations

import torch

from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.contract import (DraftBlockPlacement, DrafterBlockInputs, DraftModel, DSparkState,
                                       PagedLatentCache, SamplingParams, TargetModel, TargetOutput)
from tensorrt_llm_ext.speculative.logits_processing import SlotLogitsProcessors, record_generated
from tensorrt_llm_ext.speculative.markov_chain import MarkovChain
from tensorrt_llm_ext.speculative.markov_exactness import resolve_markov_mode
from tensorrt_llm_ext.speculative.metadata import SpecMetadata
from tensorrt_llm_ext.speculative.rejection_verifier import RejectionVerification, RejectionVerifier
from tensorrt_llm_ext.speculative.slot_sampling import SlotSampling
from tensorrt_llm_ext.kernels.common import copy_from_host_, host_to_device
from tensorrt_llm_ext.kernels.paged_latent import PagedLatentStep
from tensorrt_llm_ext.speculative.step_ops import FUSED_OPS, StepOps
from tensorrt_llm_ext.speculative.step_variant import (DEFAULT_VARIANT, PROCESSED_TOP_P_VARIANT, PROCESSED_VARIANT,
                                                       TOP_P_VARIANT, StepVariant)
from tensorrt_llm_ext.speculative.target_distribution import TargetDistribution
from tensorrt_llm_ext.speculative.vocab_parallel import TARGET_SALT, VocabShardedLogits
from tensorrt_llm_ext.speculative.worker_base import SpecWorkerBase, nvtx_range


class DSparkWorker(SpecWorkerBase):
    """One-model DSpark worker over a :class:`~tensorrt_llm_ext.models.llama_target.LlamaTarget` and a
    :class:`~tensorrt_llm_ext.models.dspark_drafter.DSparkDrafter` sharing its LM head.

    Usage: ``w = DSparkWorker(...); w.post_load(vocab_parallel_mode=...)``; per admission
    ``w.prefill_batch(slots, prompts, ...)`` (or ``w.prefill(slot, prompt, ...)``); per step ``w.set_rows(slots, batch_size)`` then ``w.forward(B)``.
    """

    def __init__(self, target: TargetModel, drafter: DraftModel, state: DSparkState, *, mapping: Mapping,
                 draft_len: int, max_batch_size: int, markov_chain_mode: str = "auto", ops: StepOps = FUSED_OPS,
                 sampling: bool = True, use_rejection_sampling: bool = False, verification_mode: str = "auto",
                 prefill_chunk_tokens: int | None = None, draft_temperature_scale: float = 1.0):
        super().__init__(mapping, target, drafter, draft_len, max_batch_size)
        self.ops = ops
        # Chunked prefill: at most this many tokens per target forward of a prefill (None: one forward).
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # The prefill's target forward in captured token buckets (runtime/prefill_graph.py; set by the engine
        # when cuda_graph_config.prefill_max_tokens is on); None: eager.
        self.prefill_runner = None
        # A greedy-only worker passes no temperatures to selection (plain argmax, as a greedy-only
        # upstream worker does) and refuses sampled requests.
        self.sampling = sampling
        self.use_rejection_sampling = use_rejection_sampling  # config; the decision lives in self.verifier
        # Rejection sampling: drafts drawn at this fraction s of the row's temperature T (in (0, 1]: the config
        # checks it); the stored draft logits are the chain's divided by s, so the verifier's q at T is exactly the
        # distribution they were drawn from.
        self.draft_temperature_scale = float(draft_temperature_scale)
        self.verification_mode = verification_mode
        self.verifier: RejectionVerifier | None = None  # bound in _on_bound when rejection sampling is on
        self.state = state
        self.markov_chain_mode = ops.markov_mode or markov_chain_mode
        self.device = state.ctx_lens.device
        self.vocab_size = target.vocab_size
        self.mask_token_id = drafter.mask_token_id
        r, k = max_batch_size, draft_len
        dev = self.device
        num_slots = state.ctx_lens.shape[0]
        # Slot ids of the step's rows live on the spec metadata (shared by every CUDA-graph view).
        self.metadata = SpecMetadata(max_num_requests=r, max_draft_len=k, vocab_size=self.vocab_size,
                                     num_seq_slots=num_slots, device=dev, use_rejection_sampling=False)
        self.metadata.prepare()
        self.slot_ids = self.metadata.batch_slot_ids  # [R] int32
        self.num_accepted = self.metadata.num_accepted  # [R] int32
        self.is_dummy = torch.ones(r, dtype=torch.bool, device=dev)
        # RoPE's cos / sin of every position a step reaches (the cache's, plus a verify block's columns past a full
        # slot), gathered with the step's inputs in one launch (kernels/decode_step.py: bit for bit what the forward
        # would compute, without its four RoPE launches); the reference decoder's steps read it too
        self.rope_table = target.rotary_emb.cos_sin_table(state.kv_cache.max_positions + k + 1)
        self.target_tokens = torch.zeros(r * (k + 1), dtype=torch.int64, device=dev)
        self.accepted = torch.zeros(r, k + 1, dtype=torch.int64, device=dev)
        self.num_blocks = torch.zeros(num_slots, dtype=torch.int32, device=dev)
        self.next_new_tokens = torch.zeros(r, k + 1, dtype=torch.int64, device=dev)
        # Per-position confidences of the drafts in next_new_tokens[:, 1:] (a drafter with a confidence
        # head; the scheduler reads them from the step output; zeros without one).
        self.draft_confidences = torch.zeros(r, k, dtype=torch.float32, device=dev)
        self._tail = PagedLatentStep.allocate(r, k, dev)
        self._tail_views: dict[int, PagedLatentStep] = {}
        # The admission's first block (prefill_batch past its first tokens: the first token's bookkeeping as an
        # accepted one, its latent, the drafter's block, the chain) on static rows of its own, so the engine can
        # replay it from CUDA graphs per row count (admission_runner; runtime/cuda_graph.py) instead of launching
        # its few dozen kernels from Python per admission; without a runner it runs eagerly on the same rows.
        # Its own rows, not the step's: with the overlap scheduler a step is in flight while an admission runs.
        self.admission_runner = None
        self.admit_slot_ids = torch.full((r,), state.dummy_slot, dtype=torch.int32, device=dev)
        self.admit_is_dummy = torch.ones(r, dtype=torch.bool, device=dev)
        self.admit_accepted = torch.zeros(r, k + 1, dtype=torch.int64, device=dev)  # [first token, 0 ...]
        self.admit_num_accepted = torch.ones(r, dtype=torch.int32, device=dev)
        pool = state.latent_pool  # [L, pages, page_size, d_c]
        self.admit_latents = torch.zeros(r, k + 1, pool.shape[0], pool.shape[-1], dtype=pool.dtype, device=dev)
        self.admit_next = torch.zeros(r, k + 1, dtype=torch.int64, device=dev)  # [first token, drafts]
        self._admit_tail = PagedLatentStep.allocate(r, k, dev)
        self._admit_views: dict[int, PagedLatentStep] = {}
        self._admit_batch_size: int | None = None
        self.markov: MarkovChain | None = None
        self._neg_one = torch.full((), -1, dtype=torch.int32, device=dev)
        self._rows_batch_size: int | None = None  # batch size of the last set_rows()
        # Each slot's SamplingParams: the slot tensors the step reads and the host copy set_rows() routes by.
        self.slot_sampling = SlotSampling(state, sampling)
        self._step_variant = DEFAULT_VARIANT
        # Processing, the exact top-p set and selection of target rows, composed once (bound after load).
        self.distribution = TargetDistribution(ops, max_batch_size, draft_len, dev)
        self.processors: SlotLogitsProcessors | None = None  # bound in _on_bound (the target's columns)
        self._step_slots: list[int] = []  # host slot ids of the last set_rows
        # The raw target logits of the last prefill's rows ([R, V], or this rank's shard): logprobs read them.
        self.prefill_logits: VocabShardedLogits | torch.Tensor | None = None
        # The last prefill's rows on the device: (slots int64 [R], prompt lengths int64 [R], first tokens int64 [R])
        self.prefill_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # The last prefill's (or chunk's) final hidden states [R * cols, H], row r's position s_r + j at r * cols + j,
        # kept (until the next prefill) when keep_prefill_hidden says a request reads its prompt's log-probabilities.
        self.keep_prefill_hidden = False
        self.prefill_hidden: torch.Tensor | None = None
        self.prefill_cols = 0

    # -- binding -------------------------------------------------------------------------------------
    def _on_bound(self) -> None:
        sel = self.token_selector.selection
        if not self.ops.vocab_parallel and (sel.target_enabled or sel.draft_enabled):
            # Same op table and decision on every rank: every rank raises alike, no peer waits.
            raise ValueError(f"DSparkWorker: the {self.ops.name} op table selects from gathered logits; bind it "
                             f"with vocab_parallel_mode='off' ({sel.describe()})")
        exchange = self.token_selector.draft_exchange
        weights = self.drafter.markov_head_weights(vocab_parallel=exchange is not None)

        def chain(mode: str) -> MarkovChain:
            return MarkovChain(weights, max_batch_size=self.max_batch_size, draft_len=self.draft_len,
                               logits_dtype=self.target.dtype, exchange=exchange, mode=mode)

        self.markov = chain(self.markov_chain_mode)
        head = self.token_selector.target_head
        self.processors = SlotLogitsProcessors(
            self.state.ctx_lens.shape[0], head.vocab_start if head is not None else 0,
            head.lm_head.shard_width if head is not None else self.vocab_size, self.vocab_size, self.device,
            self.mapping, sharded=head is not None)
        self.slot_sampling.bind_processors(self.processors)
        self.distribution.bind(self.token_selector)
        decision = RejectionVerification.decide(
            use_rejection_sampling=self.use_rejection_sampling, mode=self.verification_mode,
            sampling=self.sampling, selector=self.token_selector, tp_size=self.mapping.tp_size)
        if decision.enabled:
            self.verifier = RejectionVerifier(decision, self.token_selector, self.mapping,
                                              max_batch_size=self.max_batch_size, draft_len=self.draft_len,
                                              vocab_size=self.vocab_size, logits_dtype=self.target.dtype,
                                              device=self.device)
            self.metadata.allocate_draft_logits(self.verifier.width, self.target.dtype)
        else:
            logger.info(decision.describe())
        if exchange is not None:  # agreed on every rank, and so are the sizes: the guard's collective is too
            exact_sizes = [b for b in range(1, self.max_batch_size + 1) if self.markov.mode_for(b) == "exact"]
            full = self.drafter.markov_head_weights(vocab_parallel=False)
            mode = resolve_markov_mode(self.markov_chain_mode, self.mapping, weights.markov_w1, full.markov_w2,
                                       weights.markov_w2, weights.vocab_start, weights.vocab_size, exact_sizes)
            if mode != self.markov_chain_mode:
                self.markov = chain(mode)

    # -- host-side row setup (outside any captured region) -------------------------------------------------
    @property
    def step_variants(self) -> tuple[StepVariant, ...]:
        """The variants this worker's steps can need, cheapest first (what CUDA graphs capture): a
        greedy-only worker never restricts to a top-p set; one processed variant per worker (a sampling
        worker's also runs top-p, so it covers every step but a wide top-k one)."""
        if self.sampling:
            return (DEFAULT_VARIANT, TOP_P_VARIANT, PROCESSED_TOP_P_VARIANT)
        return (DEFAULT_VARIANT, PROCESSED_VARIANT)

    def step_needs(self, slots: list[int]) -> StepVariant:
        """The cheapest variant that computes every row's distribution for a step over ``slots``, from the
        slots' params alone (:meth:`SlotSampling.needs`)."""
        return self.slot_sampling.needs(slots)

    def set_rows(self, slots: list[int], batch_size: int, variant: StepVariant | None = None) -> None:
        """Rows ``[0, len(slots))`` run these slots; rows up to ``batch_size`` are dummies (dummy slot).

        ``variant``: the code path the step runs (default: :meth:`step_needs` of ``slots``); it must cover
        the rows' needs -- a step never runs a path that computes another distribution for a row.
        """
        self._check_rows("set_rows", slots, batch_size)
        need = self.step_needs(slots)
        variant = need if variant is None else variant
        # A variant no graph is captured for (wide top-k) runs as the rows need it, eagerly.
        if not variant.covers(need) or (variant not in self.step_variants and variant != need):
            raise ValueError(f"set_rows: the {variant} step variant does not serve these rows (they need the "
                             f"{need} variant; this worker runs {[str(v) for v in self.step_variants]})")
        self._copy_rows(slots, batch_size, self.slot_ids, self.is_dummy)
        self._rows_batch_size = batch_size
        self._step_variant = variant
        self._step_slots = list(slots)

    def _check_rows(self, where: str, slots: list[int], batch_size: int) -> None:
        if len(slots) > batch_size or not 1 <= batch_size <= self.max_batch_size:
            raise ValueError(f"{where}: {len(slots)} slots do not fit batch_size={batch_size} "
                             f"(max {self.max_batch_size})")
        self.check_slots(where, slots)

    def _copy_rows(self, slots: list[int], batch_size: int, slot_ids: torch.Tensor, is_dummy: torch.Tensor) -> None:
        """``slot_ids[:batch_size]`` / ``is_dummy[:batch_size]``: ``slots`` first, then dummy rows (the dummy slot).
        On CUDA from pinned memory, asynchronously (:func:`copy_from_host_`): the copy is stream-ordered behind the
        step in flight (the overlap scheduler launches the next step before the previous one is done) and never
        waits for it."""
        n = len(slots)
        pad = batch_size - n
        # Each host row built whole from a list (one op each; filling a buffer, then its first n, took five).
        copy_from_host_(slot_ids[:batch_size],
                        torch.tensor([*slots, *[self.state.dummy_slot] * pad], dtype=torch.int32))
        copy_from_host_(is_dummy[:batch_size], torch.tensor([False] * n + [True] * pad, dtype=torch.bool))

    def check_slots(self, where: str, slots: list[int]) -> None:
        """Distinct request slots ``[0, dummy_slot)``: the step indexes per-slot state with these ids on the
        device and advances each real row's slot once -- an id out of range is a device fault, a repeated
        one advances a request twice."""
        dummy = self.state.dummy_slot
        bad = [s for s in slots if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < dummy]
        want = f"{where}: expected distinct request slots [0, {dummy}), got {list(slots)[:8]}"
        if bad:
            raise ValueError(f"{want}: {bad[:5]} are not request slots")
        if len(set(slots)) != len(slots):
            raise ValueError(f"{want}: a slot may run in one row of a step")

    @property
    def step_variant(self) -> StepVariant:
        """The variant the step prepared by the last :meth:`set_rows` runs."""
        return self._step_variant

    @property
    def step_top_p(self) -> bool:
        """Whether the prepared step runs the exact top-p restriction (its variant's switch)."""
        return self._step_variant.top_p

    @property
    def step_slots(self) -> list[int]:
        """The host slot ids of the last :meth:`set_rows` (its real rows)."""
        return self._step_slots

    @property
    def step_processed(self) -> bool:
        """Whether the prepared step processes its rows' logits (its variant's switch)."""
        return self._step_variant.processed

    def processed(self, logits: VocabShardedLogits | torch.Tensor, slots: list[int], row_slots: torch.Tensor,
                  temps: torch.Tensor | None, block_tokens: torch.Tensor | None = None
                  ) -> VocabShardedLogits | torch.Tensor:
        """``logits`` (a shard or full rows) through the slots' logits processing (:mod:`.logits_processing`)."""
        x = logits.logits if isinstance(logits, VocabShardedLogits) else logits
        if x.shape[-1] != self.processors.width:
            raise ValueError(f"processed: logits of width {x.shape[-1]}, the processors hold {self.processors.width}")
        y = self.processors.apply(x, slots, row_slots, temps, block_tokens)
        return logits.__class__(y, logits.vocab_start, logits.vocab_size, logits.padded_vocab_size) \
            if isinstance(logits, VocabShardedLogits) else y

    def reset_step_state(self) -> None:
        """Forget the prepared rows and clean the Markov workspace (after a step was aborted part way).

        The next step then needs a fresh :meth:`set_rows`; per-slot state is rewritten by each prefill.
        """
        self._rows_batch_size = None
        if self.markov is not None:
            self.markov.reset()

    def check_rows(self, batch_size: int) -> None:
        # Rows past the last set_rows() batch hold stale slot ids: running them would advance (and
        # overwrite the caches of) requests that are not in this step.
        if batch_size != self._rows_batch_size:
            raise ValueError(f"{type(self).__name__}: the step runs {batch_size} rows but set_rows() prepared "
                             f"{self._rows_batch_size}; call set_rows(slots, {batch_size}) first")

    def tail_buffers(self, batch_size: int) -> PagedLatentStep:
        """Views of the preallocated tail outputs for ``batch_size`` rows (created outside capture)."""
        return _rows_view(self._tail, self._tail_views, batch_size)

    # -- pieces shared by prefill, the step and the target-only decode -----------------------------------
    def decode_pages(self) -> None:
        """Encoded offsets -> physical page ids, ``-1`` kept where unallocated.

        :func:`decode_block_table` maps an unallocated entry to page 0 (and counts the valid ones);
        :func:`paged_latent_step` counts allocated pages as the entries ``>= 0``, so the unallocated ones
        are set back to -1 (one more elementwise launch; capturable).
        """
        st = self.state
        self.ops.decode_block_table(st.encoded_offsets, st.page_divisor, out=st.block_table,
                                    num_blocks_out=self.num_blocks)
        torch.where(st.encoded_offsets >= 0, st.block_table, self._neg_one, out=st.block_table)

    def _select(self, hidden: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
                out: torch.Tensor, top_p: torch.Tensor | None = None, process=None
                ) -> tuple[torch.Tensor, VocabShardedLogits | torch.Tensor]:
        """Target tokens for rows of ``hidden [R, H]``: vocab-parallel when bound, else gathered, from the rows'
        distribution (:class:`TargetDistribution`: ``process`` then the exact top-p set of ``top_p [R]``, each
        None when no row needs it). Returns the ids and the raw logits (before processing and the top-p mask:
        what log-probabilities are computed from)."""
        raw = self.token_selector.target_logits(hidden)
        if not self.sampling:
            temps = seeds = offsets = top_p = None
        return self.distribution.select(raw, temps, seeds, offsets, TARGET_SALT, out, process=process,
                                        top_p=top_p), raw

    def draft_block_logits(self, tail: PagedLatentStep, slots: torch.Tensor) -> torch.Tensor:
        """The drafter's block decode through the shared head: ``[B, K, V_shard]`` on a vocab-parallel draft
        side, else ``[B, K, V]``."""
        cache = PagedLatentCache(pool=self.state.latent_pool, block_table=self.state.block_table)
        hidden = self.drafter.forward_block(DrafterBlockInputs(block_input_ids=tail.block_input_ids, slot_ids=slots,
                                                               placement=tail.placement, cache=cache))
        self._block_hidden = hidden  # the confidence head reads it after the chain
        return self.token_selector.draft_logits(hidden)

    def draft(self, tail: PagedLatentStep, slots: torch.Tensor, out_drafts: torch.Tensor) -> None:
        """Drafter block decode -> base logits -> Markov chain -> ``out_drafts [B, K]``."""
        with nvtx_range("draft_forward"):
            base = self.draft_block_logits(tail, slots)
        with nvtx_range("markov_chain"):
            if self.verifier is None:
                _, drafts = self.markov(base, tail.bonus_tokens)
            else:
                # Sampled drafts: keyed Gumbel-max at the row's temperature, Philox offset = the absolute
                # position of the drafted token (the anchor sits at ctx_len, already advanced; draft k at
                # ctx_len + 1 + k); the biased logits are the draft distribution q of the next verification.
                st, ss, slots_l = self.state, self.slot_sampling, slots.long()
                offsets = st.ctx_lens[slots_l].long() + 1
                scale = self.draft_temperature_scale
                temps = ss.temps[slots_l] if scale == 1.0 else ss.temps[slots_l] * scale
                biased, drafts = self.markov(base, tail.bonus_tokens, temps, ss.seeds[slots_l], offsets)
                if scale != 1.0:  # q = softmax(biased / (s T)) = softmax((biased / s) / T): the verifier's form;
                    biased.div_(scale)  # in place: the chain's step buffer, no [B, K, V] copy in a captured graph
                self.ops.store_rows(self.metadata.draft_logits, slots_l, self.verifier.store_width(biased))
            out_drafts.copy_(drafts)
        if getattr(self.drafter, "has_confidence_head", False):
            with nvtx_range("draft_confidence"):
                prev = torch.cat((tail.bonus_tokens.view(-1, 1).long(), drafts[:, :-1].long()), dim=1)
                self.draft_confidences[:drafts.shape[0]].copy_(self.drafter.block_confidences(self._block_hidden, prev))

    # -- prefill (a batch of requests in one target forward; eager but for its bucketed target forward) ----
    def prefill(self, slot: int, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                speculative: bool = True) -> int:
        """Context phase of one request on ``slot`` (:meth:`prefill_batch` of one): its first token."""
        return self.prefill_batch([slot], [prompt_ids], [params], speculative=speculative)[0]

    def _check_prefill(self, slots, prompts, params) -> None:
        n = len(slots)
        if n == 0 or not len(prompts) == len(params) == n:
            raise ValueError(f"prefill_batch: expected one prompt and one SamplingParams per slot (at least one), "
                             f"got {n} slots, {len(prompts)} prompts, {len(params)} params")
        self.check_slots("prefill_batch", slots)
        empty = [s for s, p in zip(slots, prompts) if len(p) == 0]
        if empty:
            raise ValueError(f"prefill_batch: empty prompt on slots {empty}")

    def prefill_batch(self, slots: list[int], prompts: list[list[int]], params: list[SamplingParams],
                      speculative: bool = True, starts: list[int] | None = None) -> list[int]:
        """:meth:`launch_prefill_batch`, its first tokens read back (host ints; one device synchronisation)."""
        return self.launch_prefill_batch(slots, prompts, params, speculative, starts).tolist()

    def launch_prefill_batch(self, slots: list[int], prompts: list[list[int]], params: list[SamplingParams],
                             speculative: bool = True, starts: list[int] | None = None,
                             prompt_lens: list[int] | None = None, draft: bool = True) -> torch.Tensor:
        """Context phase of several requests in ONE target forward, enqueued: their first generated tokens
        (``[R]`` int64 on the device; nothing waits for the device).

        ``starts[r]``: prompt ``r``'s positions already in the cache (written by :meth:`prefill_chunk`; default
        none), so row ``r`` runs positions ``s_r .. n_r-1``. The ragged rows are padded to ``[R, T]`` (``T`` =
        the longest ``n_r - s_r``; row ``r`` holds its tokens at positions ``s_r .. n_r-1`` and padding tokens
        at ``n_r .. s_r+T-1``). Each row writes only its own
        slot's KV cache: the padding positions lie past the prompt, stale like rejected drafts, and every
        later step rewrites a position before any query attends it. Speculative: ONE store of every
        prompt's drafter context latents (positions ``0 .. n_r-2``; padding rows masked out), the
        bookkeeping of all rows as generation rows that accepted one token (the first generated one), whose
        latent ``n_r-1`` is stored in a second store, and ONE block decode drafting every row's first block.
        ``speculative=False``: the context phase only, the first tokens and nothing drafted. ``params``: each
        request's :class:`SamplingParams` (checked where the request entered), assigned to its slot
        (:class:`SlotSampling`): temperature, seed, top-p set and logits processing. ``prompt_lens[r]``: where
        row ``r``'s own prompt ends when ``prompts[r]`` also holds tokens it generated (a request resuming
        speculation re-prefills what it decoded target-only): the logits processing counts those as generated
        (presence / frequency penalties read them); default: all prompt. ``draft=False`` (speculative): the prompt's
        latents of positions ``s .. n-2`` stored, nothing drafted and no step state set -- a request that decodes
        target-only from here keeps latents to resume speculation from (its last prompt position on).

        Same tokens and caches as one :meth:`prefill` per request wherever the target's and the drafter's
        GEMMs compute a row independently of the others (the CPU tests check it bit for bit); on a GPU a
        GEMM of another shape may round differently. Eager but for the target forward, which replays captured
        token buckets where the engine enabled them (:meth:`_prefill_forward`), and for the first block, which replays
        its graph of the row count where the engine captured one (:meth:`draft_first_block`); never synchronises (the
        slots' next step reads their first tokens and drafts on the device).
        """
        self._check_prefill(slots, prompts, params)
        st = self.state
        dev = self.device
        k = self.draft_len
        r = len(slots)
        lens = [len(p) for p in prompts]
        starts = [0] * r if starts is None else list(starts)
        bad = [(s, n) for s, n in zip(starts, lens) if not 0 <= s < n]
        if len(starts) != r or bad:
            raise ValueError(f"prefill_batch: expected one start per prompt in [0, its length), got {starts} for "
                             f"lengths {lens}")
        t = max(n - s for s, n in zip(starts, lens))
        # The rows' slots, lengths, starts, the row of each prompt's last token in the block and the [R, T] id
        # block (padded with 0) in one host-to-device copy (each its own copy or a few launches cost ~3 host ops;
        # the block built as one host tensor: one per row cost ~10 us a row).
        last = [row * t + n - s - 1 for row, (s, n) in enumerate(zip(starts, lens))]
        block = host_to_device(list(slots) + lens + starts + last + [tok for p, s in zip(prompts, starts)
                                                                    for tok in (*p[s:], *[0] * (t - (len(p) - s)))],
                               torch.int64, dev)
        slots_l, lens_t, starts_t, last_t = block[:4 * r].view(4, r)
        ids = block[4 * r:].view(r, t)
        slots_t = slots_l.int()
        own = prompts if prompt_lens is None else [p[:k] for p, k in zip(prompts, prompt_lens)]
        try:
            temps, seeds, top_p = self.slot_sampling.assign(slots, list(params), own, idx=slots_l)
        except ValueError as e:
            raise ValueError(f"{type(self).__name__}: {e}") from None
        if prompt_lens is not None and self.processors.counting(slots):
            record_generated(self.processors, slots, slots_l, [p[k:] for p, k in zip(prompts, prompt_lens)])
        process = None
        if self.processors.active(slots):
            def process(logits, temps):
                return self.processed(logits, slots, slots_l, temps)
        # with the latent fold the runner's graphs also copy each row's last latent into the first block's rows
        fold = self._latent_fold(speculative)
        with nvtx_range("prefill"):
            out = self._prefill_forward(ids, starts_t, slots_t, [(s, n - s) for s, n in zip(starts, lens)],
                                        prompt_lens=lens_t if fold else None,
                                        last_latents=self.admit_latents[:r, 0] if fold else None)
            self._keep_hidden(out, t)
            tok = torch.empty(r, dtype=torch.int64, device=dev)
            _, self.prefill_logits = self._select(out.hidden_states.index_select(0, last_t), temps, seeds, lens_t, tok,
                                                  top_p if self.slot_sampling.restricts_top_p(slots) else None,
                                                  process)
            if self.processors.counting(slots):
                self.processors.record(slots, slots_l, tok[:, None], torch.ones(r, dtype=torch.int32, device=dev))
            # the admission's rows on the device, for a caller that keeps state of its own (the reference decode)
            self.prefill_rows = (slots_l, lens_t, tok)
            if not speculative:  # the context phase only (the reference decode records its own state)
                return tok
            # Positions s .. n-2 are stored here; position n-1 goes through the step bookkeeping of the first block,
            # which treats each prompt as a generation row that accepted exactly one token (its first generated one).
            last_latents = None  # the fold put them in the first block's rows
            if out.captured is not None:  # the eager forward (no runner, or its rule said eager): stored here
                last_latents = self._store_prompt_latents(out, slots_l, starts_t, lens_t).index_select(0, last_t)
            if not draft:
                return tok
            st.ctx_lens[slots_l] = (lens_t - 1).to(st.ctx_lens.dtype)
            self.draft_first_block(slots, tok, last_latents)
        return tok

    # -- the admission's first block (static rows; replayed per row count where the engine captured it) -------
    @property
    def admission_rows(self) -> "AdmissionRows":
        """The first block's rows as a graph runner drives them (:class:`AdmissionRows`)."""
        return AdmissionRows(self)

    def set_admission_rows(self, slots: list[int], batch_size: int) -> None:
        """Rows ``[0, len(slots))`` of the admission's first block run these slots; rows up to ``batch_size`` are
        dummies (the dummy slot: their writes land on its scratch pages and state, as a padded step's do)."""
        self._check_rows("set_admission_rows", slots, batch_size)
        self._copy_rows(slots, batch_size, self.admit_slot_ids, self.admit_is_dummy)
        self._admit_batch_size = batch_size

    def draft_first_block(self, slots: list[int], first_tokens: torch.Tensor, last_latents: torch.Tensor | None
                          ) -> None:
        """The admission's first block for ``slots`` (their ``ctx_lens`` at the prompt's length - 1): each row's
        first token ``first_tokens [R]`` taken as one accepted token (bookkeeping, and its context latent
        ``last_latents [R, L, d_c]`` stored at position ``n - 1``; None: already in ``admit_latents[:R, 0]``, where
        the prefill runner's latent fold copies them), then the drafter's block and the chain: the slot's verify
        block ``[first token, K drafts]`` and its confidences (``draft_confidences[:R]``).

        Through :attr:`admission_runner` (a graph per row count, padded with dummy rows) when the engine set
        one, else eagerly over ``R`` rows; either way on the same static rows (:meth:`admission_draft`)."""
        r = len(slots)
        self.admit_accepted[:r, 0].copy_(first_tokens)
        if last_latents is not None:
            self.admit_latents[:r, 0].copy_(last_latents)
        if self.admission_runner is not None:
            self.admission_runner.step(list(slots))
        else:
            self.set_admission_rows(list(slots), r)
            self.admission_draft(r)

    def admission_draft(self, batch_size: int) -> dict[str, torch.Tensor]:
        """The first block over the rows :meth:`set_admission_rows` prepared (capturable: no host sync, no
        allocation through a launcher). Returns ``{"next_new_tokens": [B, K+1]}`` (also stored per slot)."""
        if batch_size != self._admit_batch_size:
            raise ValueError(f"{type(self).__name__}: the first block runs {batch_size} rows but "
                             f"set_admission_rows() prepared {self._admit_batch_size}")
        st, ops, b, k = self.state, self.ops, batch_size, self.draft_len
        slots = self.admit_slot_ids[:b]
        tail = ops.paged_latent_step(self.admit_accepted[:b], self.admit_num_accepted[:b], slots,
                                     self.admit_is_dummy[:b], st.ctx_lens, st.block_table, num_contexts=0,
                                     page_size=st.page_size, draft_len=k, max_ctx_len=st.max_ctx_len,
                                     mask_token_id=self.mask_token_id,
                                     out=_rows_view(self._admit_tail, self._admit_views, b))
        latents = self.admit_latents[:b]
        ops.store_context_latents(latents.view(b * (k + 1), *latents.shape[2:]), tail.latent_pages.view(-1),
                                  tail.latent_offsets.view(-1), tail.latent_write_mask.view(-1), st.latent_pool)
        nxt = self.admit_next[:b]
        self.draft(tail, slots, nxt[:, 1:])
        nxt[:, 0].copy_(tail.bonus_tokens)
        ops.store_rows(st.slot_tokens, slots, nxt)
        return {"next_new_tokens": nxt}

    def prefill_chunk(self, slot: int, prompt_ids: list[int], start: int, end: int, speculative: bool = True) -> None:
        """Prompt positions ``start .. end-1`` of ``slot`` (``end`` below the prompt's length): one target forward
        writing their K/V and, speculative, their drafter context latents; no token. A long prompt runs as such
        chunks between decode steps, then :meth:`prefill_batch` with ``starts=[end]`` runs its rest and picks
        its first token: the same tokens as one prefill (each chunk's K/V is written before a later one
        attends it). Eager but for the target forward (:meth:`_prefill_forward`)."""
        n = len(prompt_ids)
        if not 0 <= start < end < n:
            raise ValueError(f"prefill_chunk: expected 0 <= start < end < {n} (the prompt's length), got {start}, {end}")
        self.check_slots("prefill_chunk", [slot])
        dev = self.device
        with nvtx_range("prefill_chunk"):
            # the slot, the prompt's length, the chunk's start and its ids in one host-to-device copy
            block = host_to_device([slot, n, start, *prompt_ids[start:end]], torch.int64, dev)
            slot_l, len_t, start_t, ids = block[0:1], block[1:2], block[2:3], block[3:][None]
            fold = self._latent_fold(speculative)
            out = self._prefill_forward(ids, start_t, slot_l.int(), [(start, end - start)],
                                        prompt_lens=len_t if fold else None)
            self._keep_hidden(out, end - start)
            if speculative and out.captured is not None:  # the eager forward: stored here
                self._store_prompt_latents(out, slot_l, start_t, len_t)

    def _latent_fold(self, speculative: bool) -> bool:
        """Whether this prefill's prompt latents are stored by the prefill runner's graphs (its latent fold, a
        speculative prefill); if so the block table they read is decoded now, before the forward."""
        fold = speculative and self.prefill_runner is not None and self.prefill_runner.folds_latents
        if fold:
            self.decode_pages()
        return fold

    def _keep_hidden(self, out: TargetOutput, cols: int) -> None:
        """The prefill's hidden states for the prompt log-probabilities, only when asked (they hold a prefill's
        ``[R * T, H]`` activations past its end)."""
        self.prefill_hidden, self.prefill_cols = (out.hidden_states, cols) if self.keep_prefill_hidden else (None, 0)

    def _store_prompt_latents(self, out: TargetOutput, slots_l: torch.Tensor, starts: torch.Tensor,
                              lens_t: torch.Tensor) -> torch.Tensor:
        """Store the drafter context latents of a prefill block's prompt positions below ``n - 1`` (row ``r``
        holds positions ``starts[r] ..`` consecutively, ``lens_t`` ``[R]`` the prompts' lengths); returns every
        row's latents ``[R*T, L, d_c]``."""
        st = self.state
        self.decode_pages()
        latents = self.drafter.compute_context_latents(out.captured)  # [R*T, L, d_c]
        # one launch: the kernel looks each row's page up (was ~8 torch launches on the admission's host path)
        self.ops.store_prompt_latents(latents, slots_l, starts, lens_t, st.block_table, st.latent_pool,
                                      page_size=st.page_size)
        return latents

    def _prefill_forward(self, ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor,
                         spans: list[tuple[int, int]], prompt_lens: torch.Tensor | None = None,
                         last_latents: torch.Tensor | None = None) -> TargetOutput:
        """The target forward of a ``[R, T]`` prefill block: one forward, or with chunked prefill consecutive
        column chunks of at most ``prefill_chunk_tokens`` tokens (``R`` rows x ``chunk`` columns), each writing
        its K/V before the next attends it; the outputs are the same rows (``r * T + t``). ``spans[r]``: row
        ``r``'s first position and real tokens (its positions ``starts[r] ..`` consecutive -- ``starts`` ``[R]``
        on the device; the columns past them padding).

        With a :attr:`prefill_runner` the rows (and chunks) replay its captured ``[1, T_b]`` buckets instead,
        where its rule allows (:func:`~tensorrt_llm_ext.runtime.prefill_graph.plan_prefill`); a row's padding
        columns then hold zeros (every caller masks them). A runner with the latent fold returns no features
        (``captured`` None): its graphs stored the latents of positions below ``prompt_lens - 1`` (None: none) and
        copied each row's last one into ``last_latents`` (:meth:`PrefillGraphRunner.run`); an eager forward returns
        the features, and the caller stores their latents."""
        r, t = ids.shape
        cols = t if self.prefill_chunk_tokens is None else max(1, self.prefill_chunk_tokens // r)
        if self.prefill_runner is not None:
            out = self.prefill_runner.run(ids, slots, spans, min(cols, t), prompt_lens, last_latents)
            if out is not None:
                return out
        positions = starts[:, None] + torch.arange(t, dtype=torch.int64, device=ids.device)
        if cols >= t:
            return self.target(ids, positions, slots, self.state.kv_cache)
        outs = [self.target(ids[:, s:s + cols], positions[:, s:s + cols], slots, self.state.kv_cache)
                for s in range(0, t, cols)]

        def cat(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([p.view(r, -1, p.shape[-1]) for p in parts], dim=1).reshape(r * t, -1)

        return TargetOutput(hidden_states=cat([o.hidden_states for o in outs]),
                            captured=cat([o.captured for o in outs]))

    # -- the speculative step ---------------------------------------------------------------------------
    # The step's stages, each a method so that ``bench step`` can time them on the worker itself (with
    # either op table) instead of re-assembling a step.
    def verify_forward(self, batch_size: int):
        """The target's verification forward of ``[anchor, d_0 .. d_{K-1}]``: ``(tokens [B, K+1], positions
        [B, K+1], TargetOutput)``. The rows' tokens, positions (``ctx_len .. ctx_len+K``) and RoPE rows are gathered
        in one launch (``ops.decode_inputs``: the same values as ``slot_tokens[slots]``, ``ctx_lens[slots] + j``
        and ``rotary_emb.cos_sin(positions)``)."""
        st = self.state
        slots = self.slot_ids[:batch_size]
        tokens, positions, cos, sin = self.ops.decode_inputs(slots, st.slot_tokens, st.ctx_lens, self.draft_len + 1,
                                                             self.rope_table)
        return tokens, positions, self.target(tokens, positions, slots, st.kv_cache, rope=(cos, sin))

    def select_targets(self, batch_size: int, hidden: torch.Tensor, positions: torch.Tensor):
        """The target's token at every verified position: ``([B*(K+1)] int64, logits)``."""
        ss = self.slot_sampling
        b, k = batch_size, self.draft_len
        slots_l = self.slot_ids[:b].long()
        # contiguous(): at B = 1 a reshape of the expanded row would be a stride-0 view, and the
        # selection kernel indexes these per-row tensors as dense arrays.
        temps = ss.temps[slots_l][:, None].expand(b, k + 1).contiguous().view(-1)
        seeds = ss.seeds[slots_l][:, None].expand(b, k + 1).contiguous().view(-1)
        top_p = ss.top_p[slots_l][:, None].expand(b, k + 1).contiguous().view(-1) if self.step_top_p else None
        return self._select(hidden, temps, seeds, (positions + 1).reshape(-1), self.target_tokens[:b * (k + 1)],
                            top_p, self._block_process(b) if self.step_processed else None)

    def _block_process(self, batch_size: int):
        """The step's processing of ``[B*(K+1)]`` verified rows: row ``j`` of a block counts drafts ``0..j-1``."""
        b, k = batch_size, self.draft_len
        slots_l = self.slot_ids[:b].long()
        drafts = self.state.slot_tokens[slots_l][:, 1:]  # the step's drafts (slot_tokens change after the step)
        rows = slots_l.repeat_interleave(k + 1)

        def process(logits, temps):
            return self.processed(logits, self._step_slots, rows, temps, drafts)
        return process

    def sample_and_accept_draft_tokens(self, batch_size: int, tokens: torch.Tensor, positions: torch.Tensor,
                                       hidden: torch.Tensor):
        """The step's token decision, in both verification modes (TensorRT-LLM's one-model worker method of
        this name): ``(accepted [B, K+1], num_accepted [B], logits)``.

        Strict acceptance (no rejection verifier): the target's token at every verified position
        (:meth:`select_targets`: the argmax, or keyed Gumbel-max at the row's temperature within its top-p
        set), then the drafts accepted while they equal it (:meth:`strict_accept`). Rejection sampling:
        :meth:`rejection_verify` against the draft logits the previous step stored (greedy rows: the strict
        rule, bitwise). docs/token_decision.md maps the whole path.
        """
        if self.verifier is None:
            with nvtx_range("selection"):
                target_tokens, logits = self.select_targets(batch_size, hidden, positions)
            with nvtx_range("strict_accept"):
                accepted, num_acc = self.strict_accept(batch_size, tokens, target_tokens)
            return accepted, num_acc, logits
        with nvtx_range("rejection_sampling"):
            return self.rejection_verify(batch_size, tokens, positions, hidden)

    def strict_accept(self, batch_size: int, tokens: torch.Tensor, target_tokens: torch.Tensor):
        """The drafts ``tokens[:, 1:]`` accepted while they equal the target's tokens ``[B*(K+1)]``:
        ``(accepted [B, K+1], num_accepted [B])``."""
        b, k = batch_size, self.draft_len
        return self.ops.strict_accept(tokens[:, 1:], target_tokens.view(b, k + 1),
                                      out=(self.accepted[:b], self.num_accepted[:b]))

    def rejection_verify(self, batch_size: int, tokens: torch.Tensor, positions: torch.Tensor,
                         hidden: torch.Tensor):
        """Rejection-sampling verification of the step's rows against the stored draft logits:
        ``(accepted [B, K+1], num_accepted [B], logits)`` (greedy rows: strict acceptance, bitwise)."""
        ss = self.slot_sampling
        b = batch_size
        slots_l = self.slot_ids[:b].long()
        logits = self.token_selector.target_logits(hidden)
        verified = logits
        if self.step_processed:  # the processed distribution is the one verification preserves
            temps_rows = ss.temps[slots_l][:, None].expand(b, self.draft_len + 1).reshape(-1)
            # top-p: the verifier's own kernel restricts to the same exact kept set (TargetDistribution's doc)
            verified = self.distribution.logits(logits, temps_rows, process=self._block_process(b))
        x = verified.logits if isinstance(verified, VocabShardedLogits) else verified
        top_p = ss.top_p[slots_l] if self.step_top_p else None
        accepted, num_acc = self.verifier.verify(
            self.ops.rejection_sample, x, self.metadata.draft_logits, slots_l, tokens,
            temperatures=ss.temps[slots_l], seeds=ss.seeds[slots_l], offsets=positions[:, 0] + 1,
            top_p=top_p, out=(self.accepted[:b], self.num_accepted[:b]), load_rows=self.ops.load_rows)
        return accepted, num_acc, logits

    def update_drafter_context(self, batch_size: int, accepted: torch.Tensor, num_acc: torch.Tensor,
                               captured: torch.Tensor) -> PagedLatentStep:
        """After the decision: paged-latent bookkeeping (advances ``ctx_lens``) and the context-latent store of
        the accepted tokens; the bookkeeping's outputs (bonus tokens, the next block's placement)."""
        st, ops = self.state, self.ops
        b, k = batch_size, self.draft_len
        slots, dummy = self.slot_ids[:b], self.is_dummy[:b]
        tail = ops.paged_latent_step(accepted, num_acc, slots, dummy, st.ctx_lens, st.block_table,
                                     num_contexts=0, page_size=st.page_size, draft_len=k,
                                     max_ctx_len=st.max_ctx_len, mask_token_id=self.mask_token_id,
                                     out=self.tail_buffers(b))
        latents = self.drafter.compute_context_latents(captured)  # [B*(K+1), L, d_c]
        ops.store_context_latents(latents, tail.latent_pages.view(-1), tail.latent_offsets.view(-1),
                                  tail.latent_write_mask.view(-1), st.latent_pool)
        return tail

    def _forward_impl(self, batch_size: int) -> dict[str, torch.Tensor]:
        self.check_rows(batch_size)
        st = self.state
        b = batch_size
        slots = self.slot_ids[:b]
        with nvtx_range("block_table"):
            self.decode_pages()
        with nvtx_range("target_forward"):
            tokens, positions, out = self.verify_forward(b)
        accepted, num_acc, logits = self.sample_and_accept_draft_tokens(b, tokens, positions, out.hidden_states)
        with nvtx_range("tail"):
            tail = self.update_drafter_context(b, accepted, num_acc, out.captured)
        if self.step_processed:
            self.processors.record(self._step_slots, slots, accepted, num_acc, live=~self.is_dummy[:b])
        nxt = self.next_new_tokens[:b]
        self.draft(tail, slots, nxt[:, 1:])
        nxt[:, 0].copy_(tail.bonus_tokens)
        self.ops.store_rows(st.slot_tokens, slots, nxt)  # the next verify block at each slot, one launch
        logits_out = logits.logits if isinstance(logits, VocabShardedLogits) else logits
        return {
            "logits": logits_out,  # [B*(K+1), V] gathered, or this rank's [B*(K+1), V_shard]
            "new_tokens": accepted,  # [B, K+1], the first new_tokens_lens are accepted
            "new_tokens_lens": num_acc,  # [B] int32
            "next_draft_tokens": nxt[:, 1:],  # [B, K]
            "next_new_tokens": nxt,  # [B, K+1]: [bonus, drafts], the next step's verification input
            "draft_confidences": self.draft_confidences[:b],  # [B, K] fp32: c_k of each next draft (0: no head)
        }


def _rows_view(full: PagedLatentStep, views: dict[int, PagedLatentStep], batch_size: int) -> PagedLatentStep:
    """Views of the preallocated bookkeeping outputs ``full`` for ``batch_size`` rows, cached in ``views``
    (created outside capture)."""
    view = views.get(batch_size)
    if view is None:
        t, p, b = full, full.placement, batch_size
        view = PagedLatentStep(
            bonus_tokens=t.bonus_tokens[:b], block_input_ids=t.block_input_ids[:b],
            latent_pages=t.latent_pages[:b], latent_offsets=t.latent_offsets[:b],
            latent_write_mask=t.latent_write_mask[:b],
            placement=DraftBlockPlacement(positions=p.positions[:b], page_ids=p.page_ids[:b],
                                          page_offsets=p.page_offsets[:b], ctx_lens=p.ctx_lens[:b],
                                          seq_lens=p.seq_lens[:b]))
        views[batch_size] = view
    return view


class AdmissionRows:
    """The admission's first block as :class:`~tensorrt_llm_ext.runtime.cuda_graph.CudaGraphRunner` drives a
    step: its rows (:meth:`DSparkWorker.set_admission_rows`), one variant (the block reads each slot's
    sampling state itself; nothing in it depends on the rows' params) and the state a capture restores."""

    def __init__(self, worker: DSparkWorker):
        self.worker = worker
        self.state = worker.state
        self.max_batch_size = worker.max_batch_size
        self.step_variants = (DEFAULT_VARIANT,)

    def step_needs(self, slots: list[int]) -> StepVariant:
        return DEFAULT_VARIANT

    def set_rows(self, slots: list[int], batch_size: int, variant: StepVariant | None = None) -> None:
        self.worker.set_admission_rows(slots, batch_size)
