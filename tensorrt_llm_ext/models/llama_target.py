"""A tiny TensorRT-LLM-style Llama-like target model for one-model DSpark decoding.

Decoder layers (pre-norm): ``h += o_proj(attn(norm(h)))``; ``h += down(silu(gate(x)) * up(x))`` with
``x = norm(h)``; final norm; column-parallel :class:`LMHead` (``gather_output=True``) applied through the
plain :class:`LogitsProcessor`. Attention is GQA (``num_kv_heads`` divides ``num_heads``) with NeoX RoPE
over a per-slot KV cache sized at start.

The Hugging Face families this covers (see ``docs/checkpoints.md``) differ only in switches of
:class:`LlamaTargetConfig`: q/k/v biases (Qwen2), an ``o_proj`` bias and MLP biases (Llama's
``attention_bias`` / ``mlp_bias``), per-head RMSNorm of q and k before RoPE (Qwen3's ``q_norm`` /
``k_norm``) and scaled RoPE (:class:`~tensorrt_llm_ext.modules.rope.RopeScaling`: Llama 3.x ``llama3``,
``linear``, ``yarn``).

TP layout: q/k/v and gate/up column-parallel (heads and the MLP split over ranks), o_proj and down_proj
row-parallel with a reduced output, norms and the embedding replicated. Every TP size holds the same
FULL weights (deterministic seeded init, or :meth:`LlamaTarget.load_full_state_dict`), sliced per rank.

The step forward (:meth:`LlamaTarget.forward`) takes a fixed ``[B, T]`` block of tokens with their
absolute positions and cache slots, writes their K/V at ``cache[slot, position]`` first and then attends
causally by absolute position over the WHOLE fixed-size cache row (keys at positions ``<= `` the query's).
Entries beyond a request's length are stale (rejected drafts, padding) but always sit at positions
larger than every query that could see them, until the step that owns that position rewrites them.
Hence no length tensor, no host sync, no data-dependent branch: CUDA-graph capturable per ``[B, T]``.

Per token the computation only depends on that token's row (and the cache), so the same token computed
at a different row of a same-shaped step gives the same bits -- the property that makes speculative
verification lossless against the target's own decode at the same step shape.

The hidden states after the layers listed in ``capture_layers`` are concatenated per token
(``[N, n_cap * H]``): the drafter's context features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm_ext.contract import TargetOutput
from tensorrt_llm_ext.logger import info_once
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.modules.attention import apply_rope
from tensorrt_llm_ext.modules.embedding import Embedding
from tensorrt_llm_ext.modules.linear import Linear, TensorParallelMode
from tensorrt_llm_ext.modules.lm_head import LMHead
from tensorrt_llm_ext.modules.logits_processor import LogitsProcessor
from tensorrt_llm_ext.kernels.rms_norm import rms_norm_reference
from tensorrt_llm_ext.modules.rms_norm import RMSNorm
from tensorrt_llm_ext.modules.rope import RopeScaling, RotaryEmbedding
from tensorrt_llm_ext.models.weights import check_full_state_dict, load_sharded_modules


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The fused RMSNorm kernel on CUDA; its eager twin on the CPU, where the Triton interpreter would run
    one program per token row (seconds per step). Both paths of a comparison use the same function."""
    if x.is_cuda:
        return norm(x)
    shape = x.shape
    out, _ = rms_norm_reference(x.reshape(-1, shape[-1]), norm.weight, norm.eps)
    return out.reshape(shape)


@dataclass(frozen=True)
class LlamaTargetConfig:
    """Sizes of the target. ``capture_layers`` are layer indices whose outputs feed the drafter."""

    vocab_size: int = 1031
    hidden_size: int = 40
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 10
    intermediate_size: int = 96
    capture_layers: tuple[int, ...] = (0, 1, 2)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2, Llama attention_bias)
    o_proj_bias: bool = False  # o_proj carries a bias (Llama attention_bias)
    mlp_bias: bool = False  # gate/up/down carry a bias (Llama mlp_bias)
    qk_norm: bool = False  # RMSNorm over head_dim of q and k before RoPE (Qwen3), weights [head_dim]
    rope_scaling: RopeScaling | None = None  # None: plain RoPE

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaTargetConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaTargetConfig.head_dim must be even (RoPE), got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaTargetConfig: num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if not self.capture_layers or any(not 0 <= i < self.num_layers for i in self.capture_layers):
            raise ValueError(f"LlamaTargetConfig.capture_layers must be non-empty indices in "
                             f"[0, {self.num_layers}), got {self.capture_layers}")

    @property
    def capture_width(self) -> int:
        """``F``: width of the concatenated captured features."""
        return len(self.capture_layers) * self.hidden_size


