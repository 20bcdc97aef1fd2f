"""The body of ``trtllm-ext generate`` (argument handling and printing; the work is in :mod:`.launch`).

Exit codes (documented in README and docs/fault_matrix.md):

* ``0``: every request was served (and with ``--check`` every path and rank agreed);
* ``1``: ``--check`` found a difference, or compared nothing;
* ``2``: bad arguments, config or prompts, or ``--tp N`` on a host with fewer than N GPUs (nothing ran);
* ``3``: one or more requests were rejected (the others were served and printed);
* ``4``: a rank failed, died or hung (the report names it, how it ended and its last log lines);
* ``130`` / ``143`` (128 + the signal): ``--tp N`` interrupted by SIGINT / SIGTERM; the signal was passed on
  to the ranks, which were given 5 s to end before the rest of the job was killed (no rank left running).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace

from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.argtypes import output_dir_error, output_file_error
from tensorrt_llm_ext.runtime import launch
from tensorrt_llm_ext.runtime.config import ConfigError, load_config
from tensorrt_llm_ext.runtime.serve_cli import use_cuda_graph
from tensorrt_llm_ext.runtime.launch import (DEFAULT_PROMPTS, GenerateJob, check_reports, load_prompts_file,
                                             parse_prompt, run_generate)
from tensorrt_llm_ext.runtime.ranks import RankJobError, RankJobInterrupted
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.contract import MIN_TEMPERATURE, SamplingParams

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_REJECTED, EXIT_RANK_FAILED = 0, 1, 2, 3, 4


def _fmt_ids(ids: list[int], limit: int = 32) -> str:
    head = " ".join(str(t) for t in ids[:limit])
    return head + (f" ... (+{len(ids) - limit})" if len(ids) > limit else "")


def sampling_from_flags(temperature: float, top_p: float, seed: int) -> SamplingParams:
    """The command line's :class:`SamplingParams`; a ``ValueError`` naming the flag (``--top-p: expected ...``)."""
    try:
        params = SamplingParams(temperature, top_p, seed)
        params.check()
        return params
    except ValueError as e:
        field, _, problem = str(e).partition(": ")
        raise ValueError(f"--{field.replace('_', '-')}: {problem}") from None


def _sampling(s: SamplingParams) -> str:
    if s.temperature == 0:
        return "greedy"
    if s.is_greedy:
        return f"temperature={s.temperature:g} (below the minimum {MIN_TEMPERATURE:g}: served greedy, its T -> 0 limit)"
    return f"temperature={s.temperature} seed={s.seed}+i"


class TextPrompts:
    """Prompts as ids: ``"1 2 3"`` is token ids; anything else is text, encoded by the model's tokenizer
    (:func:`~tensorrt_llm_ext.runtime.tokenizer.resolve_tokenizer`, loaded on first need) as a completion prompt,
    or with ``chat`` as one user message through the chat template. ``tokenizer`` stays None until a prompt
    needs it (then the outputs are printed as text too)."""

    def __init__(self, cfg, chat: bool = False):
        self.cfg, self.chat, self.tokenizer, self._looked = cfg, chat, None, False

    def _tokenizer(self, text: str):
        if not self._looked:
            from tensorrt_llm_ext.runtime.tokenizer import resolve_tokenizer

            self.tokenizer, self._looked = resolve_tokenizer(self.cfg), True
        if self.tokenizer is None:
            raise ValueError(f"prompt {text!r}: " + ("--chat needs" if self.chat else "not token ids, and text needs")
                             + " a tokenizer; this model has none (send ids, or --model a directory with one)")
        return self.tokenizer

    def ids(self, text: str) -> list[int]:
        if not self.chat:
            try:
                return parse_prompt(text)
            except ValueError:
                pass
        tok = self._tokenizer(text)
        if self.chat:
            if not getattr(tok, "chat_template", None):
                raise ValueError("--chat: the model's tokenizer has no chat template")
            rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=False)
            return list(tok(rendered, add_special_tokens=False)["input_ids"])  # the template wrote the specials
        return list(tok.encode(text, add_special_tokens=True))


