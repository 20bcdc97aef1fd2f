"""The compile sweep: every Triton launcher over the variants the runtime launches (test support).

Each :class:`SweepCase` calls one public launcher (or the speculative entry point that composes several)
with CPU tensors of the runtime's shapes and dtypes; run under
:class:`~tensorrt_llm_ext.testing.compile_only.CompileOnly`, each launch compiles its specialization
for the target and runs nothing. The variants: the model's dtypes bf16 / fp32 at every variant and fp16
at the first of each loop (:func:`_variants`), greedy / sampled / top-p rows, every row of the schedule
tables (``FUSED_SCHEDULES`` and the built 64-row tile,
``ATTENTION_SCHEDULES``), the vocabulary shards of TP 1 / 2 / 8 of a 128256 vocabulary and an odd one
(50257: lengths not divisible by 16 give other integer specializations), and the draft lengths of the
default config and the benchmarks (K = 4, 7).

``captured`` marks the kernels of the captured decode step (CUDA graph): a spill there fails the check
unless :data:`ACCEPTED_SPILLS` names the kernel with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["ACCEPTED_SPILLS", "AcceptedSpill", "SWEEP", "SweepCase", "captured_kernels"]

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
# What the model launches: ``model.dtype`` is bfloat16 (the GPU default) or float32, and a checkpoint stored in
# fp16 is loaded into parameters of that dtype, so no model, benchmark or runtime path hands a kernel fp16.
MODEL_FLOATS = (torch.bfloat16, torch.float32)
VOCAB = 128256  # Llama 3: shards of 128256 / 64128 / 16032 columns at TP 1 / 2 / 8
ODD_VOCAB = 50257  # a length with no power-of-two factor: the other integer specializations
DRAFT_LENS = (4, 7)  # the default config's max_draft_len, and the benchmarks' K
# The float dtypes a run compiles, in FLOATS' order (``compile-check --dtypes``): all of FLOATS by default; CI takes
# bf16 alone, the GPU's default (every kernel and every launcher path at ~1/3 of the whole sweep's CPU).
DTYPES: tuple[torch.dtype, ...] = FLOATS


def _floats(*candidates: torch.dtype) -> tuple[torch.dtype, ...]:
    """Of ``candidates`` (a loop's dtypes), those this run compiles (:data:`DTYPES`)."""
    return tuple(d for d in candidates if d in DTYPES)


def _variants(dtype: torch.dtype, variants) -> tuple:
    """Every variant (shape, shard, head layout) of a loop for the model's dtypes; for fp16, which the launchers
    accept but nothing launches (:data:`MODEL_FLOATS`), the first only: its code path (fp16 loads, converts,
    dots) compiles for every kernel and every setting the loop varies besides the shape, not once per shape
    (96 specializations and 74 CPU s of the 354 / 327 of 2026-12-04, Triton 3.6.0, before)."""
    variants = tuple(variants)
    return variants if dtype in MODEL_FLOATS else variants[:1]


@dataclass(frozen=True)
class SweepCase:
    name: str
    run: Callable[[], None]
    kernels: tuple[str, ...]  # the kernels (qualnames) this case launches; the check fails if one does not compile
    captured: bool = True  # launched inside the captured decode step
    cost: float = 1.0  # CPU seconds of compiling it (measured, sm_90, Triton 3.6.0), to split the cases over workers


@dataclass(frozen=True)
class AcceptedSpill:
    """A spill the check lets pass: in ``kernel``, on specializations whose description holds every string
    of ``when`` (e.g. ``"BLOCK_B=64"``), up to ``max_bytes`` (stores + loads); any other spill fails."""

    kernel: str
    when: tuple[str, ...]
    max_bytes: int
    reason: str


_KM = "tensorrt_llm_ext.kernels."
# Spills found by the first run of the check (2026-12-02), listed so CI is green while their owners decide;
# each names the specializations and a bound, so a new or larger spill still fails.
ACCEPTED_SPILLS: tuple[AcceptedSpill, ...] = (
    AcceptedSpill(_KM + "markov_fused_step:_markov_fused_step_kernel", ("BLOCK_B=16", "IS_FIRST=True", "SAMPLE=True"),
                  16, "4 B stored / 4 B loaded under Triton 3.7.1 only (none under 3.6.0): first step of a "
                  "sampled chain; left to the kernel's owner"),
    AcceptedSpill(_KM + "markov_fused_step:_markov_fused_step_kernel", ("R=576",), 70_000,
                  "a 576-wide target's Markov rank (r pads to 1024): ~300 B at 255 registers with bf16 weights, "
                  "~30 KB with fp32 ones (found when that sweep row landed); left to the kernel's owner"),
    AcceptedSpill(_KM + "rejection_sample:_rejection_draw_kernel", ("HAS_P=True",), 512,
                  "top-p rows at 255 registers: 12 B stored / loaded under Triton 3.6.0, 128-136 B each under 3.7.1 "
                  "(the draw's per-lane running best and sub-chunk tie bases); the H200 timings of the top-p "
                  "verifier include it; the draw's register budget is the next lever"),
    AcceptedSpill(_KM + "latent_block_attention:_latent_block_attention_kernel", ("PRECISION='ieee'", "BLOCK_C=256"),
                  12_000, "an fp32 drafter (IEEE dots) at latent 256 (~5 KB at 255 registers); the GPU default "
                  "dtype is bf16, which does not spill"),
    AcceptedSpill(_KM + "paged_attention:_paged_attention_kernel", ("PRECISION='ieee'",), 100_000,
                  "an fp32 target (IEEE dots on fp32 operand tiles of 32-64 rows x 64-128 dims) spilled 0.4-31 KB at "
                  "4 warps under Triton 3.7.1 (8 warps spill as much); fp32 targets are the CPU tests' dtype, the "
                  "GPU default bf16 / fp16 tiles do not spill"),
    AcceptedSpill(_KM + "paged_attention:_paged_attention_kernel", ("BLOCK_N=128", "num_warps=8"), 16,
                  "a launch-settings candidate the benchmark times (128 keys, 8 warps): 4 B stored / loaded on the "
                  "32-row verify tile at D = 64 under Triton 3.6.0; not in DECODE_CONFIGS unless a run picks it"),
    AcceptedSpill(_KM + "paged_attention:_paged_attention_kernel", ("BLOCK_N=64", "BLOCK_D=128", "LAST_FIRST=True"), 16,
                  "head dim 128's verify tile (64-key blocks, 3 stages) with the split axis reversed: 8 B stored / "
                  "loaded at 168 registers under Triton 3.6.0 (2026-12-05); not yet timed on an 8B shape"),
    AcceptedSpill(_KM + "fused_qkv:_fused_qkv_rope_kernel", ("QK_NORM=True", "BLOCK_HALF=64", "GEMV=False", "PDL=True"),
                  32, "q / k norms at head dim 128 in dot tiles with programmatic launch: the first K block's two "
                  "64 x 128 weight tiles held across the wait, 16 B stored / loaded under Triton 3.6.0 (2026-12-04); "
                  "a Qwen3-like 8B shape's steps of 2-32 rows"),
    AcceptedSpill(_KM + "latent_block_attention:_latent_block_attention_combine_kernel",
                  ("PRECISION='ieee'", "BLOCK_C=256"), 20_000,
                  "an fp32 drafter at latent 256 with split-K (~6 KB stored); the GPU default dtype is bf16"),
    AcceptedSpill(_KM + "latent_block_attention:_latent_block_attention_kernel", ("BLOCK_C=512",), 2048,
                  "a 512-wide latent in bf16 (2026-12-04, Triton 3.6.0): 112-136 B stored at 8 warps, 644-888 B "
                  "stored + as many loaded at 4 warps (the table's rows for B > 1 at latent 512: measured faster on "
                  "the H200 all the same); the "
                  "fp32 [K, d_c] state and the W_uk / W_uv tiles pass 255 registers"),
    AcceptedSpill(_KM + "latent_block_attention:_latent_block_attention_combine_kernel", ("BLOCK_C=512",), 256,
                  "a 512-wide latent's split-K merge in bf16: 76 B at 255 registers (the fp32 W_uv tiles of _finish)"),
)


def _shards(vocab: int = VOCAB):
    """(vocab_start, width, vocab_size) of the last shard at TP 1 / 2 / 8 (the last holds the padding)."""
    out = []
    for tp in (1, 2, 8):
        width = -(-vocab // tp)
        out.append(((tp - 1) * width, width, vocab))
    return out


def _rows(b: int):
    temps = torch.full((b,), 0.7)
    temps[0] = 0.0  # a greedy row in a sampled batch
    seeds = torch.arange(b, dtype=torch.int64) + 11
    offsets = torch.arange(b, dtype=torch.int64) * 3
    return temps, seeds, offsets


# -- target selection: shard_select ---------------------------------------------------------------------------
def _select():
    from tensorrt_llm_ext.speculative.vocab_parallel import gumbel_sample, vocab_parallel_argmax

    for dtype in DTYPES:
        shards = ((_shards()[2], (1, 40)), (_shards(ODD_VOCAB)[0], (40,)))
        for (start, width, size), batches in _variants(dtype, shards):
            for b in batches:  # one row; 8 requests x (K + 1)
                logits = torch.zeros(b, width, dtype=dtype)
                vocab_parallel_argmax(logits, start, size)
                gumbel_sample(logits, *_rows(b), start, size)


# -- verification: top-p and rejection sampling ---------------------------------------------------------------
# The runtime's column chunks on a GPU (rejection_verifier / dspark_worker): 32 for rejection sampling, 8 for
# the top-p mask.
_REJECTION_SPLITS, _TOP_P_SPLITS = 32, 8


def _one_rank(steps):
    """Drive one rank's verification pipeline (a generator of exchange points) with no-op exchanges: compile
    only, the values are never read, so one simulated rank of any TP size is enough."""
    try:
        next(steps)
        while True:
            next(steps)
    except StopIteration as stop:
        return stop.value


def _verification_shards():
    """(tp, vocab_start, width, vocab_size): the whole vocabulary (TP 1 and the gathered path), the last
    shard at TP 2 and 8, and the odd vocabulary whole."""
    return [(tp, start, width, size) for tp, (start, width, size) in zip((1, 2, 8), _shards())] + [
        (1, *_shards(ODD_VOCAB)[0])]


def _top_p():
    from tensorrt_llm_ext.speculative import verification as vf

    for dtype in DTYPES:
        for tp, start, width, size in _variants(dtype, _verification_shards()):
            b, k = 8, 7
            rows = b * (k + 1)
            ws = vf.VerificationWorkspace.for_verification(b, k, width, tp=tp, num_splits=_TOP_P_SPLITS)
            logits = torch.zeros(rows, width, dtype=dtype)
            temps, _, _ = _rows(rows)
            _one_rank(vf._top_p_keep_steps(vf._FUSED_KERNELS, logits, torch.full((rows,), 0.9), temps, start, size,
                                           tp, tp - 1, None, ws))


def _rejection():
    from tensorrt_llm_ext.speculative import verification as vf

    for dtype in DTYPES:
        for tp, start, width, size in _variants(dtype, _verification_shards()):
            b, k = 4, 7
            ws = vf.VerificationWorkspace.for_verification(b, k, width, tp=tp, num_splits=_REJECTION_SPLITS)
            temps, seeds, offsets = _rows(b)  # sampled rows and a greedy one: greedy is per row, not per launch
            target = torch.zeros(b, k + 1, width, dtype=dtype)
            draft = torch.zeros(b, k, width, dtype=dtype)
            tokens = torch.zeros(b, k, dtype=torch.int64) + start
            for top_p in (None, torch.full((b,), 0.9)):
                _one_rank(vf._rejection_sample_steps(vf._FUSED_KERNELS, target, draft, tokens, temps, seeds, offsets,
                                                     top_p, start, size, tp, tp - 1, None, ws))


def _block_stats():
    """The one-pass statistics (the verification's first launch on block-aligned shards; also timed alone by bench
    verify --one-pass-stats): bf16 on Llama 3's block-aligned last TP-4 shard, at one row group's chunks (2 blocks each)
    and at 480 rows (whole-shard chunks)."""
    from tensorrt_llm_ext.kernels.block_stats import STAT_BLOCK, STATS_COLS, block_stats
    from tensorrt_llm_ext.kernels.fixed_point_softmax import plan_chunks

    width = STAT_BLOCK * -(-(-(-VOCAB // 4)) // STAT_BLOCK)
    k = 7
    for b, splits in ((1, 32), (32, 2)):
        rt, rq = b * (k + 1), b * k
        s, _ = plan_chunks(width, STAT_BLOCK, splits)
        temps, _, _ = _rows(b)
        for num_warps, prefetch in ((None, None), (4, True), (2, True)):  # the default and bench's schedules
            block_stats(torch.zeros(rt, width, dtype=torch.bfloat16), torch.zeros(rq, width, dtype=torch.bfloat16),
                        temps, 3 * width, VOCAB, tokens=torch.zeros(b, k, dtype=torch.int64), row_div=k + 1,
                        row_div_q=k, keys_out=torch.zeros(rt + rq, s, 2, dtype=torch.int64),
                        stats_out=torch.zeros(rt + rq, s, STATS_COLS, dtype=torch.int64), num_splits=splits,
                        num_warps=num_warps, prefetch=prefetch)


# -- the step's small kernels ---------------------------------------------------------------------------------
def _step_bookkeeping():
    from tensorrt_llm_ext.kernels.block_table import decode_block_table
    from tensorrt_llm_ext.kernels.paged_latent import paged_latent_step, store_context_latents, store_prompt_latents
    from tensorrt_llm_ext.kernels.strict_accept import strict_accept

    for b in (1, 8, 64):
        for max_blocks in (10, 64):
            decode_block_table(torch.zeros(b, max_blocks, dtype=torch.int32), 16)
        for k in DRAFT_LENS:
            drafts = torch.zeros(b, k, dtype=torch.int64)
            strict_accept(drafts, torch.zeros(b, k + 1, dtype=torch.int64))
            tokens = torch.zeros(b, k + 1, dtype=torch.int64)  # the worker's strided view of one buffer
            strict_accept(tokens[:, 1:], torch.zeros(b, k + 1, dtype=torch.int64))
            strict_accept(drafts, torch.zeros(b, k + 1, dtype=torch.int64),  # int32 ids out, as bench tail
                          out=(torch.empty(b, k + 1, dtype=torch.int32), torch.empty(b, dtype=torch.int32)))
            slots = 2 * b
            for max_pages in (10, 64):
                block_table = torch.zeros(slots, max_pages, dtype=torch.int32)
                paged_latent_step(torch.zeros(b, k + 1, dtype=torch.int64), torch.ones(b, dtype=torch.int32),
                                  torch.arange(b, dtype=torch.int64), torch.zeros(b, dtype=torch.bool),
                                  torch.zeros(slots, dtype=torch.int32), block_table, num_contexts=0, page_size=16,
                                  draft_len=k, max_ctx_len=max_pages * 16, mask_token_id=3)
    for dtype in DTYPES:
        for d_c, layers in _variants(dtype, ((d_c, layers) for d_c in (32, 512) for layers in (1, 2))):
            n = 8 * 5
            pool = torch.zeros(layers, 16, 16, d_c, dtype=dtype)
            store_context_latents(torch.zeros(n, layers, d_c, dtype=dtype), torch.zeros(n, dtype=torch.int32),
                                  torch.zeros(n, dtype=torch.int32), torch.ones(n, dtype=torch.bool), pool)
            for r, t in ((1, 16), (1, 128), (4, 33)):  # the admission's [R, T] block; starts a column of positions
                positions = torch.zeros(r, t, dtype=torch.int64)
                store_prompt_latents(torch.zeros(r * t, layers, d_c, dtype=dtype), torch.zeros(r, dtype=torch.int64),
                                     positions[:, 0], torch.ones(r, dtype=torch.int64),
                                     torch.zeros(8, 10, dtype=torch.int32), pool, page_size=16)


def _rms_norm():
    from tensorrt_llm_ext.kernels.rms_norm import rms_norm

    for dtype in DTYPES:
        for hidden in _variants(dtype, (48, 4096, 8192)):
            x = torch.zeros(40, hidden, dtype=dtype)
            w = torch.ones(hidden, dtype=dtype)
            rms_norm(x, w, 1e-5)
            rms_norm(x, w, 1e-5, residual=torch.zeros_like(x))


def _decode_step():  # the target-only step's bookkeeping: int32 / int64 slots and lengths, 1 and K + 1 columns
    from tensorrt_llm_ext.kernels.decode_step import decode_step_advance, decode_step_inputs

    for idt in (torch.int32, torch.int64):
        slots, lengths = torch.zeros(8, dtype=idt), torch.zeros(9, dtype=idt)
        slot_tokens = torch.zeros(9, DRAFT_LENS[-1] + 1, dtype=torch.int64)
        for columns in (1, DRAFT_LENS[-1] + 1):
            decode_step_inputs(slots, slot_tokens, lengths, columns)
            for half in (32, 64):  # RoPE rows of head dims 64 / 128
                table = (torch.zeros(16, half), torch.zeros(16, half))
                decode_step_inputs(slots, slot_tokens, lengths, columns, table)
        decode_step_advance(slots, torch.zeros(8, dtype=torch.bool), torch.zeros(8, dtype=torch.int64), lengths,
                            slot_tokens)


def _slot_rows():  # the sampled step's draft-logits store and load: [B, K, V] rows of the model's dtypes
    from tensorrt_llm_ext.kernels.slot_rows import gather_rows, scatter_rows

    for dtype in DTYPES:
        for k in _variants(dtype, DRAFT_LENS):
            rows, slotted = torch.zeros(3, k, VOCAB, dtype=dtype), torch.zeros(4, k, VOCAB, dtype=dtype)
            scatter_rows(slotted, torch.zeros(3, dtype=torch.int64), rows)
            gather_rows(slotted, torch.zeros(3, dtype=torch.int64), rows)


def _block_loss():  # train-drafter's loss rows (not in the captured step)
    from tensorrt_llm_ext.kernels.block_loss import block_loss_rows, teacher_stats

    for dtype in _floats(torch.bfloat16, torch.float32):
        for vocab, kl in ((49152, True), (49152, False), (1000, False)):
            z, t = torch.zeros(4, vocab, dtype=dtype), torch.zeros(4, vocab, dtype=dtype)
            a = torch.ones(4)
            block_loss_rows(z, t, torch.zeros(4, dtype=torch.long), a, a, a if kl else None, write_grad=True)
    block_loss_rows(z, t, torch.zeros(4, dtype=torch.long), a, a, None, write_grad=False)
    # the "dedup" layout: teacher rows shared through an index, their statistics from teacher_stats
    for dtype in _floats(torch.bfloat16, torch.float32):
        for vocab, kl in ((49152, True), (49152, False), (1000, False)):
            z, t, idx = torch.zeros(4, vocab, dtype=dtype), torch.zeros(2, vocab, dtype=dtype), torch.zeros(4).long()
            stats = teacher_stats(t)
            block_loss_rows(z, t, idx, a, a, a if kl else None, write_grad=True, t_index=idx, t_stats=stats)


# -- drafter block attention -----------------------------------------------------------------------------------
def _attention():
    from tensorrt_llm_ext.contract import DraftBlockPlacement
    from tensorrt_llm_ext.kernels.latent_block_attention import (ATTENTION_SCHEDULES, AttentionSchedule,
                                                                 attention_schedule, latent_block_attention)

    def schedules(d_c):  # the table's rows a drafter of latent d_c can launch, and the split-K path's default
        rows = {attention_schedule(s.max_batch or 1 << 20, latent_dim=d_c) for s in ATTENTION_SCHEDULES}
        return sorted(rows, key=lambda s: s.max_batch or 1 << 20) + [AttentionSchedule(None, split_k=4)]

    # tiny; the served default (fp16 at the first only, _variants)
    shapes = [(dtype, shape) for dtype in DTYPES for shape in _variants(dtype, ((4, 16, 32), (8, 64, 256)))]
    if torch.bfloat16 in DTYPES:
        shapes.append((torch.bfloat16, (8, 64, 512)))  # the 512-wide latent (recipe 6), bf16 as served
    for dtype, (heads, head_dim, d_c) in shapes:
        for k in DRAFT_LENS[-1:]:  # K is a runtime argument; BLOCK_M = 16 for every K <= 16
            b, slots, max_pages, page = 8, 16, 16, 16
            i32 = lambda *s: torch.zeros(s, dtype=torch.int32)  # noqa: E731
            placement = DraftBlockPlacement(positions=i32(b, k), page_ids=i32(b, k), page_offsets=i32(b, k),
                                            ctx_lens=i32(b), seq_lens=i32(b) + k)
            for sch in schedules(d_c):
                latent_block_attention(
                    torch.zeros(b, k, heads, head_dim, dtype=dtype), torch.zeros(b, k, d_c, dtype=dtype),
                    torch.zeros(32, page, d_c, dtype=dtype), i32(slots, max_pages),
                    torch.arange(b, dtype=torch.int64), placement,
                    torch.zeros(heads * head_dim, d_c, dtype=dtype), torch.zeros(heads * head_dim, d_c, dtype=dtype),
                    10000.0, head_dim ** -0.5, schedule=sch)


# -- target paged attention -----------------------------------------------------------------------------------
def _paged_attention():
    from tensorrt_llm_ext.kernels.paged_attention import paged_attention
    from tensorrt_llm_ext.kernels.paged_kv_write import paged_kv_write

    # SmolLM2-135M (9 / 3 heads x 64), an 8B Llama (32 / 8 x 128), a Qwen3-like GQA 2 at head_dim 128; decode
    # (T = 1), verify (T = K + 1 = 8) and a prefill block (several query tiles, no split).
    for dtype in DTYPES:
        for heads, kv_heads, d in _variants(dtype, ((9, 3, 64), (32, 8, 128), (16, 8, 128))):
            page, max_pages, b = 16, 64, 4
            table = torch.zeros(b + 1, max_pages, dtype=torch.int32)
            pool = torch.zeros(b * max_pages + 1, page, kv_heads, d, dtype=dtype)
            for t in (1, DRAFT_LENS[-1] + 1, 48):
                q = torch.zeros(b, t, heads, d, dtype=dtype)
                pos = torch.zeros(b, t, dtype=torch.int64)
                slots = torch.zeros(b, dtype=torch.int32)
                paged_attention(q, pool, pool, table, slots, pos, d ** -0.5)
                kv = torch.zeros(b, t, kv_heads, d, dtype=dtype)
                cos = torch.zeros(b, t, d // 2)
                paged_kv_write(q, kv, kv, cos, cos, pos, slots, table, pool, pool)
    # The split tiles' settings the model launches (16-bit models: the GPU's dtypes), each prefetch form the grid
    # may pick ('a': registers for a small grid, L2 for a large one). `bench target`'s other CONFIG_CANDIDATES
    # compile when the benchmark runs them on the GPU; the runtime never launches them.
    from dataclasses import replace

    from tensorrt_llm_ext.kernels.paged_attention import DECODE_CONFIGS

    for dtype in _floats(torch.bfloat16, torch.float16):
        for heads, kv_heads, d in _variants(dtype, ((9, 3, 64), (32, 8, 128))):
            cfg = DECODE_CONFIGS[d]
            page, max_pages, b = 16, 64, 4
            table = torch.zeros(b + 1, max_pages, dtype=torch.int32)
            pool = torch.zeros(b * max_pages + 1, page, kv_heads, d, dtype=dtype)
            for form in ((1, 2) if cfg.prefetch == -1 else (cfg.prefetch,)):
                for t in (1, DRAFT_LENS[-1] + 1):
                    paged_attention(torch.zeros(b, t, heads, d, dtype=dtype), pool, pool, table,
                                    torch.zeros(b, dtype=torch.int32), torch.zeros(b, t, dtype=torch.int64), d ** -0.5,
                                    config=replace(cfg, prefetch=form))
    # The decode pieces of larger steps (DECODE_CONFIGS_BY_BATCH), each at its first batch in a 4k table: under
    # programmatic launch and without it (the unfused layer's steps of more than 32 requests).
    from tensorrt_llm_ext.kernels.paged_attention import DECODE_CONFIGS_BY_BATCH

    for dtype in _floats(torch.bfloat16, torch.float16):
        for heads, kv_heads, d in _variants(dtype, ((9, 3, 64),)):
            for b, _ in DECODE_CONFIGS_BY_BATCH.get(d, ()):
                page, max_pages = 32, 128
                table = torch.zeros(b + 1, max_pages, dtype=torch.int32)
                pool = torch.zeros(b * max_pages + 1, page, kv_heads, d, dtype=dtype)
                for programmatic in (None, False):
                    paged_attention(torch.zeros(b, 1, heads, d, dtype=dtype), pool, pool, table,
                                    torch.zeros(b, dtype=torch.int32), torch.zeros(b, 1, dtype=torch.int64),
                                    d ** -0.5, programmatic=programmatic)
    from tensorrt_llm_ext.kernels.silu_mul import silu_mul

    for dtype in DTYPES:
        for inter in _variants(dtype, (1536, 14336)):  # SmolLM2-135M, an 8B Llama (per rank at TP 1)
            silu_mul(torch.zeros(8, 2 * inter, dtype=dtype))


# -- target fused layer (small steps) --------------------------------------------------------------------------
def _fused_layer():
    from tensorrt_llm_ext.kernels.fused_linear import EPI_RESIDUAL, EPI_SILU_MUL, fused_linear
    from tensorrt_llm_ext.kernels import fused_linear as fl
    from tensorrt_llm_ext.kernels.fused_qkv import fused_qkv_rope

    default_split = fl.DOT_K_SPLIT
    # SmolLM2-135M (hidden 576, 9 / 3 heads x 64, MLP 1536), an 8B Llama (4096, 32 / 8 x 128, 14336) and a
    # Qwen3-like target (q / k norms, q/k/v biases); M = 1 and 4 (the few-row dot-free form), 8 and 64
    # (FUSED_MAX_ROWS: B = 8 verify at K = 7). Weights are torch.empty: nothing runs, and an 8B layer must not be
    # touched on the host.
    shapes = ((576, 9, 3, 64, 1536, False), (4096, 32, 8, 128, 14336, False), (1024, 16, 8, 128, 3072, True))
    try:
        for dtype in DTYPES:
            for hidden, heads, kv_heads, d, inter, qwen in _variants(dtype, shapes):
                page, max_pages, b = 16, 8, 64
                table = torch.zeros(b + 1, max_pages, dtype=torch.int32)
                pool = torch.empty(b * max_pages + 1, page, kv_heads, d, dtype=dtype)
                wqkv = torch.empty((heads + 2 * kv_heads) * d, hidden, dtype=dtype)
                bias = torch.empty(wqkv.shape[0], dtype=dtype) if qwen else None
                qk = torch.empty(d, dtype=dtype) if qwen else None
                norm = torch.empty(hidden, dtype=dtype)
                w_gate_up, w_down = torch.empty(2 * inter, hidden, dtype=dtype), torch.empty(hidden, inter, dtype=dtype)
                w_o = torch.empty(hidden, heads * d, dtype=dtype)
                # M = 8 again under DOT_K_SPLIT 1 / 2 (the K-split dot tiles off and halved: TLLM_EXT_DOT_K_SPLIT)
                for m, split in ((1, 0), (4, 0), (8, 0), (64, 0), (8, 1), (8, 2)):
                    if split and dtype not in MODEL_FLOATS:
                        continue
                    fl.DOT_K_SPLIT = split or default_split
                    t = 8 if m == 64 else 1
                    x = torch.empty(m // t, t, hidden, dtype=dtype)
                    pos = torch.zeros(m // t, t, dtype=torch.int64)
                    cos = torch.empty(m // t, t, d // 2)
                    slots = torch.zeros(m // t, dtype=torch.int32)
                    fused_qkv_rope(x, wqkv, bias, norm, 1e-6, cos, cos, pos, slots, table, pool, pool, heads, qk, qk)
                    h = x.view(m, hidden)
                    fused_linear(torch.empty(m, heads * d, dtype=dtype), w_o, epilogue=EPI_RESIDUAL, residual=h)
                    fused_linear(h, w_gate_up, norm_weight=norm, epilogue=EPI_SILU_MUL)
                    fused_linear(torch.empty(m, inter, dtype=dtype), w_down, epilogue=EPI_RESIDUAL, residual=h)
    finally:
        fl.DOT_K_SPLIT = default_split


# -- Markov draft chain ---------------------------------------------------------------------------------------
def _markov():
    from tensorrt_llm_ext.speculative.markov_chain import markov_chain_logits

    start, width, size = _shards()[2]
    r, k = 256, 7  # the measured table's rank and draft length (docs/markov_chain.md)
    w1s = {dtype: torch.zeros(size, r, dtype=dtype) for dtype in _floats(torch.bfloat16, torch.float32)}
    for dtype, w1 in w1s.items():
        w2 = torch.zeros(width, r, dtype=dtype)
        # B = 1 specializes the exact kernels' row count; the fused kernel never specializes on B (one table row).
        for b, modes in ((1, ("exact",)), (8, ("exact", "fused"))):
            base = torch.zeros(b, k, width, dtype=dtype)
            anchors = torch.zeros(b, dtype=torch.int64)
            for sampled in (False, True):
                rows = dict(zip(("temperatures", "seeds", "offsets"), _rows(b))) if sampled else {}
                if "exact" in modes:
                    markov_chain_logits(base, anchors, w1, w2, vocab_start=start, vocab_size=size, mode="exact",
                                        **rows)
                if "fused" in modes:
                    for cfg in _fused_configs(r, b, w1.element_size()):
                        markov_chain_logits(base, anchors, w1, w2, vocab_start=start, vocab_size=size,
                                            mode="fused", config=cfg, **rows)
    # A shard whose first id is not a multiple of 4 (Qwen's V = 151936 at TP 3: rank 1 starts at 50646): the sampled
    # noise's runs of four ids straddle two Philox blocks (ALIGNED=False); the runtime's fused tile for 8 rows.
    r, k, width, start = 256, 7, 1031, 50646
    for dtype in _floats(torch.bfloat16, torch.float32):
        rows = dict(zip(("temperatures", "seeds", "offsets"), _rows(8)))
        w1, w2 = torch.zeros(start + width, r, dtype=dtype), torch.zeros(width, r, dtype=dtype)
        base, anchors = torch.zeros(8, k, width, dtype=dtype), torch.zeros(8, dtype=torch.int64)
        markov_chain_logits(base, anchors, w1, w2, vocab_start=start, vocab_size=start + width, mode="exact", **rows)
        markov_chain_logits(base, anchors, w1, w2, vocab_start=start, vocab_size=start + width, mode="fused", **rows)
    # A wide rank with fp32 weights (a 576-wide target's drafter: r pads to 1024): the table's pipeline is
    # fitted to shared memory (it asked 320 KiB of an SM's 227 KiB on the H200 before).
    for wdtype in _floats(torch.bfloat16, torch.float32):
        r, k, width = 576, 7, 4099
        markov_chain_logits(torch.zeros(1, k, width, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64),
                            torch.zeros(width, r, dtype=wdtype), torch.zeros(width, r, dtype=wdtype),
                            vocab_start=0, vocab_size=width, mode="fused")


def _fused_configs(r: int, b: int, elem_bytes: int):
    """The configs the runtime launches for ``b`` rows (:func:`fused_config`: a table row fitted to shared memory
    for this rank and weight size) and every other table row, fitted the same way; with 16-bit weights also
    each row on the other built row tile (``BLOCK_B_CHOICES``: 64 rows, which no table row uses yet and
    ``bench markov`` times in bf16). A 64-row tile with fp32 weights is launched by nothing (12-17 s of
    compiling each, spilling 20-28 KB): a table row that adopts it brings it back into the sweep."""
    import dataclasses

    from tensorrt_llm_ext.kernels.markov_fused_step import (BLOCK_B_CHOICES, FUSED_SCHEDULES, fit_shared_memory,
                                                            fused_config)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = {fused_config(r, False, None, b, elem_bytes)}
    for s in FUSED_SCHEDULES:
        row = s.config(sms)
        tiles = BLOCK_B_CHOICES if elem_bytes == 2 else (row.block_b,)
        for block_b in tiles:
            configs.add(fit_shared_memory(dataclasses.replace(row, block_b=block_b), r, elem_bytes))
    return sorted(configs, key=lambda c: c.describe())


# -- low-latency exchange ---------------------------------------------------------------------------------------
def _exchange():
    from tensorrt_llm_ext.kernels.ll_exchange import SimulatedPeers

    for world in (1, 2, 8):
        for rows in (8, 40, 256):
            peers = SimulatedPeers(world, rows, "cpu")
            peers.exchange(torch.zeros(world, rows, dtype=torch.int64))


_K = "tensorrt_llm_ext.kernels."
SWEEP: tuple[SweepCase, ...] = (
    SweepCase("select", _select, (_K + "shard_select:_shard_select_kernel",), cost=13),
    SweepCase("top_p", _top_p, (_K + "fixed_point_softmax:_verify_keys_kernel",
                                _K + "fixed_point_softmax:_verify_sums_kernel",
                                _K + "top_p:_top_p_window_kernel", _K + "top_p:_top_p_round_kernel",
                                _K + "top_p:_top_p_mask_kernel"), cost=13),
    SweepCase("rejection", _rejection, (_K + "rejection_sample:_rejection_draw_kernel",
                                        _K + "rejection_sample:_rejection_assemble_kernel",
                                        _K + "block_stats:_block_combine_kernel",
                                        _K + "block_stats:_block_keys_kernel",
                                        _K + "block_stats:_block_bins_kernel"), cost=45),
    SweepCase("block_stats", _block_stats, (_K + "block_stats:_block_stats_kernel",), captured=False, cost=1),
    SweepCase("step_bookkeeping", _step_bookkeeping, (_K + "block_table:_decode_block_table_kernel",
                                                      _K + "strict_accept:_strict_accept_kernel",
                                                      _K + "paged_latent:_paged_latent_step_kernel",
                                                      _K + "paged_latent:_store_context_latents_kernel",
                                                      _K + "paged_latent:_store_prompt_latents_kernel"), cost=2),
    SweepCase("rms_norm", _rms_norm, (_K + "rms_norm:_rms_norm_kernel",), cost=2),
    SweepCase("slot_rows", _slot_rows, (_K + "slot_rows:_slot_rows_kernel",), cost=1),
    SweepCase("decode_step", _decode_step, (_K + "decode_step:_decode_step_inputs_kernel",
                                            _K + "decode_step:_decode_step_advance_kernel"), cost=1),
    SweepCase("block_loss", _block_loss, (_K + "block_loss:_block_loss_rows_kernel",
                                          _K + "block_loss:_teacher_stats_kernel"), captured=False, cost=5),
    SweepCase("attention", _attention, (_K + "latent_block_attention:_latent_block_attention_kernel",
                                        _K + "latent_block_attention:_latent_block_attention_combine_kernel"), cost=42),
    SweepCase("paged_attention", _paged_attention, (_K + "paged_attention:_paged_attention_kernel",
                                                    _K + "paged_kv_write:_paged_kv_write_kernel",
                                                    _K + "silu_mul:_silu_mul_kernel"), cost=60),
    SweepCase("fused_layer", _fused_layer, (_K + "fused_linear:_fused_linear_kernel",
                                            _K + "fused_qkv:_fused_qkv_rope_kernel"), cost=53),
    SweepCase("markov", _markov, (_K + "markov_exact_step:_markov_resolve_kernel",
                                  _K + "markov_exact_step:_markov_select_kernel",
                                  _K + "markov_fused_step:_markov_fused_step_kernel"), cost=57),
    SweepCase("exchange", _exchange, (_K + "ll_exchange:_ll_exchange_kernel",), cost=1),
)


def captured_kernels() -> set[str]:
    return {k for case in SWEEP if case.captured for k in case.kernels}
