"""``trtllm-ext``: the command-line entry point (default command: ``generate`` on the embedded model)."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from tensorrt_llm_ext.argtypes import output_file_error, positive_int, seconds


def _cmd_info(args: argparse.Namespace) -> int:
    from tensorrt_llm_ext.selfcheck import environment_report, multi_rank_selfcheck

    for k, v in environment_report():
        print(f"{k:>20}: {v}")
    if args.ranks <= 1:
        return 0
    print(f"\n{args.ranks}-rank self-check (MPI spawn, {'NCCL' if _cuda() else 'gloo'}): "
          "pair exchange vs torch.argmax, AllReduce+RMSNorm vs eager")
    results = multi_rank_selfcheck(args.ranks)
    ok = True
    for rank, exchange_ok, norm_ok in results:
        print(f"  rank {rank}: pair exchange {'ok' if exchange_ok else 'MISMATCH'}, "
              f"all-reduce norm {'ok' if norm_ok else 'MISMATCH'}")
        ok &= exchange_ok and norm_ok
    print("self-check passed" if ok else "self-check FAILED")
    return 0 if ok else 1


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cmd_test_list(args: argparse.Namespace) -> int:
    from tensorrt_llm_ext.testing.runner import run_test_list
    from tensorrt_llm_ext.testing.test_db import ListDbError

    try:
        return run_test_list(args.name, dry_run=args.dry_run, pytest_args=args.pytest_args, jobs=args.jobs)
    except ListDbError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    from tensorrt_llm_ext.bench.harness import load_benchmark, write_tables

    try:
        bench = load_benchmark(args.name)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"trtllm-ext bench {bench.name}", description=bench.help)
    parser.add_argument("--out", help="also append the Markdown table(s) to this file")
    parser.add_argument("--json", dest="json_out", help="also write the tables as JSON to this file")
    parser.add_argument("--csv", dest="csv_out", help="also write the tables as CSV to this file")
    if bench.add_args is not None:
        bench.add_args(parser)
    bargs = parser.parse_args(rest)
    for path, flag in ((bargs.out, "--out"), (bargs.json_out, "--json"), (bargs.csv_out, "--csv")):
        err = path and output_file_error(path, flag)
        if err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    rc = bench.run(bargs)
    write_tables(bargs.json_out, bargs.csv_out)
    return rc if isinstance(rc, int) else 0


def _cmd_serve(args: argparse.Namespace, argv: list[str]) -> int:
    from tensorrt_llm_ext.runtime.serve_cli import main_serve

    return _checkpoint_refusal_exits_2(main_serve, args, argv)


def _cmd_export(args: argparse.Namespace) -> int:
    from tensorrt_llm_ext.runtime.config import ConfigError, load_config
    from tensorrt_llm_ext.runtime.export import export_model

    try:
        cfg = load_config(args.config)
        paths = export_model(cfg, args.dir, args.drafter_dir, dtype=args.dtype)
    except (ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _print_paths(paths)


def _print_paths(paths) -> int:
    """Print what a command wrote, one ``what: path`` per line; exit code 0."""
    for what, path in paths:
        print(f"{what}: {path}")
    return 0


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    from tensorrt_llm_ext.models.gguf_import import ImportInterrupted, import_gguf

    try:
        paths = import_gguf(args.file, args.dir, dtype=args.dtype, tokenizer=not args.no_tokenizer)
    except (ImportError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportInterrupted as e:
        done = (f"{args.dir} was already complete" if e.complete else
                f"nothing was written to {args.dir}, no staging directory is left")
        print(f"error: import-gguf: {e}; {done}", file=sys.stderr)
        return 128 + e.signum
    return _print_paths(paths)


def _cmd_train_drafter(args: argparse.Namespace) -> int:
    import dataclasses

    from tensorrt_llm_ext.models.checkpoint import CheckpointError
    import torch

    from tensorrt_llm_ext.training.trainer import TrainConfig, TrainingDiverged, train_drafter

    try:
        tc = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
        out = args.out or str(Path(args.dir) / "dspark_drafter")
        if args.max_seconds is not None and not (args.max_seconds > 0 and args.max_seconds < float("inf")):
            raise ValueError(f"train-drafter: --max-seconds must be a finite number > 0, got {args.max_seconds}")
        if args.fit_schedule and args.max_seconds is None:
            raise ValueError("train-drafter: --fit-schedule needs --max-seconds (the budget the schedule ends at)")
        if args.schedule_seconds is not None and not (args.fit_schedule and 0 < args.schedule_seconds < float("inf")):
            raise ValueError(f"train-drafter: --schedule-seconds must be a finite number > 0 with --fit-schedule, got "
                             f"{args.schedule_seconds}{'' if args.fit_schedule else ' without --fit-schedule'}")
        summary = train_drafter(args.dir, out, tc, work_dir=args.work_dir, resume=args.resume,
                                progress=not args.no_progress, max_seconds=args.max_seconds,
                                keep_state=not args.drop_state, fit_schedule=args.fit_schedule,
                                schedule_seconds=args.schedule_seconds, answers_cache=args.answers_cache,
                                feature_cache_gib=args.feature_cache_gib)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the step in flight was finished and checkpointed first (the trainer)
        print("train-drafter: interrupted; the work directory keeps the last checkpoint: the same command with "
              "--resume continues from it", file=sys.stderr)
        return 130
    except (torch.OutOfMemoryError, MemoryError) as e:
        print(f"error: train-drafter ran out of memory ({str(e).splitlines()[0][:120] if str(e) else 'host'}); "
              "lower --batch-seqs, --anchors, --gen-batch or --max-new-tokens", file=sys.stderr)
        return 1
    acc = summary["held_out_greedy_acceptance"]
    print(f"drafter: {out}")
    print(f"loss: {summary['first_losses'][:1]} -> {summary['last_losses'][-1:]}")
    skipped = [s["step"] for s in summary["skipped_steps"]]  # every call's, a resumed run's included
    listed = ", ".join(map(str, skipped[:8])) + (", ..." if len(skipped) > 8 else "")
    print(f"skipped steps: {len(skipped)}" + (f" (non-finite loss or gradient, no update; steps {listed}; "
                                              "training.json: skipped_steps)" if skipped else ""))
    print(f"held-out greedy acceptance length (K={tc.draft_len}): init ({tc.init}) {acc['init']}, "
          f"trained {acc['trained']}")
    return 0


def _add_train_drafter_args(t: argparse.ArgumentParser) -> None:
    import dataclasses

    from tensorrt_llm_ext.training.trainer import TrainConfig

    t.add_argument("dir", help="the target: a Hugging Face Llama directory (e.g. written by import-gguf)")
    t.add_argument("--out", default=None, help="the drafter directory to write (default DIR/dspark_drafter, "
                                                "where serve DIR finds it)")
    t.add_argument("--work-dir", default=None, help="data cache and trainer checkpoints (default OUT_work beside OUT)")
    t.add_argument("--resume", action="store_true", help="continue from WORK_DIR/trainer_state.pt and its data")
    t.add_argument("--answers-cache", default=None, metavar="DIR",
                   help="regenerated answers shared by runs: read from DIR when a run with the same target and data "
                        "knobs wrote them (an ablation of the steps' knobs decodes nothing), else decoded and written "
                        "there (default: WORK_DIR's own)")
    t.add_argument("--feature-cache-gib", type=float, default=0.0, metavar="GIB",
                   help="keep up to GIB of the teacher pass's rows on the device so each sequence's pass runs once "
                        "(0: off, every step runs it; size it beside the training's own peak)")
    t.add_argument("--drop-state", action="store_true",
                   help="remove WORK_DIR/trainer_state.pt (weights and AdamW moments: hundreds of MB on a real "
                        "model) once a complete run's drafter is written (only an unfinished run resumes from it; "
                        "the token data stays)")
    t.add_argument("--no-progress", action="store_true", help="no progress bars (log lines instead)")
    t.add_argument("--max-seconds", type=float, default=None,
                   help="wall-time budget of this call: checkpoint and write the drafter when it is spent "
                        "(--resume continues to --steps)")
    t.add_argument("--fit-schedule", action="store_true",
                   help="with --max-seconds: end the cosine decay at the time budget (the run is complete when it "
                        "is spent, learning rate 0) instead of at --steps")
    t.add_argument("--schedule-seconds", type=float, default=None,
                   help="with --fit-schedule: the cosine spans this many seconds of steps over several calls (each "
                        "stops at --max-seconds, checkpointed; --resume continues the same schedule until the total "
                        "is spent)")
    for f in dataclasses.fields(TrainConfig):
        kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" ")[0], None)
        extra = {}
        if f.name == "prompts":
            kind, extra = str, {"nargs": "+", "metavar": "SOURCE[:WEIGHT]"}
        elif f.name == "position_decay":
            kind = float
        help_ = {"prompts": "sharegpt, chitchat, stdlib_functions, templates or FILE.jsonl[.gz], several mixed by "
                            "weight (default templates)",
                 "position_decay": "position weight factor (default exp(-1/K), the paper's)"}.get(
                     f.name, f"default {f.default}")
        t.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=f.default,
                       help=help_ + " (docs/real_model.md)", **extra)


def _cmd_generate(args: argparse.Namespace) -> int:
    from tensorrt_llm_ext.runtime.generate_cli import main_generate

    return _checkpoint_refusal_exits_2(main_generate, args)


def _checkpoint_refusal_exits_2(command, *args) -> int:
    """A weight refused at load (a NaN / inf tensor; the header checks run with the config, before any work), or a
    KV cache that cannot fit the memory there is, is the same one line and exit 2 as those checks, not a traceback
    (:class:`~tensorrt_llm_ext.contract.BuildRefusal`). At ``serve --tp N`` every rank refuses alike: rank 0 prints
    the line."""
    from tensorrt_llm_ext.contract import BuildRefusal

    try:
        return command(*args)
    except BuildRefusal as e:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2


def _add_generate_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("prompts", nargs="*", help="prompts as token ids ('1 2 3' or '1,2,3') or text (encoded by the "
                                              "model's tokenizer); default: the embedded set")
    g.add_argument("--chat", action="store_true",
                   help="each prompt is a user message, put through the tokenizer's chat template")
    g.add_argument("--prompts-file", help="a file of prompts: one per line (token ids or text, as the positional "
                   "prompts; '#' lines skipped), or a JSON list of id lists and strings")
    g.add_argument("--config", help="runtime YAML (trtllm-serve style); default: the embedded dspark_default.yaml")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks, launched through MPI (default: config)")
    g.add_argument("--max-new-tokens", type=int, default=24)
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (so is T < 1e-5, its T -> 0 limit); more: keyed Gumbel-max sampling")
    g.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (prompt i uses seed + i, modulo 2^63)")
    g.add_argument("--stop", type=int, nargs="*", default=[], help="stop token ids")
    g.add_argument("--draft-len", type=int, default=None, help="override speculative_config.max_draft_len")
    g.add_argument("--vocab-parallel", choices=["auto", "on", "off"], default=None,
                   help="override speculative_config.vocab_parallel_selection")
    g.add_argument("--markov-mode", choices=["exact", "fused", "auto"], default=None,
                   help="override speculative_config.markov_chain_mode")
    g.add_argument("--top-p", type=float, default=1.0, help="exact top-p of sampled requests, in (0, 1] (1 = off)")
    g.add_argument("--rejection-sampling", action="store_true",
                   help="speculative_config.use_rejection_sampling: sampled drafts, rejection-sampling verification")
    g.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture every decode step in CUDA graphs on a CUDA device (default: on, unless the config "
                        "sets cuda_graph_config: null); --no-cuda-graph runs every step eagerly")
    g.add_argument("--check", action="store_true",
                   help="also run the target's own decode and the gathered path; exit 1 unless all agree "
                        "(and something was compared); with --rejection-sampling: sharded == gathered bitwise, "
                        "greedy rows == target decode, every token in the target's top-p set (docs/end_to_end.md)")
    g.add_argument("--rank-timeout", type=seconds, default=60.0,
                   help="TP > 1: seconds a rank waits for a peer in a collective before the job fails "
                        "(bounds how long a hung rank goes unnoticed)")
    g.add_argument("--job-timeout", type=seconds, default=1800.0, help="TP > 1: seconds the whole run may take")
    g.add_argument("--log-dir", help="TP > 1: keep each rank's log (rank<r>.log) in this directory")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--json", dest="json_out", help="also write the results as JSON to this file")
    g.add_argument("--model", default=None,
                   help="a checkpoint directory (Hugging Face Llama; see `trtllm-ext export`); default: embedded")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``command``, the options of that subcommand only (the others' option sets import
    torch-heavy modules: ``--version``, ``--help`` and ``test-list`` start without them)."""
    from tensorrt_llm_ext import __version__

    p = argparse.ArgumentParser(prog="trtllm-ext", description=__doc__)
    p.add_argument("--version", action="version", version=f"trtllm-ext {__version__}")
    sub = p.add_subparsers(dest="command")
    info = sub.add_parser("info", help="report the environment and self-check the distributed layer")
    info.add_argument("--ranks", type=int, default=2, help="ranks for the self-check (1 = skip)")
    tl = sub.add_parser("test-list", help="run a test-db list with pytest",
                        usage="trtllm-ext test-list [NAME] [--dry-run] [--jobs N] [-- PYTEST ARGS ...]",
                        epilog="Arguments after `--` go to every pytest command unchanged, e.g. "
                               "`trtllm-ext test-list l0_cpu -- -x -k markov`.")
    tl.add_argument("name", nargs="?", help="list name (default: lists matching this machine)")
    tl.add_argument("--dry-run", action="store_true", help="print the pytest commands only")
    tl.add_argument("--jobs", type=positive_int, default=None,
                    help="pytest-xdist workers (default: one per core, at most 2, on a CPU machine with "
                         "pytest-xdist installed; 1 = one process)")
    b = sub.add_parser("bench", help="run a benchmark (tables; CUDA-graph timing on GPU)", add_help=False)
    b.add_argument("name")
    g = sub.add_parser("generate", help="speculative generation (DSpark) on the embedded model (the default command)")
    _add_generate_args(g)
    s = sub.add_parser("serve", help="an OpenAI-compatible server (POST /v1/completions) over the engine")
    if command in (None, "serve"):
        from tensorrt_llm_ext.runtime.serve_cli import add_serve_args

        add_serve_args(s)
    sub.add_parser("compile-check", add_help=False,
                   help="compile every Triton kernel for a GPU target without a GPU (sm_90 by default; --help)")
    e = sub.add_parser("export", help="write the configured model as checkpoint directories (HF Llama + drafter)")
    e.add_argument("dir", help="target directory (config.json + model.safetensors, Hugging Face names)")
    e.add_argument("--drafter-dir", default=None, help="drafter directory (default: DIR/dspark_drafter)")
    e.add_argument("--config", help="runtime YAML whose model is exported (default: the embedded one)")
    e.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gg = sub.add_parser("import-gguf", help="write a llama.cpp GGUF (Llama) as a Hugging Face directory "
                        "(dequantized safetensors, tokenizer, generation config)")
    gg.add_argument("file", help="the .gguf file (architecture llama)")
    gg.add_argument("dir", help="the Hugging Face directory to write (serve DIR / generate --model DIR)")
    gg.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="weights' dtype on disk (float32 keeps the dequantized values exactly)")
    gg.add_argument("--no-tokenizer", action="store_true", help="skip the tokenizer files (needs no transformers)")
    tr = sub.add_parser("train-drafter", help="train a DSpark drafter on a target by self-distillation "
                        "(docs/real_model.md)")
    if command in (None, "train-drafter"):
        _add_train_drafter_args(tr)
    return p


