"""The runtime configuration: the YAML a ``trtllm-serve --config`` user writes, plus this module's options.

Field names follow TensorRT-LLM's LLM API arguments (``tensorrt_llm/llmapi/llm_args.py``: ``TorchLlmArgs``,
``KvCacheConfig``, ``CudaGraphConfig``, ``DecodingBaseConfig``). :func:`load_config` reads it once:

* **Layering.** The user's file is merged over the embedded default
  (``tensorrt_llm_ext/configs/dspark_default.yaml``): mappings merge key by key, anything else (a scalar,
  a list, ``null``) replaces. A file that sets only ``speculative_config`` keeps the default model.
* **Strict types.** Integers must be integers (``true`` is not 1, ``2.0`` is not 2), booleans booleans,
  strings strings; ranges are checked. An invalid value raises :class:`ConfigError` whose message names the
  field path (``speculative_config.max_draft_len: ...``).
* **Unknown keys are errors** (a typo must not be silently ignored). Every field of TensorRT-LLM that a
  public recipe uses is declared: either honoured, or declared *no effect here* (``no_effect(...)`` below),
  which is accepted, type-checked and logged once with the reason.
* **YAML limits.** UTF-8 text; a tree whose aliases expand past :data:`MAX_YAML_NODES` nodes (a "billion
  laughs" file), an alias inside itself or nesting deeper than the YAML parser's recursion is refused as a
  :class:`ConfigError` before anything walks it.
* **Models from disk.** ``model: DIR`` (or ``trtllm-ext serve DIR``) reads the target's sizes from a
  Hugging Face Llama ``DIR/config.json``; ``speculative_config.speculative_model`` (alias
  ``speculative_model_dir``) or ``DIR/dspark_drafter`` gives the drafter's (see
  :mod:`tensorrt_llm_ext.models.checkpoint`).

Example::

    tensor_parallel_size: 2
    max_batch_size: 8
    max_seq_len: 256
    speculative_config:
      decoding_type: DSpark
      max_draft_len: 4
      vocab_parallel_selection: auto   # auto | on | off
      markov_chain_mode: auto          # exact | fused | auto
      exchange: auto                   # auto | nccl | low_latency
      use_rejection_sampling: false    # sampled drafts + rejection-sampling verification
      draft_temperature_scale: 1.0     # rejection sampling: drafts drawn at this fraction of the temperature
      vocab_sharded_verification: auto # auto | on | off
    cuda_graph_config:                 # on a GPU (default on): capture per batch size (null: eager)
      batch_sizes: [1, 2, 4, 8]        # default: powers of two up to max_batch_size, and max_batch_size
      enable_padding: true
      prefill_max_tokens: 2048         # the prefill's target forward captured in token buckets up to it (0: eager)
"""

from __future__ import annotations

import copy
import math
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat,
                      StrictInt, StrictStr, ValidationError, field_validator, model_validator)

from tensorrt_llm_ext.logger import info_once

DEFAULT_CONFIG_NAME = "dspark_default.yaml"
DRAFTER_SUBDIR = "dspark_drafter"
# max_model_len of a checkpoint whose max_position_embeddings is larger, when nothing else bounds the KV cache
# (caches are sized max_batch_size x max_seq_len at start).
DEFAULT_MAX_MODEL_LEN = 4096  # where `trtllm-ext export DIR` puts the drafter, and where `DIR` looks for it


# Bounds that keep every size a tensor can hold (a value past them was an OverflowError deep in the engine's
# allocation; now one config error naming the field): requests in one step, and tokens of a sequence / a pool.
MAX_BATCH_SIZE = 1 << 16
MAX_TOKENS = 1 << 31


class ConfigError(ValueError):
    """An invalid configuration; the message names every offending field."""


def no_effect(default: Any, reason: str) -> Any:
    """A declared TensorRT-LLM field that this runtime accepts, type-checks and logs, but does not use."""
    return Field(default, json_schema_extra={"no_effect": reason})


_YAML11_EXP_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _yaml_float(v):
    # PyYAML reads YAML 1.1, where `1e-6` (no dot) is a string, not a float; accept exactly that spelling.
    return float(v) if isinstance(v, str) and _YAML11_EXP_FLOAT.fullmatch(v) else v