def main_generate(args: argparse.Namespace) -> int:
    import torch

    from tensorrt_llm_ext.speculative.step_ops import fused_ops_run_on

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
    try:
        sampling = sampling_from_flags(args.temperature, args.top_p, args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, model_dir=args.model, **overrides)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cuda_graph and not torch.cuda.is_available():
        print("error: --cuda-graph needs a CUDA device", file=sys.stderr)
        return 2
    # Flags every request shares: a value no request can be served with is the flag's error (exit 2, before the
    # model is built), not one rejection per prompt (exit 3). A prompt holds one token at least.
    vocab = cfg.model.target.vocab_size
    flag_error = None
    if not 1 <= args.max_new_tokens < cfg.max_seq_len:
        flag_error = (f"--max-new-tokens {args.max_new_tokens}: expected an integer in [1, {cfg.max_seq_len - 1}] "
                      f"(max_seq_len={cfg.max_seq_len} holds the prompt too)")
    elif any(not 0 <= t < vocab for t in args.stop):
        flag_error = (f"--stop: token id(s) {[t for t in args.stop if not 0 <= t < vocab]} outside the vocabulary "
                      f"[0, {vocab})")
    if flag_error:
        print(f"error: {flag_error}", file=sys.stderr)
        return 2
    gpus = launch.tp_gpu_error(cfg.tensor_parallel_size)
    if gpus:
        print(f"error: {gpus}", file=sys.stderr)
        return 2
    # the outputs, checked before the run, not after it (--log-dir: a file in its way was a traceback)
    out_error = ((args.json_out and output_file_error(args.json_out, "--json"))
                 or (args.log_dir and output_dir_error(args.log_dir, "--log-dir")))
    if out_error:
        print(f"error: {out_error}", file=sys.stderr)
        return 2
    if args.cuda_graph and cfg.cuda_graph_config is None:
        cfg = cfg.with_overrides(**{"cuda_graph_config.enable_padding": True})
    cuda_graph = use_cuda_graph(cfg, args.cuda_graph)
    texts = TextPrompts(cfg, chat=args.chat)
    try:
        if args.prompts_file:
            prompts = load_prompts_file(args.prompts_file, parse_line=texts.ids)  # a line: ids or text, as an argument
        elif args.prompts:
            prompts = [texts.ids(p) for p in args.prompts]
        else:
            prompts = [[t % vocab for t in p] for p in DEFAULT_PROMPTS]
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # prompt i samples with seed + i, wrapped into the seeds' range [0, 2^63) (--seed 2^63 - 1 with two prompts
    # gave prompt 1 a seed the request check refused after prompt 0 had run: exit 3)
    requests = [Request(prompt_ids=p, max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(args.stop),
                        sampling=replace(sampling, seed=(args.seed + i) % 2**63), request_id=i)
                for i, p in enumerate(prompts)]
    rejection = cfg.speculative_config.use_rejection_sampling
    greedy = [sampling.is_greedy] * len(requests)  # T = 0, or a tiny T served as its T -> 0 limit
    if args.check and rejection:
        # Sampled rejection runs are checked distributionally; greedy copies of every prompt ride in the same
        # batches so that greedy rows next to sampled ones are checked against the target-only decode.
        n = len(requests)
        requests += [replace(r, sampling=replace(r.sampling, temperature=0.0), request_id=n + i)
                     for i, r in enumerate(requests)]
        greedy += [True] * n
    if args.check and cfg.speculative_config.max_concurrency is not None:
        # the check compares the speculative step with its references plan for plan; a run that decodes part of
        # its plans target-only (max_concurrency) has no such twin, and its switching is tested in CI instead
        logger.info(f"generate --check: speculative_config.max_concurrency="
                    f"{cfg.speculative_config.max_concurrency} not applied (every step of the checked run speculates)")
        cfg = cfg.with_overrides(**{"speculative_config.max_concurrency": None})
    tp = cfg.tensor_parallel_size
    # At tp 1 nothing is sharded, nor on a CPU running the stock torch ops (they always gather): the gathered
    # path is then the speculative path itself, so it is not compared.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sharded = tp > 1 and fused_ops_run_on(device)
    # --check: the lossless reference is the target-only decode in the verification's shape ("reference")
    modes = ["speculative"] + (["reference"] + (["gathered"] if sharded else []) if args.check else [])
    job = GenerateJob(config=cfg.model_dump(mode="json"), requests=requests, modes=modes, cuda_graph=cuda_graph,
                      show_progress=not args.no_progress, progress_terminal=sys.stderr.isatty(), check_top_p=args.check and rejection)
    device += "" if device == "cuda" else (" (Triton interpreter)" if fused_ops_run_on(device) else " (torch ops)")
    spec = cfg.speculative_config
    banner = (f"trtllm-ext generate: DSpark one-model, K={spec.max_draft_len}, tp={tp}, vocab={vocab}, "
              f"markov={spec.markov_chain_mode}, device={device}, cuda_graph={'on' if cuda_graph else 'off'}, "
              f"{len(prompts)} prompts, max_new_tokens={args.max_new_tokens}, "
              f"{_sampling(sampling)}"
              f"{f', top_p={args.top_p}' if args.top_p < 1 else ''}, "
              f"verification={'rejection sampling' if rejection else 'strict acceptance'}")
    try:
        # The banner follows the load: a checkpoint refused there (NaN weights) prints its one line alone.
        reports = run_generate(job, tp, timeout=args.job_timeout, rank_timeout=args.rank_timeout,
                               log_dir=args.log_dir, on_built=lambda: print(banner, flush=True))
    except RankJobInterrupted as e:
        print(f"error: the {tp}-rank job was {e.headline} (rank logs: {e.log_dir})", file=sys.stderr)
        return 128 + e.signum
    except RankJobError as e:
        print(f"error: the {tp}-rank job failed: {e}", file=sys.stderr)
        return EXIT_RANK_FAILED
    except FileNotFoundError as e:  # no mpiexec (or a file the engine needs): nothing was generated
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
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
        if texts.tokenizer is not None:
            print(f"    text: {texts.tokenizer.decode(res.outputs[i], skip_special_tokens=True)!r}")
    shown = res.accepted_lens[:len(prompts)]  # without the check's greedy copies
    ntok = sum(len(o) for o in res.outputs[:len(prompts)])
    steps = [n for acc in shown for n in acc]
    mal = sum(steps) / len(steps) if steps else float("nan")
    print(f"speculative: {res.num_steps} steps, {ntok} tokens, mean acceptance length "
          f"{'-' if math.isnan(mal) else f'{mal:.2f}'} tokens/step (K+1 = {spec.max_draft_len + 1} max), "
          f"{res.wall_s:.1f} s")
    outcome = None
    rejected = [i for i, e in enumerate(res.errors) if e]
    rc = EXIT_REJECTED if rejected else EXIT_OK
    if rejected:
        print(f"{len(rejected)} of {len(prompts)} request(s) rejected: {rejected} (exit code {EXIT_REJECTED})")
    if args.check:
        outcome = check_reports(reports, rejection_sampling=rejection, greedy=greedy)
        print("check:")
        for line in outcome.lines:
            print(line)
        if outcome.ok:
            sharded = "sharded == gathered verification, " if tp > 1 else ""
            print(f"check passed: {sharded}greedy rows == the target's own decode, every token in the target's "
                  f"top-p set" if rejection else
                  "check passed: speculative output equals the target's own decode")
        else:
            why = [w for w, bad in (("outputs differ", outcome.differs), ("requests were rejected", outcome.rejected),
                                    ("nothing was compared", outcome.compared == 0)) if bad]
            print(f"check FAILED: {', '.join(why)}")
        if outcome.differs or outcome.compared == 0:
            rc = EXIT_CHECK_FAILED
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(json_report(cfg, prompts, requests, reports, outcome, cuda_graph), f, indent=1)
    return rc


