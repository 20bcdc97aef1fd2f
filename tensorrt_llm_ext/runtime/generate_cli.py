"""The body of ``trtllm-ext generate`` (argument handling and printing; the work is in :mod:`.launch`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from tensorrt_llm_ext.runtime.config import ConfigError, load_config
from tensorrt_llm_ext.runtime.launch import (DEFAULT_PROMPTS, GenerateJob, check_reports, load_prompts_file,
                                             parse_prompt, run_generate)


def _fmt_ids(ids: list[int], limit: int = 32) -> str:
    head = " ".join(str(t) for t in ids[:limit])
    return head + (f" ... (+{len(ids) - limit})" if len(ids) > limit else "")


def main_generate(args: argparse.Namespace) -> int:
    import torch

    overrides = {}
    if args.tp is not None:
        overrides["tensor_parallel_size"] = args.tp
    if args.draft_len is not None:
        overrides["speculative_config.max_draft_len"] = args.draft_len
    if args.vocab_parallel is not None:
        overrides["speculative_config.vocab_parallel_selection"] = args.vocab_parallel
    if args.markov_mode is not None:
        overrides["speculative_config.markov_chain_mode"] = args.markov_mode
    if args.rejection_sampling:
        overrides["speculative_config.use_rejection_sampling"] = True
    if not 0 < args.top_p <= 1:
        print(f"error: --top-p must be in (0, 1], got {args.top_p}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, **overrides)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cuda_graph and not torch.cuda.is_available():
        print("error: --cuda-graph needs a CUDA device", file=sys.stderr)
        return 2
    if args.cuda_graph and cfg.cuda_graph_config is None:
        cfg = cfg.with_overrides(**{"cuda_graph_config.enable_padding": True})
    vocab = cfg.model.target.vocab_size
    try:
        if args.prompts_file:
            prompts = load_prompts_file(args.prompts_file)
        elif args.prompts:
            prompts = [parse_prompt(p) for p in args.prompts]
        else:
            prompts = [[t % vocab for t in p] for p in DEFAULT_PROMPTS]
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    requests = [dict(prompt_ids=p, max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(args.stop),
                     temperature=args.temperature, seed=args.seed + i, request_id=i, top_p=args.top_p)
                for i, p in enumerate(prompts)]
    rejection = cfg.speculative_config.use_rejection_sampling
    greedy = [args.temperature == 0] * len(requests)
    if args.check and rejection:
        # Sampled rejection runs are checked distributionally; greedy copies of every prompt ride in the same
        # batches so that greedy rows next to sampled ones are checked against the target-only decode.
        n = len(requests)
        requests += [{**r, "temperature": 0.0, "request_id": n + i} for i, r in enumerate(requests)]
        greedy += [True] * n
    modes = ["speculative"] + (["target_only", "gathered"] if args.check else [])
    tp = cfg.tensor_parallel_size
    job = GenerateJob(config=cfg.model_dump(mode="json"), requests=requests, modes=modes, cuda_graph=args.cuda_graph,
                      show_progress=not args.no_progress and sys.stderr.isatty(), check_top_p=args.check and rejection)
    device = "cuda" if torch.cuda.is_available() else "cpu (Triton interpreter)"
    spec = cfg.speculative_config
    print(f"trtllm-ext generate: DSpark one-model, K={spec.max_draft_len}, tp={tp}, vocab={vocab}, "
          f"markov={spec.markov_chain_mode}, device={device}, cuda_graph={'on' if args.cuda_graph else 'off'}, "
          f"{len(prompts)} prompts, max_new_tokens={args.max_new_tokens}, "
          f"{'greedy' if args.temperature == 0 else f'temperature={args.temperature} seed={args.seed}+i'}"
          f"{f', top_p={args.top_p}' if args.top_p < 1 else ''}, "
          f"verification={'rejection sampling' if rejection else 'strict acceptance'}")
    reports = run_generate(job, tp)
    res = reports[0].results["speculative"]
    print(f"selection: {res.selection}")
    for i, p in enumerate(prompts):
        if res.errors[i]:
            print(f"[{i}] rejected: {res.errors[i]}")
            continue
        acc = res.accepted_lens[i]
        mean = sum(acc) / len(acc) if acc else float("nan")
        print(f"[{i}] prompt ({len(p)} ids): {_fmt_ids(p, 16)}")
        print(f"    -> {len(res.outputs[i])} ids ({res.finish_reasons[i]}, {len(acc)} steps, "
              f"acceptance {mean:.2f}): {_fmt_ids(res.outputs[i])}")
    shown = res.accepted_lens[:len(prompts)]  # without the check's greedy copies
    ntok = sum(len(o) for o in res.outputs[:len(prompts)])
    steps = [n for acc in shown for n in acc]
    mal = sum(steps) / len(steps) if steps else float("nan")
    print(f"speculative: {res.num_steps} steps, {ntok} tokens, mean acceptance length "
          f"{'-' if math.isnan(mal) else f'{mal:.2f}'} tokens/step (K+1 = {spec.max_draft_len + 1} max), "
          f"{res.wall_s:.1f} s")
    rc = 0
    if args.check:
        outcome = check_reports(reports, rejection_sampling=rejection, greedy=greedy)
        print("check:")
        for line in outcome.lines:
            print(line)
        passed = ("check passed: sharded == gathered verification, greedy rows == the target's own decode, every "
                  "token in the target's top-p set" if rejection else
                  "check passed: speculative output equals the target's own decode")
        print(passed if outcome.ok else "check FAILED")
        rc = 0 if outcome.ok else 1
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([{"rank": r.rank, "results": {m: asdict(x) for m, x in r.results.items()}} for r in reports],
                      f, indent=1)
    return rc
