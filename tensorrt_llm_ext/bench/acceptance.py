"""``trtllm-ext bench acceptance --model DIR``: mean acceptance length of the serving engine on held-out
prompts, the trained drafter (``DIR/dspark_drafter`` or ``--drafter``) against the bigram initialisation
(the seeded drafter the engine builds when a checkpoint has no drafter), per draft length ``K`` and sampling.

Samplings: greedy (``T = 0``, strict acceptance) and ``T = 1, top-p 0.95`` with rejection sampling
(``speculative_config.use_rejection_sampling``). Prompts: :func:`~tensorrt_llm_ext.training.prompts.
prompt_token_ids` of the ``held_out`` split (chat-templated instructions on topics ``train-drafter`` never
saw; seeded random ids for a model without a chat tokenizer). Acceptance length = tokens a request gains per
generation step (accepted drafts + the bonus token, ``1 .. K+1``), averaged over every step of every request;
the first token (prefill) is not counted. The engine is the one ``serve`` runs (fused kernels; CUDA graphs
with ``--cuda-graph``); on a CPU every kernel runs in the Triton interpreter, which is only practical for the
small test models (``docs/real_model.md``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from tensorrt_llm_ext.bench.harness import fmt, print_table, register_benchmark

SAMPLINGS = {"greedy": dict(temperature=0.0, top_p=1.0), "T=1 top-p 0.95": dict(temperature=1.0, top_p=0.95)}


def _add_args(p: argparse.ArgumentParser) -> None:
    cpu = not torch.cuda.is_available()
    p.add_argument("--model", required=True, help="the target checkpoint directory")
    p.add_argument("--drafter", default=None, help="the trained drafter (default MODEL/dspark_drafter)")
    p.add_argument("--variants", nargs="+", choices=["trained", "bigram"], default=["trained", "bigram"])
    p.add_argument("--draft-lens", type=int, nargs="+", default=[4, 7])
    p.add_argument("--samplings", nargs="+", choices=list(SAMPLINGS), default=list(SAMPLINGS))
    p.add_argument("--num-prompts", type=int, default=4 if cpu else 64)
    p.add_argument("--max-new-tokens", type=int, default=16 if cpu else 256)
    p.add_argument("--batch-size", type=int, default=4 if cpu else 16, help="max_batch_size of the engine")
    p.add_argument("--seed", type=int, default=0, help="prompt shuffle seed; request i samples with seed + i")
    p.add_argument("--cuda-graph", action="store_true", help="capture the steps (CUDA)")


def bigram_view(model_dir: Path, work: Path) -> Path:
    """A directory of links to ``model_dir``'s files without its drafter: loading it builds the bigram init."""
    view = work / model_dir.name
    view.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not (view / f.name).exists():
            (view / f.name).symlink_to(f.resolve())
    return view


@register_benchmark("acceptance", "mean acceptance length on held-out prompts: trained drafter vs bigram init, "
                    "per K, greedy and T=1 rejection sampling", _add_args)
def run(args: argparse.Namespace) -> int:
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.contract import SamplingParams
    from tensorrt_llm_ext.runtime.requests import Request
    from tensorrt_llm_ext.training.prompts import prompt_token_ids

    model = Path(args.model)
    drafter = Path(args.drafter) if args.drafter else model / "dspark_drafter"
    if "trained" in args.variants and not (drafter / "config.json").is_file():
        print(f"error: --variants trained: no drafter at {drafter} (train one: trtllm-ext train-drafter {model})")
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench_acceptance_"))
    base = load_config(model_dir=str(bigram_view(model, work)))
    prompts = prompt_token_ids(model, "held_out", args.num_prompts, base.model.target.vocab_size, seed=args.seed)
    max_len = max(map(len, prompts)) + args.max_new_tokens + max(args.draft_lens) + 8
    rows = []
    for variant in args.variants:
        for k in args.draft_lens:
            overrides = {"speculative_config.max_draft_len": k, "speculative_config.use_rejection_sampling": True,
                         "max_batch_size": args.batch_size, "max_seq_len": min(max_len, base.max_seq_len)}
            if variant == "trained":
                overrides["speculative_config.speculative_model"] = str(drafter)
            cfg = load_config(model_dir=str(model if variant == "trained" else bigram_view(model, work)), **overrides)
            engine = Engine(cfg, use_cuda_graph=args.cuda_graph and torch.cuda.is_available())
            for name in args.samplings:
                reqs = [Request(prompt_ids=p, max_new_tokens=args.max_new_tokens,
                                sampling=SamplingParams(seed=args.seed + i, **SAMPLINGS[name]))
                        for i, p in enumerate(prompts)]
                t0 = time.perf_counter()
                results, stats = engine.generate(reqs)
                wall = time.perf_counter() - t0
                lens = [n for r in results for n in r.accepted_lens]
                errors = [r.error for r in results if r.error]
                if errors:
                    print(f"error: {len(errors)} request(s) failed: {errors[0]}")
                    return 1
                rows.append([variant, k, name, len(results), len(lens), sum(lens),
                             fmt(sum(lens) / len(lens) if lens else float("nan"), 3), fmt(wall, 1)])
            del engine
    notes = [f"model {model.name}; drafter {drafter if 'trained' in args.variants else '-'}; {args.num_prompts} "
             f"held-out prompts, max_new_tokens {args.max_new_tokens}, max_batch_size {args.batch_size}, "
             f"cuda_graph {'on' if args.cuda_graph and torch.cuda.is_available() else 'off'}. acceptance length = "
             "tokens gained per generation step (accepted drafts + bonus), over every step of every request; "
             "bigram = the engine's seeded drafter with the target's bigram Markov head (no drafter checkpoint); "
             "T=1 rows verify by rejection sampling."]
    text = print_table("bench acceptance: mean acceptance length on held-out prompts",
                       ["drafter", "K", "sampling", "requests", "steps", "tokens", "mean acceptance length",
                        "wall s"], rows, notes)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0
