"""The contract between models and speculative workers: plain data types and ``typing.Protocol`` s.

A leaf module: torch, dataclasses and typing only -- no kernel, no communication, no model import.
Models depend on this module alone from the speculative side; workers fill these types, hand them to
models, and call models only through :class:`TargetModel` and :class:`DraftModel` (exactly what a
worker uses, nothing else). :class:`DSparkState` is the device state a DSpark step reads and mutates;
:class:`SamplingParams` is how one request's tokens are drawn.

Shape letters: B requests, K draft length (block length), V vocabulary, r Markov rank, L drafter
layers, d_c latent width, tp TP size.

Paged single-latent drafter context (the semantics every owner of these types follows)
--------------------------------------------------------------------------------------
For a request, ``ctx_len`` counts the positions whose drafter context latent is stored in the paged
pool (positions ``0 .. ctx_len-1``); it equals the position of the *anchor*, the last accepted token,
whose target hidden state is not yet known. A generation step verifies ``[anchor, d_0 .. d_{K-1}]`` at
positions ``ctx_len .. ctx_len+K``; strict acceptance yields ``n_acc`` in ``[1, K+1]`` tokens. The target
hidden states of the first ``n_acc`` verified positions become context: latent ``j < n_acc`` is stored at
position ``ctx_len + j``, then ``ctx_len += n_acc``. The bonus token (last accepted token) is the next
anchor at position ``ctx_len`` (advanced). The draft block holds ``K`` positions
``ctx_len .. ctx_len+K-1`` (input ids ``[anchor, MASK, ..., MASK]``); its own latents are placed in the
pages right after the context (:class:`DraftBlockPlacement`) and overwritten by real context later.
Page ``p`` of a request holds positions ``p*page_size .. (p+1)*page_size-1``; the physical page id comes
from the request's block table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Protocol, runtime_checkable

import math
import secrets
import struct

import torch

# The smallest temperature a keyed Gumbel draw takes: below about 1e-38 the scaled logit overflows fp32 and
# every positive logit ties at +inf; far above 1e-38 a draw already equals the argmax unless logits tie
# within ~20 T. A request below it is served greedy (its T -> 0 limit); the selection API refuses it.
MIN_TEMPERATURE = 1e-5
# The engine samples in fp32, so a sampling field is checked in fp32 where it enters: a double the layers below
# would see as another value is refused or normalised at the boundary, never inside a step.
FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: a larger temperature is inf in fp32
FP32_MIN_NORMAL = 2.0 ** -126  # torch.finfo(torch.float32).tiny: below it a value is denormal or 0.0 in fp32
# A smaller positive top_p (1e-46 is 0.0 in fp32, which the kernels refuse)
# keeps exactly what any top_p below 1 / (the row's fixed-point mass) keeps -- the most probable token -- so
# it is served as MIN_TOP_P: the same kept set, a value every layer accepts.
MIN_TOP_P = FP32_MIN_NORMAL
# A seen token's logit is divided (positive) or multiplied (negative) by the repetition penalty, later by the
# temperature (>= MIN_TEMPERATURE), in fp32: within these bounds a logit up to 2000 stays finite at every
# temperature. Past them (1e-38 was accepted) seen logits overflowed to +inf, which the exact top-p set dropped
# (drawing a token of probability 0) and rejection sampling turned into NaN weights.
MIN_REPETITION_PENALTY = 2.0 ** -100
MAX_REPETITION_PENALTY = 2.0 ** 100


MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries per request (a slot holds this many)
_NO_LIMIT_TOP_K = -1  # vLLM's "no limit"; 0 means the same and is what a SamplingParams holds


def _fp32(x: float) -> float:
    """``x`` as a slot holds it (fp32): the effective-temperature rule decides on this value, as the device does.
    The C cast through ``struct`` (round to nearest even, as torch's conversion; ~10x cheaper than a tensor, and
    every admission asks several times); torch for what ``struct`` refuses (a finite value past fp32's range,
    which rounds to the largest fp32 or to infinity)."""
    try:
        return _FP32.unpack(_FP32.pack(x))[0]
    except OverflowError:
        return float(torch.tensor(float(x), dtype=torch.float32))


_FP32 = struct.Struct("f")


def fp32_words(values: list[float]) -> list[int]:
    """``values`` in fp32 (:func:`_fp32`'s rounding), two to an int64 word, the first in the low half (a zero pad
    for an odd count): a host buffer of int64 carries fp32 fields beside int64 ones in one copy, and on the
    (little-endian) device ``words.view(torch.float32)[:len(values)]`` reads them back bit for bit, contiguous."""
    n = len(values)
    raw = struct.pack(f"<{n + n % 2}f", *(_fp32(v) for v in values), *([0.0] * (n % 2)))
    return list(struct.unpack(f"<{(n + 1) // 2}q", raw))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v) -> bool:
    """Compared, never converted: an int past 1e308 has no float (``math.isfinite`` would raise on it)."""
    return isinstance(v, int) or math.isfinite(v)


def sampling_problem(name: str, value, vocab_size: int | None = None) -> str | None:
    """What is wrong with one :class:`SamplingParams` field's value (``"expected ..., got ..."``), None when it
    is valid: the one rule of each field. The HTTP protocol, requests, the CLI and the benchmarks say it under
    their own name for the field (``temperature``, ``--top-p``, ...). ``logit_bias`` is a sequence of
    ``(token id, bias)`` pairs; its ids are checked against ``vocab_size`` when it is given."""
    if name == "temperature":
        if not (_is_number(value) and value >= 0 and _finite(value)):
            return f"expected a finite number >= 0 (0 = greedy), got {value!r}"
        if value > FP32_MAX:
            return f"{value!r} overflows fp32, the engine's precision (at most {FP32_MAX:.6g})"
    elif name == "top_p":
        if not (_is_number(value) and 0 < value <= 1):  # NaN fails too
            return f"expected a number in (0, 1], got {value!r}"
    elif name == "seed":
        if not (_is_int(value) and 0 <= value < 2**63):
            return f"expected an int in [0, 2^63), got {value!r}"
    elif name == "top_k":
        if not (_is_int(value) and _NO_LIMIT_TOP_K <= value < 2**63):  # the slot holds it as int64
            return f"expected -1 or 0 (no limit) or a positive count below 2^63, got {value!r}"
    elif name == "min_p":
        if not (_is_number(value) and 0 <= value <= 1):
            return f"expected a number in [0, 1], got {value!r}"
    elif name in ("presence_penalty", "frequency_penalty"):
        if not (_is_number(value) and -2 <= value <= 2):
            return f"expected a number in [-2, 2], got {value!r}"
    elif name == "repetition_penalty":
        if not (_is_number(value) and value > 0 and _finite(value)):
            return f"expected a finite number > 0, got {value!r}"
        expected = "expected 2^-100 .. 2^100, about 7.9e-31 .. 1.3e+30"
        if not FP32_MIN_NORMAL <= value <= FP32_MAX:  # a divisor: 0 or inf in fp32
            return f"{value!r} is {'0' if value < 1 else 'inf'} in fp32, the engine's precision ({expected})"
        if not MIN_REPETITION_PENALTY <= value <= MAX_REPETITION_PENALTY:
            return (f"{value!r} would scale a seen token's logit past fp32 at the sampler's temperatures ("
                    f"{expected})")
    elif name == "logit_bias":
        return _logit_bias_problem(value, vocab_size)
    else:
        raise ValueError(f"sampling_problem: expected a SamplingParams field, got {name!r}")
    return None


def _logit_bias_problem(pairs, vocab_size: int | None) -> str | None:
    if not isinstance(pairs, (tuple, list)) or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
        return f"expected (token id, bias) pairs, got {type(pairs).__name__}"
    if len(pairs) > MAX_LOGIT_BIAS:
        return f"expected at most {MAX_LOGIT_BIAS} entries, got {len(pairs)}"
    ids = [t for t, _ in pairs]
    if not all(_is_int(t) for t in ids) or len(set(ids)) != len(ids):
        return "expected distinct int token ids"
    bad = [t for t in ids if t < 0 or vocab_size is not None and t >= vocab_size]
    if bad:
        return f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
    odd = [(t, b) for t, b in pairs if not (_is_number(b) and -100 <= b <= 100)]
    if odd:
        return f"expected biases in [-100, 100], got {odd[0][1]!r} for token {odd[0][0]}"
    return None


class BuildRefusal(ValueError):
    """What the engine was given, refused while it is built -- a checkpoint (``CheckpointError``), a KV cache that
    cannot fit the memory there is: one line naming it, exit 2 from every command. Every rank refuses alike, so at
    TP N it is the input's refusal, not a rank fault."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are drawn (TensorRT-LLM's and vLLM's ``SamplingParams``): built once where the
    request enters (``_Sampling.to_sampling_params()`` for HTTP, the flags for the CLI) and handed as this one
    object to the slot that serves it.

    ``temperature`` 0 is greedy (the argmax); a sampled request draws keyed Gumbel-max at its
    :attr:`effective_temperature`, the token at absolute position ``p`` with Philox key ``(seed, offset=p)``,
    so a draw is reproducible and the same on the speculative path and the target's own decode. ``top_p``
    in ``(0, 1]`` restricts a sampled request to the target's exact top-p set (1: no restriction; a greedy
    request ignores it). Logits processing (vLLM's fields, applied in this order before top-p, see
    :mod:`tensorrt_llm_ext.speculative.logits_processing`): ``logit_bias`` (sorted ``(token id, bias)`` pairs),
    ``repetition_penalty`` (1: none; within :data:`MIN_REPETITION_PENALTY` .. :data:`MAX_REPETITION_PENALTY`),
    ``frequency_penalty`` / ``presence_penalty`` (0: none) for every request; ``min_p`` (0: none) and ``top_k``
    (0: no limit; -1 is taken as 0) for sampled ones.

    A slot holds these in fp32, so the rules decide in fp32: a temperature beyond fp32 is refused, a top-p
    below the smallest normal fp32 is served as :data:`MIN_TOP_P`. :meth:`check` is the one check: a value
    outside its field's rule (:func:`sampling_problem`) is a ``ValueError`` naming the field. Construction only
    normalises (``top_k`` -1 -> 0, a ``logit_bias`` dict -> sorted pairs), so a request holding a bad value
    can still reach admission and be refused there, alone.

    Example::

        SamplingParams(temperature=0.7, top_p=0.9, seed=3, logit_bias={50256: -100})
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        bias = self.logit_bias
        if isinstance(bias, dict):  # {id: bias} as OpenAI writes it -> sorted pairs
            bias = tuple(sorted(bias.items(), key=lambda kv: kv[0] if _is_int(kv[0]) else -1))
        elif isinstance(bias, list):
            bias = tuple(tuple(p) if isinstance(p, list) else p for p in bias)
        object.__setattr__(self, "logit_bias", bias)
        if self.top_k == _NO_LIMIT_TOP_K:
            object.__setattr__(self, "top_k", 0)

    def check(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError("field: problem")`` for the first field outside its rule (logit_bias ids against
        ``vocab_size`` when given)."""
        for f in fields(self):
            problem = sampling_problem(f.name, getattr(self, f.name), vocab_size)
            if problem is not None:
                raise ValueError(f"{f.name}: {problem}")

    @property
    def effective_temperature(self) -> float:
        """The temperature a slot samples at: ``0.0`` (greedy, the T -> 0 limit) when the fp32 temperature is
        below :data:`MIN_TEMPERATURE` in fp32, else ``temperature``."""
        return 0.0 if _fp32(self.temperature) < _fp32(MIN_TEMPERATURE) else float(self.temperature)

    @property
    def effective_top_p(self) -> float:
        """The top-p a slot samples with: ``top_p``, raised to :data:`MIN_TOP_P` below the smallest normal fp32
        (the same kept set: the most probable token)."""
        return max(float(self.top_p), MIN_TOP_P)

    @property
    def is_greedy(self) -> bool:
        return self.effective_temperature == 0.0

    @property
    def restricts_top_p(self) -> bool:
        """Whether a top-p set applies: a sampled request with ``top_p < 1`` (the top-p step variant)."""
        return not self.is_greedy and self.top_p < 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether a processing field acts on this request's rows (the processed step variant; top-p is not
        processing): :meth:`acts_on_logits` over any vocabulary."""
        return self.acts_on_logits()

    def acts_on_logits(self, vocab_size: int | None = None) -> bool:
        """Whether processing changes this request's rows: a logit bias or a penalty always; ``min_p`` and ``top_k``
        on sampled rows only, a ``top_k`` below ``vocab_size`` only (a greedy request sending them, as many clients do
        by default, must not move its neighbours' steps off the default variant)."""
        sampled_only = (self.min_p > 0 and not self.is_greedy) or self.limiting_top_k(vocab_size) > 0
        return bool(self.logit_bias) or self.uses_counts or sampled_only

    def limiting_top_k(self, vocab_size: int | None = None) -> int:
        """``top_k`` where it limits a sampled row (``0 < k``, below ``vocab_size`` when given), else 0."""
        limits = 0 < self.top_k and (vocab_size is None or self.top_k < vocab_size)
        return self.top_k if limits and not self.is_greedy else 0

    @property
    def uses_counts(self) -> bool:
        """Whether the token history matters (a penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def for_choice(self, index: int) -> SamplingParams:
        """The params of choice ``index`` of a request with ``n > 1``: choice 0 keeps ``seed``; choice ``k``
        draws with a seed mixed from ``(seed, k)`` (SplitMix64), so the choices of one request share no
        stream with each other or with the requests of neighbouring seeds."""
        if index == 0:
            return self
        return replace(self, seed=_mix_seed(self.seed, index))


def _mix_seed(seed: int, index: int) -> int:
    """SplitMix64's finaliser over ``seed + index * golden``: a well-mixed seed in ``[0, 2^63)``."""
    m = (1 << 64) - 1
    z = (seed + index * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) >> 1


def fresh_seed() -> int:
    """A seed for a request that gave none (vLLM: an unseeded request is random), in ``[0, 2^63)``."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class DraftBlockPlacement:
    """Where the draft block's own positions live in the paged latent pool.

    Computed by the worker's fused bookkeeping kernel (one owner of paging) and consumed by the
    drafter's block decode, which must not re-derive it.
    """

    positions: torch.Tensor  # [B, K] int32, absolute position (also the RoPE position) of each block token
    page_ids: torch.Tensor  # [B, K] int32, physical page holding that position's latent
    page_offsets: torch.Tensor  # [B, K] int32, slot inside the page
    ctx_lens: torch.Tensor  # [B] int32, context positions visible to the block (before the block)
    seq_lens: torch.Tensor  # [B] int32, ctx_lens + K (0 for a dummy slot)


@dataclass(frozen=True)
class PagedLatentCache:
    """The drafter's paged single-latent (MLA-style) context cache."""

    pool: torch.Tensor  # [L, num_pages, page_size, d_c], latents of every drafter layer
    block_table: torch.Tensor  # [num_slots, max_pages] int32, physical page ids (>= 0 where allocated)

    @property
    def page_size(self) -> int:
        return self.pool.shape[2]


@dataclass(frozen=True)
class DrafterBlockInputs:
    """Inputs of one drafter block decode (generation requests of a step)."""

    block_input_ids: torch.Tensor  # [B, K] int64: [anchor, MASK * (K-1)]
    slot_ids: torch.Tensor  # [B] int32, rows of the cache's block table
    placement: DraftBlockPlacement
    cache: PagedLatentCache


@dataclass(frozen=True)
class MarkovHeadWeights:
    """The DSpark vanilla Markov head, as exposed by a drafter; the worker runs the chain.

    ``markov_w1`` is indexed by the previous token (a global vocab id) and is whole on every rank;
    ``markov_w2`` holds this rank's vocabulary rows ``[vocab_start, vocab_start + V_local)`` (the whole
    vocabulary on a single rank or a replicated head).
    """

    markov_w1: torch.Tensor  # [V, r]
    markov_w2: torch.Tensor  # [V_local, r]
    vocab_start: int
    vocab_size: int  # V, the real (unpadded) vocabulary

    @property
    def rank(self) -> int:
        return self.markov_w1.shape[1]


@dataclass(frozen=True)
class DrafterTPFusions:
    """What a drafter class declares it supports under plain TP (tp > 1, no attention DP).

    Declared as the class attribute ``tp_fusions``; resolved once into a :class:`DrafterTPPlan` when
    the drafter is built under a Mapping.
    """

    fc_input_split: bool = False  # fc split along input features, all-reduce with hidden_norm fused
    residual_norm_fusion: bool = False  # o_proj/down_proj all-reduce fused with residual add + RMSNorm


NO_TP_FUSIONS = DrafterTPFusions()


@dataclass(frozen=True)
class DrafterTPPlan:
    """The resolved, immutable TP plan of one built drafter (observable by tests and logs)."""

    fc_input_split: bool
    residual_norm_fusion: bool
    reason: str  # why the plan is what it is (logged once at load)


class DrafterCapabilities:
    """Mixin for drafter classes: the declaration the worker and the TP plan read, never probed."""

    tp_fusions: ClassVar[DrafterTPFusions] = NO_TP_FUSIONS


@dataclass(frozen=True)
class TargetOutput:
    """One target forward's outputs (rows flattened ``b * T + t``)."""

    hidden_states: torch.Tensor  # [B*T, H] final-normed, the LM head's input
    captured: torch.Tensor | None  # [B*T, n_cap * H] the drafter's capture layers' hidden states, concatenated
    # (None from a forward that was asked not to capture: the target-only decode)


@dataclass
class DSparkState:
    """Device state a DSpark step reads and mutates, indexed by slot (``num_slots`` = requests + the dummy slot).

    Allocated once by the runtime (before any CUDA-graph capture); every tensor keeps its storage.
    """

    kv_cache: Any  # the target's paged KV cache (``tensors()``: k, v [L_t, num_pages + 1, page_size, kvh, D]; page_table)
    latent_pool: torch.Tensor  # [L, num_pages + 1, page_size, d_c]; the last page is scratch
    encoded_offsets: torch.Tensor  # [num_slots, max_pages] int32, page * divisor, -1 = unallocated
    block_table: torch.Tensor  # [num_slots, max_pages] int32, decoded each step
    ctx_lens: torch.Tensor  # [num_slots] int32, drafter context length = position of the anchor
    ref_lens: torch.Tensor  # [num_slots] int32, sequence length minus one for the target-only decode
    slot_tokens: torch.Tensor  # [num_slots, K+1] int64, next step's [anchor, drafts] (target-only: [last, pad])
    page_size: int
    page_divisor: int
    dummy_slot: int
    max_ctx_len: int

    def mutable_tensors(self) -> list[torch.Tensor]:
        """Every tensor a step writes (snapshotted around CUDA-graph warm-up)."""
        return [*self.kv_cache.tensors(), self.latent_pool, self.block_table, self.ctx_lens, self.ref_lens,
                self.slot_tokens]


@runtime_checkable
class LanguageModelHead(Protocol):
    """What a worker calls on an LM head. Vocab-parallel selection needs more than this protocol (a
    column-parallel, evenly sharded, unquantized head it can shard): it binds only the package's own
    ``LMHead`` class and takes the gathered path for any other head, saying why."""

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> full-vocabulary logits ``[..., V]`` (gathered across ranks where sharded)."""


@runtime_checkable
class LogitsProcessorLike(Protocol):
    """Hidden states -> the logits tokens are selected from. Only the package's plain ``LogitsProcessor``
    leaves the head's logits unchanged; any other processor may transform them, so vocab-parallel
    selection takes the gathered path for it."""

    def __call__(self, hidden_states: torch.Tensor, lm_head: LanguageModelHead,
                 row_indices: torch.Tensor | None = None) -> torch.Tensor:
        """``[R, H]`` (rows ``row_indices`` of it where given) -> ``[R', V]`` logits."""


@runtime_checkable
class TargetModel(Protocol):
    """What a speculative worker calls on the target model (and nothing else)."""

    lm_head: LanguageModelHead  # the (possibly vocab-sharded) LM head the selection binds after load
    logits_processor: LogitsProcessorLike  # the plain one keeps vocab-parallel selection possible
    dtype: torch.dtype  # activation / logits dtype

    @property
    def vocab_size(self) -> int:
        """``V``, the real (unpadded) vocabulary."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                 kv_cache: Any) -> TargetOutput:
        """One fixed-shape forward of ``[B, T]`` tokens at ``positions`` writing the slots' KV cache."""

    def logits(self, hidden_states: torch.Tensor, row_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Full-vocabulary ``[R, V]`` logits through the head and the logits processor."""


@runtime_checkable
class DraftModel(Protocol):
    """What a speculative worker calls on a DSpark block drafter (and nothing else)."""

    lm_head: LanguageModelHead | None  # the head drafts go through (the target's, after take_over_lm_head)

    @property
    def mask_token_id(self) -> int:
        """Input id of the block's masked positions."""

    def take_over_lm_head(self, lm_head: LanguageModelHead) -> None:
        """Draft through the target's LM head from now on (called once, after load)."""

    def markov_head_weights(self, vocab_parallel: bool | None = None) -> MarkovHeadWeights:
        """The Markov head, ``markov_w2`` restricted to this rank's vocabulary rows when ``vocab_parallel``."""

    def compute_context_latents(self, features: torch.Tensor) -> torch.Tensor:
        """Captured target features ``[N, F]`` -> context latents of every drafter layer ``[N, L, d_c]``."""

    def forward_block(self, inputs: DrafterBlockInputs) -> torch.Tensor:
        """One block decode -> final hidden states ``[B, K, H]`` (the LM head's input)."""
