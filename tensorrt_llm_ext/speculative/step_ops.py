"""The two op tables a :class:`~tensorrt_llm_ext.speculative.dspark_worker.DSparkWorker` step runs with.

One worker, two tables: :data:`FUSED_OPS` (this module's kernels) and :data:`STOCK_OPS` -- the eager path
the upstream one-model worker ran before these optimisations, op for op:

=====================  ======================================  ==========================================
stage                  fused                                   stock (upstream eager)
=====================  ======================================  ==========================================
block table            :func:`decode_block_table` (1 launch)   clamp + floor-divide + count (torch)
target selection       shard kernel + pair exchange            gathered logits + ``torch.argmax``; sampled
                                                               rows ``argmax(x / T + G)`` in torch
strict acceptance      :func:`strict_accept` (1 launch)        compare + cumprod + sum chain (torch)
drafter bookkeeping    :func:`paged_latent_step` (1 launch)    the eager chain (torch)
context-latent store   :func:`store_context_latents`           index-put into the pool (torch; rows not
                                                               written go to the scratch page)
prompt-latent store    :func:`store_prompt_latents` (1         destinations in torch, then the same
                       launch, destinations looked up)         index-put
Markov chain           ``exact`` / ``fused`` kernels           per step ``F.linear`` + add + ``torch.argmax``
rejection sampling     :func:`rejection_sample` on the shard   :func:`rejection_sample_reference` (the
(``use_rejection_       (or gathered) + small exchanges         eager twin) on the gathered full-vocabulary
sampling``)                                                     logits
exact top-p            :func:`top_p_keep`                      :func:`top_p_keep_reference` (gathered)
draft-logits store /   :func:`scatter_rows` /                  ``index_copy_`` / ``index_select`` (torch)
load (sampled drafts)  :func:`gather_rows` (1 launch each)
=====================  ======================================  ==========================================

The stock worker always selects from the gathered logits (vocab-parallel selection off), since the
upstream path gathers. Both tables produce the same tokens (tests hold them to it); ``trtllm-ext bench
step`` times the same worker object with each table, so its baseline is the real stock step, never a
re-assembly. Every op is CUDA-graph capturable (the stock ones allocate inside the graph's pool).

Which table an engine path runs (:func:`step_ops_for`, logged once per process): the fused one wherever
Triton runs -- CUDA, or a CPU with ``TRITON_INTERPRET=1`` set (the test suite sets it, so the tests keep
exercising the kernels) -- and the stock one on a CPU without it. The interpreter runs each kernel program
in Python (tens of seconds per step over a 49152-column vocabulary); the stock ops are plain torch and
produce the same tokens, so ``serve`` / ``generate`` on a CPU run at torch speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tensorrt_llm_ext._env import ENV
from tensorrt_llm_ext.kernels.block_table import decode_block_table, decode_block_table_reference
from tensorrt_llm_ext.kernels.decode_step import (decode_step_advance, decode_step_advance_reference,
                                                 decode_step_inputs, decode_step_inputs_reference)
from tensorrt_llm_ext.kernels.ordered_key import keyed_gumbel_scores_torch
from tensorrt_llm_ext.kernels.paged_latent import (PagedLatentStep, paged_latent_step, paged_latent_step_reference,
                                                   store_context_latents, store_context_latents_reference,
                                                   store_prompt_latents, store_prompt_latents_reference)
from tensorrt_llm_ext.kernels.slot_rows import (gather_rows, gather_rows_reference, scatter_rows,
                                                 scatter_rows_reference)
from tensorrt_llm_ext.kernels.strict_accept import strict_accept, strict_accept_reference
from tensorrt_llm_ext.logger import info_once
from tensorrt_llm_ext.speculative.token_selector import SelectionParams, VocabParallelSelector
from tensorrt_llm_ext.speculative.verification import (rejection_sample, rejection_sample_reference, top_p_keep,
                                                        top_p_keep_reference)

__all__ = ["FUSED_OPS", "OP_TABLES", "STOCK_OPS", "StepOps", "fused_ops_run_on", "step_ops_for", "stock_select"]


def stock_select(logits: torch.Tensor, temperatures: torch.Tensor | None, seeds: torch.Tensor | None,
                 offsets: torch.Tensor | None, salt: int, out: torch.Tensor) -> torch.Tensor:
    """Stock target selection on full-vocabulary logits ``[R, V]`` -> ``out [R]`` int64.

    Greedy (``temperatures=None``): ``torch.argmax``. Sampled: rows with ``T > 0`` take the argmax of the
    keyed Gumbel-max scores (``keyed_gumbel_scores_torch``: the same keyed noise and score as the fused
    kernels, computed in torch over the whole row) and the others ``argmax(x)``.
    """
    if temperatures is None:
        return torch.argmax(logits, dim=-1, out=out)
    scored = keyed_gumbel_scores_torch(logits, temperatures, seeds, offsets, 0, salt)
    return torch.argmax(scored, dim=-1, out=out)


def _selector_select(selector: VocabParallelSelector, logits, temperatures, seeds, offsets, salt: int,
                     out: torch.Tensor) -> torch.Tensor:
    """Fused target selection: the worker's bound selector (this rank's shard with the pair exchange when
    vocab-parallel, else the full rows; ``temperatures=None``: greedy)."""
    params = SelectionParams(temperatures=temperatures, seeds=seeds, offsets=offsets, salt=salt)
    return selector.select_tokens(logits, params, out=out)


def _stock_target_select(selector: VocabParallelSelector, logits, temperatures, seeds, offsets, salt: int,
                         out: torch.Tensor) -> torch.Tensor:
    del selector  # the stock table always selects from the gathered logits, in torch
    return stock_select(logits, temperatures, seeds, offsets, salt, out)


def _stock_store_context_latents(latents, dest_pages, dest_offsets, write_mask, pool):
    # The upstream eager store: rows not written go to the pool's last (scratch) page, no sync.
    return store_context_latents_reference(latents, dest_pages, dest_offsets, write_mask, pool,
                                           sink_page=pool.shape[1] - 1)


def _stock_store_prompt_latents(latents, slots, starts, lens, block_table, pool, *, page_size):
    # the destinations in torch, then the upstream eager store (scratch page for the rows not written)
    return store_prompt_latents_reference(latents, slots, starts, lens, block_table, pool, page_size=page_size,
                                          sink_page=pool.shape[1] - 1)


def _stock_decode_block_table(encoded_offsets, divisor, *, out, num_blocks_out):
    table, num_blocks = decode_block_table_reference(encoded_offsets, divisor)
    out.copy_(table)
    num_blocks_out.copy_(num_blocks)
    return out, num_blocks_out


def _stock_strict_accept(draft_tokens, target_tokens, *, out=None):
    del out  # the eager chain returns its own tensors
    return strict_accept_reference(draft_tokens, target_tokens)


def _stock_paged_latent_step(accepted, num_accepted, slot_ids, is_dummy, ctx_lens, block_table, *,
                             out: PagedLatentStep | None = None, **kwargs) -> PagedLatentStep:
    del out
    return paged_latent_step_reference(accepted, num_accepted, slot_ids, is_dummy, ctx_lens, block_table, **kwargs)


@dataclass(frozen=True)
class StepOps:
    """The ops one DSpark step calls; signatures are those of the fused launchers.

    ``markov_mode`` ``None`` keeps the worker's configured chain mode; ``"stock"`` runs the eager chain.
    ``vocab_parallel``: whether this table may select from vocab shards (stock: never).
    """

    name: str
    decode_block_table: Callable
    strict_accept: Callable
    paged_latent_step: Callable
    store_context_latents: Callable
    store_prompt_latents: Callable  # a prefill block's latents at their prompt positions (destinations looked up)
    select: Callable  # (selector, logits, temperatures, seeds, offsets, salt, out) -> out: the target's tokens
    markov_mode: str | None
    vocab_parallel: bool
    rejection_sample: Callable  # signature of verification.rejection_sample
    top_p_keep: Callable  # signature of verification.top_p_keep
    store_rows: Callable  # (dst [S, ...], slots [B], src [B, ...]) -> dst: the draft logits stored at their slots
    load_rows: Callable  # (src [S, ...], slots [B], out [B, ...]) -> out: ... and read back for verification
    decode_inputs: Callable  # (slots, slot_tokens, lengths, columns, rope_table): the target-only step's inputs
    decode_advance: Callable  # (slots, is_dummy, new_tokens, lengths, slot_tokens): ... and its state after it


FUSED_OPS = StepOps(name="fused", decode_block_table=decode_block_table, strict_accept=strict_accept,
                    paged_latent_step=paged_latent_step, store_context_latents=store_context_latents,
                    store_prompt_latents=store_prompt_latents, select=_selector_select,
                    markov_mode=None, vocab_parallel=True, rejection_sample=rejection_sample, top_p_keep=top_p_keep,
                    store_rows=scatter_rows, load_rows=gather_rows, decode_inputs=decode_step_inputs,
                    decode_advance=decode_step_advance)
STOCK_OPS = StepOps(name="stock", decode_block_table=_stock_decode_block_table, strict_accept=_stock_strict_accept,
                    paged_latent_step=_stock_paged_latent_step, store_context_latents=_stock_store_context_latents,
                    store_prompt_latents=_stock_store_prompt_latents,
                    select=_stock_target_select, markov_mode="stock", vocab_parallel=False,
                    rejection_sample=rejection_sample_reference, top_p_keep=top_p_keep_reference,
                    store_rows=scatter_rows_reference, load_rows=gather_rows_reference,
                    decode_inputs=decode_step_inputs_reference, decode_advance=decode_step_advance_reference)
OP_TABLES = {t.name: t for t in (FUSED_OPS, STOCK_OPS)}


def step_ops_for(path: str, device: torch.device | str) -> StepOps:
    """The op table an engine path runs on ``device``; the choice is logged once per process.

    ``path`` ``"stock"`` always gets :data:`STOCK_OPS`. Other paths get :data:`FUSED_OPS` where Triton runs
    (CUDA, or CPU with ``TRITON_INTERPRET=1`` set explicitly: the kernels in the interpreter, for tests) and
    :data:`STOCK_OPS` on a CPU without the interpreter (torch ops; the same tokens).

    >>> step_ops_for("speculative", "cpu").name  # without TRITON_INTERPRET=1
    'stock'
    """
    dev = torch.device(device)
    if path == "stock":
        return STOCK_OPS
    if not fused_ops_run_on(dev):
        info_once(f"step ops: stock torch ops on {dev.type} (Triton does not run here; set TRITON_INTERPRET=1 to "
                  f"run the fused kernels in the interpreter)", key=f"step-ops-stock-{dev.type}")
        return STOCK_OPS
    if dev.type == "cuda":
        info_once("step ops: fused Triton kernels (cuda)", key="step-ops-fused-cuda")
        return FUSED_OPS
    info_once(f"step ops: fused Triton kernels in the interpreter on {dev.type} (TRITON_INTERPRET=1: "
              f"exercises the kernels, slow; unset it to run torch ops)", key=f"step-ops-interpret-{dev.type}")
    return FUSED_OPS


def fused_ops_run_on(device: torch.device | str) -> bool:
    """Whether :data:`FUSED_OPS` run on ``device``: CUDA, or any device under ``TRITON_INTERPRET=1``."""
    return torch.device(device).type == "cuda" or ENV.triton_interpret
