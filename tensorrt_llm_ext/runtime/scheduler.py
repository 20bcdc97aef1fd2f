"""Continuous batching over an :class:`~tensorrt_llm_ext.runtime.engine.Engine`: requests join and leave
between engine steps. The one batching loop of the project: ``serve``'s engine loop, :meth:`Engine.generate`
(and so ``bench``) admit, prefill and step through it.

The scheduler is driven by :class:`StepPlan` s -- plain data (admit these requests, cancel those, run one
step) -- so that at TP N the plan rank 0 decides can be broadcast and applied identically on every rank:
slot assignment (lowest free slot first), page allocation and every token depend only on the sequence
of plans, never on timing. :meth:`Scheduler.apply` returns the :class:`Event` s of the plan (each
request's new tokens and whether it finished).

Per request the tokens are exactly what it gets alone: prefill gives the first
token, each step appends the accepted tokens up to a stop token (its ``stop_token_ids`` or, unless
``ignore_eos``, the checkpoint's EOS, honoured after ``min_tokens``) or ``max_new_tokens``; a request's
tokens depend only on its own prompt, seed and temperature, not on which requests share its steps (a batched
prefill's GEMMs round at the batch's row count: its first token may differ from a lone prefill's at a near-tie).

Admission and prefill: a plan's admitted requests take a slot and their pages at once, then are prefilled in
batched prefills (:meth:`Engine.prefill_slots`: one target forward for several prompts), each of at most
``max_num_tokens`` padded tokens (rows x the longest prompt; a longer prompt alone is one prefill). With
``enable_chunked_prefill`` a plan carries at most ``max_num_tokens`` prefill tokens in all: the prompts that fit
are prefilled, the next one runs a chunk of what is left (:meth:`Engine.prefill_chunk`) and goes on in the
next plans, while the running requests take their decode step in every plan -- a long prompt never stalls
the streams. A request in prefill holds its slot and pages (it counts in :attr:`Scheduler.num_active`) and
gets its first token with its last chunk. Tokens are those of one prefill per request: a prefill row (and a
chunk) computes only its own prompt's positions.

With block reuse a request's prefill starts past the cached pages of its prompt; requests admitted together that
share a prompt's start wait (one group of the plan) for the first one's pages instead of computing them again
(:meth:`Scheduler._prefill_group`, :meth:`Scheduler._rematch_waiting`).

A request-level error inside a plan -- a layer below refusing a value that validation let through
(:data:`REQUEST_FAULTS`) -- fails requests, never the engine: in a prefill that request alone (a batched
prefill that raises is retried one request at a time to find it); in a step
every request of the step (a step aborted part way cannot be resumed row by row), the ones that fail validation named as the cause.
Their slots are freed, the workers' step state reset, and later plans are served. Any other exception (a
collective timeout, a device fault, out of memory, a broken invariant, a bug) propagates: the engine has failed.

Overlap (``overlap=True``, the server's default): a plan *launches* step n + 1 (:meth:`Engine.launch_step`)
over the requests live now, then *collects* step n, so the host work of step n's tokens (stop checks here,
detokenizing and streaming in the server) runs while the device runs step n + 1. A request that step n
finishes is already in step n + 1: that row's tokens are discarded when step n + 1 is collected (its request is
no longer live; a handle admitted again meanwhile names a new request, which never gets them), so nothing past its
stop is emitted, and its slot is released when step n is collected (the device runs a later prefill into that slot
after step n + 1, in stream order). Two rules keep the serial path's guarantees: a request that step n may end by
``max_new_tokens`` sits out step n + 1 (an extra step past its length could outrun the pages reserved for it; it
rejoins at n + 2 if it runs on), and a step with a ``logprobs`` row is collected at once (the next launch overwrites its logits). A plan that prefills while
requests decode launches their step n + 1 first and prefills after it (the device runs the step while the host
launches the prefill; the prefilled requests join step n + 2). That prefill's first tokens are read back a plan
later, not in the plan that launched it (:meth:`Scheduler._collect_firsts`): the host would otherwise wait there
for step n + 1 and the prefill and leave the device idle while it collects step n and plans the next launch. The
requests are live at once -- step n + 2 reads their first tokens and drafts on the device -- but one whose first
token is its last sits step n + 2 out, and a first token that is a stop ends its request as a step's would (its
row in step n + 2 discarded). A prefill with a ``logprobs`` or ``prompt_logprobs`` row is read back at once (its
logits are read now). Tokens are the serial path's:
a request's tokens never depend on which steps it shares, and the decisions depend only on the plans and the
tokens, so every TP rank pipelines the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.runtime.requests import Request, RequestError
from tensorrt_llm_ext.runtime.speculation_gate import speculation_gate, speculation_max_concurrency

# The exceptions a request's own values cause in host code: a ValueError a layer below raises for a value it
# refuses, an ArithmeticError (OverflowError, ZeroDivisionError) computing with one (a top_k past int64 once
# raised OverflowError in a prefill). They leave the device and the other slots' state intact, so the request
# fails and the engine serves on. Everything else -- RuntimeError (torch, CUDA, collectives, out of memory),
# MemoryError, AssertionError, TypeError / KeyError / IndexError (bugs) -- may leave the engine inconsistent:
# it fails closed.
REQUEST_FAULTS = (ValueError, ArithmeticError)
# The engine's modes that decode with the target alone, one token per request per step: the serving decode
# (``[B, 1]`` rows) and the lossless reference (the same decode in the verification's ``[B, K+1]`` shape).
NON_SPECULATIVE = ("target_only", "reference")


@dataclass
class StepPlan:
    """What every rank does next, in this order: cancel, admit, run one step over the active requests."""

    cancel: list[int] = field(default_factory=list)  # handles
    admit: list[tuple[int, Request]] = field(default_factory=list)  # (handle, request)
    run: bool = True
    stop: bool = False  # the server is shutting down: ranks leave their loop


@dataclass
class Event:
    """One request's progress in one plan."""

    handle: int
    tokens: list[int]  # tokens appended by this plan (the prompt excluded)
    finish_reason: str | None = None  # length | stop | cancelled | error; None: still running
    error: str | None = None
    accepted_len: int | None = None  # tokens accepted by this step (None: the prefill's first token)
    logprobs: list | None = None  # with Request.logprobs: per token (logprob, [(id, logprob)] top k)
    # With finish_reason "error": True when the request's own values are the cause (HTTP 400), False when it
    # ended because its step was aborted by another request's error (HTTP 500).
    request_fault: bool = True
    # The drafter's confidences c_k of the K drafts this step verified (a drafter with a confidence head).
    confidences: list[float] | None = None
    # With Request.prompt_logprobs, on the prefill's event: (logprob, top k) of prompt tokens 1 .. n-1.
    prompt_logprobs: list | None = None
    speculative: bool = False  # the tokens come from a speculative step (accepted_len counts its drafts)

    @staticmethod
    def merged(events: list[Event]) -> Event:
        """One request's consecutive ``events`` as one (a stream's chunks batched: ``stream_interval``): their tokens
        and log-probabilities in order, the last one's end; the prefill's prompt log-probabilities, if any."""
        last = events[-1]
        lps = [lp for e in events for lp in e.logprobs or ()] if any(e.logprobs is not None for e in events) else None
        return Event(last.handle, [t for e in events for t in e.tokens], last.finish_reason, last.error,
                     sum(e.accepted_len or 0 for e in events), lps, last.request_fault,
                     prompt_logprobs=next((e.prompt_logprobs for e in events if e.prompt_logprobs is not None), None),
                     speculative=any(e.speculative for e in events))


