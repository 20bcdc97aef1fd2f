"""The server's engine loop: one thread on rank 0 that owns the :class:`Scheduler`, its plan broadcast to the
other TP ranks, and the server's Prometheus metrics.

Handlers (on the HTTP event loop) :meth:`EngineLoop.submit` requests and :meth:`EngineLoop.cancel` them; the
loop admits waiting requests between engine steps while slots are free (continuous batching). Every plan
(cancel / admit / step) goes through a :class:`PlanChannel` first: at TP N it is broadcast to every rank over
the TP group's gloo group, so all ranks run the same steps (an idle loop sends an empty plan every
``HEARTBEAT_S``, so a rank blocked waiting for work never reaches the collective timeout, and a dead peer is
noticed within a heartbeat or a step).

Queue bound: ``max_queue`` counts requests *waiting* for a slot -- a burst at an idle server first fills the
free slots. A failure of the engine answers every request in flight (:class:`EngineFailure`); a shutdown
past its drain deadline ends every request still running with :class:`Aborted` and frees its slot.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.runtime.scheduler import Event, Scheduler, StepPlan

HEARTBEAT_S = 0.5


# Latency buckets (seconds) of the request histograms: vLLM's ranges, from sub-millisecond inter-token
# times to minute-long requests.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    """Prometheus metrics of one server (its own registry). Names: ``trtllm_ext_`` + vLLM's metric name
    (``vllm:time_to_first_token_seconds`` is ``trtllm_ext_time_to_first_token_seconds``), each with a
    ``model_name`` label, so a vLLM dashboard needs only its prefix replaced (docs/serving.md)."""

    def __init__(self, draft_len: int, model_name: str = "dspark-embedded"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        p = "trtllm_ext_"
        self.draft_len = draft_len
        name = ["model_name"]

        def one(metric):  # the child of this server's model name
            return metric.labels(model_name)

        self._requests = Counter(p + "requests", "Finished requests by finish reason", name + ["finish_reason"],
                                 registry=r)
        self._rejected = Counter(p + "requests_rejected", "Requests to a served endpoint answered 4xx/5xx before "
                                 "reaching the engine", name + ["status"], registry=r)
        self._model = model_name
        self.prompt_tokens = one(Counter(p + "prompt_tokens", "Prompt tokens admitted", name, registry=r))
        self.generated_tokens = one(Counter(p + "generation_tokens", "Tokens generated", name, registry=r))
        self.steps = one(Counter(p + "engine_steps", "Engine steps run", name, registry=r))
        # Tokens one request gets from one speculative step: 1 (no draft accepted) .. K + 1 (all K drafts
        # and the bonus token); one bucket per value, so full acceptance has its own finite bucket.
        self.acceptance = one(Histogram(p + "acceptance_length", "Tokens accepted per request per speculative step "
                                        "(accepted drafts + 1)", name, buckets=list(range(1, draft_len + 2)),
                                        registry=r))
        self.step_time = one(Histogram(p + "step_seconds", "Wall time of one engine step", name,
                                       buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                2.5, 5, 10], registry=r))
        self.host_time = one(Histogram(p + "step_host_seconds", "Host time between two consecutive engine steps "
                                       "(plans, bookkeeping, token delivery; prefills excluded): the device waits "
                                       "this long per step in the serial loop", name,
                                       buckets=[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                0.1], registry=r))
        self.batch = one(Histogram(p + "step_batch_size", "Requests per engine step", name,
                                   buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256], registry=r))
        self.queue_depth = one(Gauge(p + "queue_depth", "Requests waiting for a slot", name, registry=r))
        self.active = one(Gauge(p + "active_requests", "Requests holding a slot", name, registry=r))
        self.kv_usage = one(Gauge(p + "kv_cache_usage_perc", "Fraction of the KV / latent cache pages held by "
                                  "running requests (0..1)", name, registry=r))
        self.ttft = one(Histogram(p + "time_to_first_token_seconds", "Arrival to the first token (queue time and "
                                  "prefill)", name, buckets=TTFT_BUCKETS, registry=r))
        self.itl = one(Histogram(p + "inter_token_latency_seconds", "Time between consecutive token deliveries of "
                                 "a request (one per step; a speculative step delivers its accepted tokens at once)",
                                 name, buckets=ITL_BUCKETS, registry=r))
        self.e2e = one(Histogram(p + "e2e_request_latency_seconds", "Arrival to the last token", name,
                                 buckets=REQUEST_BUCKETS, registry=r))
        self.queue_time = one(Histogram(p + "request_queue_time_seconds", "Arrival to admission (a slot)", name,
                                        buckets=REQUEST_BUCKETS, registry=r))
        self.num_drafts = one(Counter(p + "spec_decode_num_drafts", "Speculative steps over requests (one draft of "
                                      "K tokens each)", name, registry=r))
        self.num_draft_tokens = one(Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed", name,
                                            registry=r))
        self.num_accepted_tokens = one(Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted", name,
                                               registry=r))
        self._accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at "
                                         "each draft position (0 = the first drafted token)", name + ["position"],
                                         registry=r)
        self.accepted_per_pos = [self._accepted_per_pos.labels(model_name, str(i)) for i in range(draft_len)]

    def request_finished(self, reason: str) -> None:
        self._requests.labels(self._model, reason).inc()

    def rejected(self, status: int) -> None:
        self._rejected.labels(self._model, str(status)).inc()

    def speculative_step(self, accepted_len: int) -> None:
        """One request's speculative step that emitted ``accepted_len`` tokens (``accepted_len - 1`` drafts)."""
        self.acceptance.observe(accepted_len)
        self.num_drafts.inc()
        self.num_draft_tokens.inc(self.draft_len)
        accepted = max(0, min(accepted_len - 1, self.draft_len))
        self.num_accepted_tokens.inc(accepted)
        for pos in range(accepted):
            self.accepted_per_pos[pos].inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class PlanChannel:
    """Rank 0's plans reach every rank of the TP group (no-op at TP 1)."""

    def __init__(self, mapping=None):
        self.group = None
        if mapping is not None and mapping.tp_size > 1:
            from tensorrt_llm_ext.distributed.communicator import tp_cpu_group

            self.group = tp_cpu_group(mapping)
            self.src = mapping.tp_group[0]

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def exchange(self, plan: StepPlan | None) -> StepPlan:
        """Rank 0 passes its plan, the others None; every rank returns rank 0's plan."""
        if self.group is None:
            return plan
        import torch.distributed as dist

        box = [plan]  # the plan itself, its Request objects included (pickled by the broadcast)
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


