"""The runtime configuration: the YAML a ``trtllm-serve --config`` user writes, plus this module's options.

Read once (:func:`load_config`), validated by pydantic; an invalid value raises :class:`ConfigError`
whose message names the field path (``speculative_config.max_draft_len: ...``). Unknown keys are errors
(a typo must not be silently ignored), except a short list of ``trtllm-serve`` options that have no
meaning here; those are accepted and logged once.

Example (the embedded default is ``tensorrt_llm_ext/configs/dspark_default.yaml``)::

    tensor_parallel_size: 2
    max_batch_size: 8
    max_seq_len: 256
    speculative_config:
      decoding_type: DSpark
      max_draft_len: 4
      markov_rank: 8
      vocab_parallel_selection: auto   # auto | on | off
      markov_chain_mode: auto          # exact | fused | auto
      exchange: auto                   # auto | nccl | low_latency
      use_rejection_sampling: false    # sampled drafts + rejection-sampling verification
      vocab_sharded_verification: auto # auto | on | off
    cuda_graph_config:
      batch_sizes: [1, 2, 4, 8]
      enable_padding: true
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tensorrt_llm_ext.logger import info_once

DEFAULT_CONFIG_NAME = "dspark_default.yaml"

# trtllm-serve options a user's file may carry that mean nothing to this runtime: accepted, logged.
IGNORED_SERVE_KEYS = frozenset({
    "backend", "print_iter_log", "disable_overlap_scheduler", "enable_chunked_prefill", "stream_interval",
    "enable_iter_perf_stats", "return_perf_metrics", "moe_config", "max_num_tokens", "trust_remote_code",
    "scheduler_config", "kv_cache_dtype", "enable_autotuner",
})


class ConfigError(ValueError):
    """An invalid configuration; the message names every offending field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetModelConfig(_Strict):
    """The tiny Llama-like target (see :class:`tensorrt_llm_ext.models.llama_target.LlamaTargetConfig`)."""

    vocab_size: int = Field(1031, ge=16, lt=2**24)
    hidden_size: int = Field(48, ge=2)
    num_layers: int = Field(3, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    head_dim: int = Field(12, ge=2)
    intermediate_size: int = Field(96, ge=1)
    capture_layers: tuple[int, ...] = (0, 1, 2)
    rope_theta: float = Field(10000.0, gt=0)
    residual_scale: float = Field(0.25, gt=0)  # seeded init only: scale of what each layer adds (see llama_target)

    @model_validator(mode="after")
    def _check(self):
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if not self.capture_layers or any(not 0 <= i < self.num_layers for i in self.capture_layers):
            raise ValueError(f"capture_layers must be non-empty layer indices in [0, {self.num_layers}), "
                             f"got {list(self.capture_layers)}")
        return self


class DrafterModelConfig(_Strict):
    """The DSpark drafter sizes. Its hidden size is the target's (it drafts through the target's LM head);
    vocab and Markov rank come from the target and ``speculative_config``."""

    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    head_dim: int = Field(16, ge=2)
    latent_dim: int = Field(32, ge=1)
    intermediate_size: int = Field(96, ge=1)


class ModelConfig(_Strict):
    """Which weights: the embedded deterministic ones (``seed``) or full state dicts (``*_weights``)."""

    target: TargetModelConfig = TargetModelConfig()
    drafter: DrafterModelConfig = DrafterModelConfig()
    seed: int = Field(1234, ge=0)
    # Seeded drafter init: "target_bigram" sets the Markov head to the target's embedding->head bigram (real
    # acceptance on the seeded target); "random" leaves every drafter weight random (acceptance ~1).
    drafter_init: Literal["target_bigram", "random"] = "target_bigram"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    target_weights: str | None = None  # a torch.save'd FULL state dict (names of llama_target.full_weight_shapes)
    drafter_weights: str | None = None  # ... of dspark_drafter.full_weight_shapes


class SpeculativeConfig(_Strict):
    """``speculative_config``: TensorRT-LLM's keys for a DSpark one-model drafter, plus this module's."""

    decoding_type: Literal["DSpark"] = "DSpark"
    max_draft_len: int = Field(4, ge=1, le=32)  # K
    markov_rank: int = Field(48, ge=1)  # r
    speculative_model_dir: str | None = None  # accepted for compatibility; see model.drafter_weights
    vocab_parallel_selection: Literal["auto", "on", "off"] = "auto"
    # exact: bit-identical to the eager chain; fused: one launch per block position; auto: fused for small
    # batches, exact above (the Markov chain component decides per captured batch size).
    markov_chain_mode: Literal["exact", "fused", "auto"] = "auto"
    # How the TP pair exchange runs: low_latency = tagged words over symmetric memory; nccl = an NCCL
    # all-reduce MAX; auto = low_latency where it sets up on every rank. Any setup failure (non-CUDA,
    # no symmetric memory, a rank failing) falls back to NCCL on every rank, logged identically.
    exchange: Literal["auto", "nccl", "low_latency"] = "auto"
    # TensorRT-LLM's field name: sampled requests draft with keyed Gumbel-max at their temperature and are
    # verified by rejection sampling (docs/rejection_sampling.md); greedy requests keep strict acceptance.
    use_rejection_sampling: bool = False
    # Where rejection sampling verifies: on this rank's vocabulary columns (auto: whenever target and
    # draft heads are vocab-parallel; on: an error at load otherwise) or on gathered logits (off).
    vocab_sharded_verification: Literal["auto", "on", "off"] = "auto"

    @field_validator("vocab_parallel_selection", "vocab_sharded_verification", mode="before")
    @classmethod
    def _yaml_bool(cls, v):
        # YAML 1.1 reads a bare on/off as a boolean.
        if isinstance(v, bool):
            return "on" if v else "off"
        return v

    @model_validator(mode="after")
    def _check_verification(self):
        if self.vocab_sharded_verification == "on" and not self.use_rejection_sampling:
            raise ValueError("vocab_sharded_verification='on' needs use_rejection_sampling: true (strict "
                             "acceptance has no verification to shard)")
        return self

    @field_validator("decoding_type", mode="before")
    @classmethod
    def _decoding_type(cls, v):
        if isinstance(v, str) and v.lower() == "dspark":
            return "DSpark"
        raise ValueError(f"only decoding_type 'DSpark' is supported here, got {v!r}")


class CudaGraphConfig(_Strict):
    batch_sizes: tuple[int, ...] | None = None  # None: powers of two up to max_batch_size
    enable_padding: bool = True
    max_batch_size: int | None = Field(None, ge=1)

    @field_validator("batch_sizes")
    @classmethod
    def _sizes(cls, v):
        if v is None:
            return v
        if not v or any(b < 1 for b in v):
            raise ValueError(f"batch_sizes must be positive ints, got {list(v)}")
        return tuple(sorted(set(v)))


class KvCacheConfig(_Strict):
    tokens_per_block: int = Field(16, ge=1)  # the drafter's latent page size
    free_gpu_memory_fraction: float | None = Field(None, gt=0, le=1)  # accepted; caches are sized by max_seq_len


class RuntimeConfig(_Strict):
    """The whole runtime configuration."""

    model: ModelConfig = ModelConfig()
    speculative_config: SpeculativeConfig = SpeculativeConfig()
    cuda_graph_config: CudaGraphConfig | None = None  # None: eager steps (set it to capture on CUDA)
    kv_cache_config: KvCacheConfig = KvCacheConfig()
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: Literal[1] = 1
    enable_attention_dp: bool = False
    max_batch_size: int = Field(8, ge=1)
    max_seq_len: int = Field(256, ge=8)  # prompt + generated tokens of one request

    @model_validator(mode="after")
    def _check(self):
        tp = self.tensor_parallel_size
        t = self.model.target
        for name, size in (("model.target.num_heads", t.num_heads), ("model.target.num_kv_heads", t.num_kv_heads),
                           ("model.target.intermediate_size", t.intermediate_size),
                           ("model.drafter.num_heads", self.model.drafter.num_heads),
                           ("model.drafter.intermediate_size", self.model.drafter.intermediate_size)):
            if size % tp:
                raise ValueError(f"{name}={size} must be divisible by tensor_parallel_size={tp}")
        if (tp - 1) * -(-t.vocab_size // tp) >= t.vocab_size:
            raise ValueError(f"model.target.vocab_size={t.vocab_size} is too small for tensor_parallel_size={tp}")
        if (self.model.drafter_init == "target_bigram" and self.model.drafter_weights is None
                and self.speculative_config.markov_rank != t.hidden_size):
            raise ValueError(f"speculative_config.markov_rank={self.speculative_config.markov_rank} must equal "
                             f"model.target.hidden_size={t.hidden_size} with model.drafter_init='target_bigram'")
        cg = self.cuda_graph_config
        if cg is not None and cg.batch_sizes is not None and max(cg.batch_sizes) > self.max_batch_size:
            raise ValueError(f"cuda_graph_config.batch_sizes {list(cg.batch_sizes)} exceed "
                             f"max_batch_size={self.max_batch_size}")
        return self

    # -- derived -------------------------------------------------------------------------------
    @property
    def draft_len(self) -> int:
        return self.speculative_config.max_draft_len

    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The CUDA-graph batch sizes (padding buckets): configured, else powers of two to max_batch_size."""
        cg = self.cuda_graph_config
        if cg is not None and cg.batch_sizes is not None:
            return cg.batch_sizes
        top = min(self.max_batch_size, cg.max_batch_size or self.max_batch_size) if cg else self.max_batch_size
        sizes, b = [], 1
        while b < top:
            sizes.append(b)
            b *= 2
        sizes.append(top)
        return tuple(sizes)

    def with_overrides(self, **overrides) -> "RuntimeConfig":
        """A copy with dotted-path overrides (``{"speculative_config.max_draft_len": 3}``), re-validated."""
        data = self.model_dump()
        for path, value in overrides.items():
            node = data
            keys = path.split(".")
            for k in keys[:-1]:
                if node.get(k) is None:
                    node[k] = {}
                node = node[k]
            node[keys[-1]] = value
        return parse_config(data)


def _format_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "<root>"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see tensorrt_llm_ext/configs/dspark_default.yaml)"
        parts.append(f"{loc}: {msg}")
    return "invalid runtime config: " + "; ".join(parts)


def parse_config(data: dict | None) -> RuntimeConfig:
    """Validate a config dict (as loaded from YAML); raises :class:`ConfigError` naming the fields."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"invalid runtime config: expected a mapping at the top level, got {type(data).__name__}")
    data = dict(data or {})
    ignored = sorted(k for k in data if k in IGNORED_SERVE_KEYS)
    for k in ignored:
        data.pop(k)
    if ignored:
        info_once(f"config: ignoring trtllm-serve options with no meaning here: {ignored}")
    try:
        return RuntimeConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


class _YamlError(ValueError):
    pass


def _load_yaml(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _YamlError(str(e)) from None


def default_config_text() -> str:
    return resources.files("tensorrt_llm_ext.configs").joinpath(DEFAULT_CONFIG_NAME).read_text()


def load_config(path: str | Path | None = None, **overrides) -> RuntimeConfig:
    """Load ``path`` (YAML) or the embedded default, then apply dotted-path ``overrides``."""
    text = default_config_text() if path is None else Path(path).read_text()
    try:
        data = _load_yaml(text) or {}
    except _YamlError as e:
        raise ConfigError(f"invalid runtime config: {path or DEFAULT_CONFIG_NAME} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"invalid runtime config: expected a mapping at the top level, got {type(data).__name__}")
    cfg = parse_config(data)
    return cfg.with_overrides(**overrides) if overrides else cfg