Float = Annotated[StrictFloat, BeforeValidator(_yaml_float)]  # a number; not a bool, not other strings


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- the embedded model ----------------------------------------------------------------------------------
class TargetModelConfig(_Strict):
    """The Llama target's sizes (see :class:`tensorrt_llm_ext.models.llama_target.LlamaTargetConfig`); read
    from ``config.json`` when ``model`` is a checkpoint directory."""

    vocab_size: StrictInt = Field(1031, ge=16, lt=2**24)
    hidden_size: StrictInt = Field(48, ge=2)
    num_layers: StrictInt = Field(3, ge=1)
    num_heads: StrictInt = Field(4, ge=1)
    num_kv_heads: StrictInt = Field(4, ge=1)
    head_dim: StrictInt = Field(12, ge=2)
    intermediate_size: StrictInt = Field(96, ge=1)
    capture_layers: tuple[StrictInt, ...] = (0, 1, 2)  # = speculative_config.target_layer_ids
    rope_theta: Float = Field(10000.0, gt=0)
    rms_norm_eps: Float = Field(1e-6, gt=0)
    tie_word_embeddings: StrictBool = False  # a checkpoint without lm_head.weight reads the embedding
    residual_scale: Float = Field(0.25, gt=0)  # seeded init only: scale of what each layer adds

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

    num_layers: StrictInt = Field(2, ge=1)
    num_heads: StrictInt = Field(4, ge=1)
    head_dim: StrictInt = Field(16, ge=2)
    latent_dim: StrictInt = Field(32, ge=1)
    intermediate_size: StrictInt = Field(96, ge=1)


class ModelConfig(_Strict):
    """Which weights: a checkpoint directory (``path``), the embedded seeded ones (``seed``), or full
    ``torch.save`` state dicts (``*_weights``). ``model: DIR`` in YAML is short for ``model: {path: DIR}``."""

    path: StrictStr | None = None  # a Hugging Face Llama directory (config.json + *.safetensors)
    target: TargetModelConfig = TargetModelConfig()
    drafter: DrafterModelConfig = DrafterModelConfig()
    drafter_path: StrictStr | None = None  # resolved drafter directory (speculative_model or path/dspark_drafter)
    seed: StrictInt = Field(1234, ge=0)
    # Seeded drafter init: "target_bigram" sets the Markov head to the target's embedding->head bigram (real
    # acceptance on the seeded target); "random" leaves every drafter weight random (acceptance ~1).
    drafter_init: Literal["target_bigram", "random"] = "target_bigram"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    target_weights: StrictStr | None = None  # a torch.save'd FULL state dict (llama_target.full_weight_shapes)
    drafter_weights: StrictStr | None = None  # ... of dspark_drafter.full_weight_shapes

    @model_validator(mode="before")
    @classmethod
    def _dir_shorthand(cls, v):
        return {"path": v} if isinstance(v, str) else v


# -- trtllm-serve sections ---------------------------------------------------------------------------------
class SpeculativeConfig(_Strict):
    """``speculative_config``: TensorRT-LLM's ``DecodingBaseConfig`` keys for a DSpark one-model drafter, plus
    this module's (``vocab_parallel_selection``, ``markov_chain_mode``, ``vocab_sharded_verification``)."""

    decoding_type: Literal["DSpark"] = "DSpark"
    max_draft_len: StrictInt = Field(4, ge=1, le=32)  # K
    max_total_draft_tokens: StrictInt | None = Field(None, ge=1)  # linear chains only: must equal K
    # The drafter directory (TensorRT-LLM's current name; `speculative_model_dir` is its older alias).
    speculative_model: StrictStr | None = Field(
        None, validation_alias=AliasChoices("speculative_model", "speculative_model_dir"))
    markov_rank: StrictInt = Field(48, ge=1)  # r
    mask_token_id: StrictInt | None = Field(None, ge=0)  # the drafter's block mask token; None: vocab_size - 1
    target_layer_ids: tuple[StrictInt, ...] | None = None  # target layers feeding the drafter (model.target.capture_layers)
    # TensorRT-LLM's field name: sampled requests draft with keyed Gumbel-max at their temperature and are
    # verified by rejection sampling (docs/rejection_sampling.md); greedy requests keep strict acceptance.
    use_rejection_sampling: StrictBool = False
    # With rejection sampling, the drafts are drawn at this fraction of the request's temperature (the draft
    # distribution q sharpened; 1: the request's own) and verified against that q: lossless for any value, since
    # rejection sampling keeps the target's distribution whatever q is, as long as the verifier knows q.
    draft_temperature_scale: Float = Field(1.0, gt=0, le=1)
    vocab_parallel_selection: Literal["auto", "on", "off"] = "auto"
    # exact: bit-identical to the eager chain; fused: one launch per block position; auto: fused for small
    # batches, exact above (the Markov chain component decides per captured batch size).
    markov_chain_mode: Literal["exact", "fused", "auto"] = "auto"
    # How the TP pair exchange runs: low_latency = tagged words over symmetric memory; nccl = an NCCL
    # all-reduce MAX; auto = low_latency where it sets up on every rank. Any setup failure (non-CUDA,
    # no symmetric memory, a rank failing) falls back to NCCL on every rank, logged identically.
    exchange: Literal["auto", "nccl", "low_latency"] = "auto"
    # Where rejection sampling verifies: on this rank's vocabulary columns (auto: whenever target and
    # draft heads are vocab-parallel; on: an error at load otherwise) or on gathered logits (off).
    vocab_sharded_verification: Literal["auto", "on", "off"] = "auto"
    load_format: StrictStr | None = no_effect(None, "drafter weights are read from safetensors")
    # TensorRT-LLM's dynamic speculation: a plan with more requests in flight (decoding or in their prefill) than
    # this decodes target-only, one with at most this many speculatively (runtime/scheduler.py, "Speculation by
    # batch size"). None: always speculative.
    max_concurrency: StrictInt | None = Field(None, ge=1)
    # The speculation gate (runtime/speculation_gate.py, TensorRT-LLM's names): once the mean accepted drafts per
    # step of the last `acceptance_window` finished requests falls below `acceptance_length_threshold`, the rest of
    # the process decodes target-only. Both or neither (None, or a window of 0 without a threshold: off).
    acceptance_window: StrictInt | None = Field(None, ge=0)
    acceptance_length_threshold: Float | None = None
    allow_advanced_sampling: StrictBool = no_effect(False, "deprecated upstream; sampling is per request")

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

    @field_validator("acceptance_length_threshold")
    @classmethod
    def _threshold(cls, v):
        if v is not None and not (math.isfinite(v) and 0 <= v <= 1024):
            raise ValueError(f"acceptance_length_threshold must be a finite number of accepted drafts per step in "
                             f"[0, 1024], got {v!r}")
        return v

    @model_validator(mode="after")
    def _check(self):
        if bool(self.acceptance_window) != (self.acceptance_length_threshold is not None):
            # TensorRT-LLM leaves the gate off silently here; half a gate is a typo worth naming
            raise ValueError(f"acceptance_window={self.acceptance_window!r} and acceptance_length_threshold="
                             f"{self.acceptance_length_threshold!r}: the speculation gate takes both (a window of 0 "
                             f"turns it off) or neither")
        if self.max_total_draft_tokens is not None and self.max_total_draft_tokens != self.max_draft_len:
            raise ValueError(f"max_total_draft_tokens={self.max_total_draft_tokens} must equal max_draft_len="
                             f"{self.max_draft_len} (DSpark drafts one linear chain, no tree)")
        return self