def bench_usage() -> str:
    """``trtllm-ext bench --help``: every benchmark with its one-line description (each module is imported
    to read the description it registers)."""
    from tensorrt_llm_ext.bench import BENCHMARK_MODULES
    from tensorrt_llm_ext.bench.harness import load_benchmark

    lines = ["usage: trtllm-ext bench NAME [options]   (trtllm-ext bench NAME --help: its options)", "",
             "benchmarks:"]
    width = max(len(n) for n in BENCHMARK_MODULES)
    for name in sorted(BENCHMARK_MODULES):
        try:
            text = load_benchmark(name).help
        except ImportError as e:  # a missing optional dependency: the others are still listed
            text = f"(unavailable here: {e})"
        lines.append(f"  {name:<{width}}  {text}")
    return "\n".join(lines)


def _split_test_list_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``test-list [NAME] [--dry-run] [-- PYTEST ARGS]`` in any order of NAME and --dry-run."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


# Benchmarks that run a model the way a user does (a CPU runs them with torch ops, like generate / serve).
_MODEL_BENCHMARKS = ("acceptance", "serve")


def _runs_kernels(argv: list[str]) -> bool:
    """Whether a command is about the Triton kernels themselves (the kernel benchmarks), so that a CPU runs
    them in the interpreter. ``generate``, ``serve``, ``train-drafter``, ``info`` and the model benchmarks do
    not: on a CPU without ``TRITON_INTERPRET=1`` their step runs the stock torch ops
    (:func:`~tensorrt_llm_ext.speculative.step_ops.step_ops_for`)."""
    return argv[:1] == ["bench"] and len(argv) > 1 and argv[1] not in _MODEL_BENCHMARKS


