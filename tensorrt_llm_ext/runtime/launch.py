"""``trtllm-ext generate``: speculative generation on one rank or N MPI-launched TP ranks.

``run_generate`` runs every requested mode on every rank (each rank builds the same engine from the same
config; tokens are identical across ranks by construction, and the launcher checks it) and returns what
rank 0 saw plus a per-rank digest. ``--tp 1`` runs in this process; ``--tp N`` spawns N ranks with
:func:`~tensorrt_llm_ext.runtime.ranks.launch_ranks` (supervised: a rank that fails, dies or hangs is
named, with how it ended and its last log lines, within a bound).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tensorrt_llm_ext.contract import BuildRefusal
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.runtime.scheduler import NON_SPECULATIVE

# A tiny embedded prompt set (token ids, so the check is about ids): lengths 1 .. 37, one
# longer than a latent page, ids spread over the vocabulary.
DEFAULT_PROMPTS: list[list[int]] = [
    [1, 17, 305, 42, 9, 77, 1023, 5],
    [911],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5, 0, 2, 8, 8, 4],
    [1200, 14, 640, 88, 1401, 12],
    [250, 251, 252, 253],
    [700, 33, 33, 33, 1100, 64, 7, 990, 512, 256, 128],
]


def cuda_device_count() -> int | None:
    """GPUs this host shows, or None without CUDA (ranks then run on CPU, any number of them). The one place
    the launchers read it, so that a test can stand in for a host with fewer GPUs."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def tp_gpu_error(tp_size: int) -> str | None:
    """One line when ``tp_size`` ranks (one per GPU, all on this host) need more GPUs than it has; checked
    before any rank starts (ranks sharing a GPU end in NCCL's "Duplicate GPU detected")."""
    n = cuda_device_count()
    if tp_size > 1 and n is not None and n < tp_size:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        return f"--tp {tp_size} needs {tp_size} GPUs (one rank per GPU on this host), found {n}{seen}"
    return None


def parse_prompt(text: str) -> list[int]:
    """``"1 2 3"`` / ``"1,2,3"`` / ``"[1, 2, 3]"`` -> ids (ValueError naming the bad item)."""
    items = text.replace("[", " ").replace("]", " ").replace(",", " ").split()
    try:
        return [int(x) for x in items]
    except ValueError:
        raise ValueError(f"prompt {text!r}: expected token ids separated by spaces or commas") from None


def load_prompts_file(path: str, parse_line: Callable[[str], list[int]] = parse_prompt) -> list[list[int]]:
    """A JSON list of prompts, or one prompt per line (``#`` lines and blank lines skipped). A line, or a JSON string,
    becomes ids through ``parse_line`` (default: ids separated by spaces/commas; ``generate`` passes its text prompts'
    parser, so a prompt may be text too); a JSON list is token ids, each an integer (``2.7``, ``true`` or ``null`` is an
    error naming the prompt and the item). A file whose text starts with ``[`` is JSON (text prompts that start with
    ``[`` go in a JSON list of strings)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                         f"{e.start})") from None
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e}; a file starting with '[' is read as a JSON list of "
                             f"prompts)") from None
        except RecursionError:  # a list of id lists is two levels deep; the decoder recurses per level
            raise ValueError(f"{path}: not a JSON list of prompts (nested too deeply)") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of prompts (token-id lists or strings)")
        out = []
        for i, p in enumerate(data):
            if isinstance(p, str):
                out.append(parse_line(p))
                continue
            if not isinstance(p, list):
                raise ValueError(f"{path}: prompt {i} must be a list of token ids or a string, got {json.dumps(p)}")
            bad = [t for t in p if isinstance(t, bool) or not isinstance(t, int)]
            if bad:
                raise ValueError(f"{path}: prompt {i}: token ids must be integers, got {json.dumps(bad[0])}")
            out.append(list(p))
        return out
    return [parse_line(line.strip()) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@dataclass
class GenerateJob:
    """Everything a rank needs (shipped to MPI ranks by value)."""

    config: dict  # RuntimeConfig.model_dump()
    requests: list[Request]
    modes: list[str]  # engine modes to run, "speculative" first
    cuda_graph: bool = False
    show_progress: bool = False  # progress of each mode on rank 0
    progress_terminal: bool = True  # stderr is a terminal: a tqdm bar; else a log line every PROGRESS_LINE_S
    check_top_p: bool = False  # also check every speculative token against the target's top-p kept set


@dataclass
class ModeResult:
    mode: str
    outputs: list[list[int]]
    finish_reasons: list[str | None]
    errors: list[str | None]
    accepted_lens: list[list[int]]
    num_steps: int
    mean_acceptance_length: float
    wall_s: float
    selection: str = ""
    outside_top_p: list[int] | None = None  # per request: emitted tokens outside the target's kept set


@dataclass
class RankReport:
    rank: int
    results: dict[str, ModeResult] = field(default_factory=dict)
    # speculative_config.acceptance_window is set: the served ("speculative") run may switch to the target-only
    # decode part way; its references ("gathered", "reference") never do
    speculation_gate: bool = False


PROGRESS_LINE_S = 10.0  # without a terminal: one progress line at most this often


class _ProgressLines:
    """Progress as log lines (stderr is not a terminal: a log file or a pipe, where a bar would be noise)."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done = total, desc, 0
        self.t0 = self.last = time.monotonic()

    def update(self, n: int) -> None:
        from tensorrt_llm_ext.logger import logger  # not at import: the CLI reads _env after its interpreter choice

        self.done += n
        now = time.monotonic()
        if now - self.last >= PROGRESS_LINE_S:
            self.last = now
            logger.info(f"generate: {self.desc}: {self.done}/{self.total} tokens at most, {now - self.t0:.0f} s")

    def close(self) -> None:
        from tensorrt_llm_ext.logger import logger

        logger.info(f"generate: {self.desc}: {self.done} tokens in {time.monotonic() - self.t0:.1f} s")


