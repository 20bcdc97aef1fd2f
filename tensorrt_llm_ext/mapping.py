"""Rank layout, TensorRT-LLM style: ``world_size = tp_size * pp_size``, TP groups of consecutive ranks.

Also the one rule for how a COLUMN-parallel LM head splits the vocabulary (:func:`vocab_shards`): every
user of a shard's width (the head, the drafter's Markov rows, the benchmarks, the simulated-TP tests) calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Verification's statistic block (kernels/block_stats.STAT_BLOCK): a shard that starts and ends on these
# boundaries is read once per call; any other shard takes the two-pass fallback.
VOCAB_SHARD_ALIGN = 1024
# "aligned": whole blocks per rank where every rank still holds a real id; "ceil": ceil(V / tp) always (the
# previous layout, kept for comparisons).
VOCAB_SHARD_RULES = ("aligned", "ceil")


@dataclass(frozen=True)
class VocabShards:
    """How ``vocab_size`` ids split over ``tp_size`` ranks: rank ``r`` owns ``[r width, (r + 1) width)``; ids
    ``>= vocab_size`` are zero-weight padding, all of it on the last rank (every rank holds a real id)."""

    vocab_size: int
    tp_size: int
    width: int
    rule: str  # the rule that gave ``width``: "aligned" or "ceil"
    reason: str  # why (for the log line)

    @property
    def padded_vocab_size(self) -> int:
        return self.width * self.tp_size

    @property
    def block_aligned(self) -> bool:
        """Every shard starts and ends on a :data:`VOCAB_SHARD_ALIGN` boundary (tp 1 owns every id from 0)."""
        return self.tp_size == 1 or self.width % VOCAB_SHARD_ALIGN == 0

    def start(self, tp_rank: int) -> int:
        return tp_rank * self.width

    def num_valid(self, tp_rank: int) -> int:
        """Real vocabulary rows of rank ``tp_rank``'s shard (the rest is padding)."""
        return max(0, min(self.width, self.vocab_size - tp_rank * self.width))


def vocab_shards(vocab_size: int, tp_size: int, rule: str = "aligned") -> VocabShards:
    """The vocabulary split of a COLUMN-parallel head.

    ``"aligned"`` (default): ``W = 1024 ceil(ceil(V / tp) / 1024)`` at tp > 1 when the last rank still holds a
    real id (``(tp - 1) W < V``: then every other rank holds real ids only), else ``ceil(V / tp)`` (small
    vocabularies). ``"ceil"``: ``ceil(V / tp)``. tp 1: ``V``. A ``ValueError`` when even ``ceil(V / tp)`` leaves
    the last rank without a real id.
    """
    if rule not in VOCAB_SHARD_RULES:
        raise ValueError(f"vocab shard rule: expected one of {VOCAB_SHARD_RULES}, got {rule!r}")
    for name, value in (("vocab_size", vocab_size), ("tp_size", tp_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"vocab_shards: {name} must be a positive int, got {value!r}")
    ceil_w = -(-vocab_size // tp_size)
    if (tp_size - 1) * ceil_w >= vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is too small for tp_size={tp_size}: the last rank's shard "
                         f"would hold no real vocabulary row")
    if tp_size == 1:
        return VocabShards(vocab_size, 1, vocab_size, rule, "tp 1: one shard holds the whole vocabulary")
    if rule == "ceil":
        return VocabShards(vocab_size, tp_size, ceil_w, "ceil", "rule 'ceil' asked for")
    aligned_w = VOCAB_SHARD_ALIGN * -(-ceil_w // VOCAB_SHARD_ALIGN)
    if (tp_size - 1) * aligned_w >= vocab_size:
        return VocabShards(vocab_size, tp_size, ceil_w, "ceil",
                           f"whole {VOCAB_SHARD_ALIGN}-id blocks ({aligned_w} per rank) would leave the last "
                           f"rank no real id")
    pad = tp_size * aligned_w - vocab_size
    why = (f"whole {VOCAB_SHARD_ALIGN}-id blocks: " +
           ("ceil(V / tp) is whole blocks already" if aligned_w == ceil_w else
            f"{aligned_w - ceil_w} rows per rank over ceil(V / tp) = {ceil_w}") +
           f"; {pad} zero rows on the last rank")
    return VocabShards(vocab_size, tp_size, aligned_w, "aligned", why)


@dataclass(frozen=True)
class Mapping:
    """Where this rank sits in the parallel layout.

    Only tensor parallelism (and the attention-DP flag that disables vocab-parallel selection and the
    drafter TP fusions) is used by this module; ``pp_size`` is kept so layouts read as in TensorRT-LLM.
    """

    world_size: int = 1
    rank: int = 0
    gpus_per_node: int = 8
    tp_size: int = 1
    pp_size: int = 1
    enable_attention_dp: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Mapping.{name} must be a positive int, got {value!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Mapping.rank must be in [0, {self.world_size}), got {self.rank}")
        if self.world_size % self.tp_size != 0:
            raise ValueError(
                f"tp_size={self.tp_size} does not divide world_size={self.world_size}")
        if self.tp_size * self.pp_size != self.world_size:
            raise ValueError(
                f"world_size={self.world_size} must equal tp_size*pp_size={self.tp_size}*{self.pp_size}")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_group(self) -> tuple[int, ...]:
        """Global ranks of this rank's TP group."""
        base = self.pp_rank * self.tp_size
        return tuple(range(base, base + self.tp_size))

    @property
    def local_rank(self) -> int:
        return self.rank % self.gpus_per_node

    @property
    def has_tp(self) -> bool:
        return self.tp_size > 1

    @property
    def is_plain_tp(self) -> bool:
        """TP > 1 without attention DP: the layout vocab-parallel selection and drafter fusion need."""
        return self.tp_size > 1 and not self.enable_attention_dp