@dataclass
class StepStats:
    num_rows: int = 0  # requests in the step (0: no step ran)
    accepted_lens: list[int] = field(default_factory=list)
    step_s: float = 0.0
    prefill_s: float = 0.0
    num_prefills: int = 0  # requests whose prefill completed (their first token is out)
    deferred_prefills: int = 0  # requests whose prefill was launched behind a step, its first token read a plan later
    prefill_tokens: int = 0  # prompt tokens prefilled (chunks included, padding not)
    prefix_cache_queries: int = 0  # prompt tokens of this plan's admissions looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens cached (not prefilled)
    resumed: int = 0  # requests whose speculation resumed (their prefill of what they decoded target-only is done)


@dataclass
class _InFlight:
    """A launched step not yet collected: its :class:`LaunchedStep`, the handle of each row and the request it
    served (a handle that ends and is admitted again before the collect names another request)."""

    launched: object
    handles: list[int]
    lives: list[_Live]
    seq: int = 0  # its place among the scheduler's launches (steps and deferred prefills)


@dataclass
class _PendingFirsts:
    """A batched prefill launched and not yet read back (overlap): its :class:`LaunchedPrefill`, the handle of each
    row and the request it serves (their first tokens become events when it is collected)."""

    launched: object
    handles: list[int]
    lives: list[_Live]
    seq: int  # its place among the launches: a step launched after it runs after it on the device
    plan: int  # the plan that launched it


@dataclass
class _Live:
    request: Request
    slot: int
    first_pending: bool = False  # its prefill is launched, its first token not read back yet (overlap)
    num_out: int = 0
    out: list[int] | None = None  # the tokens out so far, kept for block reuse (its pages are registered at finish)
    stops: frozenset[int] = frozenset()  # the ids that end it (Engine.stop_ids), built once: read every step
    spec_steps: int = 0  # speculative steps it took, and the tokens they accepted (the speculation gate's record)
    spec_accepted: int = 0
    # Decoding target-only: the first position of its sequence (prompt + tokens out) whose drafter latent no step
    # stored -- its speculation resumes by prefilling from there (Scheduler._resume); None: it decodes speculatively.
    latents_end: int | None = None
    resuming: bool = False  # its next token comes from the prefill that resumes its speculation


