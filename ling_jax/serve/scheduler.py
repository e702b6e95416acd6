"""Host-side scheduling: the request queue, slot assignment, page growth and preemption.

Pure Python over `Request` records and a `PageAllocator` (no jax, nothing on the device), so the
policy is testable and deterministic. One `schedule()` call per engine step (serve/README.md,
*Scheduling*, has the measurements behind each rule):
1. Admit FIFO into free slots while the free pages could hold the whole prompt (+1), no skipping
   (a preempted request goes back to the head).
2. Decode: every slot whose prompt is in gets the page for its next token(s), oldest first; if none
   is free the youngest running request is preempted (itself when it is the one asking), to be
   recomputed from prompt + generated tokens. Age (order of first admission) survives preemption,
   so the oldest always progresses and none starves.
3. Prefill: prompts still being fed get chunks, oldest first, at most `prefill_rows` rows and
   `prefill_chunk` tokens in all, each cut to the pages it can get (never preempting). With m > 1
   prompts waiting each row gets at most ceil(prefill_chunk / m) tokens (the program computes
   [rows, T] with T its longest row's bucket, so one full row beside idle ones costs as much), and
   no row more than `prefill_row_tokens`.
4. If nothing can run while requests hold slots, the youngest is preempted and the plan made again,
   so the engine never stalls.
Speculation (`speculative` = K): a decoding request gets pages for 1 + `drafts_for(req)` tokens,
and a preempted one is recomputed with its last generated token left pending (`feed_of`), so its
next verify starts at the same token index and its draws do not depend on the preemption.
Prefix cache: admission looks the sequence up and starts a hit at its restore point; free pages
include the cache's evictable ones; a chunk that is not a prompt's last ends on a page boundary
when one is in reach (where snapshots are taken).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from ling_jax.serve.allocator import PageAllocator
from ling_jax.serve.prefix_cache import PrefixCache
from ling_jax.serve.request import RequestParams

QUEUED, PREFILL, DECODE, DONE = "queued", "prefill", "decode", "done"


@dataclasses.dataclass(eq=False)
class Request:
    """One request's mutable state. `feed` = the tokens to prefill on (re)admission: the prompt,
    plus the tokens generated before a preemption; `n_fed` = tokens of this sequence in the cache
    (the slot's length); `age` = order of first admission (larger = younger, the preemption
    victim; kept across preemptions, so a recomputed request is not the next victim again)."""
    id: int
    prompt: list
    params: RequestParams
    stop: frozenset
    generated: list = dataclasses.field(default_factory=list)
    state: str = QUEUED
    slot: Optional[int] = None
    feed: list = dataclasses.field(default_factory=list)
    n_fed: int = 0
    age: int = -1
    finish_reason: Optional[str] = None
    preemptions: int = 0
    logprobs: list = dataclasses.field(default_factory=list)  # per generated token: TokenLogprob or None


@dataclasses.dataclass
class Plan:
    """What one engine step runs: decode requests (one token each) and (request, n tokens) chunks."""
    decode: list
    prefill: list


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_slots: int, prefill_chunk: int, prefill_rows: int,
                 prefix: Optional[PrefixCache] = None, speculative: int = 0, prefill_row_tokens: Optional[int] = None):
        self.alloc = allocator
        self.prefix = prefix
        self.speculative = speculative
        self.slots: list[Optional[Request]] = [None] * max_slots
        self.queue: collections.deque[Request] = collections.deque()
        self.prefill_chunk = prefill_chunk
        self.prefill_rows = prefill_rows
        self.prefill_row_tokens = prefill_row_tokens or prefill_chunk
        self.preemptions = 0
        self._age = 0

    # -- bookkeeping ---------------------------------------------------------------------------
    def running(self) -> list[Request]:
        """Requests holding a slot, oldest first."""
        return sorted((r for r in self.slots if r is not None), key=lambda r: r.age)

    def release(self, req: Request) -> None:
        """Free the request's slot and pages (finish, cancel, preemption)."""
        if req.slot is not None:
            if self.prefix is not None:
                self.prefix.release(req)  # releases the slot's pages too
            else:
                self.alloc.release(req.slot)
            self.slots[req.slot] = None
            req.slot = None

    def preempt(self, req: Request) -> None:
        """Drop the request's cache and requeue it at the head, to be recomputed from its prompt
        and the tokens it already generated (`feed`); its sampled tokens are kept."""
        self.release(req)
        req.state, req.n_fed = QUEUED, 0
        req.preemptions += 1
        self.preemptions += 1
        self.queue.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        self.release(req)
        if req in self.queue:
            self.queue.remove(req)
        req.state, req.finish_reason = DONE, reason

    # -- speculative decoding ------------------------------------------------------------------
    def drafts_for(self, req: Request) -> int:
        """Drafts the request verifies in its next decode step: `speculative`, cut so that the step
        emits at most its remaining max_tokens (it emits drafts + 1 at most). Why cut here: then
        the verify writes only positions below prompt + max_tokens <= max_seq_len, inside the
        pages a request may hold."""
        if not self.speculative:
            return 0
        return max(0, min(self.speculative, req.params.max_tokens - len(req.generated) - 1))

    def feed_of(self, req: Request) -> list:
        """The tokens to prefill on (re)admission: the prompt and the generated tokens; with
        speculation the last generated token stays pending (see the module docstring)."""
        gen = list(req.generated)
        return list(req.prompt) + (gen[:-1] if self.speculative and gen else gen)

    def holds_pending(self, req: Request) -> bool:
        """True when the request's fed tokens leave its last generated token pending (a
        speculative recompute): finishing its prefill then emits nothing, it decodes on."""
        return len(req.feed) < len(req.prompt) + len(req.generated)

    # -- policy --------------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.queue and None in self.slots:
            req = self.queue[0]
            feed = self.feed_of(req)
            # a request with penalties starts fresh: its token statistics are built from every token
            # it prefills (a hit would skip the prefix's), so it never restores (it still inserts)
            hit = self.prefix.lookup(feed) if self.prefix is not None and not req.params.penalized else None
            shared, locked = (len(hit.shared), hit.newly_locked) if hit is not None else (0, 0)
            if self.alloc.pages_for(len(feed) + 1) - shared > self.alloc.num_free - locked:
                break
            self.queue.popleft()
            slot = self.slots.index(None)
            self.slots[slot] = req
            req.slot, req.state, req.feed, req.n_fed = slot, PREFILL, feed, 0
            if hit is not None:
                self.prefix.admit(req, hit)  # n_fed = the restore point; its pages shared
            if req.age < 0:  # first admission; a preempted request keeps its age (no starvation)
                req.age, self._age = self._age, self._age + 1

    def schedule(self) -> Plan:
        while True:
            self._admit()
            decode = []
            for req in self.running():
                if req.state != DECODE or req.slot is None:
                    continue
                while not self.alloc.ensure(req.slot, req.n_fed + 1 + self.drafts_for(req)):
                    victim = self.running()[-1]
                    self.preempt(victim)
                    if victim is req:
                        break
                else:
                    decode.append(req)
            prefill, budget = [], self.prefill_chunk
            feeding = [r for r in self.running() if r.state == PREFILL]
            per_row = min(-(-budget // max(1, min(len(feeding), self.prefill_rows))),  # see the policy, item 3
                          self.prefill_row_tokens)
            for req in feeding:
                if len(prefill) == self.prefill_rows or budget == 0:
                    break
                held = len(self.alloc.pages.get(req.slot, []))
                room = (held + self.alloc.num_free) * self.alloc.sizes.page_size - req.n_fed
                n = min(budget, per_row, len(req.feed) - req.n_fed, room)
                if self.prefix is not None and n < len(req.feed) - req.n_fed:
                    n = _to_page_boundary(req.n_fed, n, self.alloc.sizes.page_size)
                if n <= 0:
                    continue
                if not self.alloc.ensure(req.slot, req.n_fed + n):
                    raise AssertionError("page accounting out of step")  # room was computed above
                prefill.append((req, n))
                budget -= n
            running = self.running()
            if decode or prefill or not running:
                return Plan(decode, prefill)
            self.preempt(running[-1])


def _to_page_boundary(start: int, n: int, page_size: int) -> int:
    """n cut so that start + n ends on a page boundary, when one lies in (start, start + n]."""
    end = (start + n) // page_size * page_size
    return end - start if end > start else n