# The smallest prefill token bucket (cuda_graph_config.prefill_max_tokens; runtime/prefill_graph.py).
MIN_PREFILL_BUCKET = 16
DEFAULT_PREFILL_MAX_TOKENS = 2048


class CudaGraphConfig(_Strict):
    """``cuda_graph_config``: on a CUDA device every decode step (speculative and target-only) is captured
    per batch size and step variant whenever this section is present -- it is by default; ``null`` turns
    graphs off (eager steps). Ignored on a CPU (logged once)."""

    batch_sizes: tuple[StrictInt, ...] | None = None  # None: powers of two up to max_batch_size
    enable_padding: StrictBool = True
    max_batch_size: StrictInt | None = Field(None, ge=1, le=MAX_BATCH_SIZE)
    # The prefill's target forward captured per token bucket [1, T_b] (powers of two from 16 up to this, capped at
    # max_num_tokens and max_seq_len; runtime/prefill_graph.py); 0: eager prefill. 2048 by default: on the H200 it
    # took SmolLM2 at 32 streams from 4,748 to 8,271 output tok/s (docs/target_forward.md).
    prefill_max_tokens: StrictInt = DEFAULT_PREFILL_MAX_TOKENS

    @field_validator("prefill_max_tokens")
    @classmethod
    def _prefill_tokens(cls, v):
        if v != 0 and v < MIN_PREFILL_BUCKET:
            raise ValueError(f"prefill_max_tokens must be 0 (off) or at least {MIN_PREFILL_BUCKET} (the smallest "
                             f"token bucket), got {v}")
        return v

    @field_validator("batch_sizes")
    @classmethod
    def _sizes(cls, v):
        if v is None:
            return v
        if not v or any(b < 1 for b in v):
            raise ValueError(f"batch_sizes must be positive ints, got {list(v)}")
        return tuple(sorted(set(v)))