def _quick(argv: list[str]) -> int:
    try:
        build_parser(command="").parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-h"], ["--help"]):
        return _quick(argv)
    if argv[:1] == ["compile-check"]:
        # Compiles for a GPU target without one: its workers need compiled (not interpreted) kernels, so it
        # runs before the interpreter is switched on. Test support, imported only for this command.
        from tensorrt_llm_ext.testing.compile_check import main as compile_check_main

        return compile_check_main(argv[1:])
    # The interpreter evaluates masked-off lanes too (inf - inf there, never stored): numpy's warning about them
    # is noise in a server's or a benchmark's log.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    if _runs_kernels(argv):
        from tensorrt_llm_ext.interpreter import ensure_triton_interpreter

        ensure_triton_interpreter()  # on a CPU, before _env is read and before any kernel module is imported
    from tensorrt_llm_ext._env import ENV

    if ENV.errors:
        for err in ENV.errors:
            print(f"error: environment: {err}", file=sys.stderr)
        return 2
    if argv and argv[0] == "bench":
        if len(argv) < 2 or argv[1].startswith("-"):
            print(bench_usage())
            return 0 if len(argv) >= 2 and argv[1] in ("-h", "--help") else 2
        return _cmd_bench(argparse.Namespace(name=argv[1]), argv[2:])
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["generate", *argv]  # generate is the default command
    pytest_args: list[str] = []
    if argv[0] == "test-list":
        head, pytest_args = _split_test_list_args(argv[1:])
        argv = ["test-list", *head]
    # Only the named subcommand's options are built (another name is argparse's error either way).
    parser = build_parser(argv[0])
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _cmd_generate(args)
    if args.command == "serve":
        return _cmd_serve(args, argv)
    if args.command == "export":
        return _cmd_export(args)
    if args.command == "import-gguf":
        return _cmd_import_gguf(args)
    if args.command == "train-drafter":
        return _cmd_train_drafter(args)
    if args.command == "info":
        return _cmd_info(args)
    if args.command == "test-list":
        args.pytest_args = pytest_args
        return _cmd_test_list(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