def json_report(cfg, prompts, requests, reports, outcome, cuda_graph: bool) -> dict:
    """What ``--json`` writes: versions, the resolved config, per-request records, per-rank results, the
    check verdict (``null`` without ``--check``)."""
    import torch
    import triton

    from tensorrt_llm_ext import __version__

    res = reports[0].results["speculative"]
    records = []
    for i, (p, r) in enumerate(zip(prompts, requests)):
        acc = res.accepted_lens[i]
        records.append({
            "request_id": i, "prompt_ids": p, "max_new_tokens": r.max_new_tokens,
            "temperature": r.sampling.temperature, "top_p": r.sampling.top_p, "seed": r.sampling.seed,
            "stop_token_ids": list(r.stop_token_ids),
            "output_ids": res.outputs[i], "finish_reason": res.finish_reasons[i], "error": res.errors[i],
            "steps": len(acc), "accepted_lens": acc,
            "mean_acceptance_length": (sum(acc) / len(acc)) if acc else None,
        })
    mal = res.mean_acceptance_length
    return {
        "versions": {"tensorrt_llm_ext": __version__, "torch": torch.__version__, "triton": triton.__version__,
                     "python": sys.version.split()[0]},
        "config": cfg.model_dump(mode="json"),
        "cuda_graph": cuda_graph,
        "selection": res.selection,
        "summary": {"num_steps": res.num_steps, "num_tokens": sum(len(o) for o in res.outputs),
                    "mean_acceptance_length": None if math.isnan(mal) else mal, "wall_s": res.wall_s},
        "requests": records,
        "check": None if outcome is None else {"passed": outcome.ok, "lines": [x.strip() for x in outcome.lines]},
        "ranks": [{"rank": r.rank, "results": {m: asdict(x) for m, x in r.results.items()}} for r in reports],
    }