class KvCacheConfig(_Strict):
    """``kv_cache_config``. One page pool sized once at start (``max_tokens`` / ``free_gpu_memory_fraction``)."""

    tokens_per_block: StrictInt = Field(16, ge=1, le=4096)  # the drafter's latent page size
    dtype: StrictStr = no_effect("auto", "caches are kept in the model dtype")
    # Prefix reuse (runtime/kv_cache.py, PageAllocator): a prompt's whole pages, once prefilled, serve later prompts
    # that start with the same tokens. Off by default until l0_h200 passes whole (TensorRT-LLM's default: on).
    enable_block_reuse: StrictBool = False
    # With block reuse: a cached page whose first tokens match where the whole pages stop is copied, not prefilled.
    enable_partial_reuse: StrictBool = True
    # The page pool (target KV + drafter latents, runtime/kv_cache.py): this fraction of the free device memory
    # after the weights and/or max_tokens (the smaller); neither: every slot at max_seq_len.
    free_gpu_memory_fraction: Float | None = Field(None, gt=0, le=1)
    # With a checkpoint directory and no max_seq_len: max_model_len <= max_tokens // max_batch_size.
    max_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    max_attention_window: tuple[StrictInt, ...] | None = no_effect(None, "full attention over max_seq_len")
    host_cache_size: StrictInt | None = no_effect(None, "no host offload")
    event_buffer_max_size: StrictInt = no_effect(0, "no KV cache events")


_PER_ITER = "this runtime's step loop has no such option"