def full_weight_shapes(cfg: LlamaTargetConfig) -> dict[str, tuple[int, ...]]:
    """Names and FULL (unsharded) shapes of the target's state dict, in init order."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.num_heads * d, h),
            p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_heads * d),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        })
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (cfg.num_heads * d,),
                           p + "self_attn.k_proj.bias": (cfg.num_kv_heads * d,),
                           p + "self_attn.v_proj.bias": (cfg.num_kv_heads * d,)})
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (cfg.intermediate_size,),
                           p + "mlp.up_proj.bias": (cfg.intermediate_size,), p + "mlp.down_proj.bias": (h,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    shapes.update({"norm.weight": (h,), "lm_head.weight": (cfg.vocab_size, h)})
    return shapes


def generate_full_state_dict(cfg: LlamaTargetConfig, seed: int, dtype: torch.dtype = torch.float32,
                             residual_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Deterministic FULL weights from one CPU fp32 generator, independent of rank and TP size.

    Norms ``1 + 0.1 N(0,1)``, biases ``0.1 N(0,1)``, linears and the head ``N(0,1)/sqrt(fan_in)``, embedding
    ``N(0,1)``. The head is scaled up (x4) so greedy decoding is not a single repeated token on random weights.
    ``residual_scale`` scales ``o_proj``/``down_proj`` (what each layer adds to the residual stream): a
    small value makes the model close to a bigram model of its embedding and head, which a drafter's
    Markov head can learn exactly (the embedded default uses that to get real acceptance).
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in full_weight_shapes(cfg).items():
        w = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith(".bias"):
            w = 0.1 * w
        elif len(shape) == 1:
            w = 1.0 + 0.1 * w
        elif name != "embed_tokens.weight":
            w = w / math.sqrt(shape[1])
            if name == "lm_head.weight":
                w = 4.0 * w
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                w = residual_scale * w
        out[name] = w.to(dtype)
    return out


class KVCache:
    """Per-slot target KV cache: ``k, v [L, num_slots, max_positions, kv_heads_local, D]`` (zeros at start).

    Sized once at start; ``max_positions`` must leave room for a whole step past the longest request
    (the verification block and padding columns are written before being attended).
    """

    def __init__(self, num_layers: int, num_slots: int, max_positions: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (num_layers, num_slots, max_positions, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_positions(self) -> int:
        return self.k.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaTargetConfig, mapping: Mapping, dtype, device):
        super().__init__()
        tp = mapping.tp_size
        if cfg.num_heads % tp or cfg.num_kv_heads % tp:
            raise ValueError(f"LlamaTarget: num_heads={cfg.num_heads} and num_kv_heads={cfg.num_kv_heads} must be "
                             f"divisible by tp_size={tp}")
        col, row = TensorParallelMode.COLUMN, TensorParallelMode.ROW
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias, dtype=dtype, device=device, mapping=mapping,
                             tensor_parallel_mode=col)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, device=device,
                             mapping=mapping, tensor_parallel_mode=col)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, device=device,
                             mapping=mapping, tensor_parallel_mode=col)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=cfg.o_proj_bias, dtype=dtype, device=device,
                             mapping=mapping, tensor_parallel_mode=row)
        # Qwen3: one [head_dim] weight shared by every head, so it is replicated, not split, under TP.
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.num_heads = cfg.num_heads // tp
        self.num_kv_heads = cfg.num_kv_heads // tp
        self.head_dim = d
        self.scale = 1.0 / math.sqrt(d)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [B, T, H]``; writes K/V at ``cache[slot, position]`` then attends causally over the cache row."""
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, t, self.num_heads, d)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, d)
        if self.q_norm is not None:
            q, k = _norm(self.q_norm, q), _norm(self.k_norm, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, d)
        slots = slot_ids.long()[:, None].expand(b, t)
        pos = positions.long()
        k_cache[slots, pos] = k.to(k_cache.dtype)
        v_cache[slots, pos] = v.to(v_cache.dtype)
        keys = k_cache[slot_ids.long()].float()  # [B, S, kvh, D]
        vals = v_cache[slot_ids.long()].float()
        group = self.num_heads // self.num_kv_heads
        qg = q.view(b, t, self.num_kv_heads, group, d)
        scores = torch.einsum("btngd,bsnd->bngts", qg, keys) * self.scale  # [B, kvh, g, T, S]
        key_pos = torch.arange(k_cache.shape[1], device=x.device)
        causal = key_pos[None, None, :] <= pos[:, :, None]  # [B, T, S]
        scores = scores.masked_fill(~causal[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("bngts,bsnd->btngd", probs, vals).reshape(b, t, self.num_heads * d)
        return self.o_proj(o.to(x.dtype))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaTargetConfig, mapping: Mapping, dtype, device):
        super().__init__()
        if cfg.intermediate_size % mapping.tp_size:
            raise ValueError(f"LlamaTarget: intermediate_size={cfg.intermediate_size} must be divisible by "
                             f"tp_size={mapping.tp_size}")
        col, row = TensorParallelMode.COLUMN, TensorParallelMode.ROW
        h, i = cfg.hidden_size, cfg.intermediate_size
        b = cfg.mlp_bias
        self.gate_proj = Linear(h, i, bias=b, dtype=dtype, device=device, mapping=mapping, tensor_parallel_mode=col)
        self.up_proj = Linear(h, i, bias=b, dtype=dtype, device=device, mapping=mapping, tensor_parallel_mode=col)
        self.down_proj = Linear(i, h, bias=b, dtype=dtype, device=device, mapping=mapping, tensor_parallel_mode=row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaTargetConfig, mapping: Mapping, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, mapping, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg, mapping, dtype, device)


class LlamaTarget(nn.Module):
    """The target model. ``forward`` runs one fixed-shape step; ``logits`` applies the head.

    Attributes: ``lm_head`` (:class:`LMHead`, COLUMN with ``gather_output`` -- a replicated head at tp 1),
    ``logits_processor`` (the plain :class:`LogitsProcessor`), ``config``, ``mapping``.
    """

    def __init__(self, config: LlamaTargetConfig, mapping: Mapping | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        mapping = mapping or Mapping()
        cfg = config
        self.config = cfg
        self.mapping = mapping
        self.dtype = dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device, mapping)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, mapping, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device, mapping=mapping,
                              tensor_parallel_mode=TensorParallelMode.COLUMN, gather_output=True)
        self.logits_processor = LogitsProcessor()
        self._capture_index = {layer: i for i, layer in enumerate(cfg.capture_layers)}

    # -- weights -------------------------------------------------------------------------------
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load FULL weights named as in :func:`full_weight_shapes`; each module slices its rank's part.

        Raises ValueError naming a missing, unexpected or mis-shaped entry. Weights stored in another dtype
        (a checkpoint's ``torch_dtype``) are cast to the model's, logged once.
        """
        check_full_state_dict("LlamaTarget", full_weight_shapes(self.config), state_dict)
        stored = sorted({str(t.dtype).removeprefix("torch.") for t in state_dict.values()})
        model = str(self.dtype).removeprefix("torch.")
        if stored != [model]:
            info_once(f"LlamaTarget: weights stored as {', '.join(stored)} are cast to {model} (the model dtype)")
        load_sharded_modules(self, state_dict, (Linear, RMSNorm, Embedding, LMHead), self.dtype)

    def init_weights(self, seed: int, residual_scale: float = 1.0) -> None:
        self.load_full_state_dict(generate_full_state_dict(self.config, seed, torch.float32, residual_scale))

    def make_kv_cache(self, num_slots: int, max_positions: int, device=None) -> KVCache:
        """A zeroed cache for ``num_slots`` slots (include any dummy slot) of ``max_positions`` positions."""
        cfg = self.config
        device = device if device is not None else self.norm.weight.device
        return KVCache(cfg.num_layers, num_slots, max_positions, cfg.num_kv_heads // self.mapping.tp_size,
                       cfg.head_dim, self.dtype, device)

    # -- forward -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                kv_cache: KVCache) -> TargetOutput:
        """One step over a fixed ``[B, T]`` block.

        Args:
            input_ids: ``[B, T]`` int64 token ids (valid ids; padding uses any valid id).
            positions: ``[B, T]`` int absolute positions, ``< kv_cache.max_positions``.
            slot_ids: ``[B]`` int cache slots (a dummy slot for padding rows).
            kv_cache: written at ``[slot, position]`` for every token of the block.

        Returns :class:`TargetOutput` (rows flattened ``b * T + t``). CUDA-graph safe.
        """
        if input_ids.dim() != 2 or positions.shape != input_ids.shape or slot_ids.shape != input_ids.shape[:1]:
            raise ValueError(f"LlamaTarget.forward: expected input_ids/positions [B, T] and slot_ids [B], got "
                             f"{tuple(input_ids.shape)}, {tuple(positions.shape)}, {tuple(slot_ids.shape)}")
        b, t = input_ids.shape
        cfg = self.config
        cos, sin = self.rotary_emb.cos_sin(positions)
        hidden = self.embed_tokens(input_ids)
        captured: list[torch.Tensor | None] = [None] * len(cfg.capture_layers)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn(_norm(layer.input_layernorm, hidden), positions, slot_ids, kv_cache.k[i],
                                   kv_cache.v[i], cos, sin)
            hidden = hidden + attn
            hidden = hidden + layer.mlp(_norm(layer.post_attention_layernorm, hidden))
            if i in self._capture_index:
                captured[self._capture_index[i]] = hidden
        final = _norm(self.norm, hidden)
        return TargetOutput(hidden_states=final.reshape(b * t, cfg.hidden_size),
                            captured=torch.cat(captured, dim=-1).reshape(b * t, cfg.capture_width))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def logits(self, hidden_states: torch.Tensor, row_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Full-vocabulary logits ``[R, V]`` through the plain processor (gathered at tp > 1)."""
        return self.logits_processor(hidden_states, self.lm_head, row_indices)
