"""The batching engine: prefill -> speculative steps -> finish, with slots freed and reused.

One :class:`Engine` per rank (every rank of a TP group runs the same loop on the same requests; the
host-side decisions depend only on tokens, which are identical on every rank). Modes of
:meth:`Engine.generate`:

* ``"speculative"``: one-model DSpark with the configured selection (vocab-parallel where eligible);
* ``"gathered"``: the same, with vocab-parallel selection forced off (gathered logits everywhere);
* ``"target_only"``: the target's own non-speculative decode, the lossless reference.

Requests are admitted in order while slots are free; a request that fails validation gets an error
result and never reaches a slot. Each step pads the active rows to a CUDA-graph batch size (dummy rows on
the dummy slot) and replays the captured step when graphs are enabled, else runs it eagerly.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tensorrt_llm_ext.logger import log_environment, logger
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafter, DSparkDrafterConfig
from tensorrt_llm_ext.models.dspark_drafter import generate_full_state_dict as generate_drafter_state_dict
from tensorrt_llm_ext.models.llama_target import LlamaTarget, LlamaTargetConfig
from tensorrt_llm_ext.models.llama_target import generate_full_state_dict as generate_target_state_dict
from tensorrt_llm_ext.runtime.config import RuntimeConfig
from tensorrt_llm_ext.runtime.cuda_graph import CudaGraphRunner
from tensorrt_llm_ext.runtime.kv_cache import build_state, pages_needed
from tensorrt_llm_ext.runtime.requests import Request, RequestError, RequestResult
from tensorrt_llm_ext.speculative.dspark_worker import DSparkWorker
from tensorrt_llm_ext.speculative.step_ops import FUSED_OPS, STOCK_OPS
from tensorrt_llm_ext.speculative.worker_base import nvtx_range

MODES = ("speculative", "gathered", "target_only", "stock")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def build_models(config: RuntimeConfig, mapping: Mapping, device: torch.device) -> tuple[LlamaTarget, DSparkDrafter]:
    """The target and the drafter with this rank's slices of the FULL weights (seeded or from files)."""
    m = config.model
    t = m.target
    dtype = resolve_dtype(m.dtype, device)
    tcfg = LlamaTargetConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_layers=t.num_layers,
                             num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                             intermediate_size=t.intermediate_size, capture_layers=tuple(t.capture_layers),
                             rope_theta=t.rope_theta)
    d = m.drafter
    dcfg = DSparkDrafterConfig(hidden_size=t.hidden_size, target_hidden_size=t.hidden_size,
                               num_capture_layers=len(t.capture_layers), num_layers=d.num_layers,
                               num_heads=d.num_heads, head_dim=d.head_dim, latent_dim=d.latent_dim,
                               intermediate_size=d.intermediate_size, vocab_size=t.vocab_size,
                               markov_rank=config.speculative_config.markov_rank, mask_token_id=t.vocab_size - 1)
    target = LlamaTarget(tcfg, mapping, dtype=dtype, device=device)
    drafter = DSparkDrafter(dcfg, mapping, dtype=dtype, device=device)
    if m.target_weights:
        target_sd = torch.load(m.target_weights, map_location="cpu", weights_only=True)
    else:
        target_sd = generate_target_state_dict(tcfg, m.seed, torch.float32, t.residual_scale)
    target.load_full_state_dict(target_sd)
    if m.drafter_weights:
        drafter.load_full_state_dict(torch.load(m.drafter_weights, map_location="cpu", weights_only=True))
    else:
        drafter_sd = generate_drafter_state_dict(dcfg, m.seed + 1, torch.float32)
        if m.drafter_init == "target_bigram":
            drafter_sd.update(bigram_markov_head(target_sd, tcfg.rms_norm_eps))
            # Quiet backbone: the draft logits are the Markov bias plus a small backbone term.
            drafter_sd["norm.weight"] = drafter_sd["norm.weight"] * 0.05
        drafter.load_full_state_dict(drafter_sd)
    return target, drafter


def bigram_markov_head(target_sd: dict[str, torch.Tensor], eps: float) -> dict[str, torch.Tensor]:
    """Markov factors that reproduce the target's bigram part: ``w2 @ w1[prev] = head @ norm(embed[prev])``.

    A target whose layers add little to the residual stream predicts roughly ``head @ norm_final(embed[prev])``;
    with ``r = H`` this is exactly representable by the DSpark vanilla Markov head.
    """
    emb = target_sd["embed_tokens.weight"].float()
    g = target_sd["norm.weight"].float()
    w1 = g * emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + eps)
    return {"markov_w1": w1, "markov_w2": target_sd["lm_head.weight"].float().clone()}


