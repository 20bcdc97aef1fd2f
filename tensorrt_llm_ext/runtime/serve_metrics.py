"""The server's Prometheus metrics, named and labelled as vLLM names them.

Every vLLM metric this server can measure has vLLM's name with ``trtllm_ext_`` in place of ``vllm:`` and vLLM's
labels (``model_name``, ``engine``; ``finished_reason`` on ``request_success``; ``position`` on the per-position
spec-decode counter), so a vLLM dashboard works with its prefix replaced. Values of ``finished_reason``:
vLLM's ``stop``, ``length`` and ``abort`` (a client that went away, a shutdown past its drain deadline), and
``error`` (a request the engine failed). Counters gain ``_total`` in the exposition, as vLLM's do.

What vLLM has and this server cannot measure is absent, not faked: prefix-cache queries / hits (no prefix
reuse), LoRA, and ``num_preemptions`` is always 0 (nothing is preempted: a request waits for its pages before
admission). This server's own metrics, beside vLLM's: ``engine_steps``, ``acceptance_length``, ``step_seconds``,
``step_host_seconds``, ``step_batch_size`` and ``requests_rejected`` (docs/serving.md lists all).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["FINISHED_REASONS", "ITL_BUCKETS", "REQUEST_BUCKETS", "TTFT_BUCKETS", "ServerMetrics", "token_buckets"]

# Latency buckets (seconds): vLLM's ranges, from sub-millisecond inter-token times to minute-long requests.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# This server's finish reasons -> vLLM's finished_reason label.
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "aborted": "abort", "error": "error"}


def token_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


def observe_many(hist, values) -> None:
    """``hist.observe(v)`` for each of ``values`` (a histogram child of prometheus_client), with one update per
    bucket touched and one of the sum: the bucket of ``v`` is the first upper bound ``>= v``, as ``observe`` picks
    it (a NaN falls in none and adds to the sum). Where the child does not expose the bucket values and the sum
    (another prometheus_client), one ``observe`` per value."""
    values = list(values)
    if not values:
        return
    bounds, buckets, total = (getattr(hist, n, None) for n in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            hist.observe(v)
        return
    hist._raise_if_not_observable()
    counts: dict[int, int] = {}
    for v in values:
        if v == v:  # not NaN
            i = bisect.bisect_left(bounds, v)
            if i < len(bounds):
                counts[i] = counts.get(i, 0) + 1
    total.inc(sum(values))
    for i, c in counts.items():
        buckets[i].inc(c)


@dataclass
class _Request:
    """One admitted request's timeline (``perf_counter`` seconds) and sizes, until it finishes."""

    arrived: float
    admitted: float
    prompt_tokens: int
    max_tokens: int | None
    first: float | None = None
    last: float | None = None
    generated: int = 0


class _ProcessCounters:
    """Counters this process keeps outside the server, read at each scrape; rank 0's own (another rank's are in its
    log): the Triton kernel builds since the server was ready (:mod:`.compile_watch`; each stalled a plan -- the
    start-up warm-up missed its specialization --: 0 in a healthy server) and the garbage collections since serving
    began (:mod:`.gc_pauses`, per generation; each stopped every thread, the engine loop and the HTTP threads)."""

    def __init__(self, prefix: str, labels: list[str], values: list[str]):
        self._prefix, self._labels, self._values = prefix, labels, values

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        from tensorrt_llm_ext.runtime import compile_watch as cw
        from tensorrt_llm_ext.runtime import gc_pauses as gp

        watch = cw.compile_watch
        counts, seconds = gp.gc_pauses.snapshot()
        per_generation = [[str(g)] for g in range(len(counts))]
        for name, doc, extra, values in (
                ("kernel_builds_while_serving", "Triton kernel builds after the server was ready (each stalled a "
                 "plan's requests; the start-up warm-up missed its specialization)", [], [watch.serving_count]),
                ("kernel_build_seconds_while_serving", "Seconds those builds took", [], [watch.serving_seconds]),
                ("gc_pauses", "Python garbage collections while serving, by generation (2: full)", ["generation"],
                 counts),
                ("gc_pause_seconds", "Seconds those collections stopped the interpreter", ["generation"], seconds)):
            family = CounterMetricFamily(self._prefix + name, doc, labels=self._labels + extra)
            for label, v in zip(per_generation if extra else [[]], values):
                family.add_metric(self._values + label, v)
            yield family


