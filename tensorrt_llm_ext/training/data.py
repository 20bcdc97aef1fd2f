"""Self-distillation data: the target's own continuations of a prompt set, with what the drafter reads.

:func:`load_target` builds this project's :class:`~tensorrt_llm_ext.models.llama_target.LlamaTarget` from a
Hugging Face directory with the drafter's capture layers. :func:`generate_dataset` decodes continuations
with it (batched, KV cache, greedy rows and sampled rows with top-p; a row stops at an EOS id) and then runs
one teacher pass over every finished sequence, keeping per position:

* ``features [N, T, F]``: the captured target layers (the residual stream after each capture layer,
  concatenated) -- exactly what the serving step feeds the drafter's ``fc``;
* ``final [N, T, H]``: the target's final-normed hidden state; the LM head turns it into the teacher
  distribution during training (49152-wide logits per position are never stored).

Nothing is downloaded: the prompts are :mod:`tensorrt_llm_ext.training.prompts`'.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tensorrt_llm_ext.models.checkpoint import load_llama_state_dict, read_checkpoint_facts, read_target_config
from tensorrt_llm_ext.models.llama_target import LlamaTarget


def load_target(model_dir: str | Path, capture_layers: list[int], device, dtype: torch.dtype) -> LlamaTarget:
    cfg, tie = read_target_config(model_dir)
    cfg = dataclasses.replace(cfg, capture_layers=tuple(capture_layers))
    target = LlamaTarget(cfg, dtype=dtype, device=device)
    target.load_full_state_dict(load_llama_state_dict(model_dir, cfg, tie))
    return target.eval()


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, top_p: float,
                  generator: torch.Generator) -> torch.Tensor:
    """``[B, V]`` -> ``[B]``: ``argmax`` where the row's temperature is 0, else a draw from the top-p set of
    ``softmax(logits / T)``."""
    greedy = logits.argmax(-1)
    t = temperatures.clamp_min(1e-5)[:, None]
    probs = torch.softmax(logits.float() / t, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # the smallest prefix reaching top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.where(temperatures > 0, drawn, greedy)


@torch.no_grad()
def generate_dataset(target: LlamaTarget, prompts: list[list[int]], *, max_new_tokens: int,
                     temperatures: list[float], top_p: float, eos_ids: tuple[int, ...], seed: int, batch_size: int,
                     storage_dtype: torch.dtype, progress=None) -> dict[str, torch.Tensor]:
    """Continuations of ``prompts`` (``temperatures[i]`` for prompt ``i``) and their teacher pass.

    Returns ``tokens [N, T]`` (padded with 0 past ``lens``), ``lens [N]``, ``prompt_lens [N]``, ``features
    [N, T, F]`` and ``final [N, T, H]`` (``storage_dtype``), ``T = max prompt length + max_new_tokens``.
    """
    dev = target.norm.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=dev)
    width = max(len(p) for p in prompts) + max_new_tokens
    cfg = target.config
    out = {"tokens": torch.zeros(len(prompts), width, dtype=torch.long),
           "lens": torch.zeros(len(prompts), dtype=torch.long),
           "prompt_lens": torch.tensor([len(p) for p in prompts], dtype=torch.long),
           "features": torch.zeros(len(prompts), width, cfg.capture_width, dtype=storage_dtype),
           "final": torch.zeros(len(prompts), width, cfg.hidden_size, dtype=storage_dtype)}
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        temps = torch.tensor(temperatures[start:start + batch_size], dtype=torch.float32, device=dev)
        seq, lens = _decode(target, chunk, max_new_tokens, temps, top_p, eos, gen)
        rows = slice(start, start + len(chunk))
        t = int(lens.max())
        feats, final = _teacher_pass(target, seq[:, :t])
        out["tokens"][rows, :t] = seq[:, :t].cpu()
        out["lens"][rows] = lens.cpu()
        out["features"][rows, :t] = feats.to(storage_dtype).cpu()
        out["final"][rows, :t] = final.to(storage_dtype).cpu()
        if progress is not None:
            progress(len(chunk))
    return out


def _decode(target: LlamaTarget, prompts: list[list[int]], max_new_tokens: int, temps: torch.Tensor,
            top_p: float, eos: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    dev = temps.device
    b = len(prompts)
    n = torch.tensor([len(p) for p in prompts], device=dev)
    tp = int(n.max())
    total = tp + max_new_tokens
    cache = target.make_kv_cache(b, total + 1)
    slots = torch.arange(b, dtype=torch.int32, device=dev)
    rows = torch.arange(b, device=dev)
    seq = torch.zeros(b, total, dtype=torch.long, device=dev)
    for r, p in enumerate(prompts):
        seq[r, :len(p)] = torch.tensor(p, device=dev)
    # Prefill (right-padded: a row's padding positions lie past its prompt and are rewritten before any
    # query of that row attends them), then one token per row and step.
    out = target(seq[:, :tp], torch.arange(tp, device=dev).expand(b, tp), slots, cache)
    last = out.hidden_states.view(b, tp, -1)[rows, n - 1]
    lens, done = n.clone(), torch.zeros(b, dtype=torch.bool, device=dev)
    for _ in range(max_new_tokens):
        tok = sample_tokens(target.logits(last), temps, top_p, gen)
        live = ~done & (lens < total)
        seq[rows[live], lens[live]] = tok[live]
        lens = lens + live.long()
        done = done | (live & torch.isin(tok, eos)) | (lens >= total)
        if bool(done.all()):
            break
        cur = seq[rows, lens - 1][:, None]
        last = target(cur, (lens - 1)[:, None], slots, cache).hidden_states
    return seq, lens


def _teacher_pass(target: LlamaTarget, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, t = seq.shape
    dev = seq.device
    cache = target.make_kv_cache(b, t)
    out = target(seq, torch.arange(t, device=dev).expand(b, t), torch.arange(b, dtype=torch.int32, device=dev), cache)
    return out.captured.view(b, t, -1), out.hidden_states.view(b, t, -1)


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    return tuple(read_checkpoint_facts(model_dir).eos_token_ids)
