"""A tiny TensorRT-LLM-style Llama-like target model for one-model DSpark decoding.

Decoder layers (pre-norm): ``h += o_proj(attn(norm(h)))``; ``h += down(silu(gate(x)) * up(x))`` with
``x = norm(h)``; final norm; column-parallel :class:`LMHead` (``gather_output=True``) applied through the
plain :class:`LogitsProcessor`. Attention is GQA (``num_kv_heads`` divides ``num_heads``) with NeoX RoPE
over a PAGED KV cache (:class:`PagedKVCache`: one pool of fixed-size pages, a page table per slot).

The Hugging Face families this covers (see ``docs/checkpoints.md``) differ only in switches of
:class:`LlamaTargetConfig`: q/k/v biases (Qwen2), an ``o_proj`` bias and MLP biases (Llama's
``attention_bias`` / ``mlp_bias``), per-head RMSNorm of q and k before RoPE (Qwen3's ``q_norm`` /
``k_norm``) and scaled RoPE (:class:`~tensorrt_llm_ext.modules.rope.RopeScaling`: Llama 3.x ``llama3``,
``linear``, ``yarn``).

TP layout: q/k/v and gate/up column-parallel (heads and the MLP split over ranks), o_proj and down_proj
row-parallel with a reduced output, norms and the embedding replicated. Every TP size holds the same
FULL weights (deterministic seeded init, or :meth:`LlamaTarget.load_full_state_dict`), sliced per rank.

The step forward (:meth:`LlamaTarget.forward`) takes a fixed ``[B, T]`` block of tokens with their
absolute positions and cache slots, writes their K/V at their page slots (``page_table[slot, pos //
page_size]``, offset ``pos % page_size``) first and then attends causally by absolute position over the slot's
pages (keys at positions ``<=`` the query's; the kernel reads only the pages below the block's last position).
Entries beyond a request's length are stale (rejected drafts, padding) but always sit at positions larger
than every query that could see them, until the step that owns that position rewrites them; writes past a
slot's pages go to the scratch page. Hence no length tensor, no host sync, no data-dependent branch:
CUDA-graph capturable per ``[B, T]``. On CUDA the layer runs the fused kernels
(:mod:`~tensorrt_llm_ext.kernels.paged_kv_write`, :mod:`~tensorrt_llm_ext.kernels.paged_attention`,
:mod:`~tensorrt_llm_ext.kernels.rms_norm` with the residual add) and one QKV / one gate-up GEMM (the
checkpoint's separate q / k / v and gate / up weights are views into the fused ones, so loading is
unchanged); on a CPU their eager twins. Steps of at most ``FUSED_MAX_ROWS`` rows (decode, verify) at TP 1 run
each layer in five launches instead (:meth:`LlamaDecoderLayer.forward_fused`: the norms folded into the GEMM
prologues, RoPE + K/V store, SiLU-mul and the residual adds into their epilogues;
:mod:`~tensorrt_llm_ext.kernels.fused_qkv`, :mod:`~tensorrt_llm_ext.kernels.fused_linear`).

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
from tensorrt_llm_ext.modules.embedding import Embedding
from tensorrt_llm_ext.modules.linear import Linear, TensorParallelMode
from tensorrt_llm_ext.modules.lm_head import LMHead
from tensorrt_llm_ext.modules.logits_processor import LogitsProcessor
from tensorrt_llm_ext.kernels.common import triton_runs_on
from tensorrt_llm_ext.kernels.fused_linear import EPI_RESIDUAL, EPI_SILU_MUL, fused_linear
from tensorrt_llm_ext.kernels.fused_qkv import fused_qkv_rope
from tensorrt_llm_ext.kernels.paged_attention import paged_attention, paged_attention_reference
from tensorrt_llm_ext.kernels.paged_kv_write import paged_kv_write, paged_kv_write_reference
from tensorrt_llm_ext.kernels.rms_norm import rms_norm, rms_norm_reference
from tensorrt_llm_ext.kernels.silu_mul import silu_mul, silu_mul_reference
from tensorrt_llm_ext.modules.rms_norm import RMSNorm
from tensorrt_llm_ext.modules.rope import RopeScaling, RotaryEmbedding
from tensorrt_llm_ext.models.weights import check_full_state_dict, load_sharded_modules


# Steps of at most this many rows (B * T) run the fused five-launch layer (LlamaDecoderLayer.forward_fused): a
# decode / verify step at B <= 8 with K = 7. Larger steps are GEMM-shaped and go to cuBLAS. `bench target`'s
# "verify fwd, unfused" column is the comparison that sets it.
# The fused layer wins up to 32 rows on the H200 (SmolLM2 shape, 2026-12-04: 686 vs 996 us at 1 row, 930 vs 990 at
# 8, 1107 vs 1141 at 32) and loses at 64 (1319 vs 1155): cuBLAS takes the larger steps.
FUSED_MAX_ROWS = 32
# ... and only for layers whose weights stream in a few microseconds, where the five launches' saved latency is
# the step's cost. A large layer is bandwidth bound and cuBLAS streams it faster at every row count: the 8B
# Llama shape (436 MB a layer, H200, 2026-12-04) took 5449 vs 4605 us unfused at 1 row, 7706 vs 4864 at 8 and
# 11689 vs 7473 at 32, while SmolLM2's layers (7 MB) win fused up to 32 rows. Between the two nothing is
# measured; the bound sits at 32 MiB (~8 us of reading at 4.2 TB/s).
FUSED_MAX_LAYER_BYTES = 32 << 20


def layer_weight_bytes(cfg: "LlamaTargetConfig", dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one decoder layer's weights on one rank (from :func:`full_weight_shapes`, split over ``tp_size``)."""
    prefix = "layers.0."
    numel = sum(math.prod(shape) for name, shape in full_weight_shapes(cfg).items() if name.startswith(prefix))
    return numel * torch.empty((), dtype=dtype).element_size() // tp_size