@dataclass
class _Active:
    request: Request
    result: RequestResult
    slot: int


@dataclass
class GenerationStats:
    mode: str
    num_steps: int = 0  # engine steps (each step serves every active request)
    num_tokens: int = 0
    wall_s: float = 0.0
    accepted_lens: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.accepted_lens) / len(self.accepted_lens) if self.accepted_lens else float("nan")


class Engine:
    """Models, caches and workers of one rank, built once from a :class:`RuntimeConfig`.

    Args:
        config: the runtime config (``tensor_parallel_size`` and ``enable_attention_dp`` must match
            ``mapping``).
        mapping: this rank's layout (default: one rank with the config's ``enable_attention_dp``).
        device: default CUDA when available, else CPU.
        use_cuda_graph: capture the speculative step per batch size (CUDA only).
    """

    def __init__(self, config: RuntimeConfig, mapping: Mapping | None = None, device=None,
                 use_cuda_graph: bool = False):
        log_environment()
        mapping = mapping or Mapping(enable_attention_dp=config.enable_attention_dp)
        if mapping.tp_size != config.tensor_parallel_size:
            raise ValueError(f"Engine: config tensor_parallel_size={config.tensor_parallel_size} but the mapping "
                             f"has tp_size={mapping.tp_size}")
        if mapping.enable_attention_dp != config.enable_attention_dp:
            # A config flag the rank layout does not carry would be silently ignored (vocab-parallel
            # selection and the drafter fusions read it from the Mapping).
            raise ValueError(f"Engine: config enable_attention_dp={config.enable_attention_dp} but the mapping "
                             f"has enable_attention_dp={mapping.enable_attention_dp}")
        if device is None:
            cuda = torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.device = torch.device(device)
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError("Engine: CUDA graphs need a CUDA device")
        self.config = config
        self.mapping = mapping
        self.draft_len = config.draft_len
        self.max_batch_size = config.max_batch_size
        self.target, self.drafter = build_models(config, mapping, self.device)
        self.vocab_size = self.target.config.vocab_size
        self.state, self.slots, self.pages = build_state(
            self.target, self.drafter, max_batch_size=config.max_batch_size, max_seq_len=config.max_seq_len,
            draft_len=self.draft_len, page_size=config.kv_cache_config.tokens_per_block, device=self.device)
        self.use_cuda_graph = use_cuda_graph
        self._workers: dict[str, DSparkWorker] = {}
        self._runners: dict[str, CudaGraphRunner] = {}
        self.batch_sizes = config.graph_batch_sizes() if use_cuda_graph else None
        self.enable_padding = config.cuda_graph_config.enable_padding if config.cuda_graph_config else True

    # -- workers -------------------------------------------------------------------------------------
    def worker(self, path: str = "speculative", *, sampling: bool = True) -> DSparkWorker:
        """The worker of ``path``: ``speculative`` (fused ops, configured selection), ``gathered`` (fused ops,
        vocab-parallel selection forced off) or ``stock`` (the upstream eager op table, gathered).

        ``sampling=False`` builds a greedy-only worker (plain argmax selection; sampled requests refused),
        kept apart from the sampling-capable one of the same path.
        """
        key = path if sampling else f"{path}:greedy"
        if key not in self._workers:
            if path not in ("speculative", "gathered", "stock"):
                raise ValueError(f"Engine.worker: unknown path {path!r}")
            spec = self.config.speculative_config
            mode = spec.vocab_parallel_selection if path == "speculative" else "off"
            # gathered / stock paths verify on gathered logits too (they are the references of the sharded one)
            verification = spec.vocab_sharded_verification if path == "speculative" and sampling else "off"
            w = DSparkWorker(self.target, self.drafter, self.state, mapping=self.mapping, draft_len=self.draft_len,
                             max_batch_size=self.max_batch_size, markov_chain_mode=spec.markov_chain_mode,
                             ops=STOCK_OPS if path == "stock" else FUSED_OPS, sampling=sampling,
                             use_rejection_sampling=spec.use_rejection_sampling and sampling,
                             verification_mode=verification)
            w.post_load(self.target, self.drafter, vocab_parallel_mode=mode,
                        exchange=self.config.speculative_config.exchange)
            self._workers[key] = w
            if self.use_cuda_graph:
                runner = CudaGraphRunner(w, self.batch_sizes, enable_padding=self.enable_padding)
                if runner.capture_agreed(self.mapping):
                    self._runners[key] = runner
        return self._workers[key]

    def _padded(self, path: str, n: int) -> int:
        runner = self._runners.get(path)
        if runner is not None:
            padded = runner.padded_size(n)
            if padded is not None:
                return padded
        return n

    # -- generation ----------------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        request.validate(self.vocab_size, self.config.max_seq_len)

    def generate(self, requests: list[Request], mode: str = "speculative", progress=None
                 ) -> tuple[list[RequestResult], GenerationStats]:
        """Serve ``requests`` to completion; results in request order (bad requests carry their error).

        ``progress``: optional callable ``progress(num_new_tokens)`` called after each step (a tqdm update).
        """
        if mode not in MODES:
            raise ValueError(f"generate: mode must be one of {MODES}, got {mode!r}")
        path = mode if mode in ("gathered", "stock") else "speculative"
        worker = self.worker(path)
        speculative = mode != "target_only"
        stats = GenerationStats(mode=mode)
        t0 = time.perf_counter()
        results: list[RequestResult] = []
        pending: deque[_Active] = deque()
        for i, req in enumerate(requests):
            rid = req.request_id if req.request_id is not None else i
            prompt = list(req.prompt_ids) if isinstance(req.prompt_ids, (list, tuple)) else []
            res = RequestResult(request_id=rid, prompt_ids=prompt)
            results.append(res)
            try:
                self.validate(req)
            except RequestError as e:
                res.finish_reason, res.error = "error", str(e)
                logger.warning(f"rejected: {e}")
                continue
            pending.append(_Active(req, res, -1))
        active: dict[int, _Active] = {}
        while pending or active:
            while pending and self.slots.num_free:
                a = pending.popleft()
                a.slot = self.slots.acquire()
                req = a.request
                self.pages.allocate(a.slot, pages_needed(len(req.prompt_ids) + req.max_new_tokens, self.draft_len,
                                                         self.state.page_size))
                tok = worker.prefill(a.slot, list(req.prompt_ids), req.temperature, req.seed, speculative=speculative,
                                     top_p=req.top_p)
                active[a.slot] = a
                if self._append(a, [tok]):
                    self._finish(active, a)
                if progress is not None:
                    progress(1)
            if not active:
                continue
            order = sorted(active)
            n = len(order)
            b = self._padded(path, n)
            worker.set_rows(order, b)
            with nvtx_range(f"engine.step.{mode}"):
                if speculative:
                    runner = self._runners.get(path)
                    # Graphs hold the default step variant; a step with a top-p row runs eagerly.
                    replay = runner is not None and b in runner.graphs and worker.step_is_default
                    outs = runner.run(b) if replay else worker.forward(b)
                    new = outs["new_tokens"][:n].cpu().tolist()
                    lens = outs["new_tokens_lens"][:n].cpu().tolist()
                else:
                    ids = worker.target_only_step(b)[:n].cpu().tolist()
                    new, lens = [[t] for t in ids], [1] * n
                # The copies above synchronised: a low-latency exchange of this step that timed out has
                # set its flag by now, and its rows must not become tokens.
                worker.check_exchange()
            stats.num_steps += 1
            produced = 0
            for row, slot in enumerate(order):
                a = active[slot]
                a.result.num_steps += 1
                a.result.accepted_lens.append(lens[row])
                stats.accepted_lens.append(lens[row])
                before = len(a.result.output_ids)
                done = self._append(a, new[row][:lens[row]])
                produced += len(a.result.output_ids) - before
                if done:
                    self._finish(active, a)
            if progress is not None:
                progress(produced)
        stats.wall_s = time.perf_counter() - t0
        stats.num_tokens = sum(len(r.output_ids) for r in results)
        return results, stats

    @staticmethod
    def _append(a: _Active, tokens: list[int]) -> bool:
        """Append accepted tokens up to the stop token / the length limit; True when the request is done."""
        res, req = a.result, a.request
        for t in tokens:
            res.output_ids.append(int(t))
            if int(t) in req.stop_token_ids:
                res.finish_reason = "stop"
                return True
            if len(res.output_ids) >= req.max_new_tokens:
                res.finish_reason = "length"
                return True
        return False

    def _finish(self, active: dict[int, _Active], a: _Active) -> None:
        active.pop(a.slot, None)
        self.pages.free(a.slot)
        self.slots.release(a.slot)