def follower_loop(scheduler: Scheduler, channel: PlanChannel) -> None:
    """Ranks > 0: apply rank 0's plans until it says stop (an error propagates: the rank exits non-zero)."""
    while True:
        plan = channel.exchange(None)
        if plan.stop:
            return
        scheduler.apply(plan)


@dataclass
class Sink:
    """Where the engine thread delivers one HTTP request's events (an asyncio queue of the handler's loop)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the HTTP loop has closed (shutdown): nobody is listening any more
            pass


@dataclass
class EngineFailure(Exception):
    """The engine failed: raised by :meth:`EngineLoop.submit` afterwards, and delivered to every waiting sink."""

    message: str


@dataclass
class Aborted:
    """The request was ended by the server (shutdown past the drain deadline)."""

    message: str


class QueueFull(Exception):
    pass


@dataclass
class LoopState:
    """A snapshot for /health."""

    healthy: bool
    active: int
    queued: int
    free_slots: int
    steps: int
    error: str | None = None
    ranks: list[dict] = field(default_factory=list)


class EngineLoop:
    """Owns the scheduler on rank 0; handlers submit requests and cancel them from the event loop."""

    def __init__(self, scheduler: Scheduler, channel: PlanChannel, metrics: ServerMetrics, max_queue: int,
                 ranks: list[dict] | None = None, speculative: bool = True):
        self.scheduler = scheduler
        self.speculative = speculative  # False: --no-speculation (no drafts to count)
        self.channel = channel
        self.metrics = metrics
        self.max_queue = max_queue
        self.capacity = scheduler.num_free_slots  # slots of an idle engine
        self.ranks = ranks or []
        self._cond = threading.Condition()
        self._pending: deque[tuple[int, Request, Sink]] = deque()
        self._arrived: dict[int, float] = {}  # handle -> submit time (perf_counter), until it finishes
        self._last_token: dict[int, float] = {}  # handle -> when its last tokens were delivered
        self._sinks: dict[int, Sink] = {}  # admitted handles (each holds a slot, or will after this plan)
        self._cancel: dict[int, str] = {}  # handle -> the finish reason its cancellation is counted as
        self._plan_reasons: dict[int, str] = {}  # the same, for the cancellations of the plan being applied
        self._next = 0
        self._stop = False
        self._steps = 0
        self.failure: str | None = None
        self.on_failure = None  # callable, set by the server: shut uvicorn down after the grace period
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- called from handlers -------------------------------------------------------------------------------
    def submit(self, requests: list[Request], sink: Sink) -> list[int]:
        """Queue every request of one HTTP request at once (all or none): their handles.

        Raises :class:`QueueFull` when more than ``max_queue`` would be left *waiting* -- requests that go
        straight into free slots do not count -- and :class:`EngineFailure` once the engine failed.
        """
        with self._cond:
            if self.failure is not None:
                raise EngineFailure(self.failure)
            free = self.capacity - len(self._sinks)
            waiting = len(self._pending) + len(requests) - max(0, free)
            if waiting > self.max_queue:
                raise QueueFull(f"{max(0, len(self._pending) - max(0, free))} requests are waiting for a slot and "
                                f"this one needs {len(requests)} (max_queue={self.max_queue})")
            handles = []
            now = time.perf_counter()
            for request in requests:
                handles.append(self._next)
                self._arrived[self._next] = now
                self._pending.append((self._next, request, sink))
                self._next += 1
            self.metrics.queue_depth.set(max(0, len(self._pending) - max(0, free)))
            self._cond.notify()
            return handles

    def cancel(self, handle: int, reason: str = "cancelled") -> None:
        """End ``handle`` before its next step (``reason``: how it is counted, e.g. ``stop`` for a stop string)."""
        with self._cond:
            self._cancel.setdefault(handle, reason)
            self._cond.notify()

    def abort_all(self, message: str) -> int:
        """End every request queued or running with :class:`Aborted` (their slots are freed by the next plan);
        returns how many. For a shutdown whose drain deadline passed."""
        with self._cond:
            items = [(h, s) for h, _, s in self._pending] + list(self._sinks.items())
            for h, _ in items:
                self._cancel.setdefault(h, "aborted")
            self._cond.notify()
        for _, sink in items:
            sink.put(Aborted(message))
        return len(items)

    def state(self) -> LoopState:
        with self._cond:
            return LoopState(self.failure is None, self.scheduler.num_active, len(self._pending),
                             self.scheduler.num_free_slots, self._steps, self.failure, self.ranks)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop (and the other ranks) once the queue is empty; bounded wait."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the loop -----------------------------------------------------------------------------------------
    def _next_plan(self) -> StepPlan | None:
        with self._cond:
            idle = not (self._pending or self._cancel or self.scheduler.num_active or self._stop)
            if idle:
                self._cond.wait(HEARTBEAT_S)
            # Cancelled requests still in the queue never reach the engine.
            if self._cancel and self._pending:
                kept = deque()
                for item in self._pending:
                    if item[0] in self._cancel:
                        reason = self._cancel.pop(item[0])
                        self.metrics.request_finished(reason)
                        self._arrived.pop(item[0], None)
                        item[2].put(Event(item[0], [], "cancelled"))
                    else:
                        kept.append(item)
                self._pending = kept
            cancel = sorted(h for h in self._cancel if h in self._sinks)
            # How this plan's cancellations are counted; a cancel of a handle that already finished is dropped.
            self._plan_reasons = {h: self._cancel[h] for h in cancel}
            self._cancel = {}
            free = self.scheduler.num_free_slots + len(cancel)
            pages = self.scheduler.free_pages_after(cancel)
            admit = []
            now = time.perf_counter()
            while self._pending and len(admit) < free:
                need = self.scheduler.pages_for(self._pending[0][1])
                if need > pages:  # the next request waits for pages (first come, first served)
                    break
                pages -= need
                handle, request, sink = self._pending.popleft()
                self._sinks[handle] = sink
                admit.append((handle, request))
                self.metrics.queue_time.observe(now - self._arrived.get(handle, now))
            self.metrics.queue_depth.set(len(self._pending))
            stop = self._stop and not self._pending and not self.scheduler.num_active and not admit
            if not (cancel or admit or self.scheduler.num_active or stop):
                return StepPlan(run=False) if self.channel.distributed else None  # heartbeat
            return StepPlan(cancel=cancel, admit=admit, run=True, stop=stop)

    def _run(self) -> None:
        last = None  # when the previous step's plan was done, while requests stayed active (back-to-back steps)
        try:
            while True:
                plan = self._next_plan()
                if plan is None:
                    continue
                start = last if last is not None else time.perf_counter()
                plan = self.channel.exchange(plan)
                if plan.stop:
                    return
                events, stats = self.scheduler.apply(plan)
                self._record(plan, events, stats)
                now = time.perf_counter()
                if stats.num_rows and last is not None:
                    self.metrics.host_time.observe(max(0.0, now - start - stats.step_s - stats.prefill_s))
                last = now if self.scheduler.num_active else None
        except BaseException as e:  # a dead rank, a collective timeout, a bug: fail loudly, never hang
            self._fail(f"{type(e).__name__}: {e}")

    def _record(self, plan: StepPlan, events: list[Event], stats) -> None:
        m = self.metrics
        for _, request in plan.admit:
            m.prompt_tokens.inc(len(request.prompt_ids))
        if stats.num_rows:
            self._steps += 1
            m.steps.inc()
            m.step_time.observe(stats.step_s)
            m.batch.observe(stats.num_rows)
        now = time.perf_counter()
        for e in events:
            if e.accepted_len is not None and self.speculative:
                m.speculative_step(e.accepted_len)
            m.generated_tokens.inc(len(e.tokens))
            if e.tokens:
                last = self._last_token.get(e.handle)
                if last is None:
                    m.ttft.observe(now - self._arrived.get(e.handle, now))
                else:
                    m.itl.observe(now - last)
                self._last_token[e.handle] = now
            if e.finish_reason is not None:
                reason = self._plan_reasons.get(e.handle, e.finish_reason) if e.finish_reason == "cancelled" \
                    else e.finish_reason
                m.request_finished(reason)
                arrived = self._arrived.pop(e.handle, None)
                self._last_token.pop(e.handle, None)
                if arrived is not None and e.finish_reason in ("stop", "length"):  # served to its end
                    m.e2e.observe(now - arrived)
            with self._cond:
                sink = self._sinks.get(e.handle)
                if sink is not None and e.finish_reason is not None:
                    del self._sinks[e.handle]
            if sink is not None:
                sink.put(e)
        m.active.set(self.scheduler.num_active)
        m.kv_usage.set(self.scheduler.kv_cache_usage)

    def _fail(self, message: str) -> None:
        logger.error(f"serve: engine failed, answering 503 and shutting down: {message}")
        with self._cond:
            self.failure = message
            sinks = list(self._sinks.values()) + [s for _, _, s in self._pending]
            self._sinks.clear()
            self._pending.clear()
        for sink in sinks:
            sink.put(EngineFailure(message))
        if self.on_failure is not None:
            self.on_failure()