class ServerMetrics:
    """Prometheus metrics of one server (its own registry); the engine loop reports a request's admission,
    every delivery of its tokens and its end, and each step; everything else is derived here."""

    def __init__(self, draft_len: int, model_name: str = "dspark-embedded", max_model_len: int = 4096,
                 engine: int = 0):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        p = "trtllm_ext_"
        self.draft_len = draft_len
        labels = ["model_name", "engine"]
        self._values = [model_name, str(engine)]
        self._requests: dict[int, _Request] = {}

        def one(metric):  # the child of this server's labels
            return metric.labels(*self._values)

        def counter(name, doc, extra=()):
            return Counter(p + name, doc, labels + list(extra), registry=r)

        def histogram(name, doc, buckets):
            return one(Histogram(p + name, doc, labels, buckets=list(buckets), registry=r))

        # -- vLLM's scheduler state --------------------------------------------------------------------------
        self.active = one(Gauge(p + "num_requests_running", "Requests holding a slot (in the step batch)", labels,
                                registry=r))
        self.queue_depth = one(Gauge(p + "num_requests_waiting", "Requests waiting for a slot", labels, registry=r))
        self.kv_usage = one(Gauge(p + "kv_cache_usage_perc", "Fraction of the KV / latent cache pages held by "
                                  "running requests (0..1)", labels, registry=r))
        self.speculating = one(Gauge(p + "speculative_decoding_enabled", "1 while steps speculate; 0 with "
                                     "--no-speculation, once the speculation gate has closed, or while more requests "
                                     "are in flight than speculative_config.max_concurrency", labels, registry=r))
        self.decode_switches = one(counter("speculation_switches", "Hand-overs of the running requests between the "
                                           "speculative and the target-only decode (the gate's, max_concurrency's)"))
        self.speculation_resumes = one(counter("speculation_resumes", "Requests whose speculation resumed by a "
                                               "prefill of the tokens they decoded target-only (max_concurrency)"))
        one(counter("num_preemptions", "Preempted requests (always 0: a request waits for its pages before "
                    "admission, and is never preempted)"))
        # -- vLLM's counters ---------------------------------------------------------------------------------
        self.prompt_tokens = one(counter("prompt_tokens", "Prompt tokens prefilled"))
        # vLLM's prefix-cache counters (tokens; kv_cache_config.enable_block_reuse): the hit rate is hits / queries.
        self.prefix_cache_queries = one(counter("prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                                "cache at admission"))
        self.prefix_cache_hits = one(counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (whole "
                                             "pages; not prefilled again)"))
        self.generated_tokens = one(counter("generation_tokens", "Tokens generated"))
        self._success = counter("request_success", "Finished requests by finished_reason", ["finished_reason"])
        for reason in sorted(set(FINISHED_REASONS.values())):
            self._success.labels(*self._values, reason)  # every series exists from the start, at 0
        # -- vLLM's request histograms -------------------------------------------------------------------------
        sizes = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of a finished request", sizes)
        self.request_generation_tokens = histogram("request_generation_tokens", "Tokens a finished request "
                                                   "generated", sizes)
        self.request_max_tokens = histogram("request_params_max_tokens", "max_tokens of a finished request", sizes)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine iteration (prompt tokens "
                                          "prefilled + tokens generated)", ITERATION_TOKEN_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to the first token (queue time and prefill)",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive token deliveries of a request "
                             "(one per step; a speculative step delivers its accepted tokens at once)", ITL_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "The same intervals as inter_token_latency_seconds "
                              "(vLLM's older name for them)", ITL_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds", "A finished request's decode time "
                                      "over its tokens after the first", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to admission (a slot): WAITING",
                                    REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Admission to the last token: RUNNING "
                                        "(prefill + decode)", REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Admission to the first token: PREFILL",
                                      REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to the last token: DECODE",
                                     REQUEST_BUCKETS)
        # -- vLLM's spec-decode counters -----------------------------------------------------------------------
        self.num_drafts = one(counter("spec_decode_num_drafts", "Speculative steps over requests (one draft of K "
                                      "tokens each)"))
        self.num_draft_tokens = one(counter("spec_decode_num_draft_tokens", "Draft tokens proposed"))
        self.num_accepted_tokens = one(counter("spec_decode_num_accepted_tokens", "Draft tokens accepted"))
        per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position "
                          "(0 = the first drafted token)", ["position"])
        self.accepted_per_pos = [per_pos.labels(*self._values, str(i)) for i in range(draft_len)]
        # The drafter's confidence beside the acceptance, per draft position (a drafter with a confidence head):
        # mean confidence at position p = confidence_sum_per_pos / num_confidence_drafts, to read against
        # num_accepted_tokens_per_pos / num_drafts.
        self.num_confidence_drafts = one(counter("spec_decode_num_confidence_drafts", "Speculative steps over "
                                                 "requests whose drafts carried the drafter's confidences"))
        conf_pos = counter("spec_decode_draft_confidence_sum_per_pos", "Sum of the drafter's confidence c_k of the "
                           "drafts verified at each draft position (0 = the first drafted token)", ["position"])
        self.confidence_per_pos = [conf_pos.labels(*self._values, str(i)) for i in range(draft_len)]
        # -- this server's own ---------------------------------------------------------------------------------
        self._rejected = counter("requests_rejected", "Requests to a served endpoint answered 4xx/5xx before "
                                 "reaching the engine", ["status"])
        self.steps = one(counter("engine_steps", "Engine steps run"))
        r.register(_ProcessCounters(p, labels, self._values))  # the compile watch's and the collector's, at each scrape
        # Tokens one request gets from one speculative step: 1 (no draft accepted) .. K + 1 (all K drafts and
        # the bonus token); one bucket per value, so full acceptance has its own finite bucket.
        self.acceptance = histogram("acceptance_length", "Tokens accepted per request per speculative step "
                                    "(accepted drafts + 1)", range(1, draft_len + 2))
        self.step_time = histogram("step_seconds", "Wall time of one engine step",
                                   (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.host_time = histogram("step_host_seconds", "Host time between two consecutive engine steps (plans, "
                                   "bookkeeping, token delivery; prefills excluded): the device waits this long per "
                                   "step in the serial loop",
                                   (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1))
        self.prefill_plan_time = histogram("prefill_seconds", "Wall time of one plan's prefill (its batched "
                                           "prefills and chunk; host launch to the first tokens), plans with one only",
                                           (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                            5, 10))
        self.batch = histogram("step_batch_size", "Requests per engine step", (1, 2, 4, 8, 16, 32, 64, 128, 256))

    # -- what the engine loop reports ------------------------------------------------------------------------
    def admitted(self, handle: int, arrived: float, now: float, request) -> None:
        """``handle`` got a slot at ``now`` (it arrived at ``arrived``); ``request``: its engine :class:`Request`."""
        self.queue_time.observe(max(0.0, now - arrived))
        self._requests[handle] = _Request(arrived, now, len(request.prompt_ids), request.max_new_tokens)

    def delivered(self, handle: int, num_tokens: int, now: float, arrived: float | None = None) -> None:
        """``num_tokens`` tokens of ``handle`` were delivered at ``now`` (time to the first, or since the last)."""
        self.delivered_many([(handle, num_tokens, arrived)], now)

    def delivered_many(self, rows, now: float) -> None:
        """:meth:`delivered` for every ``(handle, num_tokens, arrived)`` of one plan, delivered at ``now``: each
        metric updated once per plan (a 32-stream step reported row by row spent ~0.1 ms of the engine thread's
        time in metric locks, on the loop's critical path)."""
        generated, ttft, gaps = 0, [], []
        for handle, num_tokens, arrived in rows:
            generated += num_tokens
            req = self._requests.get(handle)
            if not num_tokens or req is None:
                continue
            if req.first is None:
                req.first = now
                ttft.append(max(0.0, now - (arrived if arrived is not None else req.arrived)))
            else:
                gaps.append(max(0.0, now - req.last))
            req.last = now
            req.generated += num_tokens
        if generated:
            self.generated_tokens.inc(generated)
        observe_many(self.ttft, ttft)
        observe_many(self.itl, gaps)
        observe_many(self.tpot, gaps)

    def finished(self, handle: int, reason: str, now: float) -> None:
        """``handle`` ended at ``now`` with this server's ``reason``; a request served to its end (``stop`` /
        ``length``) also feeds the per-request histograms."""
        self.request_finished(reason)
        req = self._requests.pop(handle, None)
        if req is None or reason not in ("stop", "length"):
            return
        self.e2e.observe(max(0.0, now - req.arrived))
        self.inference_time.observe(max(0.0, now - req.admitted))
        self.request_prompt_tokens.observe(req.prompt_tokens)
        self.request_generation_tokens.observe(req.generated)
        if req.max_tokens is not None:
            self.request_max_tokens.observe(req.max_tokens)
        if req.first is not None:
            self.prefill_time.observe(max(0.0, req.first - req.admitted))
            self.decode_time.observe(max(0.0, req.last - req.first))
            if req.generated > 1:
                self.request_tpot.observe((req.last - req.first) / (req.generated - 1))

    def request_finished(self, reason: str) -> None:
        """Count one finished request (also one that never reached a slot)."""
        self._success.labels(*self._values, FINISHED_REASONS.get(reason, reason)).inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(*self._values, str(status)).inc()

    def speculative_step(self, accepted_len: int, confidences=None) -> None:
        """One request's speculative step that emitted ``accepted_len`` tokens (``accepted_len - 1`` drafts);
        ``confidences``: the drafter's ``c_k`` of the K drafts this step verified (the previous step's
        ``draft_confidences`` row of the request), when its drafter has a confidence head."""
        self.speculative_steps([(accepted_len, confidences)])

    def speculative_steps(self, rows) -> None:
        """:meth:`speculative_step` for every ``(accepted_len, confidences)`` of one plan, each counter and the
        histogram updated once per plan (row by row, ~10 metric updates a row: ~0.2 ms a 32-stream step)."""
        k = self.draft_len
        conf_rows, conf_sum = 0, [0.0] * k
        accepted_total, per_pos = 0, [0] * k
        lens = []
        for accepted_len, confidences in rows:
            if confidences is not None:
                conf_rows += 1
                for pos, c in enumerate(list(confidences)[:k]):
                    conf_sum[pos] += min(1.0, max(0.0, float(c)))
            lens.append(accepted_len)
            accepted = max(0, min(accepted_len - 1, k))
            accepted_total += accepted
            for pos in range(accepted):
                per_pos[pos] += 1
        if not lens:
            return
        if conf_rows:
            self.num_confidence_drafts.inc(conf_rows)
            for pos in range(k):
                self.confidence_per_pos[pos].inc(conf_sum[pos])
        observe_many(self.acceptance, lens)
        self.num_drafts.inc(len(lens))
        self.num_draft_tokens.inc(k * len(lens))
        self.num_accepted_tokens.inc(accepted_total)
        for pos in range(k):
            if per_pos[pos]:
                self.accepted_per_pos[pos].inc(per_pos[pos])

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
