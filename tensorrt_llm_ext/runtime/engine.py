"""The batching engine: prefill -> speculative steps -> finish, with slots freed and reused.

One :class:`Engine` per rank (every rank of a TP group runs the same loop on the same requests; the
host-side decisions depend only on tokens, which are identical on every rank). Modes of
:meth:`Engine.generate`:

* ``"speculative"``: one-model DSpark with the configured selection (vocab-parallel where eligible);
* ``"gathered"``: the same, with vocab-parallel selection forced off (gathered logits everywhere);
* ``"target_only"``: the target's own non-speculative decode, one ``[B, 1]`` row per request (what
  ``serve --no-speculation`` serves);
* ``"reference"``: the same decode in the speculative step's ``[B, K+1]`` shape, the lossless reference
  (``generate --check``): strict acceptance equals it bit for bit
  (:class:`~tensorrt_llm_ext.speculative.reference_decoder.ReferenceDecoder`).

:meth:`Engine.generate` runs the one batching loop of the project, the :class:`~tensorrt_llm_ext.runtime.scheduler.Scheduler`
that ``serve`` drives too: requests are admitted in order while a slot and their cache pages are free (else
they wait for a finish), the requests admitted together are prefilled in batched calls
(:meth:`DSparkWorker.prefill_batch`: one target forward, one drafter context store, at most ``max_num_tokens``
padded tokens each; with chunked prefill interleaved with the steps), then every active request steps; a
request that fails validation gets an error result and never reaches a slot.

Every step -- of :meth:`Engine.generate` and of :meth:`Engine.run_step` (what ``serve``'s scheduler calls) --
goes through :meth:`Engine.run_step` and the mode's :class:`CudaGraphRunner` (:meth:`Engine.runner`), which
alone decides whether the step replays a captured graph (padding the rows to a graph batch size, dummy rows
on the dummy slot) or runs eagerly (:func:`~tensorrt_llm_ext.runtime.cuda_graph.plan_step`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.distributed.agree import gather_objects
from tensorrt_llm_ext.logger import info_once, log_environment, logger
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.runtime.config import RuntimeConfig
from tensorrt_llm_ext.runtime.cuda_graph import CudaGraphRunner
from tensorrt_llm_ext.runtime.kv_cache import build_state, pages_needed
from tensorrt_llm_ext.runtime.model_loader import build_models
from tensorrt_llm_ext.runtime.prefill_graph import PrefillGraphRunner, PromptLatentFold, prefill_buckets
from tensorrt_llm_ext.runtime.requests import Request, RequestError, RequestResult
from tensorrt_llm_ext.runtime.scheduler import NON_SPECULATIVE, Scheduler, StepPlan
from tensorrt_llm_ext.speculative.dspark_worker import DSparkWorker
from tensorrt_llm_ext.speculative.logprobs import token_logprobs
from tensorrt_llm_ext.speculative.reference_decoder import ReferenceDecoder
from tensorrt_llm_ext.speculative.step_ops import step_ops_for
from tensorrt_llm_ext.speculative.vocab_parallel import VocabShardedLogits
from tensorrt_llm_ext.speculative.worker_base import nvtx_range

MODES = ("speculative", "gathered", "target_only", "reference", "stock")
DEFAULT_MAX_NUM_TOKENS = 8192  # TensorRT-LLM's max_num_tokens default
PROMPT_LOGPROBS_ROWS = 512  # prompt positions per batch of logits (Engine.prompt_logprobs)


def _prefix_root(mode: str) -> str:
    """Which cached prefixes a mode's prefill may reuse and registers: a target-only prefill stores no drafter
    latents, so its pages serve only non-speculative requests."""
    return "target" if mode in NON_SPECULATIVE else "target+drafter"


def _path(mode: str) -> str:
    """The worker a mode runs on: ``gathered`` / ``stock`` their own, the rest the speculative worker."""
    return mode if mode in ("gathered", "stock") else "speculative"


def checkpoint_eos_ids(config: RuntimeConfig) -> tuple[int, ...]:
    """The EOS ids of the configured checkpoint directory (``config.json``, ``generation_config.json`` and the
    tokenizer's); none for the embedded model."""
    facts = config.checkpoint_facts
    return () if facts is None else tuple(facts.eos_token_ids)


@dataclass
class GenerationStats:
    mode: str
    num_steps: int = 0  # engine steps (each step serves every active request)
    num_tokens: int = 0
    wall_s: float = 0.0
    accepted_lens: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.accepted_lens) / len(self.accepted_lens) if self.accepted_lens else float("nan")


@dataclass
class LaunchedStep:
    """A step enqueued by :meth:`Engine.launch_step`: its rows' slots and the host buffers its tokens are
    being copied into (``done``: the copy's CUDA event; None on a CPU, where the copy already ran)."""

    slots: list[int]
    mode: str
    new: torch.Tensor
    lens: torch.Tensor | None
    done: object
    runner: CudaGraphRunner
    # The drafter's per-position confidences of the drafts this step made (host buffer, copied behind the
    # step like the tokens); None without a confidence head or in the target-only decode.
    confidences: torch.Tensor | None = None


@dataclass
class LaunchedPrefill:
    """An admission enqueued by :meth:`Engine.launch_prefill`: its slots and the host buffers its first tokens
    (and, speculative with a confidence head, its first block's confidences) are being copied into (``done``: the
    copies' CUDA event; None on a CPU, where they already ran)."""

    slots: list[int]
    mode: str
    tokens: torch.Tensor
    confidences: torch.Tensor | None
    done: object