class RuntimeConfig(_Strict):
    """The whole runtime configuration."""

    model: ModelConfig = ModelConfig()
    speculative_config: SpeculativeConfig = SpeculativeConfig()
    cuda_graph_config: CudaGraphConfig | None = CudaGraphConfig()  # None (``null``): eager steps
    kv_cache_config: KvCacheConfig = KvCacheConfig()
    tensor_parallel_size: StrictInt = Field(1, ge=1)
    pipeline_parallel_size: Literal[1] = 1
    context_parallel_size: Literal[1] = 1
    max_beam_width: Literal[1] = 1
    enable_attention_dp: StrictBool = False
    max_batch_size: StrictInt = Field(8, ge=1, le=MAX_BATCH_SIZE)
    max_seq_len: StrictInt = Field(256, ge=8, le=MAX_TOKENS)  # prompt + generated tokens of one request
    # TensorRT-LLM's top-level dtype; moved into model.dtype (one place decides).
    dtype: Literal["auto", "float32", "bfloat16"] | None = None
    tokenizer: StrictStr | None = None  # a tokenizer directory for text prompts (default: the model directory)
    # What model.path's files say beyond the fields above, read once per configuration (see checkpoint_facts).
    _checkpoint_facts: Any = PrivateAttr(default=None)
    _target_family: Any = PrivateAttr(default=None)
    # trtllm-serve's --log_level spellings; None: TLLM_EXT_LOG_LEVEL (default info). Applied by the CLI at start.
    log_level: Literal["trace", "debug", "verbose", "info", "warning", "error", "internal_error"] | None = None
    # -- accepted, no effect here ----------------------------------------------------------------------
    backend: StrictStr | None = no_effect(None, "this runtime is its own PyTorch-style backend")
    # The padded tokens of one batched prefill (default 8192, TensorRT-LLM's); with enable_chunked_prefill, of all
    # the prefill one step carries (a long prompt runs as chunks between steps).
    max_num_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    max_input_len: StrictInt | None = no_effect(None, "prompt + max_tokens is bounded by max_seq_len")
    moe_expert_parallel_size: StrictInt | None = no_effect(None, "dense target, no experts")
    moe_tensor_parallel_size: StrictInt | None = no_effect(None, "dense target, no experts")
    moe_cluster_parallel_size: StrictInt | None = no_effect(None, "dense target, no experts")
    moe_config: dict[str, Any] | None = no_effect(None, "dense target, no experts")
    attn_backend: StrictStr | None = no_effect(None, "one attention implementation (the paged Triton kernel on CUDA, its eager twin on a CPU)")
    allreduce_strategy: StrictStr | None = no_effect(None, "AllReduce picks its own strategy")
    trust_remote_code: StrictBool = no_effect(False, "no remote code is ever run")
    # True: serve runs each step's host work between steps (the serial loop; --disable-overlap-scheduler too).
    disable_overlap_scheduler: StrictBool = False
    # A long prompt's prefill runs as chunks of at most max_num_tokens tokens interleaved with the decode steps of
    # the running requests (each chunk's K/V written before the next attends it).
    enable_chunked_prefill: StrictBool = False
    print_iter_log: StrictBool = no_effect(False, "per-step numbers are on /metrics")
    enable_iter_perf_stats: StrictBool = no_effect(False, "per-step numbers are on /metrics")
    return_perf_metrics: StrictBool = no_effect(False, "per-step numbers are on /metrics")
    # A stream's tokens go to its response once this many have gathered since its last chunk (its first token and
    # its end at once; runtime/engine_loop.py). None / 1: a chunk per engine step.
    stream_interval: StrictInt | None = Field(None, ge=1)
    enable_autotuner: StrictBool = no_effect(True, _PER_ITER)
    enable_min_latency: StrictBool = no_effect(False, _PER_ITER)
    scheduler_config: dict[str, Any] | None = no_effect(None, "first come, first served between steps")
    sampler_type: StrictStr | None = no_effect(None, "selection is the worker's (vocab-parallel or gathered)")
    torch_compile_config: dict[str, Any] | None = no_effect(None, "no torch.compile")
    checkpoint_format: StrictStr | None = no_effect(None, "checkpoints are Hugging Face safetensors")
    load_format: StrictStr | None = no_effect(None, "checkpoints are Hugging Face safetensors")
    gpus_per_node: StrictInt | None = no_effect(None, "one process per GPU of this node")
    kv_cache_dtype: StrictStr | None = no_effect(None, "caches are kept in the model dtype")
    guided_decoding_backend: StrictStr | None = no_effect(None, "no guided decoding")
    num_postprocess_workers: StrictInt = no_effect(0, "detokenization runs in the server process")

    @model_validator(mode="before")
    @classmethod
    def _top_level_dtype(cls, data):
        # TensorRT-LLM's `dtype` and this module's `model.dtype` are one decision: keep it in model.dtype.
        if isinstance(data, dict) and data.get("dtype") is not None:
            model = data.get("model") or {}
            model = {"path": model} if isinstance(model, str) else dict(model)
            inner = model.get("dtype")
            if inner not in (None, "auto", data["dtype"]):
                raise ValueError(f"dtype={data['dtype']!r} and model.dtype={inner!r} disagree; set one")
            data = {**data, "model": {**model, "dtype": data["dtype"]}}
        return data

    @model_validator(mode="after")
    def _check(self):
        tp = self.tensor_parallel_size
        t = self.model.target
        spec = self.speculative_config
        for name, size in (("model.target.num_heads", t.num_heads), ("model.target.num_kv_heads", t.num_kv_heads),
                           ("model.target.intermediate_size", t.intermediate_size),
                           ("model.drafter.num_heads", self.model.drafter.num_heads),
                           ("model.drafter.intermediate_size", self.model.drafter.intermediate_size)):
            if size % tp:
                raise ValueError(f"{name}={size} must be divisible by tensor_parallel_size={tp}")
        if (tp - 1) * -(-t.vocab_size // tp) >= t.vocab_size:
            raise ValueError(f"model.target.vocab_size={t.vocab_size} is too small for tensor_parallel_size={tp}")
        if spec.vocab_parallel_selection == "on" and t.vocab_size % tp:
            # Checked here so the run fails before any rank starts (the worker would refuse it after load).
            raise ValueError(f"speculative_config.vocab_parallel_selection='on' needs a vocabulary that shards "
                             f"evenly: vocab_size={t.vocab_size} is not divisible by tensor_parallel_size={tp} "
                             f"(use auto or off)")
        if spec.vocab_parallel_selection == "on" and self.enable_attention_dp:
            raise ValueError("speculative_config.vocab_parallel_selection='on' is not available with "
                             "enable_attention_dp (the head is replicated); use auto or off")
        if (self.model.drafter_init == "target_bigram" and self.model.drafter_weights is None
                and self.model.drafter_path is None and spec.markov_rank != t.hidden_size):
            raise ValueError(f"speculative_config.markov_rank={spec.markov_rank} must equal "
                             f"model.target.hidden_size={t.hidden_size} with model.drafter_init='target_bigram'")
        if spec.target_layer_ids is not None and tuple(spec.target_layer_ids) != tuple(t.capture_layers):
            raise ValueError(f"speculative_config.target_layer_ids={list(spec.target_layer_ids)} and "
                             f"model.target.capture_layers={list(t.capture_layers)} disagree")
        if spec.mask_token_id is not None and spec.mask_token_id >= t.vocab_size:
            raise ValueError(f"speculative_config.mask_token_id={spec.mask_token_id} is outside the vocabulary "
                             f"[0, {t.vocab_size})")
        cg = self.cuda_graph_config
        if cg is not None and cg.batch_sizes is not None and max(cg.batch_sizes) > self.max_batch_size:
            raise ValueError(f"cuda_graph_config.batch_sizes {list(cg.batch_sizes)} exceed "
                             f"max_batch_size={self.max_batch_size}")
        return self

    # -- derived -------------------------------------------------------------------------------
    @property
    def draft_len(self) -> int:
        return self.speculative_config.max_draft_len

    @property
    def mask_token_id(self) -> int:
        m = self.speculative_config.mask_token_id
        return self.model.target.vocab_size - 1 if m is None else m

    @property
    def checkpoint_facts(self):
        """The serving facts of ``model.path`` (:class:`~tensorrt_llm_ext.models.checkpoint.CheckpointFacts`:
        served name, EOS ids, maximum length ...), None for the embedded model; read once per configuration."""
        if not self.model.path:
            return None
        if self._checkpoint_facts is None:
            from tensorrt_llm_ext.models.checkpoint import read_checkpoint_facts

            self._checkpoint_facts = read_checkpoint_facts(self.model.path)
        return self._checkpoint_facts

    @property
    def target_family(self) -> dict:
        """The family switches of ``model.path``'s target (biases, q/k norms, RoPE scaling) as keyword arguments
        of ``LlamaTargetConfig``, ``{}`` for the embedded model; read once per configuration."""
        if not self.model.path:
            return {}
        if self._target_family is None:
            from tensorrt_llm_ext.models.checkpoint import read_target_family

            self._target_family = read_target_family(self.model.path)
        return dict(self._target_family)

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

    def no_effect_fields(self) -> list[tuple[str, Any, str]]:
        """``(path, value, reason)`` of every *no effect here* field the configuration sets to a non-default value."""
        return _no_effect_fields(self, "")

    def with_overrides(self, **overrides) -> "RuntimeConfig":
        """A copy with dotted-path overrides (``{"speculative_config.max_draft_len": 3}``), re-validated."""
        data = self.model_dump(exclude_unset=True)
        _apply_overrides(data, overrides)
        return parse_config(data)


def _no_effect_fields(model: BaseModel, prefix: str) -> list[tuple[str, Any, str]]:
    out = []
    for name in sorted(model.model_fields_set):
        info = type(model).model_fields[name]
        value = getattr(model, name)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if "no_effect" in extra:
            if value != info.default:  # a value equal to TensorRT-LLM's default changes nothing anywhere
                out.append((prefix + name, value, extra["no_effect"]))
        elif isinstance(value, BaseModel):
            out.extend(_no_effect_fields(value, f"{prefix}{name}."))
    return out


def _apply_overrides(data: dict, overrides: dict) -> None:
    for path, value in overrides.items():
        node = data
        keys = path.split(".")
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {"path": node[k]} if k == "model" and isinstance(node.get(k), str) else {}
            node = node[k]
        node[keys[-1]] = value


def _format_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        # pydantic reports a failed Literal member of a union as a location step; keep field names only.
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("literal[", "function-")))
        loc = loc or "<root>"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see tensorrt_llm_ext/configs/dspark_default.yaml)"
        elif err["type"] in ("int_type", "bool_type", "float_type", "string_type"):
            msg += f", got {err['input']!r}"
        parts.append(f"{loc}: {msg}")
    return "invalid runtime config: " + "; ".join(dict.fromkeys(parts))


