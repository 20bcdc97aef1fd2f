"""The server's engine loop: one thread on rank 0 that owns the :class:`Scheduler`, its plan broadcast to the
other TP ranks, and what it reports to the server's Prometheus metrics (:mod:`~tensorrt_llm_ext.runtime.serve_metrics`).

Handlers (on the HTTP event loop) :meth:`EngineLoop.submit` requests and :meth:`EngineLoop.cancel` them; the
loop admits waiting requests between engine steps while slots and cache pages are free (continuous batching;
the scheduler prefills a plan's admissions in batched prefills, chunked between steps with
``enable_chunked_prefill``). While requests decode, the plan that takes new requests from the queue runs the
running requests' step alone and the next plan prefills them: the streams never wait for an admission's prefill
to get the step's tokens, and with the overlap scheduler the device runs that step -- and the next one, which
the prefilling plan launches before its prefill -- while the host launches the prefill. Every plan
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
import sys
import threading
import time
from collections import deque
from itertools import chain
from dataclasses import dataclass, field
from typing import Callable

from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.runtime.scheduler import NON_SPECULATIVE, Event, Scheduler, StepPlan
from tensorrt_llm_ext.runtime.serve_metrics import ServerMetrics

SERVE_SWITCH_INTERVAL_S = 5e-4  # see EngineLoop.start

HEARTBEAT_S = 0.5


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
    """Where the engine thread delivers one HTTP request's events: an asyncio queue of the handler's loop, through
    ``output`` (the server's :class:`~tensorrt_llm_ext.runtime.openai_responses.OutputWorker`: ``handler(item)``
    runs there and what it returns reaches ``queue``) or, without one, as they are."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    handler: Callable | None = None
    output: object | None = None

    def put(self, item) -> None:
        deliver([(self, item)])


def deliver(pairs: list[tuple[Sink, object]]) -> None:
    """Hand ``(sink, item)`` pairs over, in order: one hand-off per output worker (or event loop) for the whole
    list, not one per item."""
    groups: dict = {}
    for pair in pairs:
        sink = pair[0]
        groups.setdefault(sink.output if sink.output is not None else sink.loop, []).append(pair)
    for to, group in groups.items():
        if to is None:
            continue
        if group[0][0].output is not None:
            to.put(group)
        else:
            hand_over(to, [(sink.queue, item) for sink, item in group])


