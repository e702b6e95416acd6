"""One API request's choices on the engine: submit them, turn their token events into text deltas.

Why this sits between the routes and the driver: completions and chat differ only in how the
prompt is built and how a delta is framed, while the hard parts are shared: the bounded queue
(429 before anything is submitted), streaming detokenisation and stop strings (`text`), a stop
string cancelling its engine request at once, usage counts, latency metrics, and cancelling every
unfinished choice when the client goes away (`ChoiceRun.close`, run from `finally` whichever way
the response ends: done, error, disconnect or server shutdown).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from typing import AsyncIterator, Awaitable, Callable, Optional

from ling_jax.serve import RequestParams
from ling_jax.server.driver import EngineDriver, Submission, TokenEvent
from ling_jax.server.errors import APIError
from ling_jax.server.metrics import ServerMetrics
from ling_jax.server.text import IncrementalDetokenizer, StopMatcher

DISCONNECT_POLL_S = 0.5
RETRY_AFTER_S = 1  # the 429's Retry-After: a slot frees within a few steps of a busy engine


@dataclasses.dataclass
class ChoicePlan:
    """What one choice runs: prompt ids, engine parameters, stop strings, and the ids whose text is
    not shown when they end the choice (EOS and `stop_token_ids`, as OpenAI leaves stops out)."""
    prompt_ids: list
    params: RequestParams
    stops: tuple = ()
    stop_ids: frozenset = frozenset()
    echo_text: str = ""


@dataclasses.dataclass
class Delta:
    """New output of one choice: text, the token ids it came from, their logprobs (TokenLogprob
    or None per token, when asked for) and, on its last delta, the finish reason."""
    index: int
    text: str = ""
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None


class _ChoiceState:
    def __init__(self, plan: ChoicePlan, tokenizer):
        self.plan = plan
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = StopMatcher(plan.stops)
        self.n_tokens = 0
        self.first_at: Optional[float] = None
        self.last_at: Optional[float] = None
        self.finished = False


def _put(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, index: int, event: TokenEvent) -> None:
    loop.call_soon_threadsafe(q.put_nowait, (index, event))


class ChoiceRun:
    """The choices of one request on the engine (see the module docstring)."""

    def __init__(self, driver: EngineDriver, tokenizer, metrics: ServerMetrics, plans: list[ChoicePlan]):
        self.driver, self.metrics, self.plans = driver, metrics, plans
        self.states = [_ChoiceState(p, tokenizer) for p in plans]
        self.subs: list[Submission] = []
        self.arrival = time.monotonic()
        self._queue: Optional[asyncio.Queue] = None

    def start(self) -> None:
        """Submit every choice, or raise APIError(429) with nothing submitted when the queue is full."""
        if not self.driver.alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        if len(self.plans) > self.driver.capacity:
            raise APIError(400, f"n: {len(self.plans)} choices in all is more than this server holds at once "
                                f"({self.driver.capacity})", param="n")
        if not self.driver.try_reserve(len(self.plans)):
            if not self.driver.alive:
                raise APIError(503, "the engine is not running", code="engine_unavailable")
            raise APIError(429, f"the request queue is full ({self.driver.capacity} requests in flight); "
                                f"retry later", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        for i, plan in enumerate(self.plans):
            sub = Submission(plan.prompt_ids, plan.params, functools.partial(_put, loop, self._queue, i))
            self.subs.append(sub)
            self.driver.submit(sub)
        self.metrics.prompt_tokens.inc(sum(len(p.prompt_ids) for p in self.plans))

    @property
    def completion_tokens(self) -> int:
        return sum(s.n_tokens for s in self.states)

    def close(self) -> None:
        """Cancel every choice that has not finished (idempotent); each counts as "cancelled" in
        `requests_total`."""
        for sub, st in zip(self.subs, self.states):
            if not st.finished:
                st.finished = True
                self.metrics.requests.labels("cancelled").inc()
                self.driver.cancel(sub)

    def _finish(self, st: _ChoiceState, reason: str) -> None:
        st.finished = True
        self.metrics.requests.labels(reason).inc()
        now = time.monotonic()
        self.metrics.e2e.observe(now - self.arrival)
        if st.n_tokens > 1 and st.first_at is not None:
            self.metrics.tpot.observe((st.last_at - st.first_at) / (st.n_tokens - 1))

    def _on_event(self, i: int, ev: TokenEvent) -> Delta:
        st = self.states[i]
        if ev.error is not None:
            st.finished = True
            self.metrics.requests.labels("error").inc()
            self.close()
            raise APIError(ev.status, ev.error, param=(ev.param or "prompt") if ev.status == 400 else None)
        d = Delta(i)
        now = time.monotonic()
        last = len(ev.tokens) - 1
        for k, tok in enumerate(ev.tokens):
            if st.first_at is None:
                st.first_at = now
                self.metrics.ttft.observe(now - self.arrival)
            st.last_at = now
            st.n_tokens += 1
            self.metrics.generation_tokens.inc()
            d.token_ids.append(tok)
            if ev.logprobs is not None:
                d.logprobs.append(ev.logprobs[k])
            if not (k == last and ev.finish_reason == "stop" and tok in st.plan.stop_ids):
                d.text += st.stop.push(st.detok.push([tok]))
            if st.stop.stopped:  # a stop string: this choice ends here, its engine request is cancelled
                self.driver.cancel(self.subs[i])
                d.finish_reason = "stop"
                break
        if d.finish_reason is None and ev.finish_reason is not None:
            d.text += st.stop.push(st.detok.flush())
            d.text += st.stop.flush()
            d.finish_reason = "stop" if st.stop.stopped else ev.finish_reason
        if d.finish_reason is not None:
            self._finish(st, d.finish_reason)
        return d

    async def deltas(self, is_disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[Delta]:
        """The choices' deltas as they come (echo text first), until every choice has finished.
        Stops early (cancelling the rest) when `is_disconnected()` says the client has gone."""
        try:
            for i, st in enumerate(self.states):
                if st.plan.echo_text:
                    yield Delta(i, st.plan.echo_text)
            next_check = time.monotonic() + DISCONNECT_POLL_S
            while not all(st.finished for st in self.states):
                try:
                    i, ev = await asyncio.wait_for(self._queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    i = None
                    if not self.driver.alive and self._queue.empty():  # stopped without a word for us
                        self.close()
                        raise APIError(503, "the engine stopped", code="engine_unavailable")
                if time.monotonic() >= next_check:  # checked on time, not only when idle
                    if await is_disconnected():
                        return
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                if i is None or self.states[i].finished:
                    continue  # events already queued for a choice a stop string has ended
                yield self._on_event(i, ev)
        finally:
            self.close()

