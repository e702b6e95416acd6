"""The engine driver: one thread owns the `Engine` and is the only caller of submit/cancel/step.

Why a thread: the engine is single-threaded and `step()` blocks for a whole device step, while
the HTTP side is an asyncio event loop that must keep answering (health checks, bad requests,
other streams) meanwhile. Handlers hand `Submission`s to the driver through a thread-safe command
queue; the driver delivers `TokenEvent`s back through each submission's `sink`, a callable that
must be safe to call from the driver thread (the server's sink is `loop.call_soon_threadsafe` into
an `asyncio.Queue`). Between steps the driver applies every queued command, so a cancel frees its
slot and pages before the next step.

The queue is bounded: `try_reserve(n)` admits n more requests only while the requests in flight
(queued in the engine or running) stay within `capacity` (slots + `max_queue`); the server
answers 429 otherwise, so an overload never grows memory without bound.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Optional

from ling_jax.checks import FieldError, check_int
from ling_jax.serve import Engine, RequestHandle, RequestParams

log = logging.getLogger("ling_jax.server")


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """What the driver tells a submission: new tokens (with their logprobs when asked for), then
    once `finish_reason` ("stop" / "length" / "abort"); or an `error` (then nothing else)."""
    tokens: tuple = ()
    logprobs: Optional[tuple] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    status: int = 400  # the HTTP status an error maps to (400: the engine refused the request)
    param: Optional[str] = None  # the RequestParams field a refusal names (a checks.FieldError's field)


@dataclasses.dataclass(eq=False)
class Submission:
    """One engine request: prompt ids, its parameters, and where its events go."""
    prompt_ids: list
    params: RequestParams
    sink: Callable[[TokenEvent], None]
    handle: Optional[RequestHandle] = None
    done: bool = False


class EngineDriver:
    """Runs the engine loop on its own thread (see the module docstring).

    max_queue: requests allowed to wait for a slot beyond the engine's max_slots.
    on_exit: called on the driver thread after the loop ends (multi-host: `engine.shutdown`).
    on_failure: called on the driver thread (after every request in flight got its error) when the
        engine failed and the loop ended: the server's cue to exit non-zero, so a supervisor
        watching the process restarts it instead of finding a live process that only answers 503.

    Supervision: a submission the engine refuses (any exception from `Engine.submit`: its data
    is that request's alone) is answered with a 400 naming the field and the loop goes on; only
    an exception from `Engine.step` (or `cancel`), which leaves the engine's state unknown, stops
    it: then every request in flight or queued gets a final error event, `failed` says why.
    """

    def __init__(self, engine: Engine, max_queue: int = 64, on_exit: Callable[[], None] | None = None,
                 idle_wait_s: float = 0.05, on_failure: Callable[[str], None] | None = None,
                 warmup_items: list | None = None, warmup_progress=None):
        check_int(max_queue, "max_queue", low=0)
        self.engine = engine
        self.capacity = engine.sizes.max_slots + max_queue
        self.stats = engine.stats()  # refreshed after every step; read by /metrics and /health
        self.failed: Optional[str] = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._live: set[Submission] = set()
        self._on_exit = on_exit
        self._on_failure = on_failure
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._loop, name="ling-jax-engine-driver", daemon=True)
        self._stopping = False
        # lazy warm-up (`serve --warmup lazy`): Engine.warmup_items() run one at a time whenever the
        # engine has nothing to do; a request that comes first compiles the shapes it needs itself
        self._warmup = list(warmup_items or [])
        self._warmup_total, self._warmup_progress = len(self._warmup), warmup_progress

    # -- called from any thread -----------------------------------------------------------------
    def start(self) -> "EngineDriver":
        """Start the loop (idempotent)."""
        with self._lock:
            if self._thread.ident is None:
                self._thread.start()
        return self

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failed is None

    @property
    def warming(self) -> Optional[tuple]:
        """(items done, items in all) while a lazy warm-up is still running, else None."""
        left = len(self._warmup)
        return (self._warmup_total - left, self._warmup_total) if left else None

    def try_reserve(self, n: int) -> bool:
        """Take n places of the bounded queue; False (nothing taken) when they do not fit."""
        with self._lock:
            if self._stopping or self.failed is not None or self._in_flight + n > self.capacity:
                return False
            self._in_flight += n
            return True

    def submit(self, sub: Submission) -> None:
        """Queue a submission (its place must have been reserved with `try_reserve`)."""
        self._commands.put(("submit", sub))

    def cancel(self, sub: Submission) -> None:
        self._commands.put(("cancel", sub))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop: requests still in flight get finish_reason "abort"; then on_exit runs."""
        with self._lock:
            self._stopping = True
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the driver thread ----------------------------------------------------------------------
    def _release(self, sub: Submission) -> None:
        if not sub.done:
            sub.done = True
            self._live.discard(sub)
            with self._lock:
                self._in_flight -= 1

    def _deliver(self, sub: Submission, event: TokenEvent) -> None:
        try:
            sub.sink(event)
        except Exception:  # a sink whose event loop has closed: the client is gone
            log.debug("dropped an event for a closed sink", exc_info=True)

    def _on_tokens(self, sub: Submission, handle: RequestHandle, toks: list) -> None:
        lps = tuple(handle.logprobs[-len(toks):]) if sub.params.logprobs is not None else None
        finish = handle.finish_reason if handle.finished else None
        if finish is not None:
            self._release(sub)
        self._deliver(sub, TokenEvent(tuple(int(t) for t in toks), lps, finish))

    def _warm_one(self) -> None:
        label, call = self._warmup[0]
        t = time.perf_counter()
        call()
        self._warmup.pop(0)
        if self._warmup_progress is not None:
            self._warmup_progress(self._warmup_total - len(self._warmup), self._warmup_total, label,
                                  time.perf_counter() - t)

    def _apply(self, kind: str, sub: Optional[Submission]) -> bool:
        """Apply one command; False when it is the stop command."""
        if kind == "stop":
            return False
        if kind == "submit":
            try:
                sub.handle = self.engine.submit(sub.prompt_ids, sub.params,
                                                on_tokens=lambda h, t, s=sub: self._on_tokens(s, h, t))
                self._live.add(sub)
            except Exception as e:  # this request's data only: refuse it, the engine goes on
                if not isinstance(e, (ValueError, TypeError)):
                    log.warning("engine refused a request: %s: %s", type(e).__name__, e)
                self._release(sub)
                self._deliver(sub, TokenEvent(error=f"request refused by the engine: {e}",
                                              param=e.field if isinstance(e, FieldError) else None))
        elif kind == "cancel" and not sub.done:
            if sub.handle is not None:
                self.engine.cancel(sub.handle)
            self._release(sub)
        return True

    def _loop(self) -> None:
        running = True
        try:
            while running:
                try:  # block briefly only when the engine has nothing to do
                    wait = not self.engine.has_work() and not self._warmup
                    cmd = self._commands.get(timeout=self._idle_wait_s) if wait else self._commands.get_nowait()
                    running = self._apply(*cmd)
                    while running:
                        running = self._apply(*self._commands.get_nowait())
                except queue.Empty:
                    pass
                if running and self.engine.has_work():
                    self.engine.step()
                elif running and self._warmup:
                    self._warm_one()
                self.stats = self.engine.stats()  # after cancels too, which free slots without a step
        except Exception as e:  # an engine failure: fail every request, report unhealthy, stop
            log.exception("engine step failed")
            with self._lock:  # no new admissions from here on
                self.failed = f"{type(e).__name__}: {e}"
            for sub in list(self._live):
                self._release(sub)
                self._deliver(sub, TokenEvent(error="internal engine error: the engine stopped; the server "
                                                    "is exiting", status=503))
        finally:
            while True:  # submissions that never reached the engine
                try:
                    kind, sub = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit" and not sub.done:
                    self._release(sub)
                    self._deliver(sub, TokenEvent(finish_reason="abort") if self.failed is None else
                                  TokenEvent(error="internal engine error: the engine stopped", status=503))
            for sub in list(self._live):
                if self.failed is None and sub.handle is not None and not sub.handle.finished:
                    self.engine.cancel(sub.handle)
                self._release(sub)
                self._deliver(sub, TokenEvent(finish_reason="abort"))
            try:
                self.stats = self.engine.stats()
            except Exception:  # a broken engine: keep the last snapshot
                log.debug("engine stats after the loop failed", exc_info=True)
            try:
                if self._on_exit is not None:
                    self._on_exit()
            finally:
                if self.failed is not None and self._on_failure is not None:
                    self._on_failure(self.failed)