def hand_over(loop: asyncio.AbstractEventLoop, items: list[tuple[object, object]]) -> None:
    """Put each ``(queue, item)`` on its queue, in order, from another thread: one callback on ``loop`` for the
    whole list (each hand-off wakes the loop)."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the HTTP loop has closed (shutdown): nobody is listening any more
        pass


def _put_all(items: list[tuple[object, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


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
                 ranks: list[dict] | None = None, speculative: bool = True, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError(f"EngineLoop: stream_interval must be >= 1, got {stream_interval}")
        self.scheduler = scheduler
        # A request's tokens go to its response once at least this many have gathered since the last hand-off (its
        # first token and its end at once): TensorRT-LLM's stream_interval, vLLM's --stream-interval. Fewer,
        # larger chunks: the server's per-chunk work (a task wake-up, the send, the socket write) shared by more
        # tokens; the metrics count every token when the engine makes it.
        self.stream_interval = stream_interval
        self._held: dict[int, list[Event]] = {}  # per handle: its events not handed over yet (stream_interval)
        self._switches = 0  # the scheduler's decode switches counted in the metrics so far
        self.speculative = speculative  # False: --no-speculation (no drafts to count)
        self.channel = channel
        self.metrics = metrics
        self._record_speculating()
        self.max_queue = max_queue
        self.capacity = scheduler.num_free_slots  # slots of an idle engine
        self.ranks = ranks or []
        self._cond = threading.Condition()
        self._pending: deque[tuple[int, Request, Sink]] = deque()
        self._deferred: list[tuple[int, Request]] = []  # taken from the queue, prefilled by the next plan
        self._arrived: dict[int, float] = {}  # handle -> submit time (perf_counter), until it finishes
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
        # The engine thread, the event loop and the output threads share one interpreter lock; at Python's
        # default 5 ms switch interval a thread that wants the lock back (a stream's write, the next launch)
        # waits up to 5 ms behind one that holds it. Measured on the H200 at 32 streams (SmolLM2 shape,
        # docs/target_forward.md): TTFT p50 767 -> 136 ms, output tokens/s 2,916 -> 3,724 greedy.
        if sys.getswitchinterval() > SERVE_SWITCH_INTERVAL_S:
            sys.setswitchinterval(SERVE_SWITCH_INTERVAL_S)
            logger.info(f"serve: interpreter switch interval {SERVE_SWITCH_INTERVAL_S * 1e3:g} ms (engine, event "
                        f"loop and output threads share the lock)")
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
            queued = len(self._pending) + len(self._deferred)
            return LoopState(self.failure is None, self.scheduler.num_active, queued, self.scheduler.num_free_slots,
                             self._steps, self.failure, self.ranks)

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
            idle = not (self._pending or self._deferred or self._cancel or self.scheduler.num_active or self._stop)
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
            # Deferred admissions cancelled before their plan: answered here, never prefilled.
            if self._cancel and self._deferred:
                now = time.perf_counter()
                kept = []
                for handle, request in self._deferred:
                    if handle in self._cancel:
                        self.metrics.finished(handle, self._cancel.pop(handle), now)
                        self._arrived.pop(handle, None)
                        self._sinks.pop(handle).put(Event(handle, [], "cancelled"))
                    else:
                        kept.append((handle, request))
                self._deferred = kept
            cancel = sorted(h for h in self._cancel if h in self._sinks)
            # How this plan's cancellations are counted; a cancel of a handle that already finished is dropped.
            self._plan_reasons = {h: self._cancel[h] for h in cancel}
            self._cancel = {}
            # First come, first served while a slot and the request's pages are free (the next one waits); the
            # admissions a previous plan deferred go first.
            admit, self._deferred = self._deferred, []
            fresh = []
            now = time.perf_counter()
            queue = chain((request for _, request in admit), (request for _, request, _ in self._pending))
            for _ in range(self.scheduler.admissible(queue, cancel) - len(admit)):
                handle, request, sink = self._pending.popleft()
                self._sinks[handle] = sink
                fresh.append((handle, request))
                self.metrics.admitted(handle, self._arrived.get(handle, now), now, request)
            if fresh and not admit and self.scheduler.num_active:
                # Requests are decoding: this plan runs their step alone and the next one prefills the new
                # requests, so the running streams get this step's tokens without waiting for the prefill, and
                # (overlap scheduler) the device runs the step launched here while the host launches the prefill.
                self._deferred = fresh
            else:
                admit += fresh
            self.metrics.queue_depth.set(len(self._pending) + len(self._deferred))
            stop = self._stop and not self._pending and not self._deferred and not self.scheduler.num_active \
                and not admit
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
        prefilled = stats.prefill_tokens  # this plan's prefill (a long prompt's chunks spread over plans)
        m.prompt_tokens.inc(prefilled)
        if prefilled:
            m.prefill_plan_time.observe(stats.prefill_s)
        m.prefix_cache_queries.inc(stats.prefix_cache_queries)
        m.prefix_cache_hits.inc(stats.prefix_cache_hits)
        if stats.num_rows:
            self._steps += 1
            m.steps.inc()
            m.step_time.observe(stats.step_s)
            m.batch.observe(stats.num_rows)
        now = time.perf_counter()
        generated = 0
        # every row of the plan in one update per metric (row by row was ~0.1-0.3 ms of a 32-stream step here)
        # -- not the target-only steps of --no-speculation or of a closed speculation gate
        m.speculative_steps([(e.accepted_len, e.confidences) for e in events if e.speculative])
        m.delivered_many([(e.handle, len(e.tokens), self._arrived.get(e.handle)) for e in events], now)
        for e in events:
            generated += len(e.tokens)
            if e.finish_reason is not None:
                reason = self._plan_reasons.get(e.handle, e.finish_reason) if e.finish_reason == "cancelled" \
                    else e.finish_reason
                m.finished(e.handle, reason, now)
                self._arrived.pop(e.handle, None)
        if prefilled or generated:
            m.iteration_tokens.observe(prefilled + generated)
        m.active.set(self.scheduler.num_active)
        m.kv_usage.set(self.scheduler.kv_cache_usage)
        if stats.resumed:
            m.speculation_resumes.inc(stats.resumed)
        switches = getattr(self.scheduler, "mode_switches", 0)  # a stub scheduler has none
        if switches != self._switches:  # (an inc takes the metric's lock: not every plan for nothing)
            m.decode_switches.inc(switches - self._switches)
            self._switches = switches
        self._record_speculating()
        # The step's events, in one hand-off (after the metrics: a client that has its answer finds it counted).
        pairs = []
        with self._cond:
            for e in events:
                sink = self._sinks.get(e.handle)
                if sink is None:
                    self._held.pop(e.handle, None)
                    continue
                if self.stream_interval > 1:
                    e = self._gathered(e)
                    if e is None:
                        continue
                if e.finish_reason is not None:
                    del self._sinks[e.handle]
                pairs.append((sink, e))
        deliver(pairs)

    def _gathered(self, e: Event) -> Event | None:
        """``e`` with its request's held events before it, once ``stream_interval`` tokens have gathered, at its
        end, or for its first token (the prefill's: time to first token unchanged); else None (held)."""
        held = self._held.get(e.handle)
        if e.finish_reason is not None or e.accepted_len is None:
            return Event.merged(self._held.pop(e.handle) + [e]) if held else e
        if held is None:
            held = self._held[e.handle] = []
        held.append(e)
        if sum(len(x.tokens) for x in held) < self.stream_interval:
            return None
        return Event.merged(self._held.pop(e.handle))

    def _record_speculating(self) -> None:
        """The speculative-decoding gauge: steps speculate (not --no-speculation, the speculation gate open)."""
        step_mode = getattr(self.scheduler, "step_mode", "speculative")  # a scheduler without a gate: its mode
        self.metrics.speculating.set(self.speculative and step_mode not in NON_SPECULATIVE)

    def _fail(self, message: str) -> None:
        logger.error(f"serve: engine failed, answering 503 and shutting down: {message}")
        with self._cond:
            self.failure = message
            sinks = list(self._sinks.values()) + [s for _, _, s in self._pending]
            self._sinks.clear()
            self._pending.clear()
            self._deferred.clear()
        for sink in sinks:
            sink.put(EngineFailure(message))
        if self.on_failure is not None:
            self.on_failure()