def parse_config(data: dict | None) -> RuntimeConfig:
    """Validate a complete config dict (no layering, no checkpoint reading, no logging); raises
    :class:`ConfigError` naming the fields."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"invalid runtime config: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return RuntimeConfig.model_validate(dict(data or {}))
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


class _YamlError(ValueError):
    pass


# Nodes a config may hold once its aliases are expanded (the embedded default has about 60; a big serve recipe a
# few hundred). safe_load shares an aliased node instead of copying it, but validation, model_dump and logging walk
# the tree: ten nested aliases of ten items ("billion laughs") are 10^10 nodes, gigabytes before any error.
MAX_YAML_NODES = 100_000


def _check_yaml_size(data) -> None:
    """Refuse a tree whose aliases expand past :data:`MAX_YAML_NODES` nodes, or that holds itself (``&a [*a]``);
    counted with every shared node once (no expansion), iteratively (no recursion limit)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[object, bool]] = [(data, False)]
    open_nodes: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        if not isinstance(node, (dict, list)) or (not children_done and id(node) in sizes):
            continue
        children = [c for c in (node.values() if isinstance(node, dict) else node) if isinstance(c, (dict, list))]
        if children_done:
            open_nodes.discard(id(node))
            total = len(node) + 1 + sum(sizes[id(c)] - 1 for c in children)
            if total > MAX_YAML_NODES:
                raise _YamlError(f"its aliases expand to more than {MAX_YAML_NODES} nodes (a config is a few "
                                 "hundred; an alias bomb?)")
            sizes[id(node)] = total
            continue
        if id(node) in open_nodes:
            raise _YamlError("an alias refers to a node that contains it (a recursive structure)")
        open_nodes.add(id(node))
        stack.append((node, True))
        for c in children:
            if id(c) in open_nodes:
                raise _YamlError("an alias refers to a node that contains it (a recursive structure)")
            stack.append((c, False))


def _load_yaml(text: str):
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _YamlError(str(e)) from None
    except RecursionError:  # PyYAML's parser recurses per nesting level (a few hundred levels exhaust it)
        raise _YamlError("it is nested too deeply") from None
    _check_yaml_size(data)
    return data


def default_config_text() -> str:
    return resources.files("tensorrt_llm_ext.configs").joinpath(DEFAULT_CONFIG_NAME).read_text()


