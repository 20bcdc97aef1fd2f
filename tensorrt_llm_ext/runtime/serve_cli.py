"""The body of ``trtllm-ext serve``: checks before any work, the TP launch through mpiexec, one rank's server.

``serve --tp N`` (or ``tensor_parallel_size: N``) outside an MPI job re-runs itself under ``mpiexec -n N``
(environment ``TLLM_EXT_SERVE_RANK=1``) and forwards SIGTERM/SIGINT to it; rank 0 serves HTTP, the other
ranks follow rank 0's plans. Every rank runs under a small supervisor (``runtime/rank_supervisor.py``): MPI launchers
kill all ranks the moment one process they started dies, so a follower that dies is reported by its
supervisor (which rank, how), and the supervisor lingers while rank 0 notices the loss, answers 503 and
exits non-zero by itself (the launcher then exits non-zero too).

Exit codes: 0 after a SIGTERM/SIGINT drain; 128 + the signal (130 / 143) when a second SIGINT / SIGTERM cut
the drain short (every request still running ended with its error first); 2 for a bad argument, config, port,
a tokenizer larger than the model's vocabulary or ``--tp N`` above the host's GPU count (before any work);
3 when the engine or a rank failed while serving.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import traceback

from tensorrt_llm_ext.argtypes import MAX_TIMEOUT_S
from tensorrt_llm_ext.runtime.config import (LOG_LEVELS, ConfigError, RuntimeConfig, describe_drafter, load_config,
                                             log_no_effect_fields)

EXIT_USAGE = 2


def _port_error(host: str, port: int) -> str | None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


# trtllm-serve and vLLM flags that set a config field (argparse dest -> dotted config path); the others are
# spellings of this CLI's own flags (--tp_size = --tensor-parallel-size = --tp, --max-model-len = --max_seq_len,
# --extra_llm_api_options = --config).
TRTLLM_SERVE_FIELDS = {
    "dtype": "dtype",
    "tp": "tensor_parallel_size",
    "max_batch_size": "max_batch_size",
    "max_seq_len": "max_seq_len",
    "max_num_tokens": "max_num_tokens",
    "log_level": "log_level",
    "backend": "backend",
    "kv_cache_free_gpu_memory_fraction": "kv_cache_config.free_gpu_memory_fraction",
    "trust_remote_code": "trust_remote_code",
    "enable_prefix_caching": "kv_cache_config.enable_block_reuse",
    "pp_size": "pipeline_parallel_size",
    "ep_size": "moe_expert_parallel_size",
    "stream_interval": "stream_interval",
}


def config_overrides(args: argparse.Namespace) -> dict:
    """The config fields the command line sets (flags left out set nothing: the YAML or the default holds)."""
    return {path: getattr(args, dest) for dest, path in TRTLLM_SERVE_FIELDS.items() if getattr(args, dest) is not None}


def log_no_effect_flags(args: argparse.Namespace) -> None:
    """One line per flag given that sets a *no effect here* field to its default (the config's own lines
    name only values that differ from TensorRT-LLM's default, but a user who typed the flag asked for it)."""
    from tensorrt_llm_ext.logger import info_once
    from tensorrt_llm_ext.runtime.config import RuntimeConfig as _Cfg, no_effect_reason

    defaults = _Cfg().model_dump()
    for dest, path in TRTLLM_SERVE_FIELDS.items():
        value = getattr(args, dest)
        reason = no_effect_reason(path) if value is not None else None
        node = defaults
        for key in path.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if reason is not None and value == node:
            info_once(f"serve --{dest.replace('_', '-')}: accepted, no effect here ({reason})")


def model_argument(args: argparse.Namespace) -> str | None:
    """``serve DIR`` or ``serve --model DIR`` (vLLM's and ``generate``'s spelling); both must agree."""
    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        raise ConfigError(f"the model is given twice: {args.model} and --model {args.model_flag}")
    return args.model if args.model is not None else args.model_flag


def _load(args: argparse.Namespace) -> RuntimeConfig:
    """The job's config; its *no effect here* lines are logged later, once per job (rank 0 or TP 1)."""
    cfg = load_config(args.config, model_dir=model_argument(args), log_no_effect=False, **config_overrides(args))
    if cfg.log_level is not None:
        from tensorrt_llm_ext.logger import logger

        logger.setLevel(LOG_LEVELS[cfg.log_level])
    return cfg


def check_serve_args(args: argparse.Namespace) -> tuple[RuntimeConfig | None, str | None]:
    """The resolved config, or a one-line error (config, paths, port) -- before any model is built."""
    try:
        cfg = _load(args)
    except ConfigError as e:
        return None, str(e)
    if not 1 <= args.port <= 65535:
        return None, f"--port {args.port}: expected 1..65535"
    if args.max_queue < 1:
        return None, f"--max-queue {args.max_queue}: expected >= 1"
    if not 0 < args.drain_timeout <= MAX_TIMEOUT_S:
        return None, f"--drain-timeout {args.drain_timeout:g}: expected seconds in (0, {MAX_TIMEOUT_S:g}]"
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        return None, f"--max-body-bytes {args.max_body_bytes}: expected >= 1"
    err = api_key_error(args)
    if err:
        return None, err
    tok = args.tokenizer or cfg.tokenizer
    if tok is not None and not os.path.isdir(tok):
        return None, f"tokenizer directory {tok} not found"
    from tensorrt_llm_ext.runtime.tokenizer import TOKENIZER_FILES, has_tokenizer_files

    if tok is not None and not has_tokenizer_files(tok):
        # a named tokenizer that is not there would serve token-id prompts only, every text prompt a 400
        return None, (f"tokenizer directory {tok} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                      f"leave --tokenizer out for the model directory's")
    err = _tokenizer_error(tok or cfg.model.path, cfg.model.target.vocab_size)
    if err:
        return None, err
    from tensorrt_llm_ext.runtime import launch

    err = launch.tp_gpu_error(cfg.tensor_parallel_size)
    if err:
        return None, err
    try:
        read_chat_template(args.chat_template)
    except ValueError as e:
        return None, str(e)
    err = _port_error(args.host, args.port)
    return (None, err) if err else (cfg, None)


def _tokenizer_error(directory: str | None, vocab_size: int) -> str | None:
    """The tokenizer that would be served must not produce ids past the model's vocabulary (checked here,
    before any rank starts, so a mismatched pair exits 2 instead of failing requests)."""
    from tensorrt_llm_ext.runtime.tokenizer import load_tokenizer, tokenizer_vocab_error

    tokenizer = load_tokenizer(directory)
    err = tokenizer_vocab_error(tokenizer, vocab_size) if tokenizer is not None else None
    return f"tokenizer {directory}: {err}" if err else None


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the Jinja template itself (vLLM's rule: a path that exists is read;
    otherwise a value with Jinja markup is the template)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: expected a file or a Jinja template, got neither")


def api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``TLLM_EXT_API_KEY``, else None (no key; an empty one is refused first:
    :func:`api_key_error`)."""
    from tensorrt_llm_ext._env import ENV

    return args.api_key or ENV.api_key or None


def api_key_error(args: argparse.Namespace) -> str | None:
    """A key no HTTP client could send back (``Authorization`` carries printable ASCII, and clients strip the
    value's ends), or an empty ``--api-key`` or ``TLLM_EXT_API_KEY`` (which would silently mean no key: a
    ``TLLM_EXT_API_KEY=$SECRET`` with ``SECRET`` unset must not start an open server): one line that never
    shows the key, else None."""
    from tensorrt_llm_ext._env import ENV

    where = "--api-key" if args.api_key is not None else "TLLM_EXT_API_KEY"
    key = args.api_key if args.api_key is not None else ENV.api_key
    if key is None:
        return None
    if key == "":
        fix = "leave the flag out" if args.api_key is not None else "unset the variable"
        return f"{where}: empty (an empty key would mean no key: {fix} to serve without one)"
    if key != key.strip():
        return f"{where}: the key starts or ends with whitespace, which HTTP clients strip: no client could send it"
    bad = next((c for c in key if not 0x20 <= ord(c) <= 0x7E), None)
    if bad is not None:
        return (f"{where}: the key holds the character U+{ord(bad):04X}; an "
                f"Authorization header carries printable ASCII only, so no standard client could send it")
    return None


# A dead follower's supervisor stays this long: rank 0 notices the loss at its next heartbeat, answers
# 503 for the failure grace and exits (about 3 s); the rest bounds a rank 0 stuck in a collective.
FOLLOWER_LINGER_S = 30.0


def launch_tp(tp: int, argv: list[str]) -> int:
    """Run this command on ``tp`` MPI ranks (:func:`~tensorrt_llm_ext.runtime.ranks.launch_command`: every
    rank under a supervisor, SIGTERM/SIGINT forwarded); return the launcher's exit code."""
    from tensorrt_llm_ext.runtime.ranks import launch_command

    # A follower that dies does not take rank 0 down with it before rank 0 has answered 503 and exited.
    try:
        return launch_command(tp, [sys.executable, "-m", "tensorrt_llm_ext.cli", *argv], linger_s=FOLLOWER_LINGER_S,
                              env={"TLLM_EXT_SERVE_RANK": "1"})
    except FileNotFoundError as e:
        print(f"error: serve --tp N needs mpiexec: {e}", file=sys.stderr)
        return EXIT_USAGE


def use_overlap_scheduler(cfg: RuntimeConfig, disable: bool = False, log: bool = True) -> bool:
    """Whether the engine loop overlaps each step's host work with the next step on the device: on unless
    ``--disable-overlap-scheduler`` (``disable``) or ``disable_overlap_scheduler: true``; logged (``log``)."""
    from tensorrt_llm_ext.logger import logger

    on = not (disable or cfg.disable_overlap_scheduler)
    if log:
        logger.info("serve: overlap scheduler " + (
            "on: step n's tokens are stop-checked and streamed while the device runs step n + 1" if on else
            "off (--disable-overlap-scheduler or disable_overlap_scheduler: true): each step's host work runs "
            "between steps"))
    return on


def use_cuda_graph(cfg: RuntimeConfig, flag: bool | None = None) -> bool:
    """Whether every decode step is captured in CUDA graphs: on a CUDA device, ``flag`` (``--cuda-graph`` /
    ``--no-cuda-graph``) when given, else ``cuda_graph_config`` (present by default; ``null`` turns graphs
    off). On a CPU never (logged once)."""
    import torch

    from tensorrt_llm_ext.logger import info_once

    if not torch.cuda.is_available():
        if flag or (flag is None and cfg.cuda_graph_config is not None):
            info_once("CUDA graphs: no CUDA device, every step runs eagerly")
        return False
    return cfg.cuda_graph_config is not None if flag is None else flag


def serve_rank(cfg: RuntimeConfig, args: argparse.Namespace) -> int:
    """Build this rank's engine and serve (rank 0) or follow (other ranks)."""
    import torch

    from tensorrt_llm_ext import __version__
    from tensorrt_llm_ext._env import ENV
    from tensorrt_llm_ext.logger import logger
    from tensorrt_llm_ext.runtime.compile_watch import compile_watch
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.scheduler import Scheduler
    from tensorrt_llm_ext.runtime.tokenizer import resolve_tokenizer
    from tensorrt_llm_ext.runtime.server import (EXIT_ENGINE_FAILED, EngineLoop, PlanChannel, ServeContext,
                                                 ServerMetrics, follower_loop, run_server, served_model_name)
    from tensorrt_llm_ext.runtime.gc_pauses import freeze_startup_heap, gc_pauses
    from tensorrt_llm_ext.runtime.warmup import warm_up

    tp = cfg.tensor_parallel_size
    mapping = None
    if tp > 1:
        from tensorrt_llm_ext.distributed import init_from_mpi

        mapping = init_from_mpi(tp_size=tp, enable_attention_dp=cfg.enable_attention_dp)
        from tensorrt_llm_ext.runtime.rank_files import JOB_JOINED, tell_supervisor

        tell_supervisor(JOB_JOINED)  # the groups are up, so every rank is past MPI_Init (see the supervisor)
        if mapping.rank != 0:
            # SIGTERM reaches every rank; only rank 0 decides when to stop (after draining).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    device = None
    if torch.cuda.is_available():
        local = mapping.local_rank if mapping is not None else 0
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the tiny model's GEMMs; ranks share the cores (see runtime/launch.py)
    if mapping is None or mapping.rank == 0:
        log_no_effect_fields(cfg)  # once per job, not once per rank
        log_no_effect_flags(args)
        logger.info(describe_drafter(cfg) if not args.no_speculation else "drafter: not used (--no-speculation)")
    engine = Engine(cfg, mapping, device=device, use_cuda_graph=use_cuda_graph(cfg, args.cuda_graph))
    # Binding the worker and capturing the served decode's graphs agree across ranks (collectives): every
    # rank does both here, in the same order, before rank 0 starts planning and the others start following.
    selection = engine.worker("speculative").selection.describe()
    mode = "target_only" if args.no_speculation else "speculative"
    engine.runner(mode)
    overlap = use_overlap_scheduler(cfg, args.disable_overlap_scheduler, log=mapping is None or mapping.rank == 0)
    # Every kind of admission once, so no request of the served traffic waits for a kernel build (every rank alike).
    compile_watch.install()  # also when the warm-up is switched off: a build while serving is still logged
    warm_up(engine, mode, overlap)
    compile_watch.serving()  # from here each build is a warning and a /metrics count
    # The start-up heap (torch, Triton, the model, the graphs, the warm-up's leftovers) out of every later collection:
    # a full collection while serving walks only what serving allocated (runtime/gc_pauses.py).
    freeze_startup_heap(ENV.serve_gc_freeze)
    gc_pauses.install()  # /metrics: collections and their pauses while serving
    scheduler = Scheduler(engine, mode=mode, overlap=overlap)
    channel = PlanChannel(mapping)
    ranks = [{"rank": 0, "pid": os.getpid()}]
    if channel.distributed:
        import torch.distributed as dist

        ranks = [None] * tp
        dist.all_gather_object(ranks, {"rank": mapping.rank, "pid": os.getpid()}, group=channel.group)
        from tensorrt_llm_ext.logger import flush_rank_logs

        flush_rank_logs(channel.group)  # start-up lines: once when identical, per rank when they differ
        if mapping.rank != 0:
            from tensorrt_llm_ext.runtime.rank_files import SERVING, tell_supervisor

            tell_supervisor(SERVING)  # from now on a loss of this rank may leave requests in flight (rank 0: 503)
            try:
                follower_loop(scheduler, channel)
            except BaseException as e:  # rank 0 died or timed out: leave without MPI_Finalize (a dead peer hangs it)
                logger.error(f"serve: rank {mapping.rank} lost rank 0: {type(e).__name__}: {e}")
                os._exit(EXIT_ENGINE_FAILED)
            os._exit(0)
    # Rank 0 builds its server and serves. At TP N the followers are in their loop by now: a failure here (an error
    # building the server, uvicorn unable to listen: SystemExit 3) leaves through _serve_tp_rank's exit, with the code
    # it has at TP 1.
    names = args.served_model_name or []
    name = served_model_name(cfg, names[0] if names else None)
    metrics = ServerMetrics(cfg.draft_len, model_name=name, max_model_len=cfg.max_seq_len)
    loop = EngineLoop(scheduler, channel, metrics, max_queue=args.max_queue, ranks=ranks,
                      speculative=not args.no_speculation, stream_interval=cfg.stream_interval or 1)
    ctx = ServeContext(loop=loop, model_name=name, vocab_size=engine.vocab_size, max_seq_len=cfg.max_seq_len,
                       tokenizer=resolve_tokenizer(cfg, args.tokenizer),
                       speculative=not args.no_speculation, chat_template=read_chat_template(args.chat_template),
                       model_aliases=tuple(names[1:]), api_key=api_key(args),
                       **({"max_body_bytes": args.max_body_bytes} if args.max_body_bytes is not None else {}))
    ready = (f"trtllm-ext {__version__} serve: http://{args.host}:{args.port} model={name} tp={tp} "
             f"K={cfg.draft_len if not args.no_speculation else 'off'} max_batch_size={cfg.max_batch_size} "
             f"selection={selection} overlap={'on' if overlap else 'off'} "
             f"tokenizer={'yes' if ctx.tokenizer is not None else 'no (token-id prompts)'} "
             f"api_key={'yes' if ctx.api_key else 'no'}")
    rc = run_server(ctx, metrics, args.host, args.port, args.drain_timeout, ready, access_log=args.access_log)
    if channel.distributed:
        sys.stdout.flush()
        sys.stderr.flush()
        # A second signal ended the drain (rc = 128 + signal): the launcher that passed the signals on reports
        # that code itself; a non-zero rank would make mpiexec report a bad termination and kill the peers.
        os._exit(0 if rc > 128 else rc)  # os._exit: peers may be dead, MPI_Finalize could wait for them forever
    return rc


def _serve_tp_rank(args: argparse.Namespace) -> int:
    """One rank of ``serve --tp N`` (under the launcher). A rank that raises leaves through ``os._exit``, not the
    interpreter's exit, whose hooks wait for the peers -- 10 s at the shutdown barrier, then ``MPI_Finalize`` --
    while they wait in a start-up collective for it, its connections still open (measured: a follower failing while
    the ranks started held the job for rank 0's 120 s collective timeout; rank 0 failing, 22 s; rank 0 failing to
    build its server or to listen once the followers serve, exit 9 after 43 s / 0 or 9). A checkpoint every
    rank refuses (``BuildRefusal``) goes on to the CLI's one line and exit 2: every rank is at the barrier then."""
    from tensorrt_llm_ext.contract import BuildRefusal
    from tensorrt_llm_ext.logger import logger
    from tensorrt_llm_ext.runtime.rank_files import env_rank

    try:
        return serve_rank(_load(args), args)
    except BuildRefusal:
        raise
    except BaseException as e:
        if isinstance(e, SystemExit):
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        else:
            logger.error(f"serve: rank {env_rank()} failed: {type(e).__name__}: {e}")
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main_serve(args: argparse.Namespace, argv: list[str]) -> int:
    from tensorrt_llm_ext._env import ENV

    if ENV.serve_rank:
        return _serve_tp_rank(args)
    cfg, err = check_serve_args(args)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if cfg.tensor_parallel_size > 1:
        return launch_tp(cfg.tensor_parallel_size, argv)
    return serve_rank(cfg, args)


def _dtype(value: str) -> str:
    dtype = {"float": "float32", "auto": "auto", "bfloat16": "bfloat16", "float32": "float32"}.get(value)
    if dtype is None:
        raise argparse.ArgumentTypeError(f"expected auto, bfloat16, float32 or float, got {value!r}")
    return dtype


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a Hugging Face Llama directory (see `trtllm-ext export`); default: the embedded model")
    p.add_argument("--model", dest="model_flag", default=None, metavar="DIR", help="the same as the positional DIR")
    p.add_argument("--config", "--extra_llm_api_options", dest="config",
                   help="trtllm-serve style YAML, layered over the embedded default")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tp", "--tp_size", "--tensor-parallel-size", "-tp", dest="tp", type=int, default=None,
                   help="tensor-parallel ranks (over MPI); default: the config")
    # trtllm-serve's and vLLM's spellings of config fields (TRTLLM_SERVE_FIELDS); unset: the YAML or the default.
    p.add_argument("--max_batch_size", "--max-num-seqs", dest="max_batch_size", type=int, default=None,
                   help="= max_batch_size (request slots)")
    p.add_argument("--max_seq_len", "--max-model-len", dest="max_seq_len", type=int, default=None,
                   help="= max_seq_len (prompt + generated tokens, max_model_len)")
    p.add_argument("--dtype", type=_dtype, default=None,
                   help="= dtype: auto, bfloat16 or float32 (vLLM's 'float' = float32; float16 is not served)")
    p.add_argument("--max_num_tokens", type=int, default=None, help="= max_num_tokens (tokens of one prefill forward with enable_chunked_prefill)")
    p.add_argument("--log_level", choices=sorted(LOG_LEVELS), default=None, help="= log_level")
    p.add_argument("--backend", choices=["pytorch"], default=None, help="= backend (this runtime is its own)")
    p.add_argument("--kv_cache_free_gpu_memory_fraction", "--gpu-memory-utilization",
                   dest="kv_cache_free_gpu_memory_fraction", type=float, default=None,
                   help="= kv_cache_config.free_gpu_memory_fraction: the KV page pool's share of the GPU memory "
                        "free after the weights (TensorRT-LLM's meaning; vLLM's --gpu-memory-utilization, a share "
                        "of the whole GPU, is read the same way); no effect on a CPU")
    p.add_argument("--trust_remote_code", "--trust-remote-code", dest="trust_remote_code", action="store_const",
                   const=True, default=None, help="= trust_remote_code (accepted, no effect: no remote code is run)")
    p.add_argument("--enable-prefix-caching", "--enable_prefix_caching", dest="enable_prefix_caching",
                   action=argparse.BooleanOptionalAction, default=None,
                   help="= kv_cache_config.enable_block_reuse: a prompt's whole cache pages, once prefilled, serve "
                        "later prompts that start with the same tokens (default off)")
    p.add_argument("--pp_size", "--pipeline-parallel-size", "-pp", dest="pp_size", type=int, default=None,
                   help="= pipeline_parallel_size (1 only: no pipeline parallelism)")
    p.add_argument("--ep_size", "--moe_expert_parallel_size", dest="ep_size", type=int, default=None,
                   help="= moe_expert_parallel_size (accepted, no effect: dense targets, no experts)")
    p.add_argument("--stream_interval", "--stream-interval", dest="stream_interval", type=int, default=None,
                   help="= stream_interval: a stream's tokens go out once this many have gathered (its first token "
                        "and its end at once; default 1: every step)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model id of /v1/models and responses; further names are accepted as `model` too")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) replacing the tokenizer's")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: TLLM_EXT_API_KEY; none: open)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="one log line per HTTP request (uvicorn's access log; default off)")
    p.add_argument("--disable-uvicorn-access-log", dest="access_log", action="store_false",
                   help="vLLM's spelling of --no-access-log")
    p.add_argument("--max-queue", type=int, default=1024, help="requests waiting for a slot before 429")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="larger request bodies answer 413 without being parsed (default 8 MiB)")
    p.add_argument("--no-speculation", action="store_true",
                   help="serve the target's own decode, one token per step (no drafter; a baseline for bench serve)")
    p.add_argument("--disable-overlap-scheduler", action="store_true",
                   help="run each step's host work (stop checks, streaming, admission) between steps instead of "
                        "while the device runs the next step (the overlap scheduler, on by default); "
                        "= disable_overlap_scheduler: true")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="capture every decode step in CUDA graphs on a CUDA device (default: on, unless the config "
                        "sets cuda_graph_config: null); --no-cuda-graph runs every step eagerly")
