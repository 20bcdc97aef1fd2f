"""CUDA-graph capture and replay of the prefill's target forward, one graph per token bucket ``[1, T_b]``.

Why: a prompt's target forward runs ~280 launches from Python (SmolLM2-135M: 30 layers of the unfused layer,
each 2 add + norm, RoPE + K/V write, paged attention and SiLU-mul in Triton, 4 cuBLAS GEMMs; plus embedding,
RoPE angles, the captured features' adds and concatenation, the final norm), while the running streams wait
behind it. On by default (``cuda_graph_config.prefill_max_tokens: 2048``; 0 turns it off): on the H200 it took
SmolLM2 at 32 streams from 4,748 to 8,271 output tok/s (docs/target_forward.md).

**The rule** (:func:`plan_prefill`, a pure function of host ints): a prefill block ``[R, T]`` runs as one
piece per row -- with chunked prefill, per row and column chunk -- each piece of ``m`` real tokens at positions
``s .. s+m-1`` replayed in the smallest bucket ``T_b >= m``: the real tokens first, then padding tokens (id 0,
as the batched prefill pads) at the positions that continue the piece, ``s+m .. s+T_b-1``. The pieces' outputs
are copied out of the graph's static outputs before the next replay, into the ``[R*T, ...]`` rows the callers
read (``r * T + t``; a row's columns past its tokens are zeros, where the eager block holds its padding's
values: every caller masks them). The whole call runs eagerly (logged once per reason) when a piece has more
tokens than the largest bucket, or when its padding would reach a position at or past the slot's page table
(``PagedKVCache.max_positions``). Below that bound the padding is as safe as the batched prefill's: its K/V
land in the slot's own pages past the prompt (stale, like rejected drafts; every later step or chunk rewrites a
position before any query attends it) or on the scratch page where the slot has no page; RoPE angles are
computed from the positions (no table). The bound matters for paged attention's split tiles (``T * G <= 64``
query rows: the small buckets): a key range past the table needs more pieces than the launch has. (Until
2026-12-04 that left the tile's arrival counter non-zero for later launches -- reachable from the eager batched
prefill, whose ragged block can pad short rows that start near ``max_seq_len`` past the table; the kernel now
counts at most the grid's pieces. The bound stays here: a padding row past the table computes nothing useful.)

**Capture** (:meth:`PrefillGraphRunner.capture`): at engine start, right after the decode runner's graphs (and
again after any decode runner captured later: :meth:`Engine._capture_prefill` says why), every bucket largest
first (its warm-up sizes the lazily grown buffers), all in the engine's one graph pool; agreed across the TP
group like the decode graphs (a failure on any rank: every rank prefills eagerly).
Warm-up and capture run on the dummy slot, whose page-table row is the scratch page everywhere, at positions
``0 .. T_b-1`` (below the table's width: the largest bucket is at most ``max_seq_len``): the only cache memory
written is the scratch page, snapshotted before and restored after, as the decode runner does -- so capture
never disturbs a request. Not lazily on a bucket's first use: a capture there (warm-up, synchronisations) would
stall the running streams during an admission, the cost this module removes. Outputs live in the shared pool:
another graph of the pool may overwrite them, so they are copied out before anything else replays.

**Exactness.** The real tokens of a piece compute what the eager block computes for them (causal attention:
padding sits at later positions; every other op is per row), up to GEMM rounding of another row count (as
:meth:`DSparkWorker.prefill_batch` already accepts; on the GPU the fused layer runs buckets of up to 32 rows,
the unfused one above, the same boundary as the eager block's). The CPU tests run the same code with an eager
forward on the static buffers in place of the replay (:meth:`PrefillGraphRunner.run_bucket`).

**Cost model** (per prefill forward; host costs as estimated for the H200 host: a Triton launch from Python
~20-30 us, a torch op ~6-8 us; estimates, to be timed on the H200):

============================  ===========================================  ==========================================
                              eager (today)                                bucketed graphs
============================  ===========================================  ==========================================
launches, SmolLM2 prompt >32  ~282 (30 x 9 + ~12)                          per piece: 3 input copies + 1 graph launch
                                                                           + 2 copy-outs; per call: 1 pad + 2 zeros
host time, SmolLM2            ~4.7 ms (30 x (5 x 25 + 4 x 7) us + ~80 us)  ~50-60 us per piece + ~20 us per call
                                                                           (4-row admission: ~0.25 ms)
host time, prompt <= 32       ~3.8 ms (150 fused-layer Triton launches)    the same ~60 us
device time                   one ``[R, T]`` forward                       R pieces of ``T_b <= max(16, 2m - 2)``
============================  ===========================================  ==========================================

Device cost of the padding and of the per-row pieces: each piece streams the weights once. SmolLM2's weights
(~270 MB) stream in ~60 us, so R pieces and up to 2x padded tokens cost little next to the host time saved. An
8B Llama (~16 GB, ~3.4 ms per weight pass at 4.8 TB/s) is the other way round: its forward is device bound
(the host launches hide behind it), R pieces of a batched admission cost R weight passes instead of one, and
a long prompt's padding up to 2x the compute -- keep the knob off (or its buckets small) for such a model.
**The drafter's context latents in the graphs** (:class:`PromptLatentFold`, bound by the engine): each bucket's graph
also projects its tokens' captured features to the drafter's latents and stores those of the prompt positions below
the prompt's last at their pages (a static ``prompt_len`` per piece; 0 stores nothing: a target-only admission), and
the run copies out each row's last-token latent for the first block instead of the ``[R*T, F]`` features: an
admission's eager projection, norm, store launch and features copy (~5-7 launches from Python) leave its host path.
Its device cost is the projection of every bucket token, padding included (SmolLM2: a ``[T_b, 1728] x [1728, 768]``
product, ~1 % of the target forward's bytes), also in a target-only admission, which stores none of it.
Not captured here (host time left in a prefill): the first-token selection, the first block decode (its own graph
per row count) and the sync for the first tokens.

Memory (bf16, 3 captured layers: static outputs ``[T_b, H]`` + ``[T_b, 3H]`` = ``8 H`` bytes a token, kept
per bucket; the static inputs, 16 B a token, are views of one ``[1, T_max]`` set; the largest bucket's transient
workspace is reserved in the pool, shared by the buckets and the decode graphs):

* SmolLM2-135M (H 576, I 1536): 4.6 KB a token of outputs: buckets 16 .. 2048: ~19 MB, 16 .. 8192: ~75 MB;
  workspace of the largest bucket ~9 KB a token (gate-up and SiLU-mul outputs) + the hidden states: ~20 MB at
  2048, ~80 MB at 8192.
* 8B Llama (H 4096, I 14336): 32 KB a token: buckets 16 .. 2048: ~134 MB, 16 .. 8192: ~537 MB; workspace
  ~86 KB a token: ~180 MB at 2048, ~700 MB at 8192.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tensorrt_llm_ext.contract import TargetOutput
from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.runtime.config import MIN_PREFILL_BUCKET  # the smallest bucket (16 tokens)
from tensorrt_llm_ext.runtime.cuda_graph import agree_on_capture, warm_up_and_capture
from tensorrt_llm_ext.speculative.worker_base import nvtx_range

__all__ = ["MIN_PREFILL_BUCKET", "PrefillGraphRunner", "PrefillPiece", "PrefillPlan", "PromptLatentFold",
           "plan_prefill", "prefill_buckets"]


def prefill_buckets(max_tokens: int, bound: int) -> tuple[int, ...]:
    """The buckets of ``cuda_graph_config.prefill_max_tokens = max_tokens`` (> 0) for calls of at most ``bound``
    tokens a row (``max_num_tokens``, ``max_seq_len``): powers of two from :data:`MIN_PREFILL_BUCKET` below the
    top ``min(max_tokens, bound)``, and the top (alone where it is below the smallest bucket)."""
    top = min(int(max_tokens), int(bound))
    if top < 1:
        return ()
    sizes, b = [], MIN_PREFILL_BUCKET
    while b < top:
        sizes.append(b)
        b *= 2
    return tuple(sizes) + (top,)


@dataclass(frozen=True)
class PromptLatentFold:
    """What a bucket's graph needs to store the drafter's context latents of its prompt positions: ``compute``
    (captured features ``[T, F]`` -> latents ``[T, L, d_c]``: the drafter's ``compute_context_latents``), ``store``
    (the op table's ``store_prompt_latents``), the worker state's ``block_table`` (decoded by the caller before the
    run) and latent ``pool``, and the pool's ``page_size``."""

    compute: Callable[[torch.Tensor], torch.Tensor]
    store: Callable
    block_table: torch.Tensor
    pool: torch.Tensor
    page_size: int


@dataclass(frozen=True)
class PrefillPiece:
    """``tokens`` real tokens of row ``row`` from column ``column`` of the block, at positions ``first ..
    first+tokens-1``."""

    row: int
    column: int
    first: int
    tokens: int


@dataclass(frozen=True)
class PrefillPlan:
    """How a prefill block runs: its pieces, each in ``buckets[i]`` tokens (``replay``), or eagerly (``reason``)."""

    pieces: tuple[PrefillPiece, ...]
    buckets: tuple[int, ...]
    replay: bool
    reason: str = ""


def plan_prefill(spans: list[tuple[int, int]], columns: int, buckets: tuple[int, ...], max_positions: int
                 ) -> PrefillPlan:
    """The rule (module docstring) for a block whose row ``r`` holds ``spans[r] = (first position, tokens)``,
    run in column chunks of ``columns``; ``buckets`` ascending; padded positions must stay below
    ``max_positions``.

    Example::

        >>> plan = plan_prefill([(0, 20), (5, 3)], 64, (16, 32, 64), 128)
        >>> plan.replay, plan.buckets
        (True, (32, 16))
    """
    if columns < 1:
        raise ValueError(f"plan_prefill: columns must be >= 1, got {columns}")
    pieces = tuple(PrefillPiece(r, c, first + c, min(columns, n - c))
                   for r, (first, n) in enumerate(spans) for c in range(0, n, columns))
    if not buckets:
        return PrefillPlan(pieces, (), False, "no bucket captured")
    sizes = []
    for p in pieces:
        i = bisect.bisect_left(buckets, p.tokens)
        if i == len(buckets):
            return PrefillPlan(pieces, (), False, f"a piece of more tokens than the largest bucket ({buckets[-1]})")
        if p.first + buckets[i] > max_positions:
            return PrefillPlan(pieces, (), False, f"a bucket's padding would reach past the page table "
                                                  f"({max_positions} positions)")
        sizes.append(buckets[i])
    return PrefillPlan(pieces, tuple(sizes), True)


class PrefillGraphRunner:
    """The prefill's target forward in ``[1, T_b]`` buckets (module docstring).

    Args:
        target: the target model (``target(ids [B, T], positions [B, T], slots [B], kv_cache)``).
        kv_cache: the engine's :class:`PagedKVCache` (its ``max_positions`` bounds the padding).
        dummy_slot: the slot capture runs on (no page of its own: every write lands on the scratch page).
        buckets: the bucket sizes (each >= 1).
        pool: the CUDA-graph memory pool to capture into (the engine's, shared with the decode runners).
        latents: the drafter's context latents computed and stored in each bucket (:class:`PromptLatentFold`;
            None: the features are copied out for the caller to project).

    Without :meth:`capture` (a CPU) every bucket runs the forward eagerly on the same static buffers: the rule,
    the padding and the copy-out are the captured path's.
    """

    def __init__(self, target, kv_cache, dummy_slot: int, buckets, *, pool=None,
                 name: str = "the prefill's target forward", latents: PromptLatentFold | None = None):
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"PrefillGraphRunner: buckets must be positive ints, got {list(buckets)}")
        self.target = target
        self.kv_cache = kv_cache
        self.dummy_slot = dummy_slot
        self.pool = pool
        self.name = name
        dev = kv_cache.page_table.device
        top = self.buckets[-1]
        # Static inputs, outside the graph pool; bucket b reads the views [:, :b].
        self.ids = torch.zeros(1, top, dtype=torch.int64, device=dev)
        self._offsets = torch.arange(top, dtype=torch.int64, device=dev)[None]
        self.positions = self._offsets.clone()
        self.slot = torch.full((1,), dummy_slot, dtype=torch.int32, device=dev)
        self.latents = latents
        # The piece's prompt length (the fold stores the latents of positions below prompt_len - 1: 0 stores none),
        # and whether it holds 0 now (a target-only admission then writes nothing).
        self.prompt_len = torch.zeros(1, dtype=torch.int64, device=dev)
        self._prompt_len_zero = True
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[TargetOutput, torch.Tensor | None]] = {}
        self.replays: dict[int, int] = {}  # pieces run per bucket (graph or eager), read by tests and logs
        self.eager_calls = 0  # calls the rule sent to the eager forward
        self._logged: set[str] = set()

    @property
    def max_positions(self) -> int:
        return self.kv_cache.max_positions

    # -- the rule and the pieces ---------------------------------------------------------------------------
    @property
    def folds_latents(self) -> bool:
        """Whether the buckets store the drafter's context latents themselves (:class:`PromptLatentFold`)."""
        return self.latents is not None

    def run(self, ids: torch.Tensor, slots: torch.Tensor, spans: list[tuple[int, int]], columns: int,
            prompt_lens: torch.Tensor | None = None, last_latents: torch.Tensor | None = None
            ) -> TargetOutput | None:
        """The block ``ids [R, T]`` (row ``r`` on ``slots[r]``, its real tokens ``spans[r] = (first position,
        count)`` in columns ``0 .. count-1``) in pieces of at most ``columns`` tokens: its :class:`TargetOutput`
        rows ``r * T + t``; None when the rule says eager (the caller runs its own forward).

        With :attr:`folds_latents` the output carries no features (``captured`` None): each piece stored the
        latents of its positions below ``prompt_lens[r] - 1`` (``prompt_lens [R]`` int64 on the device; None
        stores none: a target-only admission), and the latent of each row's last real token (a piece that ends
        the row's span) is copied to ``last_latents[r]`` when given."""
        r, t = ids.shape
        plan = plan_prefill(spans, columns, self.buckets, self.max_positions)
        if not plan.replay:
            self.eager_calls += 1
            if plan.reason not in self._logged:
                self._logged.add(plan.reason)
                logger.warning(f"{self.name} runs eagerly ({plan.reason}); logged once per reason")
            return None
        # Padding tokens: id 0 past each row's columns (the batched block pads with 0 too).
        padded = F.pad(ids, (0, max(plan.buckets)))
        fold = self.latents is not None
        hidden = captured = None
        with nvtx_range("prefill_graph"):
            for piece, b in zip(plan.pieces, plan.buckets):
                c, m = piece.column, piece.tokens
                self.ids[:, :b].copy_(padded[piece.row:piece.row + 1, c:c + b])
                torch.add(self._offsets[:, :b], piece.first, out=self.positions[:, :b])
                self.slot.copy_(slots[piece.row:piece.row + 1])
                if fold and prompt_lens is not None:
                    self.prompt_len.copy_(prompt_lens[piece.row:piece.row + 1])
                    self._prompt_len_zero = False
                elif fold and not self._prompt_len_zero:
                    self.prompt_len.zero_()
                    self._prompt_len_zero = True
                out, latents = self.run_bucket(b)
                if hidden is None:
                    hidden = out.hidden_states.new_zeros(r * t, out.hidden_states.shape[-1])
                    if not fold:
                        captured = out.captured.new_zeros(r * t, out.captured.shape[-1])
                # Copied out now: the next replay (of any graph of the pool) may overwrite the static outputs.
                dst = piece.row * t + c
                hidden[dst:dst + m].copy_(out.hidden_states[:m])
                if not fold:
                    captured[dst:dst + m].copy_(out.captured[:m])
                elif last_latents is not None and c + m == spans[piece.row][1]:
                    last_latents[piece.row].copy_(latents[m - 1])
        return TargetOutput(hidden_states=hidden, captured=captured)

    def run_bucket(self, b: int) -> tuple[TargetOutput, torch.Tensor | None]:
        """Bucket ``b`` over the static inputs: its graph's replay, or (not captured) the forward run eagerly;
        ``(the target's outputs, the tokens' latents [b, L, d_c] or None without the fold)``."""
        self.replays[b] = self.replays.get(b, 0) + 1
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)
        with nvtx_range(f"prefill_graph.replay.{b}"):
            graph.replay()
        return self.outputs[b]

    def _forward(self, b: int) -> tuple[TargetOutput, torch.Tensor | None]:
        out = self.target(self.ids[:, :b], self.positions[:, :b], self.slot, self.kv_cache)
        fold = self.latents
        if fold is None:
            return out, None
        latents = fold.compute(out.captured)  # [b, L, d_c]
        # positions below prompt_len - 1 only (the last one goes through the first block's bookkeeping); the piece's
        # start is its first position (a strided view of the static positions)
        fold.store(latents, self.slot, self.positions[:, 0], self.prompt_len, fold.block_table, fold.pool,
                   page_size=fold.page_size)
        return out, latents

    # -- capture -------------------------------------------------------------------------------------------
    def capture(self, mapping: Mapping | None = None) -> bool:
        """Capture every bucket (largest first), agreed across ``mapping``'s TP group; on a failure anywhere
        no bucket is kept (every rank prefills eagerly). True if captured."""
        ok = agree_on_capture(mapping or Mapping(), self._capture_all, self.name)
        if not ok:
            self.graphs.clear()
            self.outputs.clear()
        else:
            logger.info(f"captured {self.name} at token buckets {list(self.buckets)}")
        return ok

    def _capture_all(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("PrefillGraphRunner: capturing needs CUDA")
        # The dummy slot's table row is the scratch page everywhere: the only cache memory written.
        scratch = [t[:, -1] for t in self.kv_cache.tensors()]
        snapshot = [t.clone() for t in scratch]
        try:
            self.ids.zero_()
            self.positions.copy_(self._offsets)
            self.slot.fill_(self.dummy_slot)
            self.prompt_len.zero_()  # the fold stores nothing while warming up and capturing
            self._prompt_len_zero = True
            for b in sorted(self.buckets, reverse=True):
                self.graphs[b], self.outputs[b], self.pool = warm_up_and_capture(lambda b=b: self._forward(b),
                                                                                 self.pool, f"prefill_graph.{b}")
            torch.cuda.synchronize()
        finally:
            for t, s in zip(scratch, snapshot):
                t.copy_(s)
            torch.cuda.synchronize()