@dataclass
class _Prefilling:
    """An admitted request whose prompt is not all in the cache yet (chunked prefill spreads it over plans)."""

    request: Request
    slot: int
    done: int = 0  # prompt positions in the cache (chunks run so far)
    cached: int = 0  # of those, mapped from the prefix cache (done == cached: its prefill has not begun)
    prompt_lps: list | None = None  # with Request.prompt_logprobs: those of the chunks run so far
    matched_at: int | None = None  # PageAllocator.registrations when its prompt was last matched to the cache
    # A running request resuming speculation: ``request`` is it with its tokens out appended to the prompt,
    # ``done`` its latents' end; its prefill's token is its next one (Scheduler._resume).
    resumed: _Live | None = None

    @property
    def left(self) -> int:
        return len(self.request.prompt_ids) - self.done


class Scheduler:
    """Requests in flight on one rank's engine, keyed by caller-chosen integer handles."""

    def __init__(self, engine, mode: str = "speculative", overlap: bool = False):
        self.engine = engine
        self.mode = mode
        self.overlap = overlap
        self._live: dict[int, _Live] = {}
        self._prefilling: dict[int, _Prefilling] = {}  # admitted, first token not yet out (admission order)
        self._in_flight: _InFlight | None = None  # overlap: the launched step whose tokens are not collected
        self._pending_firsts: list[_PendingFirsts] = []  # overlap: launched prefills not read back, oldest first
        self._launches = 0  # steps and deferred prefills launched (their order on the device's stream)
        self._plans = 0  # plans applied
        # Tokens one step can append to a request (the speculative block, or the target-only decode's one).
        self._step_tokens = 1 if mode in NON_SPECULATIVE else engine.draft_len + 1
        # Queued requests that passed validation, by identity (held, so an id is never reused): a request that waits
        # at the head of the queue for pages is asked about every plan, and validating it scans its whole prompt
        # (2.4 ms per plan for 30k tokens, more than a step). Its admission still validates it once more.
        self._valid: dict[int, Request] = {}
        self.gate = speculation_gate(engine, mode)
        # Speculation by batch size (speculative_config.max_concurrency; the serving speculative mode only, as the
        # gate): the running requests decode target-only while more requests are in flight than it says.
        self.max_concurrency = speculation_max_concurrency(engine, mode)
        self._decoding = mode  # the decode the running requests are in now
        self.mode_switches = 0  # hand-overs between the speculative and the target-only decode
        if (self.gate is not None or self.max_concurrency is not None) and engine.use_cuda_graph:
            engine.runner("target_only")  # captured now (every rank alike), not mid-serving at the first switch

    @property
    def step_mode(self) -> str:
        """The mode this plan decodes in: the configured one; the target-only decode once the speculation gate has
        closed (from the plan that closed it: the running requests are handed over at the next), or while more
        requests are in flight than ``max_concurrency``."""
        return "target_only" if self.gate is not None and self.gate.closed else self._decoding

    @property
    def prefill_mode(self) -> str:
        """The mode admissions prefill in (and whose cached prefixes they reuse): the decode's, but speculative
        whenever speculation may resume (``max_concurrency``, the gate open) -- a prompt prefilled while the batch
        decodes target-only stores its drafter latents too, and its pages serve speculative prompts."""
        if self.max_concurrency is not None and not (self.gate is not None and self.gate.closed):
            return self.mode
        return self._decoding

    @property
    def in_flight(self) -> bool:
        """Whether a launched step is still to be collected (overlap; never while no request is live)."""
        return self._in_flight is not None

    @property
    def num_free_slots(self) -> int:
        return self.engine.slots.num_free

    @property
    def num_active(self) -> int:
        """Requests holding a slot: decoding, or in their (chunked) prefill."""
        return len(self._live) + len(self._prefilling)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the cache pages held by requests in flight (pages are reserved at admission for the
        prompt, ``max_new_tokens`` and a step's overshoot; a request waits in the queue until they are free),
        0..1."""
        pages = self.engine.pages
        return (pages.num_pages - pages.num_free) / pages.num_pages if pages.num_pages else 0.0

    def free_pages_after(self, cancel: list[int]) -> int:
        """Cache pages free once the requests of ``cancel`` (handles) have left (what a plan may admit into)."""
        return self.engine.pages.num_free_after([held.slot for held in self._held(cancel)])

    def _held(self, handles) -> list[_Live | _Prefilling]:
        return [x for h in handles for x in (self._live.get(h) or self._prefilling.get(h),) if x is not None]

    def admissible(self, queue: Iterable[Request], cancel: list[int] = ()) -> int:
        """How many requests at the head of ``queue`` a plan that cancels ``cancel`` may admit, first come first
        served: while a slot and the request's pages (:meth:`admission_pages`) are free; the next one waits."""
        leaving = [held.slot for held in self._held(cancel)]
        slots = self.num_free_slots + len(leaving)
        pages = self.engine.pages.num_free_after(leaving)
        n = 0
        for request in queue:
            if n >= slots:
                break
            need = self.admission_pages(request, leaving)
            if need > pages:
                break
            pages -= need
            n += 1
        return n

    def admission_pages(self, request: Request, leaving=()) -> int:
        """Free pages ``request`` takes at admission now (its cached prefix pages that others hold are not taken:
        block reuse), with the slots ``leaving`` gone first; 0 for one that fails validation."""
        return self.engine.admission_pages(request, self.prefill_mode, leaving) if self._passes(request) else 0

    def pages_for(self, request: Request) -> int:
        """Pages ``request`` takes at admission; 0 for one that fails validation (its admission reports the
        error and takes nothing)."""
        return self.engine.pages_for(request) if self._passes(request) else 0

    def _passes(self, request: Request) -> bool:
        """Whether ``request`` passes validation, remembered while it waits in a queue (:attr:`_valid`)."""
        if self._valid.get(id(request)) is request:
            return True
        try:
            self.validate(request)
        except RequestError:
            return False
        if len(self._valid) >= 4 * self.engine.max_batch_size + 64:  # queued requests cancelled unseen: bounded
            self._valid.clear()
        self._valid[id(request)] = request
        return True

    def validate(self, request: Request) -> None:
        """Raise :class:`RequestError` if the engine cannot serve ``request``."""
        self.engine.validate(request)

    def apply(self, plan: StepPlan) -> tuple[list[Event], StepStats]:
        self._check_handles(plan)
        self._plans += 1
        events: list[Event] = []
        stats = StepStats()
        for handle in plan.cancel:
            held = self._live.pop(handle, None) or self._prefilling.pop(handle, None)
            if held is not None:
                self.engine.release_slot(held.slot)
                events.append(Event(handle, [], "cancelled"))
        pages = self.engine.pages
        queries, hits = pages.prefix_queries, pages.prefix_hits
        for handle, request in plan.admit:
            refused = self._admit(handle, request)
            if refused is not None:
                events.append(refused)
        events.extend(self._switch(stats))
        if self.overlap and plan.run and self._live and self._prefilling:
            # Requests are decoding and others wait for their prefill: launch the decode step first, so the device
            # runs it while the host launches the prefill; the prefilled requests join the next step.
            events.extend(self._overlap_step(stats, prefill=True))
        else:
            if self._prefilling:
                events.extend(self._prefill(stats))
            if plan.run and self._live:
                events.extend(self._overlap_step(stats) if self.overlap else self._step(stats))
        if self._in_flight is not None and not any(self._rows_live(self._in_flight)):
            # Every row of the launched step has ended (stopped or cancelled): drain it, its tokens discarded.
            events.extend(self._collect(self._take_in_flight(), stats))
        # The first tokens of an earlier plan's prefills: out by the plan after their launch at the latest (the
        # device has the step launched since queued behind them, so this wait leaves it busy).
        events.extend(self._collect_firsts(stats, lambda p: p.plan < self._plans))
        # Admissions' lookups, and the hits of prefills that waited for a sibling's pages (:meth:`_rematch_waiting`).
        stats.prefix_cache_queries, stats.prefix_cache_hits = pages.prefix_queries - queries, pages.prefix_hits - hits
        return events, stats

    def _wanted_decode(self) -> str:
        """The decode this plan's requests should be in: target-only for good once the gate has closed; with
        ``max_concurrency``, target-only while more requests are in flight (decoding or in their prefill: the
        plan's admissions counted) than it says, TensorRT-LLM's rule; else the configured mode."""
        if self.gate is not None and self.gate.closed:
            return "target_only"
        if self.max_concurrency is not None and self.num_active > self.max_concurrency:
            return "target_only"
        return self.mode

    def _switch(self, stats: StepStats) -> list[Event]:
        """Move the running requests to the decode :meth:`_wanted_decode` names, if they are not in it. A step in
        flight and the prefills not read back are collected first (their tokens are in every request's history
        before the other decode takes it over). The decision reads only the plans and the tokens: every TP rank
        switches at the same plan."""
        if self._wanted_decode() == self._decoding:
            return []
        events = self._collect_firsts(stats, lambda p: True)
        if self._in_flight is not None:
            events += self._collect(self._take_in_flight(), stats)
        want = self._wanted_decode()  # what was collected may have ended requests or closed the gate
        if want == self._decoding:
            return events
        if want == "target_only":
            self._hand_over()
        else:
            self._resume()
        logger.log(logging.INFO if self.mode_switches == 0 else logging.DEBUG,
                   f"scheduler: {self.num_active} request(s) in flight, max_concurrency {self.max_concurrency}: the "
                   f"running ones decode {'speculatively' if want == self.mode else 'target-only'} from here"
                   if self.gate is None or not self.gate.closed else
                   "scheduler: the speculation gate closed: the running requests decode target-only from here")
        self._decoding = want
        self.mode_switches += 1
        return events

    def _hand_over(self) -> None:
        """The running requests continue in the target-only decode: the engine moves each live slot's state
        (:meth:`Engine.hand_over_to_target_only`); requests in their prefill finish it in :attr:`prefill_mode`.
        Each keeps where its stored drafter latents end (its last token's position). A request whose resume is
        still in its chunks (its last prefill not launched: its slot still holds its target-only decode's state)
        stops it and decodes on, its latents now ending where the chunks did."""
        lives = list(self._live.values())
        self.engine.hand_over_to_target_only([live.slot for live in lives], [live.request for live in lives],
                                             [live.out for live in lives])
        for live in lives:
            live.latents_end = len(live.request.prompt_ids) + live.num_out - 1
        for h in [h for h, p in self._prefilling.items() if p.resumed is not None]:
            p = self._prefilling.pop(h)
            live = self._live[h] = p.resumed
            live.resuming, live.latents_end = False, p.done

    def _resume(self) -> None:
        """The running requests (decoding target-only) resume speculation: each prefills again, speculatively, the
        positions from where its stored drafter latents end to its last token -- the request with its tokens out
        appended to its prompt, their K / V rewritten with the latents -- and that prefill's token is its next one,
        sampled as the target-only decode would (the same position, seed and counts). They go before the
        admissions waiting for their prefill, and chunked prefill spreads them as it does prompts. Their pages
        are their own: a cached prefix they share ends before their prompt's last token, where the latents do not."""
        resumed = {}
        for h, live in self._live.items():
            assert live.latents_end is not None and not live.first_pending, (h, live.latents_end)
            seq = list(live.request.prompt_ids) + live.out
            live.resuming = True
            resumed[h] = _Prefilling(dataclasses.replace(live.request, prompt_ids=seq), live.slot,
                                     done=live.latents_end, cached=0, resumed=live)
        self._live.clear()
        self._prefilling = {**resumed, **self._prefilling}

    def _rows_live(self, fl: _InFlight) -> list[_Live | None]:
        """Per row of ``fl``: its request while still live, else None -- by identity, not handle: a handle that
        ended and was admitted again since is a new request, and the row's tokens are not its own."""
        return [live if self._live.get(h) is live else None for h, live in zip(fl.handles, fl.lives)]

    def _check_handles(self, plan: StepPlan) -> None:
        """Refuse, before anything changes, a plan that admits a handle twice or one still held by a request it does
        not cancel: events are keyed by handle, so the two requests' events would interleave under one handle (an
        error that reads as the first one's end, then its tokens). A caller's bug: ``ValueError`` naming them."""
        held = (self._live.keys() | self._prefilling.keys()) - set(plan.cancel)
        seen, clash = set(), set()
        for h, _ in plan.admit:
            if h in seen or h in held:
                clash.add(h)
            seen.add(h)
        if clash:
            raise ValueError(f"Scheduler.apply: handle(s) {sorted(clash)[:8]} admitted twice or still in flight (a "
                             f"handle names one request until its finish event); nothing was applied")

    def _take_in_flight(self) -> _InFlight:
        fl, self._in_flight = self._in_flight, None
        return fl

    def _overlap_step(self, stats: StepStats, prefill: bool = False) -> list[Event]:
        """Launch the next step over the live requests, then collect the one in flight (its host work overlaps
        the launched step on the device). ``prefill``: the plan's prefill runs after the launch and before the
        collect, its first tokens read back a plan later when a step was launched (:meth:`_collect_firsts`)."""
        prev = self._take_in_flight()
        pending = {h for h, live in zip(prev.handles, self._rows_live(prev)) if live} if prev is not None else set()
        # A request the pending step may end by max_new_tokens sits this launch out (see the module docstring); so
        # does one whose first token, not read back yet, is its last.
        handles = [h for h, live in self._live.items()
                   if (live.num_out + 1 < live.request.max_new_tokens if live.first_pending else
                       h not in pending or live.num_out + self._step_tokens < live.request.max_new_tokens)]
        events: list[Event] = []
        cur = None
        if handles:
            by_slot = {self._live[h].slot: h for h in handles}
            order = sorted(by_slot)
            t0 = time.perf_counter()
            try:
                launched = self.engine.launch_step(order, self.step_mode)
            except REQUEST_FAULTS as e:
                if prefill:
                    events.extend(self._prefill(stats))
                if prev is not None:
                    events.extend(self._collect(prev, stats))
                events.extend(self._collect_firsts(stats, lambda p: True))
                return events + self._fail_step([h for h in handles if h in self._live], e)
            stats.step_s += time.perf_counter() - t0
            self._launches += 1
            cur = _InFlight(launched, [by_slot[s] for s in order], [self._live[by_slot[s]] for s in order],
                            self._launches)
        if prefill:
            events.extend(self._prefill(stats, defer=cur is not None))
        if prev is not None:
            events.extend(self._collect(prev, stats))
        if cur is not None:
            if any(live.request.logprobs is not None for live in self._rows_live(cur) if live):
                events.extend(self._collect(cur, stats))  # the next launch would overwrite its logits
            else:
                self._in_flight = cur
        return events

    def _collect(self, fl: _InFlight, stats: StepStats) -> list[Event]:
        """The tokens of a launched step for its rows still live; rows that ended after the launch are
        discarded (their tokens come after their stop). The prefills launched before it are read back first:
        their first tokens come before the step's (and the device ran them before it: no wait)."""
        firsts = self._collect_firsts(stats, lambda p: p.seq < fl.seq)
        return firsts + self._collect_step(fl, stats)

    def _collect_firsts(self, stats: StepStats, which) -> list[Event]:
        """Read back the launched prefills ``which(pending)`` picks (oldest first): each row's first token, for
        the requests still live (one cancelled or failed since has had its end event)."""
        events: list[Event] = []
        keep = []
        for p in self._pending_firsts:
            if not which(p):
                keep.append(p)
                continue
            t0 = time.perf_counter()
            live_rows = [self._live.get(h) is live for h, live in zip(p.handles, p.lives)]
            firsts = self.engine.collect_prefill(p.launched, live_rows)
            stats.prefill_s += time.perf_counter() - t0
            for h, live, first, kept in zip(p.handles, p.lives, firsts, live_rows):
                if kept:
                    live.first_pending = False
                    events.append(self._first_token(h, live, first, stats))
        self._pending_firsts = keep
        return events

    def _collect_step(self, fl: _InFlight, stats: StepStats) -> list[Event]:
        t0 = time.perf_counter()
        new, lens = self.engine.collect_step(fl.launched)
        rows = self._rows_live(fl)
        reqs = [live.request if live else None for live in rows]
        try:
            lps = (self.engine.step_logprobs(reqs, new, lens, fl.launched.mode)
                   if any(r is not None and r.logprobs is not None for r in reqs) else [None] * len(reqs))
        except REQUEST_FAULTS as e:
            return self._fail_step([h for h, live in zip(fl.handles, rows) if live], e)
        stats.step_s += time.perf_counter() - t0
        stats.num_rows = len(fl.handles)
        stats.accepted_lens = list(lens)
        events = []
        confs = self.engine.step_confidences
        speculative = fl.launched.mode not in NON_SPECULATIVE
        for row, (h, live) in enumerate(zip(fl.handles, rows)):
            if live is not None:
                events.append(self._append(h, live, new[row][:lens[row]], lens[row], lps[row],
                                           confs[row] if confs else None, speculative))
        return events

    def _admit(self, handle: int, request: Request) -> Event | None:
        """Give ``request`` a slot and its pages (it is prefilled by :meth:`_prefill`); an error event if it
        cannot be served."""
        self._valid.pop(id(request), None)
        try:
            self.validate(request)
        except RequestError as e:
            return Event(handle, [], "error", str(e))
        if not self.num_free_slots:
            return Event(handle, [], "error", f"request {handle}: no free slot (the plan over-admitted)")
        slot = self.engine.slots.acquire()
        try:
            cached = self.engine.reserve(slot, request, self.prefill_mode)
        except BaseException:
            self.engine.slots.release(slot)
            raise
        self._prefilling[handle] = _Prefilling(request, slot, done=cached, cached=cached,
                                               prompt_lps=[] if request.prompt_logprobs is not None else None,
                                               matched_at=self.engine.pages.registrations)
        return None

    def _prefill(self, stats: StepStats, defer: bool = False) -> list[Event]:
        """This plan's prefill: every request in prefill, in batched prefills of at most ``max_num_tokens``
        padded tokens; with chunked prefill at most ``max_num_tokens`` tokens in all, the request that does not
        fit running a chunk of its prompt. ``defer``: a step is in flight behind which the prefills are launched;
        their first tokens are read back a plan later (:meth:`_prefill_rows`)."""
        budget = self.engine.max_num_tokens
        chunked = self.engine.chunked_prefill
        events: list[Event] = []
        while self._prefilling:
            self._rematch_waiting()
            group, width = self._prefill_group(budget, chunked)
            if group:
                events.extend(self._prefill_rows(group, stats, defer))
            if not chunked:
                continue
            budget -= len(group) * width
            if self._prefilling:  # the next prompt does not fit what is left: a chunk of it (its last token stays)
                self._rematch_waiting()
                handle, p = next(iter(self._prefilling.items()))
                n = min(budget, p.left - 1)
                if n > 0:
                    self._prefill_chunk(handle, p, n, stats, events)
            break
        return events

    def _prefill_group(self, budget: int, chunked: bool) -> tuple[list[int], int]:
        """The requests at the head of the prefill queue whose rest fits one batched prefill of ``budget``
        padded tokens (rows x the longest rest), and that width; unchunked, the head always goes. With block
        reuse the group ends before a request whose next page an earlier one in it computes (the same tokens
        from position 0): that one waits for the pages (:meth:`_rematch_waiting`) instead of computing them
        again -- ``n`` > 1 and simultaneous requests with one prompt prefill its shared pages once."""
        group, width = [], 0
        for handle, p in self._prefilling.items():
            w = max(width, p.left)
            if (len(group) + 1) * w > budget and (group or chunked):
                break
            if any(self._computes_next_page_of(self._prefilling[h], p) for h in group):
                break
            group.append(handle)
            width = w
        return group, width

    def _computes_next_page_of(self, owner: _Prefilling, waiting: _Prefilling) -> bool:
        """Whether ``owner``'s prefill registers the first page ``waiting`` would compute: a whole page of
        both prompts before their last tokens, the same tokens up to its end."""
        pages = self.engine.pages
        if not pages.enable_block_reuse or waiting.done != waiting.cached or waiting.prompt_lps is not None:
            return False
        size = pages.page_size
        end = (waiting.done // size + 1) * size
        a, b = owner.request.prompt_ids, waiting.request.prompt_ids
        return end < min(len(a), len(b)) and list(a[:end]) == list(b[:end])

    def _rematch_waiting(self) -> None:
        """Requests whose prefill has not begun take the cached pages registered since their admission (by
        the prefills before them): they start at the longer cached prefix. Only those with pages registered since their
        last match: a rematch walks the prompt's cached chain page by page (a few ms per request behind a long shared
        prefix), and every plan that admits would otherwise walk each admission's chain twice."""
        pages = self.engine.pages
        if not pages.enable_block_reuse:
            return
        for p in self._prefilling.values():
            if p.done == p.cached and p.left > 1 and p.prompt_lps is None and p.matched_at != pages.registrations:
                # never below its start: a partly reused page (partial reuse) is not a whole cached one
                p.done = p.cached = max(p.done, self.engine.rematch_prefix(p.slot, p.request, self.prefill_mode))
                p.matched_at = pages.registrations

    def _prefill_chunk(self, handle: int, p: _Prefilling, n: int, stats: StepStats, events: list[Event]) -> None:
        """The next ``n`` prompt positions of ``p`` (no token); a request-level error fails it into ``events``."""
        t0 = time.perf_counter()
        try:
            mode = self.prefill_mode
            self.engine.prefill_chunk(p.slot, p.request, p.done, p.done + n, mode)
            if p.prompt_lps is not None:
                p.prompt_lps.extend(self.engine.prompt_logprobs(p.request, 0, p.done, p.done + n, mode))
        except REQUEST_FAULTS as e:
            events.append(self._refuse_prefill(handle, e))
            return
        p.done += n
        stats.prefill_s += time.perf_counter() - t0
        stats.prefill_tokens += n

    def _prefill_rows(self, group: list[int], stats: StepStats, defer: bool = False) -> list[Event]:
        """One batched prefill of the rest of ``group``'s prompts: their first tokens. A request-level error
        retries the rows one at a time, so that only the request that causes it fails. ``defer`` (a step in
        flight, no row asking for log-probabilities, which need the prefill's logits now): launched only, the
        requests live at once -- their next step reads the first tokens on the device -- and the first tokens
        read back a plan later (:meth:`_collect_firsts`), so the host never waits here for the step in flight
        and the prefill."""
        held = [self._prefilling[h] for h in group]
        reqs = [p.request for p in held]
        t0 = time.perf_counter()
        mode = self.prefill_mode
        defer = defer and all(r.logprobs is None and p.prompt_lps is None for r, p in zip(reqs, held))
        resumed = [p.resumed for p in held]
        try:
            prompt_lens = ([len(r.request.prompt_ids) if r else len(p.request.prompt_ids) for r, p in zip(resumed, held)]
                           if any(resumed) else None)
            launched = self.engine.launch_prefill([p.slot for p in held], reqs, mode, starts=[p.done for p in held],
                                                  prompt_lens=prompt_lens, draft=mode == self._decoding)
            if mode != self._decoding:  # speculation may resume later: prefilled speculatively, decoded target-only
                self.engine.hand_over_prefilled_to_target_only([p.slot for p in held], reqs)
            if not defer:
                firsts = self.engine.collect_prefill(launched)
                lps = [[self.engine.prefill_logprobs(r, tok, mode, row)] if r.logprobs is not None else None
                       for row, (r, tok) in enumerate(zip(reqs, firsts))]
                prompt_lps = [p.prompt_lps + self.engine.prompt_logprobs(p.request, row, p.done,
                                                                         len(p.request.prompt_ids) - 1, mode)
                              if p.prompt_lps is not None else None for row, p in enumerate(held)]
        except REQUEST_FAULTS as e:  # a layer below refused a value of a request: it fails, the engine serves on
            self.engine.reset_step_state()
            if len(group) == 1:
                return [self._refuse_prefill(group[0], e)]
            return [ev for h in group for ev in self._prefill_rows([h], stats, defer)]
        stats.prefill_s += time.perf_counter() - t0
        stats.prefill_tokens += sum(p.left for p in held)
        events, lives = [], []
        for row, (h, p) in enumerate(zip(group, held)):
            self.engine.register_prefix(p.slot, p.request, mode)
            del self._prefilling[h]
            if p.resumed is not None:
                live = self._live[h] = p.resumed
                live.first_pending = defer
            else:
                # the tokens out are kept for block reuse, and for the hand-overs between the decodes
                keep = (self.engine.pages.enable_block_reuse or self.max_concurrency is not None
                        or (self.gate is not None and not self.gate.closed))
                live = self._live[h] = _Live(p.request, p.slot, first_pending=defer, out=[] if keep else None,
                                             stops=self.engine.stop_ids(p.request))
            # decoding target-only from here: its latents end at its last prompt position (none drafted it)
            live.latents_end = len(p.request.prompt_ids) - 1 if mode != self._decoding else None
            lives.append(live)
            if not defer:
                events.append(self._first_token(h, live, firsts[row], stats, lps[row]))
                events[-1].prompt_logprobs = prompt_lps[row]
        if defer:
            stats.deferred_prefills += len(group)
            self._launches += 1
            self._pending_firsts.append(_PendingFirsts(launched, list(group), lives, self._launches, self._plans))
        return events

    def _first_token(self, handle: int, live: _Live, token: int, stats: StepStats, logprobs=None) -> Event:
        """The token of ``live``'s prefill: its first (no step accepted it; a prefill in ``stats``), or for a
        request resuming speculation its next, one token as a target-only step's (``stats.resumed``)."""
        if live.resuming:
            live.resuming = False
            stats.resumed += 1
            return self._append(handle, live, [token], 1, logprobs)
        stats.num_prefills += 1
        return self._append(handle, live, [token], None, logprobs)

    def _refuse_prefill(self, handle: int, error: Exception) -> Event:
        p = self._prefilling.pop(handle)
        self.engine.release_slot(p.slot)
        self.engine.reset_step_state()
        msg = f"request {handle}: refused in its prefill: {type(error).__name__}: {error}"
        logger.warning(f"scheduler: {msg}")
        return Event(handle, [], "error", msg)

    def _step(self, stats: StepStats) -> list[Event]:
        by_slot = {live.slot: handle for handle, live in self._live.items()}
        order = sorted(by_slot)
        t0 = time.perf_counter()
        reqs = [self._live[by_slot[slot]].request for slot in order]
        mode = self.step_mode
        try:
            new, lens = self.engine.run_step(order, mode)
            lps = (self.engine.step_logprobs(reqs, new, lens, mode) if any(r.logprobs is not None for r in reqs)
                   else [None] * len(order))
        except REQUEST_FAULTS as e:
            return self._fail_step([by_slot[slot] for slot in order], e)
        stats.step_s = time.perf_counter() - t0
        stats.num_rows = len(order)
        stats.accepted_lens = list(lens)
        events = []
        confs = self.engine.step_confidences
        for row, slot in enumerate(order):
            handle = by_slot[slot]
            events.append(self._append(handle, self._live[handle], new[row][:lens[row]], lens[row], lps[row],
                                       confs[row] if confs else None, mode not in NON_SPECULATIVE))
        return events

    def _fail_step(self, handles: list[int], error: Exception) -> list[Event]:
        """A step refused a value part way: every request of it ends with an error (the ones whose own fields
        fail validation named as the cause), their slots are freed and the step state reset."""
        cause = f"{type(error).__name__}: {error}"
        culprits = {}
        for h in handles:
            try:
                self.validate(self._live[h].request)
            except RequestError as e:
                culprits[h] = str(e)
        events = []
        for h in handles:
            live = self._live.pop(h)
            self.engine.release_slot(live.slot)
            if h in culprits:
                events.append(Event(h, [], "error", f"{culprits[h]} (the step refused it: {cause})"))
            else:
                blame = f"requests {sorted(culprits)}" if culprits else "a value the step refused"
                events.append(Event(h, [], "error", f"request {h}: ended with its step, aborted by {blame}: {cause}",
                                    request_fault=False))
        self.engine.reset_step_state()
        logger.warning(f"scheduler: a step refused {cause}; ended its {len(handles)} request(s), engine serving on")
        return events

    def _append(self, handle: int, live: _Live, tokens: list[int], accepted: int | None, logprobs=None,
                confidences: list[float] | None = None, speculative: bool = False) -> Event:
        """Tokens up to a stop token / ``max_new_tokens`` (:meth:`Engine.finish_tokens`); a finished request
        leaves its slot (its KV and latent pages are freed). ``confidences``: those of the drafts the step
        verified (:attr:`Event.confidences`); ``speculative``: the tokens come from a speculative step that
        accepted ``accepted`` (the speculation gate's record)."""
        n, reason = self.engine.finish_tokens(live.request, live.num_out, tokens, live.stops)
        live.num_out += n
        if speculative and accepted is not None:
            live.spec_steps += 1
            live.spec_accepted += accepted
        if live.out is not None:
            live.out.extend(int(t) for t in tokens[:n])
        if reason is not None:
            del self._live[handle]
            if live.out is not None and self.engine.pages.enable_block_reuse:  # its pages serve a next turn
                out, mode = live.out, self.prefill_mode
                if live.latents_end is not None and mode not in NON_SPECULATIVE:  # pages with every latent only
                    out = out[:live.latents_end + 1 - len(live.request.prompt_ids)]
                self.engine.register_prefix(live.slot, live.request, mode, out)
            self.engine.release_slot(live.slot)
            if self.gate is not None:
                self.gate.record(live.spec_accepted, live.spec_steps, handle)
        return Event(handle, [int(t) for t in tokens[:n]], reason, None, accepted,
                     logprobs[:n] if logprobs is not None else None, confidences=confidences,
                     speculative=speculative and accepted is not None)