def _progress_bar(total: int, desc: str, enabled: bool, terminal: bool = True):
    """A tqdm bar on a terminal, else :class:`_ProgressLines` (None, None when disabled)."""
    from tensorrt_llm_ext.logger import logger

    if not enabled:
        return None, None
    if terminal:
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm is an optional UI dependency
            logger.info("generate: tqdm is not installed: progress as log lines")
        else:
            bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False, dynamic_ncols=True)
            return bar, bar.update
    lines = _ProgressLines(total, desc)
    logger.info(f"generate: {desc} decode of {total} tokens at most")
    return lines, lines.update


def run_job(job: GenerateJob, mapping=None, on_built=None) -> RankReport:
    """Build the engine for this rank and run every mode of ``job`` (call on every rank); ``on_built()`` is
    called once the engine is built (its checkpoint read and checked)."""
    import torch

    from tensorrt_llm_ext.mapping import Mapping
    from tensorrt_llm_ext.runtime.config import parse_config
    from tensorrt_llm_ext.runtime.engine import Engine

    cfg = parse_config(job.config)
    mapping = mapping or Mapping(enable_attention_dp=cfg.enable_attention_dp)
    device = None
    if torch.cuda.is_available():
        device = torch.device("cuda", mapping.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        # Measured on the 2-core CI machines: a [24, 48] x [48, 1536] fp32 GEMM takes 5 ms with 2 intra-op
        # threads and 0.1 ms with one; the tiny model's steps are all such GEMMs (and ranks share the cores).
        torch.set_num_threads(1)
    if job.show_progress and mapping.rank == 0:
        from tensorrt_llm_ext.logger import logger

        logger.info("generate: building the engine (weights, caches" + (", CUDA graphs)" if job.cuda_graph else ")"))
    engine = Engine(cfg, mapping, device=device, use_cuda_graph=job.cuda_graph)
    if on_built is not None:
        on_built()
    requests = list(job.requests)
    report = RankReport(rank=mapping.rank, speculation_gate=bool(cfg.speculative_config.acceptance_window))
    total = sum(r.max_new_tokens for r in requests)
    for mode in job.modes:
        bar, update = _progress_bar(total, mode, job.show_progress and mapping.rank == 0, job.progress_terminal)
        results, stats = engine.generate(requests, mode=mode, progress=update)
        if bar is not None:
            bar.close()
        worker = engine.worker("gathered" if mode == "gathered" else "speculative")
        report.results[mode] = ModeResult(
            mode=mode, outputs=[r.output_ids for r in results], finish_reasons=[r.finish_reason for r in results],
            errors=[r.error for r in results], accepted_lens=[r.accepted_lens for r in results],
            num_steps=stats.num_steps, mean_acceptance_length=stats.mean_acceptance_length, wall_s=stats.wall_s,
            selection=_describe(worker) if mode not in NON_SPECULATIVE else "gathered (target-only decode)")
        if job.check_top_p and mode == "speculative":
            report.results[mode].outside_top_p = _outside_top_p(engine, worker, requests, results)
    return report


def _describe(worker) -> str:
    v = worker.verifier
    return worker.selection.describe() + ("" if v is None else f"; {v.decision.describe()}")


def _outside_top_p(engine, worker, requests, results) -> list[int]:
    """Per request, how many emitted tokens lie outside the target's top-p kept set (run on every rank)."""
    counts = []
    for req, res in zip(requests, results):
        if res.error is not None:
            counts.append(0)
            continue
        counts.append(sum(1 for ok in engine.top_p_membership(req, res.output_ids) if not ok))
    return counts


def _rank_main(job: GenerateJob) -> dict:
    """MPI rank entry: join the TP group, run the job, return a plain dict."""
    from tensorrt_llm_ext.distributed import init_from_mpi

    tp = job.config.get("tensor_parallel_size", 1)
    mapping = init_from_mpi(tp_size=tp, enable_attention_dp=bool(job.config.get("enable_attention_dp", False)))
    try:
        report = run_job(job, mapping)
    except BuildRefusal as e:
        # Every rank reads the same files and sizes the same cache, and refuses them alike: a refusal of the input,
        # not a rank fault.
        return {"rank": mapping.rank, "refused": str(e)}
    from tensorrt_llm_ext.distributed.communicator import world_cpu_group
    from tensorrt_llm_ext.logger import flush_rank_logs

    flush_rank_logs(world_cpu_group())  # identical lines once, lines that differ once per rank
    return {"rank": report.rank, "speculation_gate": report.speculation_gate,
            "results": {m: asdict(r) for m, r in report.results.items()}}


DEFAULT_JOB_TIMEOUT_S = 1800.0
DEFAULT_RANK_TIMEOUT_S = 60.0


def run_generate(job: GenerateJob, tp_size: int, timeout: float = DEFAULT_JOB_TIMEOUT_S,
                 rank_timeout: float = DEFAULT_RANK_TIMEOUT_S, log_dir: str | None = None,
                 on_built=None) -> list[RankReport]:
    """Run ``job`` on ``tp_size`` ranks (in process at 1); returns one report per rank, rank order.

    At ``tp_size > 1`` the ranks run under :func:`~tensorrt_llm_ext.runtime.ranks.launch_ranks`: a rank
    that raises, dies or hangs ends the job with a :class:`~tensorrt_llm_ext.runtime.ranks.RankJobError`
    naming it; what every rank refuses while the engine is built (a checkpoint, a cache that cannot fit) raises a :class:`BuildRefusal` here, as at TP 1. ``rank_timeout`` is the collective timeout of the ranks (a hung peer is detected after
    it), ``timeout`` bounds the whole job, ``log_dir`` keeps the rank logs. ``on_built()`` is called once the
    engine passed its load checks: at TP 1 when it is built, at TP N when the ranks have reported (the
    launcher does not hear from them before).
    """
    if tp_size == 1:
        return [run_job(job, on_built=on_built)]
    from tensorrt_llm_ext.runtime.ranks import launch_ranks

    raw = launch_ranks(tp_size, _rank_main, job, timeout=timeout, collective_timeout=rank_timeout,
                       log_dir=log_dir)
    refused = [item["refused"] for item in raw if "refused" in item]
    if refused:
        raise BuildRefusal(refused[0])  # the one line (exit 2) a TP 1 run gives
    if on_built is not None:
        on_built()
    reports = []
    for item in raw:
        rep = RankReport(rank=item["rank"], speculation_gate=item["speculation_gate"])
        rep.results = {m: ModeResult(**r) for m, r in item["results"].items()}
        reports.append(rep)
    return reports


@dataclass
class CheckOutcome:
    ok: bool  # every mode and rank agree, nothing was rejected, something was compared
    lines: list[str]
    differs: bool = False  # some mode or rank produced other tokens than rank 0's speculative run
    rejected: list[int] = field(default_factory=list)  # requests rejected (never compared)
    compared: int = 0  # requests served and compared


def check_reports(reports: list[RankReport], *, rejection_sampling: bool = False,
                  greedy: list[bool] | None = None) -> CheckOutcome:
    """Strict acceptance: every mode and every rank must produce the same tokens as rank 0's speculative run.

    Fails as well when a request was rejected (its output was never compared) or when no request was
    served at all (nothing was compared): a check that compared nothing must not pass.

    At tp 1 (and on a CPU running the stock torch ops, which always gather) the job runs no ``gathered`` mode
    (it is the speculative path itself); the check says so.

    Rejection sampling (``rejection_sampling=True``; sampled outputs follow the target's distribution, not
    its seeded draws): at tp > 1 the vocab-sharded run equals the gathered-verification run bitwise (tokens and
    accepted lengths), the ``greedy`` requests equal the target-only decode, every emitted token lies in
    the target's top-p kept set, and every rank produced identical tokens.
    """
    if rejection_sampling:
        return _check_rejection(reports, greedy or [])
    lines = []
    differs = False
    ref = reports[0].results
    spec = ref["speculative"]
    rejected = [i for i, e in enumerate(spec.errors) if e]
    compared = len(spec.outputs) - len(rejected)
    if rejected:
        lines.append(f"  {len(rejected)} request(s) rejected, not compared: {rejected}")
    if compared == 0:
        lines.append("  nothing was compared: no request was served")
    if "gathered" not in ref:
        lines.append("  gathered-logits path: the speculative path itself here (tp=1, or torch ops on a CPU: nothing is "
                     "sharded), not compared")
    for mode, res in ref.items():
        if mode == "speculative":
            continue
        same = (res.outputs == spec.outputs and res.finish_reasons == spec.finish_reasons
                and res.errors == spec.errors)
        bad = [i for i, (a, b) in enumerate(zip(res.outputs, spec.outputs)) if a != b]
        label = {"target_only": "target-only decode (non-speculative)", "gathered": "gathered-logits path",
                 "reference": "target-only decode in the verify shape (non-speculative)"}[mode]
        lines.append(f"  speculative vs {label}: {'agree' if same else f'DIFFER on requests {bad}'}")
        differs |= not same
    if len(reports) > 1:
        same_ranks = all(r.results[m].outputs == ref[m].outputs for r in reports[1:] for m in ref)
        lines.append(f"  all {len(reports)} ranks produced identical tokens: {'yes' if same_ranks else 'NO'}")
        differs |= not same_ranks
    ok = not differs and not rejected and compared > 0
    return CheckOutcome(ok, lines, differs=differs, rejected=rejected, compared=compared)


def _gated_tail(served: list[int], reference: list[int]) -> bool:
    """The served run's accepted lengths equal the reference's until the speculation gate closed, then are the
    target-only decode's one token per step."""
    first = next((j for j, (a, b) in enumerate(zip(served, reference)) if a != b), min(len(served), len(reference)))
    return all(n == 1 for n in served[first:])


def _check_rejection(reports: list[RankReport], greedy: list[bool]) -> CheckOutcome:
    ref = reports[0].results
    spec, gathered, target = ref["speculative"], ref.get("gathered"), ref["reference"]
    lines, differs = [], False
    rejected = [i for i, e in enumerate(spec.errors) if e]
    compared = len(spec.outputs) - len(rejected)
    if rejected:
        lines.append(f"  {len(rejected)} request(s) rejected, not compared: {rejected}")
    if gathered is None:
        lines.append("  sharded vs gathered verification: the same call here (tp=1, or torch ops on a CPU: nothing is "
                     "sharded), not compared")
    else:
        bad = [i for i, (a, b) in enumerate(zip(spec.outputs, gathered.outputs)) if a != b]
        gate = reports[0].speculation_gate
        # With the speculation gate the served run's steps after it closed are target-only (one token each) while
        # the gathered reference speculates on: the acceptance agrees up to there, then the served run's is all 1s.
        steps_bad = [i for i, (a, b) in enumerate(zip(spec.accepted_lens, gathered.accepted_lens))
                     if a != b and not (gate and _gated_tail(a, b))]
        same = not bad and not steps_bad and len(spec.outputs) == len(gathered.outputs)
        what = (f"DIFFER on requests {bad}" if bad else f"acceptance DIFFERS on requests {steps_bad}" if steps_bad
                else "agree")
        gated = [i for i, (a, b) in enumerate(zip(spec.accepted_lens, gathered.accepted_lens)) if a != b]
        if same and gated:
            what += (f" (acceptance of requests {gated} agrees until the speculation gate closed; target-only "
                     f"steps after)")
        lines.append(f"  speculative vs gathered verification (bitwise, tokens + acceptance): {what}")
        differs |= not same
    rows = [i for i, g in enumerate(greedy) if g and i not in rejected]
    bad = [i for i in rows if spec.outputs[i] != target.outputs[i]]
    lines.append(f"  greedy requests {rows} vs target-only decode: {'agree' if rows and not bad else f'DIFFER on {bad}'}")
    differs |= bool(bad)
    outside = spec.outside_top_p or []
    n = sum(len(o) for o in spec.outputs)
    inside_ok = len(outside) == len(spec.outputs) and not sum(outside)
    lines.append(f"  emitted tokens inside the target's top-p kept set: {n - sum(outside)} / {n}"
                 + ("" if inside_ok else "  FAILED"))
    differs |= not inside_ok
    if len(reports) > 1:
        same_ranks = all(r.results[m].outputs == ref[m].outputs for r in reports[1:] for m in ref)
        lines.append(f"  all {len(reports)} ranks produced identical tokens: {'yes' if same_ranks else 'NO'}")
        differs |= not same_ranks
    if not rows:
        lines.append("  nothing was compared: no greedy request was served")
        compared = 0
    ok = not differs and not rejected and compared > 0
    return CheckOutcome(ok, lines, differs=differs, rejected=rejected, compared=compared)
