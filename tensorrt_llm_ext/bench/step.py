"""``trtllm-ext bench step``: one DSpark decode step, by stage, with the fused and the stock op table.

Both columns time the same :class:`~tensorrt_llm_ext.speculative.dspark_worker.DSparkWorker` code on
the same engine state: ``ours`` is the worker with :data:`~tensorrt_llm_ext.speculative.step_ops.FUSED_OPS`
(this module's kernels), ``stock`` the worker with :data:`~tensorrt_llm_ext.speculative.step_ops.STOCK_OPS`
-- the upstream eager path (gathered logits + ``torch.argmax``, the eager acceptance/bookkeeping chains,
an eager store, the ``F.linear`` + add + ``torch.argmax`` Markov chain). Both workers are greedy-only
(every row of the benchmark is a greedy generation request), as an upstream greedy worker is.

Per batch size B (every row a live request, K drafts), each stage is a worker method captured in a CUDA
graph and replayed (median):

* ``target fwd``: the verification forward (identical for both tables);
* ``select``: the LM head + the target's tokens (vocab-parallel kernel / ``torch.argmax`` on the gathered
  logits);
* ``tail``: strict acceptance + paged-latent bookkeeping + context-latent store;
* ``draft fwd``: the drafter's block decode + its LM head: ours with the fused block-attention kernel and fused
  layers, stock with their eager twins (the upstream path; same drafter object,
  :meth:`DSparkDrafter.set_attention_backend` / ``set_layer_backend`` switched before the stock column's graphs
  are captured);
* ``chain``: the Markov draft chain;
* ``outside target`` = select + tail + draft fwd + chain, and the whole step ``worker.forward(B)``.

``--temperature T [--top-p P] [--rejection-sampling]``: the sampled mode. Every row samples at ``T``; with
``--rejection-sampling`` the drafter's chain samples its drafts and the step verifies them by rejection
sampling (:func:`~tensorrt_llm_ext.speculative.verification.rejection_sample` on the shard for ours, its eager
twin on the gathered logits for stock), else the target's sampled tokens are accepted strictly. The whole step
is timed per table under CUDA-graph replay of the variant the engine replays for these rows (the top-p variant
when ``--top-p < 1``, see :mod:`tensorrt_llm_ext.runtime.cuda_graph`), next to the greedy step of the same fused
worker at the same B (``sampled / greedy``, in one run); ``--profile`` adds the fused sampled step by stage
(:class:`SampledStages`, each stage captured alone) and lists the top kernels of one captured sampled step of
each table.

``--model DIR``: the stages of a checkpoint directory's step (a Hugging Face Llama directory as ``import-gguf``
writes it, its drafter ``DIR/dspark_drafter`` when present) instead of the synthetic model: the config and the
engine come from :func:`~tensorrt_llm_ext.runtime.config.load_config` ``(model_dir=DIR)`` as ``serve DIR`` /
``generate --model DIR`` build them (no drafter: the seeded bigram drafter they build, said in a log line); the
checkpoint fixes the vocabulary (``--vocab`` is refused), ``--draft-len`` / ``--markov-mode`` / the largest batch
size are set over it. ``--no-stock``: ours only (greedy: the stock column "-"; sampled: ours and the greedy step).

On CPU: a smoke run of the tiny test model (timings meaningless, printed as "-"). The Triton interpreter is
switched on when :func:`run` starts (not at import).
"""

from __future__ import annotations

import argparse
import sys

from typing import TYPE_CHECKING

import torch

from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.argtypes import int_list, positive_int
from tensorrt_llm_ext.bench.harness import BenchTimer, first_line, fmt, print_table, register_benchmark
from tensorrt_llm_ext.runtime.config import MAX_BATCH_SIZE
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

if TYPE_CHECKING:
    from tensorrt_llm_ext.runtime.engine import Engine

GPU_MODEL = {
    "model.dtype": "bfloat16", "model.drafter_init": "random", "model.target.vocab_size": 128256,
    "model.target.hidden_size": 1024, "model.target.num_layers": 2, "model.target.num_heads": 8,
    "model.target.num_kv_heads": 8, "model.target.head_dim": 128, "model.target.intermediate_size": 2816,
    "model.target.capture_layers": [0, 1], "model.drafter.num_layers": 1, "model.drafter.num_heads": 8,
    "model.drafter.head_dim": 64, "model.drafter.latent_dim": 256, "model.drafter.intermediate_size": 2816,
    "speculative_config.markov_rank": 256, "max_seq_len": 256, "kv_cache_config.tokens_per_block": 64,
}