def picks_fused_layer(rows: int, layer_bytes: int, tp_size: int) -> bool:
    """The ``layer_kernels = "auto"`` rule on CUDA: the fused five-launch layer for a step of ``rows`` rows."""
    return tp_size == 1 and rows <= FUSED_MAX_ROWS and layer_bytes <= FUSED_MAX_LAYER_BYTES


def _add_norm(norm: RMSNorm, x: torch.Tensor | None, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + x), residual + x)`` in one launch (``x`` None: the norm of ``residual`` alone).

    The sum is formed in fp32 and rounded once to the model dtype (the bits of ``residual + x`` in that
    dtype); the norm reads the fp32 sum. CUDA: the fused kernel; CPU: its eager twin (see :func:`_norm`)."""
    if x is None:
        return _norm(norm, residual), residual
    shape = residual.shape
    x2, r2 = x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1])
    if x.is_cuda:
        out, res = rms_norm(x2.contiguous(), norm.weight, norm.eps, residual=r2.contiguous())
    else:
        out, res = rms_norm_reference(x2, norm.weight, norm.eps, residual=r2)
    return out.reshape(shape), res.reshape(shape)


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


class PagedKVCache:
    """The target's paged KV cache: ``k, v [L, num_pages + 1, page_size, kv_heads_local, D]`` (zeros at start)
    and the ``page_table [num_slots, max_pages]`` int32 of each slot's pages.

    Page ``num_pages`` (the last) is the SCRATCH page, never handed out: unallocated table entries hold its
    id, so padding rows, the dummy slot and positions past a request's pages write there and never touch a
    request's page. The table is owned by whoever hands pages out (the runtime's page allocator writes it in
    place between steps); the model only reads it.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, page_table: torch.Tensor):
        if page_table.dtype != torch.int32 or page_table.dim() != 2:
            raise ValueError(f"PagedKVCache: page_table must be int32 [num_slots, max_pages], got "
                             f"{page_table.dtype} {list(page_table.shape)}")
        shape = (num_layers, num_pages + 1, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_table = page_table

    @property
    def num_pages(self) -> int:
        """Pages that can be handed out (the scratch page excluded)."""
        return self.k.shape[1] - 1

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def scratch_page(self) -> int:
        """The last page's id: one past the pages that can be handed out."""
        return self.num_pages

    @property
    def num_slots(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_positions(self) -> int:
        """Positions one slot's table can address."""
        return self.page_table.shape[1] * self.page_size

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


def kv_bytes_per_token(cfg: "LlamaTargetConfig", tp_size: int, dtype: torch.dtype) -> int:
    """Bytes one token's K and V take on one rank, over every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * (cfg.num_kv_heads // tp_size) * cfg.head_dim * elem


def _fuse_linears(*mods: Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One ``[sum of out_local, in_local]`` weight (and bias) whose row blocks ARE the modules' weights (views):
    the modules keep their names and loaders (a checkpoint's separate q / k / v write into the fused tensor)
    while the step runs one GEMM."""
    w = torch.cat([m.weight.data for m in mods], 0)
    has_bias = [m.bias is not None for m in mods]
    if any(has_bias) and not all(has_bias):
        raise ValueError("_fuse_linears: either every fused Linear has a bias or none")
    bias = torch.cat([m.bias.data for m in mods], 0) if all(has_bias) else None
    off = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(w[off:off + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[off:off + n], requires_grad=False)
        off += n
    return w, bias


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
        # q / k / v of this rank's heads as one GEMM (the three Linears are views into it).
        self.qkv_weight, self.qkv_bias = _fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        # Qwen3: one [head_dim] weight shared by every head, so it is replicated, not split, under TP.
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.num_heads = cfg.num_heads // tp
        self.num_kv_heads = cfg.num_kv_heads // tp
        self.head_dim = d
        self.scale = 1.0 / math.sqrt(d)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor, page_table: torch.Tensor,
                k_pool: torch.Tensor, v_pool: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [B, T, H]``; writes K/V at each token's page slot, then attends causally over the slot's pages.

        CUDA: the fused RoPE + KV write and the paged attention kernel; CPU: their eager twins (the Triton
        interpreter would run one program at a time)."""
        b, t, _ = x.shape
        d, nq, nk = self.head_dim, self.num_heads, self.num_kv_heads
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # [B, T, (nq + 2 nk) * D]
        q = qkv[..., :nq * d].view(b, t, nq, d)
        k = qkv[..., nq * d:(nq + nk) * d].view(b, t, nk, d)
        v = qkv[..., (nq + nk) * d:].view(b, t, nk, d)
        if self.q_norm is not None:
            q, k = _norm(self.q_norm, q), _norm(self.k_norm, k)
        if x.is_cuda:
            q = paged_kv_write(q, k, v, cos, sin, positions, slot_ids, page_table, k_pool, v_pool)
            # no programmatic launch between the unfused layer's cuBLAS / norm launches (measured slower there)
            o = paged_attention(q, k_pool, v_pool, page_table, slot_ids, positions, self.scale, programmatic=False)
        else:
            q = paged_kv_write_reference(q, k, v, cos, sin, positions, slot_ids, page_table, k_pool, v_pool)
            o = paged_attention_reference(q, k_pool, v_pool, page_table, slot_ids, positions, self.scale)
        return self.o_proj(o.reshape(b, t, nq * d).to(x.dtype))


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
        self.gate_up_weight, self.gate_up_bias = _fuse_linears(self.gate_proj, self.up_proj)
        self.local_intermediate = i // mapping.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One gate-up GEMM, SiLU-mul (one kernel on CUDA, its eager twin on a CPU), down_proj."""
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        shape = gate_up.shape
        flat = gate_up.reshape(-1, shape[-1])
        act = silu_mul(flat) if x.is_cuda else silu_mul_reference(flat)
        return self.down_proj(act.view(*shape[:-1], self.local_intermediate))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaTargetConfig, mapping: Mapping, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, mapping, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg, mapping, dtype, device)

    def forward_fused(self, hidden: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                      page_table: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
        """The whole layer in five launches for the few rows of a decode / verify step (TP 1): ``hidden [B, T,
        H]`` (the residual stream, every earlier add done) -> the next residual stream ``[B, T, H]``.

        input norm + QKV + (q / k norms) + RoPE + K/V store; paged attention; o_proj + residual add;
        post-attention norm + gate-up + SiLU-mul; down_proj + residual add. The roundings of the unfused path
        (another summation order in the products), except that a norm reads the residual stream as stored (the
        sum rounded to the model dtype, as Hugging Face's layer does), not the fp32 sum the fused add + norm
        kernel keeps: equal in fp32, within a rounding of the sum in 16 bits."""
        b, t, width = hidden.shape
        attn, mlp = self.self_attn, self.mlp
        qn = attn.q_norm.weight if attn.q_norm is not None else None
        kn = attn.k_norm.weight if attn.k_norm is not None else None
        qk_eps = attn.q_norm.eps if attn.q_norm is not None else 1e-6
        q = fused_qkv_rope(hidden, attn.qkv_weight, attn.qkv_bias, self.input_layernorm.weight,
                           self.input_layernorm.eps, cos, sin, positions, slot_ids, page_table, k_pool, v_pool,
                           attn.num_heads, qn, kn, qk_eps)
        o = paged_attention(q, k_pool, v_pool, page_table, slot_ids, positions, attn.scale)
        # Both residuals were written two or more launches back (hidden before the QKV launch, h before gate-up):
        # read before each product's programmatic wait (early_residual).
        h = fused_linear(o.view(b * t, -1), attn.o_proj.weight, attn.o_proj.bias, epilogue=EPI_RESIDUAL,
                         residual=hidden.view(b * t, width), early_residual=True)
        act = fused_linear(h, mlp.gate_up_weight, mlp.gate_up_bias, norm_weight=self.post_attention_layernorm.weight,
                           eps=self.post_attention_layernorm.eps, epilogue=EPI_SILU_MUL)
        h = fused_linear(act, mlp.down_proj.weight, mlp.down_proj.bias, epilogue=EPI_RESIDUAL, residual=h, out=h,
                         early_residual=True)
        return h.view(b, t, width)


class LlamaTarget(nn.Module):
    """The target model. ``forward`` runs one fixed-shape step; ``logits`` applies the head.

    Attributes: ``lm_head`` (:class:`LMHead`, COLUMN with ``gather_output`` -- a replicated head at tp 1),
    ``logits_processor`` (the plain :class:`LogitsProcessor`), ``config``, ``mapping``, ``layer_kernels``
    (``"auto"`` / ``"fused"`` / ``"unfused"``: which layer a step runs, see :meth:`_fused_layers`).
    """

    def __init__(self, config: LlamaTargetConfig, mapping: Mapping | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        self.config = cfg = config
        self.mapping = mapping = mapping or Mapping()
        self.dtype = dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device, mapping)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, mapping, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device, mapping=mapping,
                              tensor_parallel_mode=TensorParallelMode.COLUMN, gather_output=True)
        self.logits_processor = LogitsProcessor()
        self._capture_index = {layer: i for i, layer in enumerate(cfg.capture_layers)}
        # "auto": the fused five-launch layer on CUDA at TP 1 for steps of at most FUSED_MAX_ROWS rows of layers
        # of at most FUSED_MAX_LAYER_BYTES (picks_fused_layer), the unfused layer (cuBLAS GEMMs) otherwise;
        # "fused": wherever Triton runs (the CPU interpreter too: tests); "unfused": never (the benchmark's
        # comparison). Set before any capture: it picks the captured kernels.
        self.layer_kernels = "auto"
        self._layer_bytes = layer_weight_bytes(cfg, dtype, mapping.tp_size)

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

    def make_kv_cache(self, num_slots: int, max_positions: int, device=None, page_size: int = 16) -> PagedKVCache:
        """A zeroed cache giving each of ``num_slots`` slots its own pages for ``max_positions`` positions
        (slot ``s`` holds pages ``s * n .. s * n + n - 1``): for callers that own every slot (training data,
        checks). The runtime builds its pool with :meth:`make_paged_kv_cache` and hands pages out itself."""
        device = device if device is not None else self.norm.weight.device
        per_slot = -(-max_positions // page_size)
        table = torch.arange(num_slots * per_slot, dtype=torch.int32, device=device).view(num_slots, per_slot)
        return self.make_paged_kv_cache(num_slots * per_slot, page_size, table, device=device)

    def make_paged_kv_cache(self, num_pages: int, page_size: int, page_table: torch.Tensor,
                            device=None) -> PagedKVCache:
        """A zeroed pool of ``num_pages`` pages (+ the scratch page) read through ``page_table``."""
        cfg = self.config
        device = device if device is not None else self.norm.weight.device
        return PagedKVCache(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads // self.mapping.tp_size,
                            cfg.head_dim, self.dtype, device, page_table)

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take on this rank (every layer)."""
        return kv_bytes_per_token(self.config, self.mapping.tp_size, self.dtype)

    # -- forward -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                kv_cache: PagedKVCache, capture: bool = True,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> TargetOutput:
        """One step over a fixed ``[B, T]`` block.

        Args:
            input_ids: ``[B, T]`` int64 token ids (valid ids; padding uses any valid id).
            positions: ``[B, T]`` int absolute positions.
            slot_ids: ``[B]`` int cache slots (a dummy slot for padding rows).
            kv_cache: written at each token's page slot (the scratch page where the slot has no page).
            capture: whether to return the capture layers' hidden states (``False``: ``captured`` is ``None``
                and nothing is concatenated -- the target-only decode, which drafts nothing, saves that launch).
            rope: optional ``(cos, sin)`` fp32 ``[B, T, D/2]``, what ``rotary_emb.cos_sin(positions)`` returns
                (the target-only step gathers them from ``rotary_emb.cos_sin_table`` with its other inputs).

        Each layer: fused residual add + RMSNorm, one QKV GEMM, RoPE + KV write, paged attention, o_proj,
        fused residual add + RMSNorm, one gate-up GEMM, one SiLU-mul, down_proj; the residual add of the MLP
        output is fused into the next layer's norm (made explicit after a captured layer). Small steps on
        CUDA (``layer_kernels``, ``FUSED_MAX_ROWS``): :meth:`LlamaDecoderLayer.forward_fused`, five launches.

        Returns :class:`TargetOutput` (rows flattened ``b * T + t``). CUDA-graph safe.
        """
        if input_ids.dim() != 2 or positions.shape != input_ids.shape or slot_ids.shape != input_ids.shape[:1]:
            raise ValueError(f"LlamaTarget.forward: expected input_ids/positions [B, T] and slot_ids [B], got "
                             f"{tuple(input_ids.shape)}, {tuple(positions.shape)}, {tuple(slot_ids.shape)}")
        b, t = input_ids.shape
        cfg = self.config
        cos, sin = rope if rope is not None else self.rotary_emb.cos_sin(positions)
        hidden = self.embed_tokens(input_ids)
        captured: list[torch.Tensor | None] = [None] * len(cfg.capture_layers)
        pending = None  # the last MLP output, not yet added to `hidden`
        table = kv_cache.page_table
        fused = self._fused_layers(b * t, hidden)
        for i, layer in enumerate(self.layers):
            if fused:
                hidden = layer.forward_fused(hidden, positions, slot_ids, table, kv_cache.k[i], kv_cache.v[i], cos, sin)
                if i in self._capture_index:
                    captured[self._capture_index[i]] = hidden
                continue
            normed, hidden = _add_norm(layer.input_layernorm, pending, hidden)
            attn = layer.self_attn(normed, positions, slot_ids, table, kv_cache.k[i], kv_cache.v[i], cos, sin)
            normed, hidden = _add_norm(layer.post_attention_layernorm, attn, hidden)
            pending = layer.mlp(normed)
            if i in self._capture_index:
                hidden, pending = hidden + pending, None
                captured[self._capture_index[i]] = hidden
        final, _ = _add_norm(self.norm, pending, hidden)
        return TargetOutput(hidden_states=final.reshape(b * t, cfg.hidden_size),
                            captured=torch.cat(captured, dim=-1).reshape(b * t, cfg.capture_width) if capture else None)

    def _fused_layers(self, rows: int, x: torch.Tensor) -> bool:
        """Whether this step's layers run :meth:`LlamaDecoderLayer.forward_fused` (see ``layer_kernels``)."""
        if self.layer_kernels == "fused":
            if self.mapping.tp_size > 1 or not triton_runs_on(x):
                raise ValueError(f"LlamaTarget: layer_kernels='fused' needs TP 1 and Triton (CUDA or "
                                 f"TRITON_INTERPRET=1), got tp_size={self.mapping.tp_size} on {x.device}")
            return True
        if self.layer_kernels not in ("auto", "unfused"):
            raise ValueError(f"LlamaTarget: layer_kernels must be 'auto', 'fused' or 'unfused', got "
                             f"{self.layer_kernels!r}")
        return (self.layer_kernels == "auto" and x.is_cuda
                and picks_fused_layer(rows, self._layer_bytes, self.mapping.tp_size))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def logits(self, hidden_states: torch.Tensor, row_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Full-vocabulary logits ``[R, V]`` through the plain processor (gathered at tp > 1)."""
        return self.logits_processor(hidden_states, self.lm_head, row_indices)