def _copy_to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` into a host buffer of its own, enqueued on the current stream: pinned and asynchronous on CUDA (the
    caching host allocator keeps the block until the copy is done), a plain copy on a CPU."""
    cuda = t.is_cuda
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
    host.copy_(t, non_blocking=cuda)
    return host


def _copies_done(device: torch.device):
    """A CUDA event behind the copies just enqueued on ``device`` (None on a CPU: they ran)."""
    if device.type != "cuda":
        return None
    done = torch.cuda.Event()
    done.record()
    return done


class Engine:
    """Models, caches and workers of one rank, built once from a :class:`RuntimeConfig`.

    Args:
        config: the runtime config (``tensor_parallel_size`` and ``enable_attention_dp`` must match
            ``mapping``).
        mapping: this rank's layout (default: one rank with the config's ``enable_attention_dp``).
        device: default CUDA when available, else CPU.
        use_cuda_graph: capture every decode step this engine runs (the speculative step and the
            target-only decode), per batch size and step variant, on first use of each (CUDA only; the
            batch sizes and padding from ``cuda_graph_config``, or derived from ``max_batch_size``); with
            ``cuda_graph_config.prefill_max_tokens``, also the prefill's target forward per token bucket
            (:mod:`~tensorrt_llm_ext.runtime.prefill_graph`), captured after the decode runners' graphs.
        weights: optional FULL ``(target, drafter)`` state dicts in memory instead of the configured ones
            (:func:`~tensorrt_llm_ext.runtime.model_loader.build_models`).
    """

    def __init__(self, config: RuntimeConfig, mapping: Mapping | None = None, device=None,
                 use_cuda_graph: bool = False, weights=None, torch_ops: bool = False):
        log_environment()
        mapping = mapping or Mapping(enable_attention_dp=config.enable_attention_dp)
        if mapping.tp_size != config.tensor_parallel_size:
            raise ValueError(f"Engine: config tensor_parallel_size={config.tensor_parallel_size} but the mapping "
                             f"has tp_size={mapping.tp_size}")
        if mapping.enable_attention_dp != config.enable_attention_dp:
            # A config flag the rank layout does not carry would be silently ignored (vocab-parallel
            # selection and the drafter fusions read it from the Mapping).
            raise ValueError(f"Engine: config enable_attention_dp={config.enable_attention_dp} but the mapping "
                             f"has enable_attention_dp={mapping.enable_attention_dp}")
        if device is None:
            cuda = torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.device = torch.device(device)
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError("Engine: CUDA graphs need a CUDA device")
        self.config = config
        self.mapping = mapping
        self.draft_len = config.draft_len
        self.max_batch_size = config.max_batch_size
        self.target, self.drafter = build_models(config, mapping, self.device, weights)
        self.vocab_size = self.target.config.vocab_size
        self.state, self.slots, self.pages = build_state(
            self.target, self.drafter, max_batch_size=config.max_batch_size, max_seq_len=config.max_seq_len,
            draft_len=self.draft_len, page_size=config.kv_cache_config.tokens_per_block, device=self.device,
            max_tokens=config.kv_cache_config.max_tokens,
            free_gpu_memory_fraction=config.kv_cache_config.free_gpu_memory_fraction,
            enable_block_reuse=config.kv_cache_config.enable_block_reuse,
            enable_partial_reuse=config.kv_cache_config.enable_partial_reuse)
        # The checkpoint's EOS ids end every request that does not set ignore_eos (the embedded model has none).
        self.eos_token_ids: frozenset[int] = frozenset(checkpoint_eos_ids(config))
        self._step_logits: torch.Tensor | None = None  # the last run_step's target logits (step_logprobs)
        self.use_cuda_graph = use_cuda_graph
        # Every path on the stock torch op table, even where Triton runs: for a caller whose output is data, not
        # a kernel exercise (train-drafter's answers on a CPU under TRITON_INTERPRET=1; the same tokens).
        self.torch_ops = torch_ops
        self._workers: dict[str, DSparkWorker] = {}
        self._references: dict[tuple[str, bool], ReferenceDecoder] = {}
        self._runners: dict[str, CudaGraphRunner] = {}
        self.batch_sizes = config.graph_batch_sizes() if use_cuda_graph else None  # None: every step eager
        # One memory pool for every runner's graphs: steps of different decodes never run concurrently.
        self._graph_pool = torch.cuda.graph_pool_handle() if use_cuda_graph else None
        self.enable_padding = config.cuda_graph_config.enable_padding if config.cuda_graph_config else True
        # The tokens of one batched prefill forward (the scheduler groups admissions by it) and, with chunked
        # prefill, of all the prefill a plan carries next to its decode step.
        self.max_num_tokens = config.max_num_tokens or DEFAULT_MAX_NUM_TOKENS
        self.chunked_prefill = config.enable_chunked_prefill
        # Chunked prefill: the tokens of one prefill forward (None: a prefill is one forward).
        self.prefill_chunk_tokens = self.max_num_tokens if config.enable_chunked_prefill else None
        # The prefill's target forward in captured token buckets (cuda_graph_config.prefill_max_tokens; captured
        # after the decode runners' graphs, _capture_prefill): none where graphs are off. A row of one call runs
        # at most max_num_tokens and max_seq_len tokens: no bucket above.
        cg = config.cuda_graph_config
        self.prefill_buckets = (prefill_buckets(cg.prefill_max_tokens, min(self.max_num_tokens, config.max_seq_len))
                                if use_cuda_graph and cg is not None and cg.prefill_max_tokens else ())
        self.prefill_runner: PrefillGraphRunner | None = None
        # The drafter's confidence head (when it has one) per step: ``_pending_confidences[slot]`` are the
        # confidences of the drafts the slot's next step verifies (from its prefill or its last step);
        # ``step_confidences[row]`` those the last collected step verified (None: no head, or a row without).
        self._pending_confidences: dict[int, list[float]] = {}
        self.step_confidences: list[list[float] | None] | None = None
        # Held while a generate() runs: a second one on this engine (from its progress callback, or another
        # thread) would share its slots and pages, and its exception path releases them all.
        self._generating = threading.Lock()

    # -- workers -------------------------------------------------------------------------------------
    def worker(self, path: str = "speculative", *, sampling: bool = True) -> DSparkWorker:
        """The worker of ``path``: ``speculative`` (fused ops, configured selection), ``gathered`` (fused ops,
        vocab-parallel selection forced off) or ``stock`` (the upstream eager op table, gathered).

        ``sampling=False`` builds a greedy-only worker (plain argmax selection; sampled requests refused),
        kept apart from the sampling-capable one of the same path.
        """
        key = path if sampling else f"{path}:greedy"
        if key not in self._workers:
            if path not in ("speculative", "gathered", "stock"):
                raise ValueError(f"Engine.worker: unknown path {path!r}")
            spec = self.config.speculative_config
            # fused where Triton runs, stock torch ops on a plain CPU (or when asked: torch_ops)
            ops = step_ops_for("stock" if self.torch_ops else path, self.device)
            sharded = path == "speculative" and ops.vocab_parallel
            if path == "speculative" and not sharded and "on" in (spec.vocab_parallel_selection,
                                                                   spec.vocab_sharded_verification):
                info_once(f"vocab-parallel selection / sharded verification 'on': not with the {ops.name} op table "
                          f"(it selects from gathered logits)", key=f"vocab-parallel-on-{ops.name}")
            mode = spec.vocab_parallel_selection if sharded else "off"
            # gathered / stock paths verify on gathered logits too (they are the references of the sharded one)
            verification = spec.vocab_sharded_verification if sharded and sampling else "off"
            w = DSparkWorker(self.target, self.drafter, self.state, mapping=self.mapping, draft_len=self.draft_len,
                             max_batch_size=self.max_batch_size, markov_chain_mode=spec.markov_chain_mode,
                             ops=ops, sampling=sampling,
                             use_rejection_sampling=spec.use_rejection_sampling and sampling,
                             draft_temperature_scale=spec.draft_temperature_scale,
                             verification_mode=verification, prefill_chunk_tokens=self.prefill_chunk_tokens)
            w.post_load(vocab_parallel_mode=mode, exchange=spec.exchange)
            w.prefill_runner = self.prefill_runner
            self._workers[key] = w
        return self._workers[key]

    def reference(self, path: str = "speculative", *, verify_shaped: bool = True) -> ReferenceDecoder:
        """The target-only decode over the worker of ``path``: verify-shaped (the lossless reference, mode
        ``reference``) or ``[B, 1]`` (the serving decode, mode ``target_only``)."""
        key = (path, verify_shaped)
        ref = self._references.get(key)
        if ref is None:
            ref = self._references[key] = ReferenceDecoder(self.worker(path), verify_shaped=verify_shaped)
        return ref

    def _decoder(self, mode: str) -> ReferenceDecoder:
        """The target-only decoder of a non-speculative ``mode``."""
        return self.reference(_path(mode), verify_shaped=mode == "reference")

    def runner(self, mode: str = "speculative") -> CudaGraphRunner:
        """The step runner of ``mode`` (one per decode: the speculative step of ``speculative`` / ``gathered`` /
        ``stock``, and the target-only decode), built -- and with graphs on, captured (every rank in the same
        order: capture agrees across ranks) -- on first use."""
        if mode not in MODES:
            raise ValueError(f"Engine.runner: mode must be one of {MODES}, got {mode!r}")
        runner = self._runners.get(mode)
        if runner is None:
            worker = self.worker(_path(mode))
            if mode in NON_SPECULATIVE:
                forward = self._decoder(mode).step_outputs
                name = "the target-only decode" if mode == "target_only" else "the lossless reference decode"
            else:
                forward, name = worker.forward, f"the {mode} step"
            runner = CudaGraphRunner(worker, forward, name=name, batch_sizes=self.batch_sizes,
                                     enable_padding=self.enable_padding, pool=self._graph_pool)
            self._runners[mode] = runner
            if runner.enabled:
                runner.capture(self.mapping)
            self._capture_admissions()
            if runner.enabled:
                self._capture_prefill()
        return runner

    def _capture_admissions(self) -> None:
        """The speculative prefill's first block (bookkeeping, drafter block, chain: DSparkWorker.draft_first_block)
        per row count, for every speculative decode built so far: one replay per admission instead of its few
        dozen launches from Python. Captured again after each new decode runner, for the reason
        :meth:`_capture_prefill` gives (an admission replays between a launched step and the read of its
        outputs); its own outputs are static buffers outside the pool. Graphs off: the runner runs it eagerly."""
        speculative = [(m, self.worker(_path(m))) for m in self._runners if m not in NON_SPECULATIVE]
        for _, w in speculative:
            w.admission_runner = None  # the older graphs' memory back to the pool first
        for m, w in speculative:
            runner = CudaGraphRunner(w.admission_rows, w.admission_draft, name=f"the {m} admission's first block",
                                     batch_sizes=self.batch_sizes, enable_padding=self.enable_padding,
                                     pool=self._graph_pool)
            if runner.enabled:
                runner.capture(self.mapping)
            w.admission_runner = runner

    def _capture_prefill(self) -> None:
        """Capture the prefill's token buckets after every decode runner's graphs, in the same pool (every rank at
        the same point: capture agrees across ranks); a failure leaves the prefill eager.

        Again after each new decode runner (an engine serving one decode captures them once): a decode graph
        captured after the prefill graphs could place its outputs in their freed intermediates, and a prefill
        launched between that step and the read of its logits (the scheduler prefills behind a launched step)
        would overwrite them. Captured last, the prefill graphs never reuse a live output of another graph; a
        later replay of another graph may overwrite theirs, which the runner copies out at once."""
        if not self.prefill_buckets:
            return
        self.use_prefill_runner(None)  # the older graphs' memory back to the pool first
        runner = self.prefill_graph_runner(self.prefill_buckets, pool=self._graph_pool)
        self.use_prefill_runner(runner if runner.capture(self.mapping) else None)

    def prefill_graph_runner(self, buckets, pool=None) -> PrefillGraphRunner:
        """A prefill runner over ``buckets`` whose graphs also compute and store the drafter's context latents of
        the prompt positions (:class:`PromptLatentFold`: the drafter's projection, the op table's store into the
        state's latent pool); not captured yet."""
        st = self.state
        ops = step_ops_for("stock" if self.torch_ops else "speculative", self.device)
        fold = PromptLatentFold(compute=self.drafter.compute_context_latents, store=ops.store_prompt_latents,
                                block_table=st.block_table, pool=st.latent_pool, page_size=st.page_size)
        return PrefillGraphRunner(self.target, st.kv_cache, st.dummy_slot, buckets, pool=pool, latents=fold)

    def use_prefill_runner(self, runner: PrefillGraphRunner | None) -> None:
        """Run every worker's prefill target forward through ``runner`` (None: eagerly); the CPU tests pass an
        uncaptured runner (its buckets run eagerly on the static buffers)."""
        self.prefill_runner = runner
        for w in self._workers.values():
            w.prefill_runner = runner

    # -- generation ----------------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        request.validate(self.vocab_size, self.config.max_seq_len)

    def generate(self, requests: list[Request], mode: str = "speculative", progress=None
                 ) -> tuple[list[RequestResult], GenerationStats]:
        """Serve ``requests`` to completion; results in request order (bad requests carry their error).

        ``progress``: optional callable ``progress(num_new_tokens)`` called after each step (a tqdm update).

        A request-level error inside the loop (a layer below refusing a value: the scheduler's ``REQUEST_FAULTS``)
        ends the requests it concerns with ``finish_reason`` ``error`` and the message, as ``serve`` answers them;
        the others are served on.

        Exception-safe: whatever escapes (a prefill, a step, the progress callback, Ctrl-C) first hands
        every slot and page back and resets the step state (:meth:`_release_all`), then propagates; the
        next call serves its requests as a fresh engine would.

        One call at a time per engine: a call made while another runs (from its ``progress`` callback, or from
        another thread) raises ``RuntimeError`` at once and leaves the running one untouched.
        """
        # A lone Request would be iterated through its field lookup (KeyError: 0), a string char by char.
        if isinstance(requests, (Request, str, bytes, dict)) or not hasattr(requests, "__iter__"):
            raise TypeError(f"generate: requests must be a list of Request, got {type(requests).__name__}")
        requests = list(requests)  # a generator is read once (the TP batch check reads it before the loop)
        if progress is not None and not callable(progress):  # else it fails after the first step's work
            raise TypeError(f"generate: progress must be a callable or None, got {type(progress).__name__}")
        if not self._generating.acquire(blocking=False):
            raise RuntimeError("generate: this engine is already running a generate() call (re-entered from its "
                               "progress callback, or called from another thread); an engine serves one call at a "
                               "time: wait for it, or batch the requests into one call")
        try:
            return self._generate(requests, mode, progress)
        except BaseException:
            self._release_all()
            raise
        finally:
            self._generating.release()

    def _generate(self, requests: list[Request], mode: str, progress) -> tuple[list[RequestResult], GenerationStats]:
        if mode not in MODES:
            raise ValueError(f"generate: mode must be one of {MODES}, got {mode!r}")
        self.runner(mode)  # its worker built (and graphs captured) before the clock starts
        stats = GenerationStats(mode=mode)
        t0 = time.perf_counter()
        if self.mapping.tp_size > 1:
            self._check_same_batch(requests, mode)
        results: list[RequestResult] = []
        queue: deque[tuple[int, Request]] = deque()  # (handle = index into results, request)
        for i, req in enumerate(requests):
            is_request = isinstance(req, Request)  # a caller may pass anything: then that item's error
            rid = req.request_id if is_request else None
            rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else i
            prompt = req.prompt_ids if is_request and isinstance(req.prompt_ids, (list, tuple)) else []
            res = RequestResult(request_id=rid, prompt_ids=list(prompt))
            results.append(res)
            try:
                if not is_request:
                    raise RequestError(f"request {rid}: expected a Request, got {type(req).__name__}")
                self.validate(req)
                # RequestResult has no field for either: refused, never computed and dropped
                for name in ("logprobs", "prompt_logprobs"):
                    if getattr(req, name) is not None:
                        raise RequestError(f"request {rid}: {name} are reported by the step-level API (serve), "
                                           f"not by generate()")
            except RequestError as e:
                res.finish_reason, res.error = "error", str(e)
                logger.warning(f"rejected: {e}")
                continue
            queue.append((i, req))
        # The one batching loop, as serve's: admission while a slot and the request's pages are free (else it
        # waits for a finish), batched (and with chunked prefill, interleaved) prefill, then a step.
        scheduler = Scheduler(self, mode=mode)
        while queue or scheduler.num_active:
            admit = [queue.popleft() for _ in range(scheduler.admissible(r for _, r in queue))]
            if not admit and not scheduler.num_active:  # an idle engine always has room for one request
                raise RuntimeError(f"generate: request {queue[0][0]} fits no idle engine (a broken invariant)")
            events, st = scheduler.apply(StepPlan(admit=admit))
            if st.num_rows:
                stats.num_steps += 1
                stats.accepted_lens.extend(st.accepted_lens)
            produced = 0
            for e in events:
                res = results[e.handle]
                res.output_ids.extend(e.tokens)
                produced += len(e.tokens)
                if e.accepted_len is not None:
                    res.num_steps += 1
                    res.accepted_lens.append(e.accepted_len)
                if e.finish_reason is not None:
                    res.finish_reason, res.error = e.finish_reason, e.error
            if progress is not None and produced:
                progress(produced)
        stats.wall_s = time.perf_counter() - t0
        stats.num_tokens = sum(len(r.output_ids) for r in results)
        return results, stats

    def pages_for(self, request: Request) -> int:
        """Cache pages ``request`` (validated) holds from admission to finish: its prompt, ``max_new_tokens``
        and the overshoot of a step (:func:`~tensorrt_llm_ext.runtime.kv_cache.pages_needed`)."""
        return pages_needed(len(request.prompt_ids) + request.max_new_tokens, self.draft_len, self.state.page_size)

    # -- step-level API (continuous batching: runtime/scheduler.py) -----------------------------------
    def reserve(self, slot: int, request: Request, mode: str = "speculative") -> int:
        """Take the cache pages ``request`` (validated) holds on ``slot`` until it finishes (:meth:`pages_for`);
        with block reuse its prompt's cached whole pages come first. Returns the prompt positions already in
        the cache (its prefill starts there). A request with ``prompt_logprobs`` prefills every position (the
        log-probabilities come from its own forward)."""
        if request.prompt_logprobs is not None:
            self.pages.allocate(slot, self.pages_for(request))
            return 0
        prefix, partial = self.pages.match_with_partial(request.prompt_ids, _prefix_root(mode))
        pages = self.pages.allocate(slot, self.pages_for(request), prefix=prefix)
        if partial is None:
            return len(prefix) * self.state.page_size
        self.copy_page(partial[0], pages[len(prefix)])  # stream-ordered before any write to either page
        return len(prefix) * self.state.page_size + partial[1]

    def copy_page(self, src: int, dst: int) -> None:
        """Page ``src``'s contents into page ``dst``: the target's K and V of every layer and the drafter's
        latents (partial reuse)."""
        kv = self.state.kv_cache
        for pool in (kv.k, kv.v, self.state.latent_pool):
            pool[:, dst].copy_(pool[:, src])

    def rematch_prefix(self, slot: int, request: Request, mode: str = "speculative") -> int:
        """``request`` on ``slot`` has not begun its prefill: map the cached pages that now hold its prompt's
        start (registered since its :meth:`reserve`) in place of its fresh ones. Returns the prompt positions in
        the cache (its prefill starts there)."""
        return self.pages.rematch(slot, request.prompt_ids, _prefix_root(mode)) * self.state.page_size

    def admission_pages(self, request: Request, mode: str = "speculative", leaving=()) -> int:
        """Free pages admitting ``request`` (validated) would take now, with the slots ``leaving`` gone first:
        :meth:`pages_for`, less its cached prefix pages other requests hold (block reuse)."""
        if request.prompt_logprobs is not None:
            return self.pages_for(request)
        return self.pages.admission_cost(request.prompt_ids, self.pages_for(request), _prefix_root(mode), leaving)

    def register_prefix(self, slot: int, request: Request, mode: str = "speculative",
                        output_ids: list[int] = ()) -> None:
        """``request``'s prompt (its prefill is done) and ``output_ids`` (at its finish: the tokens it emitted)
        are in the cache on ``slot``: their whole pages before the last token serve later prompts (block reuse;
        nothing without). Every position before the last emitted token holds its final K/V and latents (the
        steps that emitted those tokens wrote them; any later write lands at or past the last one)."""
        self.pages.register(slot, list(request.prompt_ids) + list(output_ids), _prefix_root(mode))

    def prefill_slots(self, slots: list[int], requests: list[Request], mode: str = "speculative",
                      starts: list[int] | None = None) -> list[int]:
        """Prefill ``requests`` (validated, pages reserved) on ``slots`` in ONE batched prefill
        (:meth:`DSparkWorker.launch_prefill_batch`); ``starts``: each prompt's positions already written by
        :meth:`prefill_chunk`. Returns the first generated tokens. :meth:`collect_prefill` of :meth:`launch_prefill`."""
        return self.collect_prefill(self.launch_prefill(slots, requests, mode, starts))

    def launch_prefill(self, slots: list[int], requests: list[Request], mode: str = "speculative",
                       starts: list[int] | None = None, prompt_lens: list[int] | None = None,
                       draft: bool = True) -> LaunchedPrefill:
        """Enqueue :meth:`prefill_slots`' prefill and the copy of its first tokens (and first block's confidences)
        into host buffers; returns without waiting for the device on CUDA. The overlap scheduler reads them a
        plan later (:meth:`collect_prefill`), so the host goes on launching while the device runs the step before
        the prefill, the prefill and the step after it. The slots' next step may be launched before the collect:
        it reads their first tokens and drafts on the device. The prefill's logits (:meth:`prefill_logprobs`) stay
        valid only until the next launch. ``prompt_lens``: where each request's own prompt ends in its
        ``prompt_ids`` (a speculative prefill resuming a request: :meth:`DSparkWorker.launch_prefill_batch`);
        ``draft=False``: a speculative prefill that stores the prompt's latents and drafts nothing (the requests
        decode target-only next: :meth:`hand_over_prefilled_to_target_only`)."""
        worker = self.worker(_path(mode))
        prompts = [list(r.prompt_ids) for r in requests]
        params = [r.sampling for r in requests]
        worker.keep_prefill_hidden = any(r.prompt_logprobs is not None for r in requests)
        confidences = None
        if mode in NON_SPECULATIVE:
            if prompt_lens is not None:
                raise ValueError(f"Engine.launch_prefill: prompt_lens resumes speculation; not in mode {mode!r}")
            tokens = self._decoder(mode).launch_prefill_batch(list(slots), prompts, params, starts=starts)
        else:
            tokens = worker.launch_prefill_batch(list(slots), prompts, params, starts=starts, prompt_lens=prompt_lens,
                                                 draft=draft)
            if self.has_confidence_head and draft:  # the prefill drafted each slot's first block: its step verifies them
                # copied now: the next step rewrites the buffer
                confidences = _copy_to_host(worker.draft_confidences[:len(slots)])
        return LaunchedPrefill(list(slots), mode, _copy_to_host(tokens), confidences, _copies_done(tokens.device))

    def collect_prefill(self, launched: LaunchedPrefill, live: list[bool] | None = None) -> list[int]:
        """Wait for ``launched``'s copies; its first tokens (host ints). The slots' first-block confidences become
        those their next step verifies -- for the rows ``live`` keeps (default all): a request cancelled before its
        prefill is read back may have left its slot to another, whose confidences these are not."""
        if launched.done is not None:
            launched.done.synchronize()
        if launched.confidences is not None:
            for row, (slot, confs) in enumerate(zip(launched.slots, launched.confidences.tolist())):
                if live is None or live[row]:
                    self._pending_confidences[slot] = confs
        return launched.tokens.tolist()

    @property
    def has_confidence_head(self) -> bool:
        """The drafter has a confidence head: every speculative step reports its drafts' confidences."""
        return bool(getattr(self.drafter, "has_confidence_head", False))

    def prefill_chunk(self, slot: int, request: Request, start: int, end: int, mode: str = "speculative") -> None:
        """Prompt positions ``start .. end-1`` of ``request`` on ``slot`` (chunked prefill between decode steps;
        :meth:`DSparkWorker.prefill_chunk`); its last chunk goes through :meth:`prefill_slots`."""
        worker = self.worker(_path(mode))
        worker.keep_prefill_hidden = request.prompt_logprobs is not None
        worker.prefill_chunk(slot, list(request.prompt_ids), start, end, speculative=mode not in NON_SPECULATIVE)

    def prefill_logprobs(self, request: Request, token: int, mode: str = "speculative", row: int = 0):
        """The first token's ``(logprob, top k)`` of row ``row`` of the last :meth:`prefill_slots` (on every rank);
        the target-only decode's prefill is the worker's context phase, which keeps the same logits."""
        path = _path(mode)
        logits = self.worker(path).prefill_logits
        sharded = isinstance(logits, VocabShardedLogits)
        return self._logprobs(path, logits.logits if sharded else logits, [row], [token], [request], sharded)[0]

    def prompt_logprobs(self, request: Request, row: int, start: int, end: int, mode: str = "speculative") -> list:
        """``(logprob, top k)`` of ``request``'s prompt tokens ``start + 1 .. end`` (``prompt_logprobs`` ``k``),
        from row ``row`` of the last :meth:`prefill_slots` or :meth:`prefill_chunk` (which ran positions
        ``start ..``): the raw model distribution at positions ``start .. end - 1``, as for generated tokens. A
        few hundred positions per batch of logits (a long prompt's ``[T, V]`` rows are never all held). Call on
        every rank (a vocab-parallel head exchanges per batch)."""
        path = _path(mode)
        worker = self.worker(path)
        hidden, cols = worker.prefill_hidden, worker.prefill_cols
        out: list = []
        tokens = request.prompt_ids
        for lo in range(start, end, PROMPT_LOGPROBS_ROWS):
            hi = min(end, lo + PROMPT_LOGPROBS_ROWS)
            idx = torch.arange(row * cols + lo - start, row * cols + hi - start, device=hidden.device)
            raw = worker.token_selector.target_logits(hidden.index_select(0, idx))
            sharded = isinstance(raw, VocabShardedLogits)
            out += self._logprobs(path, raw.logits if sharded else raw, None,
                                  [int(t) for t in tokens[lo + 1:hi + 1]], [request] * (hi - lo), sharded,
                                  k=request.prompt_logprobs)
        return out

    def step_logprobs(self, requests: list[Request | None], new: list[list[int]], lens: list[int],
                      mode: str = "speculative") -> list[list | None]:
        """Per row of the last :meth:`run_step`: the accepted tokens' ``(logprob, top k)`` for rows whose
        request asks for logprobs (``None`` elsewhere). One batched computation (and, on a vocab-parallel
        head, its few ``[rows]`` / ``[rows, k]`` collectives) per step; call on every rank."""
        path = _path(mode)
        k1 = 1 if mode in NON_SPECULATIVE else self.draft_len + 1  # logits rows per request
        rows, toks, reqs, where = [], [], [], []
        for r, req in enumerate(requests):
            if req is None or req.logprobs is None:
                continue
            for j in range(lens[r]):
                rows.append(r * k1 + j)
                toks.append(new[r][j])
                reqs.append(req)
                where.append(r)
        out: list[list | None] = [None if req is None or req.logprobs is None else [] for req in requests]
        if rows:
            # the target-only decode selects from gathered (full) rows; the speculative step's may be a shard
            sharded = mode not in NON_SPECULATIVE
            for r, lp in zip(where, self._logprobs(path, self._step_logits, rows, toks, reqs, sharded)):
                out[r].append(lp)
        return out

    def _logprobs(self, path: str, logits: torch.Tensor, rows: list[int] | None, tokens: list[int],
                  requests: list[Request], sharded: bool = True, k: int | None = None
                  ) -> list[tuple[float, list[tuple[int, float]]]]:
        """The raw model distribution's log-probabilities (vLLM's default ``logprobs_mode``,
        ``raw_logprobs``): ``log_softmax`` of the target's logits before temperature, top-p and every logits
        processing field, whatever the request samples with. ``sharded``: ``logits`` may be this rank's
        vocabulary shard (the worker's head decides); else they are full rows. ``k``: the top ``k`` of every
        row (default: each request's ``logprobs``). ``rows``: the rows of ``logits`` to read (None: every row, no
        copy)."""
        worker = self.worker(path)
        dev = logits.device
        x = logits if rows is None else logits.index_select(0, torch.tensor(rows, dtype=torch.int64, device=dev))
        n = x.shape[0]
        head = worker.token_selector.target_head if sharded else None
        lp = token_logprobs(x, torch.tensor(tokens, dtype=torch.int64, device=dev),
                            torch.zeros(n, dtype=torch.float32, device=dev),  # raw: temperature 1, no top-p
                            torch.ones(n, dtype=torch.float32, device=dev),
                            max(r.logprobs for r in requests) if k is None else k, head=head)
        return [lp.row(i, r.logprobs if k is None else k) for i, r in enumerate(requests)]

    def run_step(self, slots: list[int], mode: str = "speculative") -> tuple[list[list[int]], list[int]]:
        """One engine step over the requests on ``slots`` (sorted, distinct): per slot the step's new
        tokens (``[K+1]`` speculative, ``[1]`` target-only; the first ``lens[i]`` accepted) and ``lens``.

        The step :meth:`generate` runs too: the mode's runner (:meth:`runner`) replays a captured graph
        that covers the rows or runs the step eagerly -- it alone decides. ``run_step`` is
        :meth:`collect_step` of :meth:`launch_step`.
        """
        return self.collect_step(self.launch_step(slots, mode))

    def launch_step(self, slots: list[int], mode: str = "speculative") -> LaunchedStep:
        """Enqueue one step over ``slots`` and the copy of its tokens into host buffers; returns at once on a
        CUDA device (the overlap scheduler does the previous step's host work while this one runs).

        The copy is enqueued right behind the step, so the next step's replay (which rewrites the graph's
        output tensors) cannot overwrite these tokens. The step's logits (:meth:`step_logprobs`) stay valid
        only until the next launch.
        """
        runner = self.runner(mode)
        n = len(slots)
        with nvtx_range(f"engine.launch.{mode}"):
            outs = runner.step(list(slots))
            self._step_logits = outs["logits"]  # read by step_logprobs, valid until the next launch
            if mode in NON_SPECULATIVE:
                new_dev, lens_dev = outs["new_tokens"][:n], None
            else:
                new_dev, lens_dev = outs["new_tokens"][:n], outs["new_tokens_lens"][:n]
            # Host buffers of their own per step, the copies enqueued behind it (_copy_to_host)
            new = _copy_to_host(new_dev)
            lens = _copy_to_host(lens_dev) if lens_dev is not None else None
            conf = None
            if mode not in NON_SPECULATIVE and self.has_confidence_head and "draft_confidences" in outs:
                conf = _copy_to_host(outs["draft_confidences"][:n])
            done = _copies_done(new_dev.device)
        return LaunchedStep(list(slots), mode, new, lens, done, runner, conf)

    def collect_step(self, launched: LaunchedStep) -> tuple[list[list[int]], list[int]]:
        """Wait for ``launched``'s tokens (its copy's event) and return them as :meth:`run_step` does."""
        with nvtx_range(f"engine.collect.{launched.mode}"):
            if launched.done is not None:
                launched.done.synchronize()
            n = len(launched.slots)
            if launched.lens is None:  # target-only: one token per row
                new, lens = [[t] for t in launched.new.tolist()], [1] * n
            else:
                new, lens = launched.new.tolist(), launched.lens.tolist()
            self._collect_confidences(launched)
            # The step is done: a low-latency exchange of it that timed out has set its flag by now, and its
            # rows must not become tokens.
            launched.runner.worker.token_selector.check_exchange()
        return new, lens

    def _collect_confidences(self, launched: LaunchedStep) -> None:
        """``step_confidences``: per row, the confidences of the drafts ``launched`` verified (made by the
        slot's prefill or previous step); then the slot's pending ones become those ``launched`` drafted."""
        if launched.confidences is None:
            self.step_confidences = None
            return
        rows = launched.confidences.tolist()
        self.step_confidences = [self._pending_confidences.get(slot) for slot in launched.slots]
        for slot, row in zip(launched.slots, rows):
            self._pending_confidences[slot] = row

    def reset_step_state(self) -> None:
        """Reset every worker's step state (prepared rows, Markov key ring) after a prefill or step that was
        aborted part way; held slots stay held (each prefill rewrites its slot's state)."""
        for w in self._workers.values():
            w.reset_step_state()

    def top_p_membership(self, request: Request, output_ids: list[int]) -> list[bool]:
        """For each of ``output_ids``, whether it lies in the target's exact top-p set at its position
        (:meth:`ReferenceDecoder.top_p_membership`), replayed on a slot of its own holding pages for the whole
        sequence (a slot without pages reads the scratch page past its first page: every check of a sequence longer
        than one page read wrong logits). Call between requests."""
        slot = self.slots.acquire()
        try:
            self.pages.allocate(slot, pages_needed(len(request.prompt_ids) + len(output_ids), 0, self.state.page_size))
            return self.reference().top_p_membership(slot, list(request.prompt_ids), list(output_ids),
                                                     request.sampling.effective_temperature,
                                                     request.sampling.effective_top_p)
        finally:
            self.release_slot(slot)

    def hand_over_to_target_only(self, slots: list[int], requests: list[Request], outputs: list[list[int]]) -> None:
        """The speculation gate closed: ``slots`` (decoding speculatively, their last step collected) continue in
        the target-only decode (:meth:`ReferenceDecoder.take_over`); ``outputs``: each request's tokens out so
        far."""
        self._decoder("target_only").take_over(list(slots), [r.sampling for r in requests],
                                               [list(r.prompt_ids) for r in requests], [list(o) for o in outputs])
        for slot in slots:
            self._pending_confidences.pop(slot, None)

    def hand_over_prefilled_to_target_only(self, slots: list[int], requests: list[Request]) -> None:
        """``slots``' speculative prefill was just launched without drafting (``draft=False``: its latents stored, so
        that their speculation can resume later) and they decode target-only from their first token on (:meth:`ReferenceDecoder.take_over_prefill`:
        stream-ordered, nothing read back)."""
        self._decoder("target_only").take_over_prefill(list(slots), [r.sampling for r in requests],
                                                       [list(r.prompt_ids) for r in requests])

    def release_slot(self, slot: int) -> None:
        """Free ``slot``'s pages and return it to the pool (a finished or cancelled request)."""
        self.pages.free(slot)
        self.slots.release(slot)
        self._pending_confidences.pop(slot, None)

    def stop_ids(self, request: Request) -> frozenset[int]:
        """The ids that end ``request``: its ``stop_token_ids`` plus, unless ``ignore_eos``, the EOS ids."""
        own = frozenset(int(t) for t in request.stop_token_ids)
        return own if request.ignore_eos else own | self.eos_token_ids

    def finish_tokens(self, request: Request, num_out: int, tokens: list[int],
                      stops: frozenset[int] | None = None) -> tuple[int, str | None]:
        """How many of ``tokens`` (appended after ``num_out`` outputs) ``request`` keeps, and why it ends.

        A stop id (after ``min_tokens`` outputs) is kept as the last token; ``max_new_tokens`` ends with
        ``length``; the tokens after either in an accepted block are discarded. ``(len(tokens), None)``:
        the request runs on. ``stops``: :meth:`stop_ids` of ``request`` when the caller holds them (the
        scheduler builds them once per request: a list of a thousand ids rebuilt per row per step costs more
        host time than the step).
        """
        stops = self.stop_ids(request) if stops is None else stops
        for i, t in enumerate(tokens):
            n = num_out + i + 1
            if int(t) in stops and n > request.min_tokens:
                return i + 1, "stop"
            if n >= request.max_new_tokens:
                return i + 1, "length"
        return len(tokens), None

    def _check_same_batch(self, requests: list[Request], mode: str) -> None:
        """Every TP rank must serve the same batch: its host decisions (admission, rows per step, stops)
        follow from the requests, and ranks that disagree would meet in collectives of different shapes
        (an abort inside the collective library) or sample with different parameters (tokens matching no
        rank's request). One small CPU all-gather per ``generate()`` call, where the batch is set up --
        nothing is added to the step. Every field of :class:`Request` is compared (prompt, max tokens,
        stop ids, every SamplingParams field, request id, and any field added later). Raises ``ValueError``
        on every rank, naming each rank's batch and the fields that differ.
        """
        # The request's fields, its SamplingParams' one by one (so a mismatch names top_p, not sampling).
        own = [f.name for f in dataclasses.fields(Request) if f.name != "sampling"]
        drawn = [f.name for f in dataclasses.fields(SamplingParams)]
        names = own + drawn

        def sig(r) -> tuple:
            if not isinstance(r, Request):
                return (type(r).__name__,)
            s = r.sampling if isinstance(r.sampling, SamplingParams) else SamplingParams(seed=repr(r.sampling))
            return tuple(repr(getattr(r, n)) for n in own) + tuple(repr(getattr(s, n)) for n in drawn)

        def digest(x) -> str:
            return hashlib.sha256(repr(x).encode()).hexdigest()

        sigs = [sig(r) for r in requests]
        # Per field: its digest over the batch, so a mismatch names what differs (prompt_ids, top_p, ...).
        per_field = {n: digest([s[i] if len(s) > i else s for s in sigs]) for i, n in enumerate(names)}
        lens = [len(r.prompt_ids) if isinstance(r, Request) and isinstance(r.prompt_ids, (list, tuple)) else None
                for r in requests]
        shape = f"{len(requests)} requests, prompt lengths {lens[:8]}{' ...' if len(lens) > 8 else ''}, mode {mode}"
        views = gather_objects(self.mapping, (digest([mode] + sigs), shape, per_field))
        if len({d for d, _, _ in views}) > 1:
            fields = [n for n in names if len({f[n] for _, _, f in views}) > 1]
            differ = ("the number of requests" if len({s.split(" ")[0] for _, s, _ in views}) > 1
                      else ", ".join(fields) or "the mode or the request types")
            ranks = "; ".join(f"rank {r}: {s} (digest {d[:8]})" for r, (d, s, _) in enumerate(views))
            raise ValueError(f"generate: the {self.mapping.tp_size} TP ranks were given different batches "
                             f"(every rank must serve the same requests; they differ in: {differ}): {ranks}")

    def _release_all(self) -> None:
        """Return every held slot and page and reset the workers' step state (after an escaped exception).

        Per-slot device state needs no reset: a prefill rewrites everything its slot's next request
        reads (context length, tokens, sampling state; KV and latent positions are written before they
        are attended), exactly as when a request finishes normally.
        """
        held = self.slots.release_all()
        self.pages.free_all()
        self.reset_step_state()
        if held:  # a refusal before any admission (a build check) has nothing to release and says so itself
            logger.warning(f"engine: an exception escaped generate(); released {held} slot(s) and their pages")