def merge_layers(base: dict, top: dict) -> dict:
    """``top`` over ``base``: mappings merge key by key; a scalar, a list or ``None`` replaces."""
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_layers(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _read_user_file(path: str | Path) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:  # YAML is text: a binary file or another encoding is the user's mistake
        raise ConfigError(f"invalid runtime config: {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                          f"offset {e.start})") from None
    try:
        data = _load_yaml(text)
    except _YamlError as e:
        raise ConfigError(f"invalid runtime config: {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid runtime config: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _resolve_checkpoints(data: dict, user: dict, user_len=None):
    """Fill model/drafter sizes from checkpoint directories (``model.path``, ``speculative_model``) and the
    maximum length from the checkpoint (``user_len``: the ``max_seq_len`` the user set, or None). Returns
    ``(data, the checkpoint's facts or None)``."""
    from tensorrt_llm_ext.models.checkpoint import (CheckpointError, read_checkpoint_facts, read_drafter_config,
                                                     read_llama_config)

    model = data.get("model")
    if isinstance(model, str):
        model = {"path": model}
    spec = data.get("speculative_config") or {}
    paths = (model.get("path"), spec.get("speculative_model"), spec.get("speculative_model_dir")) if (
        isinstance(model, dict) and isinstance(spec, dict)) else ()
    if not paths or any(p is not None and not isinstance(p, str) for p in paths):
        return data, None  # a section or a directory of the wrong type: parse_config names the field
    facts = None
    data = {**data, "model": dict(model)}
    model = data["model"]
    spec = dict(spec)
    user_model = user.get("model") if isinstance(user.get("model"), dict) else {}
    user_spec = user.get("speculative_config") if isinstance(user.get("speculative_config"), dict) else {}
    try:
        if model.get("path"):
            if "target" in user_model:
                raise ConfigError("invalid runtime config: model.target: the sizes come from the checkpoint's "
                                  "config.json when model is a directory; remove model.target")
            target = read_llama_config(model["path"])
            if spec.get("target_layer_ids") is not None:
                target["capture_layers"] = list(spec["target_layer_ids"])
            model["target"] = target
            if "drafter_init" not in user_model:
                model["drafter_init"] = "target_bigram"
        drafter_dir = spec.pop("speculative_model_dir", None) or spec.get("speculative_model")
        if drafter_dir is None and model.get("path") and (Path(model["path"]) / DRAFTER_SUBDIR).is_dir():
            drafter_dir = str(Path(model["path"]) / DRAFTER_SUBDIR)
        if drafter_dir is not None:
            d = read_drafter_config(drafter_dir)
            target = model.get("target") if isinstance(model.get("target"), dict) else {}
            for key in ("hidden_size", "vocab_size"):
                if key in target and target[key] != d[key]:
                    raise ConfigError(f"invalid runtime config: the drafter checkpoint {drafter_dir} has {key}="
                                      f"{d[key]} but the target has {target[key]} (a drafter drafts through the "
                                      f"target's LM head)")
            for key in ("markov_rank", "mask_token_id", "target_layer_ids"):
                if key in user_spec and user_spec[key] is not None and _as_list(user_spec[key]) != _as_list(d[key]):
                    raise ConfigError(f"invalid runtime config: speculative_config.{key}={user_spec[key]!r} but "
                                      f"the drafter checkpoint {drafter_dir} has {d[key]!r}")
            spec.update(speculative_model=drafter_dir, markov_rank=d["markov_rank"], mask_token_id=d["mask_token_id"],
                        target_layer_ids=d["target_layer_ids"])
            model["drafter"] = d["drafter"]
            model["drafter_path"] = drafter_dir
            if isinstance(model.get("target"), dict):
                model["target"] = {**model["target"], "capture_layers": list(d["target_layer_ids"])}
        elif model.get("path"):
            # No drafter checkpoint: the seeded drafter, its Markov head the target's bigram (r = hidden size).
            spec["markov_rank"] = model["target"]["hidden_size"]
            info_once(f"config: no drafter checkpoint (speculative_config.speculative_model unset and no "
                      f"{DRAFTER_SUBDIR}/ in {model['path']}): seeded drafter with the target's bigram Markov head")
        data["speculative_config"] = spec
        if model.get("path"):
            facts = read_checkpoint_facts(model["path"])
            data["max_seq_len"] = _max_model_len(data, facts.max_position_embeddings, user_len)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    return data, facts


def _max_model_len(data: dict, mpe: int | None, user_len) -> int:
    """``max_seq_len`` with a checkpoint: the user's value, else the checkpoint's ``max_position_embeddings``
    (``mpe``); either capped by ``mpe`` and by the KV configuration (``kv_cache_config.max_tokens`` over
    ``max_batch_size`` slots, else :data:`DEFAULT_MAX_MODEL_LEN`); every cap is logged once."""
    kv = data.get("kv_cache_config") if isinstance(data.get("kv_cache_config"), dict) else {}
    batch = data.get("max_batch_size")
    if isinstance(kv.get("max_tokens"), int) and isinstance(batch, int) and batch > 0:
        kv_cap, kv_why = kv["max_tokens"] // batch, f"kv_cache_config.max_tokens={kv['max_tokens']} over {batch} slots"
    else:
        kv_cap, kv_why = DEFAULT_MAX_MODEL_LEN, f"the default KV bound {DEFAULT_MAX_MODEL_LEN} per slot"
    if user_len is not None:
        if not isinstance(user_len, int) or isinstance(user_len, bool) or mpe is None or user_len <= mpe:
            return user_len  # a bad type is reported by the field's own check
        info_once(f"config: max_seq_len={user_len} capped to the checkpoint's max_position_embeddings={mpe}")
        return mpe
    if mpe is None:
        return data.get("max_seq_len")
    if mpe > kv_cap:
        info_once(f"config: max_model_len {kv_cap} (the checkpoint's max_position_embeddings={mpe} capped by "
                  f"{kv_why}; set max_seq_len or kv_cache_config.max_tokens to change it)")
        return kv_cap
    info_once(f"config: max_model_len {mpe} (the checkpoint's max_position_embeddings)")
    return mpe


def describe_drafter(cfg: "RuntimeConfig") -> str:
    """One line naming the drafter a config loads: where from, trained or seeded, ``K`` and the Markov rank."""
    spec, m = cfg.speculative_config, cfg.model
    sizes = (f"K={spec.max_draft_len}, Markov rank r={spec.markov_rank}, {m.drafter.num_layers} layer(s), "
             f"latent {m.drafter.latent_dim}")
    if m.drafter_path is not None:
        return f"drafter: {m.drafter_path} (a trained DSpark checkpoint; {sizes})"
    if m.drafter_weights is not None:
        return f"drafter: {m.drafter_weights} (a torch.save state dict; {sizes})"
    init = ("its Markov head the target's embedding->head bigram" if m.drafter_init == "target_bigram" else
            "random weights: expect no acceptance")
    return f"drafter: seeded, not trained (seed {m.seed}; {init}; {sizes})"


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else v


# trtllm-serve's log levels -> the logging module's.
LOG_LEVELS = {"trace": "DEBUG", "debug": "DEBUG", "verbose": "DEBUG", "info": "INFO", "warning": "WARNING",
              "error": "ERROR", "internal_error": "CRITICAL"}


def no_effect_reason(field_path: str) -> str | None:
    """Why the field at dotted ``field_path`` (``kv_cache_config.enable_block_reuse``) has no effect here, or
    None for a field this runtime uses (a command-line flag that sets such a field says so even when its value
    is the default, which the config's own lines leave out)."""
    model: type[BaseModel] = RuntimeConfig
    *parents, name = field_path.split(".")
    for key in parents:
        model = model.model_fields[key].annotation
        model = next((a for a in getattr(model, "__args__", (model,)) if isinstance(a, type)
                      and issubclass(a, BaseModel)), model)
    extra = model.model_fields[name].json_schema_extra
    return extra.get("no_effect") if isinstance(extra, dict) else None


def log_no_effect_fields(cfg: RuntimeConfig) -> None:
    """One INFO line per *no effect here* field the configuration sets (once per process)."""
    for field_path, value, reason in cfg.no_effect_fields():
        info_once(f"config: {field_path}={value!r} accepted, no effect here ({reason})")


def load_config(path: str | Path | None = None, model_dir: str | None = None, *, log_no_effect: bool = True,
                **overrides) -> RuntimeConfig:
    """The embedded default, the YAML at ``path`` layered over it, ``model_dir`` (a checkpoint directory,
    e.g. ``serve DIR``), then dotted-path ``overrides``; logs each *no effect here* field once
    (``log_no_effect=False``: the caller logs them where it decides, e.g. once per job on rank 0)."""
    data = _load_yaml(default_config_text())
    user = _read_user_file(path) if path is not None else {}
    if isinstance(user.get("model"), str):
        # A checkpoint directory replaces the embedded target; the embedded drafter sizes stay the default.
        user = {**user, "model": {"path": user["model"]}}
    if model_dir is not None:
        user = merge_layers(user, {"model": {"path": str(model_dir)}})
    if isinstance(user.get("model"), dict) and user["model"].get("path"):
        data["model"] = {k: v for k, v in data["model"].items() if k not in ("target",)}
    data = merge_layers(data, user)
    _apply_overrides(data, overrides)
    user_len = overrides.get("max_seq_len", user.get("max_seq_len"))
    data, facts = _resolve_checkpoints(data, user, user_len)
    cfg = parse_config(data)
    cfg._checkpoint_facts = facts  # read while resolving the checkpoint: not again for this configuration
    if log_no_effect:
        log_no_effect_fields(cfg)
    return cfg