def cpu_model() -> dict:
    from tensorrt_llm_ext.configs.tiny_model import tiny_model

    return tiny_model(**{"model.drafter_init": "random", "model.target.vocab_size": 517,
                         "speculative_config.markov_rank": 8})


STAGES = ("target_fwd", "select", "tail", "draft_fwd", "chain", "step")


def _add_args(p: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a checkpoint directory (as import-gguf writes it; its drafter DIR/dspark_drafter when "
                        "present, else the seeded bigram drafter serve builds): time its step, loaded as serve DIR "
                        "loads it, instead of the synthetic model")
    p.add_argument("--batch-sizes", type=int_list(1, MAX_BATCH_SIZE), default="1,2,4,8,16,32,64" if cuda else "1,2")
    p.add_argument("--draft-len", type=positive_int, default=7 if cuda else 3)
    p.add_argument("--vocab", type=positive_int, default=None,
                   help=f"the synthetic model's vocabulary (default {128256 if cuda else 517}); not with --model "
                        "(the checkpoint fixes it)")
    p.add_argument("--prompt-len", type=positive_int, default=64 if cuda else 8)
    p.add_argument("--markov-mode", choices=["exact", "fused", "auto"], default="auto")
    p.add_argument("--profile", action="store_true",
                   help="print the top kernels of one captured fused step per batch size (torch profiler)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: the sampled mode (every row samples at this temperature; whole step timed)")
    p.add_argument("--top-p", type=float, default=1.0, help="the sampled rows' top-p (sampled mode)")
    p.add_argument("--rejection-sampling", action="store_true",
                   help="sampled mode: sampled drafts + rejection-sampling verification (else strict acceptance)")
    p.add_argument("--no-stock", action="store_true",
                   help="time ours only: greedy mode, the stock column printed as '-'; sampled mode, ours and the "
                        "greedy step (the stock table's eager twins take most of a run's time at large B or on a "
                        "many-layer --model)")


def _drafter_paths(eng) -> dict[str, tuple[str, str]]:
    """The drafter's (block attention, layers) per table: ours as resolved at build (the fused kernels where Triton
    runs), stock the eager twins (upstream's torch ops)."""
    return {"ours": (eng.drafter.attention_backend, eng.drafter.layer_backend), "stock": ("eager", "eager")}


def _use_drafter_paths(eng, paths: tuple[str, str]) -> None:
    """Switch the drafter to ``(block attention, layers)`` (before a table's graphs are captured)."""
    eng.drafter.set_attention_backend(paths[0])
    eng.drafter.set_layer_backend(paths[1])


class StepStages:
    """The stage callables of one worker at batch size ``b`` over the live rows set up by :func:`setup_rows`."""

    def __init__(self, eng: Engine, worker, b: int, ctx0: torch.Tensor):
        self.eng, self.w, self.b, self.ctx0 = eng, worker, b, ctx0
        worker.set_rows(list(range(b)), b)
        worker.decode_pages()
        self.tokens, self.positions, out = worker.verify_forward(b)
        self.tokens = self.tokens.clone()
        self.hidden, self.captured = out.hidden_states, out.captured
        self.targets, _ = worker.select_targets(b, self.hidden, self.positions)
        self.targets = self.targets.clone()
        self.tail_out = self._tail()
        eng.state.ctx_lens.copy_(ctx0)
        self.slots = worker.slot_ids[:b]
        self.base = worker.draft_block_logits(self.tail_out, self.slots).clone()
        self.anchors = self.tail_out.bonus_tokens.clone()

    def target_fwd(self):
        return self.w.verify_forward(self.b)

    def select(self):
        return self.w.select_targets(self.b, self.hidden, self.positions)

    def _tail(self):
        accepted, num_acc = self.w.strict_accept(self.b, self.tokens, self.targets)
        return self.w.update_drafter_context(self.b, accepted, num_acc, self.captured)

    def tail(self):
        self.eng.state.ctx_lens.copy_(self.ctx0)  # thousands of replays never run past the caches
        return self._tail()

    def draft_fwd(self):
        return self.w.draft_block_logits(self.tail_out, self.slots)

    def chain(self):
        return self.w.markov(self.base, self.anchors)

    def step(self):
        self.eng.state.ctx_lens.copy_(self.ctx0)
        return self.w.forward(self.b)


class SampledStages:
    """The stage callables of a sampling worker's step at batch size ``b`` (rows set up by :func:`setup_rows`
    and :meth:`DSparkWorker.set_rows`): what ``--profile`` times one by one in the sampled mode.

    ``head``: the target's LM head on the verified rows; ``decision``: the head, the exact top-p restriction
    and the verification (rejection sampling with ``--rejection-sampling``, else the keyed target draw and strict
    acceptance); ``tail``: paged-latent bookkeeping + context-latent store; ``draft``: the drafter's block
    decode, the sampled Markov chain and the stored draft logits; ``step``: ``worker.forward(B)``."""

    NAMES = ("target_fwd", "head", "decision", "tail", "draft", "step")

    def __init__(self, eng: Engine, worker, b: int, ctx0: torch.Tensor):
        self.eng, self.w, self.b, self.ctx0 = eng, worker, b, ctx0
        worker.decode_pages()
        tokens, positions, out = worker.verify_forward(b)
        self.tokens, self.positions = tokens.clone(), positions.clone()
        self.hidden, self.captured = out.hidden_states.clone(), out.captured.clone()
        accepted, num_acc, _ = worker.sample_and_accept_draft_tokens(b, self.tokens, self.positions, self.hidden)
        self.accepted, self.num_acc = accepted.clone(), num_acc.clone()
        self.tail_out = worker.update_drafter_context(b, self.accepted, self.num_acc, self.captured)
        eng.state.ctx_lens.copy_(ctx0)
        self.slots = worker.slot_ids[:b]
        self.drafts = torch.empty_like(self.tokens[:, 1:])

    def target_fwd(self):
        return self.w.verify_forward(self.b)

    def head(self):
        return self.w.token_selector.target_logits(self.hidden)

    def decision(self):
        return self.w.sample_and_accept_draft_tokens(self.b, self.tokens, self.positions, self.hidden)

    def tail(self):
        self.eng.state.ctx_lens.copy_(self.ctx0)  # thousands of replays never run past the caches
        return self.w.update_drafter_context(self.b, self.accepted, self.num_acc, self.captured)

    def draft(self):
        return self.w.draft(self.tail_out, self.slots, self.drafts)

    def step(self):
        self.eng.state.ctx_lens.copy_(self.ctx0)
        return self.w.forward(self.b)


def setup_rows(eng, b: int, prompt_len: int, worker=None, temperature: float = 0.0, top_p: float = 1.0) -> torch.Tensor:
    """``b`` live requests on slots ``0..b-1`` (one batched prefill; greedy unless ``temperature > 0``); returns
    their ``ctx_lens`` to restore between replays."""
    w = worker if worker is not None else eng.worker("speculative", sampling=False)
    slots = list(range(b))
    for slot in slots:
        eng.pages.allocate(slot, eng.pages.max_pages_per_slot)
    prompts = [[(slot * 7919 + i * 104729) % eng.vocab_size for i in range(prompt_len)] for slot in slots]
    w.prefill_batch(slots, prompts, [SamplingParams(temperature, top_p, seed=1000 + s) for s in slots])
    return eng.state.ctx_lens.clone()


def _profile(step, top: int = 12) -> list[str]:
    """Top CUDA kernels of one captured ``step()`` (replayed under the torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    with graph_capture(graph):
        step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top)
    return table.splitlines()


@register_benchmark("step", "one DSpark decode step by stage: fused vs stock op table (CUDA graphs)",
                    add_args=_add_args)
def run(args: argparse.Namespace) -> int:
    from tensorrt_llm_ext.interpreter import ensure_triton_interpreter

    ensure_triton_interpreter()  # at run time, before the engine imports any kernel module (CPU smoke run)
    from tensorrt_llm_ext.contract import BuildRefusal
    from tensorrt_llm_ext.runtime.config import ConfigError, load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.generate_cli import sampling_from_flags

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    sizes = [int(x) for x in args.batch_sizes.split(",")]

    def refuse(msg: str) -> int:
        print(f"error: bench step: {msg}", file=sys.stderr)
        return 2

    err = None
    try:
        sampling_from_flags(args.temperature, args.top_p, 0)
    except ValueError as e:
        err = str(e)
    if err is None and args.temperature == 0 and (args.rejection_sampling or args.top_p < 1.0):
        err = "--rejection-sampling / --top-p need --temperature > 0 (the sampled mode)"
    if err is None and args.model is not None and args.vocab is not None:
        err = f"--vocab: not with --model (the checkpoint {args.model} fixes the vocabulary)"
    if err:
        return refuse(err)
    # --model: the checkpoint through the loader serve DIR / generate --model DIR use (sizes, drafter, dtype,
    # max_seq_len from the directory); else the synthetic model. The run's own fields go over either.
    model = {} if args.model is not None else {**(GPU_MODEL if cuda else cpu_model()),
                                               "model.target.vocab_size": args.vocab or (128256 if cuda else 517)}
    model.update({"speculative_config.max_draft_len": args.draft_len,
                  "speculative_config.markov_chain_mode": args.markov_mode, "max_batch_size": max(sizes),
                  "speculative_config.use_rejection_sampling": bool(args.rejection_sampling)})
    try:
        cfg = load_config(model_dir=args.model, **model)
    except (ConfigError, OSError) as e:  # a missing / broken directory, a K or batch size the config refuses
        first = first_line(e)
        return refuse(f"--model {args.model}: {first}" if args.model is not None else first)
    if args.prompt_len + cfg.draft_len + 1 > cfg.max_seq_len:  # a request of the prompt and one step's K + 1
        return refuse(f"--prompt-len {args.prompt_len} with K={cfg.draft_len} does not fit max_seq_len "
                      f"{cfg.max_seq_len} (prompt + K + 1 tokens, as a request that makes one step)")
    if args.model is not None:
        from tensorrt_llm_ext.logger import logger
        from tensorrt_llm_ext.runtime.config import DRAFTER_SUBDIR, describe_drafter

        if cfg.model.drafter_path is None:
            logger.info(f"bench step: no trained drafter in {args.model} (no {DRAFTER_SUBDIR}/): timing what serve "
                        f"builds without one -- {describe_drafter(cfg)}")
        else:
            logger.info(f"bench step: {describe_drafter(cfg)}")
    try:
        eng = Engine(cfg)
    except BuildRefusal as e:  # weights refused at load (NaN / inf), a KV pool that cannot fit: one line, as serve
        return refuse(str(e).strip().splitlines()[0])
    if args.temperature > 0:
        _run_sampled(args, cfg, eng, sizes)
        return 0
    # A whole step is ~1 ms: few replays per sample keep the run to minutes at every batch size.
    timer = BenchTimer(reps=7, calls_per_rep=4)
    fused = eng.worker("speculative", sampling=False)
    tables = {"ours": fused}
    if not args.no_stock:  # the stock table's eager twins double a many-layer model's run
        tables["stock"] = eng.worker("stock", sampling=False)
    paths = _drafter_paths(eng)
    rows, profiles = [], []
    for b in sizes:
        ctx0 = setup_rows(eng, b, args.prompt_len)
        snapshot = [t.clone() for t in eng.state.mutable_tensors()]
        t: dict[tuple[str, str], float] = {}
        for table, worker in tables.items():
            _use_drafter_paths(eng, paths[table])
            stages = StepStages(eng, worker, b, ctx0)
            for name in STAGES:
                if name == "target_fwd" and table == "stock":
                    t[(name, table)] = t[(name, "ours")]  # the same model code in both tables
                    continue
                t[(name, table)] = timer.time_graph([getattr(stages, name)], min_calls_per_graph=4)
                for dst, src in zip(eng.state.mutable_tensors(), snapshot):  # every stage starts alike
                    dst.copy_(src)
            if args.profile and cuda and table == "ours":
                profiles += [f"profile of one captured fused step at B={b}:"] + _profile(stages.step)
        outside = {tab: sum(t[(s, tab)] for s in ("select", "tail", "draft_fwd", "chain")) for tab in tables}
        stocked = "stock" in tables
        pair = lambda s: f"{fmt(t[(s, 'ours')])} / {fmt(t[(s, 'stock')]) if stocked else '-'}"  # noqa: E731
        gain = lambda o, s: fmt(s / o, 2) if stocked and not timer.smoke else "-"  # noqa: E731
        rows.append([b, fmt(t[("target_fwd", "ours")]), pair("select"), pair("tail"), pair("draft_fwd"),
                     pair("chain"), f"{fmt(outside['ours'])} / {fmt(outside['stock']) if stocked else '-'}",
                     gain(outside["ours"], outside.get("stock")), pair("step"),
                     gain(t[("step", "ours")], t.get(("step", "stock")))])
        print(f"bench step: B={b} done", file=sys.stderr, flush=True)
        for slot in range(b):
            eng.pages.free(slot)
    _use_drafter_paths(eng, paths["ours"])
    notes = [f"model: {_model_line(args, cfg)}, K={cfg.draft_len}, r={cfg.speculative_config.markov_rank}, "
             f"markov mode {cfg.speculative_config.markov_chain_mode}, dtype {eng.target.dtype}; "
             f"{fused.selection.describe()}",
             "times in us, median of CUDA-graph replays; 'ours / stock' = the same worker with the fused / the stock "
             "op table (stock: gathered torch.argmax, eager acceptance/bookkeeping/store chains, the drafter's eager "
             "block attention, F.linear + add + torch.argmax Markov chain"
             f"{'; not timed: --no-stock' if args.no_stock else ''}); outside target = select + tail + draft "
             f"fwd + chain; drafter block attention / layers ours: {' / '.join(paths['ours'])}"]
    print_table("bench step: DSpark decode step by stage, fused / stock op table",
                ["B", "target fwd", "select", "tail", "draft fwd", "chain", "outside target", "gain x", "whole step",
                 "step gain x"], rows, notes)
    for line in profiles:
        print(line)
    return 0


def _model_line(args: argparse.Namespace, cfg) -> str:
    """The notes' model: the checkpoint (and the drafter it loaded) or the synthetic shape."""
    t = cfg.model.target
    line = f"vocab {t.vocab_size}, hidden {t.hidden_size}, {t.num_layers} target layers"
    if args.model is None:
        return line
    from tensorrt_llm_ext.runtime.config import describe_drafter

    return f"checkpoint {args.model}, {line}; {describe_drafter(cfg)}"


def _run_sampled(args: argparse.Namespace, cfg, eng: Engine, sizes: list[int]) -> None:
    """The whole step with sampled traffic: every row samples at ``--temperature`` (``--top-p``); drafts
    sampled from the Markov chain and rejection-sampling verification with ``--rejection-sampling``, else
    strict acceptance of sampled target tokens. Ours (fused op table) vs stock (the same worker with the
    stock table: gathered logits, eager twins) in one run, on the same engine state (``cfg`` / ``eng``: built by
    :func:`run`)."""
    timer = BenchTimer(reps=7, calls_per_rep=4)
    workers = {"ours": eng.worker("speculative", sampling=True)}
    if not args.no_stock:
        workers["stock"] = eng.worker("stock", sampling=True)
    paths = _drafter_paths(eng)
    greedy = eng.worker("speculative", sampling=False)
    rows, profiles, stage_rows = [], [], []
    for b in sizes:
        t, how = {}, {}
        # the greedy step of the same fused worker code at this B: the 1.3x goal's denominator, in the same run
        _use_drafter_paths(eng, paths["ours"])
        ctx_g = setup_rows(eng, b, args.prompt_len, greedy)
        greedy.set_rows(list(range(b)), b)

        def greedy_step(ctx_g=ctx_g):
            eng.state.ctx_lens.copy_(ctx_g)
            return greedy.forward(b)

        t["greedy"] = timer.time_graph([greedy_step], min_calls_per_graph=4)
        if args.profile:  # the greedy step by stage, beside the sampled one: which stage makes the gap
            gs = StepStages(eng, greedy, b, ctx_g)
            snapshot = [x.clone() for x in eng.state.mutable_tensors()]
            g = {}
            for name in STAGES:
                g[name] = timer.time_graph([getattr(gs, name)], min_calls_per_graph=4)
                for dst, src in zip(eng.state.mutable_tensors(), snapshot):
                    dst.copy_(src)
            greedy_row = [b, "greedy", fmt(g["target_fwd"]), "-", fmt(g["select"]), fmt(g["tail"]),
                          fmt(g["draft_fwd"] + g["chain"]), fmt(g["step"]), "-", "-"]
        for slot in range(b):
            eng.pages.free(slot)
        for table, worker in workers.items():
            _use_drafter_paths(eng, paths[table])
            ctx0 = setup_rows(eng, b, args.prompt_len, worker, args.temperature, args.top_p)
            worker.set_rows(list(range(b)), b)  # the variant these rows need: the one the engine replays
            how[table] = str(worker.step_variant)

            def step(worker=worker, ctx0=ctx0):
                eng.state.ctx_lens.copy_(ctx0)  # every replay verifies the same positions
                return worker.forward(b)

            t[table] = timer.time_graph([step], min_calls_per_graph=4)
            if args.profile and table == "ours":
                # which stage holds the sampled step: each stage captured and replayed alone, every one from the
                # same engine state
                stages = SampledStages(eng, worker, b, ctx0)
                snapshot = [x.clone() for x in eng.state.mutable_tensors()]
                st = {}
                for name in SampledStages.NAMES:
                    st[name] = timer.time_graph([getattr(stages, name)], min_calls_per_graph=4)
                    for dst, src in zip(eng.state.mutable_tensors(), snapshot):
                        dst.copy_(src)
                stage_rows.append([b, "sampled"] + [fmt(st[n]) for n in SampledStages.NAMES] + [
                    fmt(st["decision"] - st["head"]), fmt(st["step"] / g["step"], 2) if not timer.smoke else "-"])
                stage_rows.append(greedy_row)
            if args.profile and not timer.smoke:
                profiles += [f"profile of one captured sampled step ({table}) at B={b}:"] + _profile(step)
            for slot in range(b):
                eng.pages.free(slot)
        stock = "stock" in t
        rows.append([b, fmt(t["ours"]), fmt(t["stock"]) if stock else "-",
                     fmt(t["stock"] / t["ours"], 2) if stock and not timer.smoke else "-",
                     fmt(t["greedy"]), fmt(t["ours"] / t["greedy"], 2) if not timer.smoke else "-",
                     f"{how['ours']} / {how.get('stock', '-')}"])
        print(f"bench step (sampled): B={b} done", file=sys.stderr, flush=True)
    _use_drafter_paths(eng, paths["ours"])
    verify = "rejection sampling (sampled drafts)" if args.rejection_sampling else "strict acceptance"
    notes = [f"model: {_model_line(args, cfg)}, K={cfg.draft_len}, "
             f"dtype {eng.target.dtype}; every row T={args.temperature}, top-p {args.top_p}; verification: {verify}; "
             f"{workers['ours'].selection.describe()}",
             "times in us per whole step (worker.forward), median of CUDA-graph replays of the step variant the "
             "engine replays for these rows (top-p: the exact top-p restriction captured in the step); ours = fused "
             "op table, stock = the same worker with the stock op table (gathered logits, eager twins)."]
    notes.append("greedy us = the same fused worker with greedy rows (strict acceptance, argmax drafts) at the same B "
                 "in this run; sampled / greedy is the issue's goal (<= 1.3 at B <= 32).")
    print_table("bench step --temperature: the whole DSpark step with sampled traffic, fused / stock op table",
                ["B", "ours us", "stock us", "step gain x", "greedy us", "sampled / greedy", "variant (ours / stock)"],
                rows, notes)
    if stage_rows:
        print_table(
            "bench step --temperature --profile: the fused step by stage, sampled and greedy rows",
            ["B", "rows", "target fwd", "head", "decision", "tail", "draft", "whole step", "decision - head",
             "sampled / greedy"], stage_rows,
            ["us, median of CUDA-graph replays, each stage captured alone from the same engine state. Sampled rows "
             "(ours): head = the target's LM head on the B*(K+1) verified rows; decision = head + exact top-p + "
             "verification (decision - head: the verification alone); tail = bookkeeping + latent store; draft = "
             "drafter block decode + sampled Markov chain + stored draft logits. Greedy rows (the same fused worker, "
             "greedy requests): decision = select (head + argmax), tail = strict acceptance + bookkeeping + store, "
             "draft = drafter block decode + argmax chain. The stages sum to about the whole step (the block-table "
             "decode is in the step only)."])
    for line in profiles:
        print(line)
