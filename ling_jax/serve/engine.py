"""`Engine`: continuous batching over paged latent pages and KDA state slots (the Python API).

    engine = Engine(model, max_slots=8, page_size=16, num_pages=256, prefill_chunk=64)
    engine.warmup()                                   # compiles every shape it will ever run
    h = engine.submit(prompt_ids, RequestParams(max_tokens=32, temperature=0.7, seed=1))
    for tok in h.tokens(): ...                        # drives engine.step() until h finishes
    engine.run_until_done(); engine.stats()

Single-threaded and deterministic: nothing runs between calls, and the same submissions in the
same order give the same tokens. A server drives `step()` from one thread and routes the
`{handle: new tokens}` it returns; `submit` / `cancel` are called between steps.

The engine is the request lifecycle (queue and admission through the scheduler, the prefix cache's
host tree, stop and length rules, handles, callbacks, statistics); the device side is its
`ModelRunner` (`self.runner`, runner.py says why apart): a step asks the scheduler what to run,
calls the runner once per program and emits the tokens it returns. Every program has one shape per
bucket (`ModelRunner.program_shapes`) and `warmup()` runs each on padding rows, so afterwards no
request within `max_seq_len` compiles anything (serve/README.md, *Compile bound*). Multi-host
(`multihost.py`): every process builds the same Engine; process 0 drives it and its runner
broadcasts each program call; processes > 0 call `follow()` until process 0's `shutdown()`.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Iterator, Optional, Sequence


from ling_jax.checks import check_int
from ling_jax.exec_config import ExecConfig
from ling_jax.sampling_params import TokenLogprob
from ling_jax.serve.allocator import PageAllocator
from ling_jax.serve.pools import GIB, plan_pools, stored_kpe_values
from ling_jax.serve.prefix_cache import PrefixCache
from ling_jax.serve.request import RequestFieldError, RequestParams
from ling_jax.serve.runner import ModelRunner, check_row_buckets, decode_widths, token_buckets
from ling_jax.serve.scheduler import DECODE, DONE, PREFILL, Request, Scheduler
from ling_jax.serve.snapshots import DEFAULT_BUDGET_FRACTION, plan_snapshots
from ling_jax.speculation import MAX_SPECULATIVE


class RequestHandle:
    """What `submit` returns: the request's id, its tokens so far and how it ended.

    finish_reason: None while running, "stop" (a stop id, included in the tokens), "length"
    (max_tokens) or "cancelled". `tokens()` iterates the new tokens, stepping the engine."""

    def __init__(self, engine: "Engine", req: Request):
        self._engine, self._req = engine, req
        self._on_tokens = None

    @property
    def id(self) -> int:
        return self._req.id

    @property
    def generated(self) -> list:
        return list(self._req.generated)

    @property
    def logprobs(self) -> list:
        """Per generated token (aligned with `generated`): a `TokenLogprob`, or None when the
        request did not ask for logprobs."""
        return list(self._req.logprobs)

    @property
    def finished(self) -> bool:
        return self._req.state == DONE

    @property
    def finish_reason(self) -> Optional[str]:
        return self._req.finish_reason

    def tokens(self) -> Iterator[int]:
        return self._engine.stream(self)

    def __repr__(self):
        return f"RequestHandle(id={self.id}, state={self._req.state}, n={len(self._req.generated)})"


class Engine:
    """Continuous-batching engine over one model (module docstring, serve/README.md).

    max_slots: sequences in flight; page_size: tokens per latent page; num_pages or cache_memory_gib:
    the page pool (`describe()` prints its bytes); max_seq_len: prompt + new tokens of one request;
    kv_cache_dtype: "auto" or "fp8" (float8 pages with per-token scales); with_mtp: keep the MTP
    layer's pages (default: the model has an MTP layer); exec: how to run (default `model.exec`).
    prefill_chunk: prompt tokens a step at most; prefill_rows: prompts fed side by side (at most
    max_slots); prefill_row_tokens: one prompt's tokens a step at most (default and at most
    prefill_chunk): a lone prompt's steps stay short while a backlog is fed in large batched ones;
    prefill_row_buckets: prefill row counts compiled (default `(prefill_rows,)`). These keyword
    defaults (64 tokens over 2 rows) are the explicit API's; the commands use the platform's
    (`prefill_policy.default_prefill_policy`). buckets / widths / decode_rows: the compiled token
    widths, block-table widths and decode row counts (defaults `token_buckets(min(prefill_chunk,
    prefill_row_tokens))`, `decode_widths(max_blocks, 256 // page_size)`, `row_buckets(max_slots)`).
    speculative: MTP drafts verified per decode step, 0 (off) … `MAX_SPECULATIVE`. prefix_cache: keep
    an exact prefix cache; prefix_cache_memory_gib: its byte budget (default `DEFAULT_BUDGET_FRACTION`
    of the page pool), which also sizes the snapshot pool; snapshot_interval: tokens between the KDA
    snapshots a prefill chunk takes inside itself (a multiple of page_size; default
    `default_snapshot_interval`).
    """

    def __init__(self, model, *, max_slots: int = 8, page_size: int = 16, num_pages: int | None = None,
                 cache_memory_gib: float | None = None, prefill_chunk: int = 64, prefill_rows: int = 2,
                 max_seq_len: int | None = None, with_mtp: bool | None = None, exec: ExecConfig | None = None,
                 buckets: Sequence[int] | None = None, widths: Sequence[int] | None = None,
                 decode_rows: Sequence[int] | None = None, prefill_row_buckets: Sequence[int] | None = None,
                 speculative: int = 0, prefix_cache: bool = True,
                 prefix_cache_memory_gib: float | None = None, snapshot_interval: int | None = None,
                 kv_cache_dtype: str | None = None, prefill_row_tokens: int | None = None):
        cfg = model.cfg
        self.cfg = cfg
        if num_pages is None and cache_memory_gib is None:
            raise ValueError("Engine needs num_pages or cache_memory_gib (the page pool's size)")
        prefill_row_tokens = prefill_chunk if prefill_row_tokens is None else prefill_row_tokens
        for name, v in (("prefill_chunk", prefill_chunk), ("prefill_rows", prefill_rows),
                        ("prefill_row_tokens", prefill_row_tokens)):
            check_int(v, f"Engine {name}", field=name, low=1)
        row_max = min(prefill_chunk, prefill_row_tokens)  # one prompt's tokens a step
        with_mtp = (model.mtp is not None) if with_mtp is None else bool(with_mtp)
        if with_mtp and model.mtp is None:
            raise ValueError("Engine with_mtp=True needs the MTP layer, and this model has none")
        _check_speculative(speculative, model, with_mtp)
        self.sizes = plan_pools(cfg, model.dtype, max_slots=max_slots, page_size=page_size, num_pages=num_pages,
                                cache_memory_gib=cache_memory_gib, max_seq_len=max_seq_len, with_mtp=with_mtp,
                                kv_cache_dtype=kv_cache_dtype,
                                kpe_stored=stored_kpe_values(cfg, exec or model.exec, model.dtype, kv_cache_dtype))
        if self.sizes.max_seq_len > self.sizes.num_pages * page_size:
            raise ValueError(f"max_seq_len={self.sizes.max_seq_len} exceeds the pool "
                             f"({self.sizes.num_pages} pages x {page_size} tokens)")
        buckets = tuple(sorted(set(buckets))) if buckets else token_buckets(row_max)
        if buckets[-1] < row_max:
            raise ValueError(f"the largest bucket {buckets[-1]} is below the tokens one prompt is fed a step "
                             f"(min(prefill_chunk, prefill_row_tokens) = {row_max})")
        mb = self.sizes.max_blocks
        widths = tuple(sorted(set(widths))) if widths else decode_widths(mb, max(1, 256 // page_size))
        if widths[-1] != mb or widths[0] < 1:
            raise ValueError(f"decode widths {widths} must be positive and end at max_blocks={mb}")
        decode_rows = check_row_buckets(decode_rows, max_slots, "decode_rows", "max_slots")
        prefill_rows = min(prefill_rows, max_slots)
        prefill_row_buckets = check_row_buckets(prefill_row_buckets, prefill_rows, "prefill_row_buckets",
                                                "prefill_rows", default=(prefill_rows,))
        self.prefill_chunk, self.prefill_row_tokens = prefill_chunk, row_max
        self.exec = exec or model.exec
        if self.exec.layer_loop != model.model.layers.loop:
            raise ValueError(f"exec.layer_loop={self.exec.layer_loop!r}, but the model's layers are stored for "
                             f"{model.model.layers.loop!r} (a load-time choice: load with that layer loop, or "
                             f"model.set_layer_loop({self.exec.layer_loop!r}) before building the engine)")
        interval = _check_snapshot_interval(snapshot_interval, page_size, self.exec)
        self.speculative = speculative
        self.alloc = PageAllocator(self.sizes)
        self.prefix, snapshot_rows = self._make_prefix_cache(prefix_cache, prefix_cache_memory_gib,
                                                             min(row_max, interval))
        # the device side: parameters, pools, compiled programs, their shapes and warm-up (runner.py)
        self.runner = ModelRunner(model, self.sizes, self.exec, self.alloc, buckets=buckets, widths=widths,
                                  decode_rows=decode_rows, prefill_row_buckets=prefill_row_buckets,
                                  speculative=speculative,
                                  snapshot_rows=snapshot_rows, snapshot_interval=interval)
        self.sched = Scheduler(self.alloc, max_slots, prefill_chunk, prefill_rows, self.prefix,
                               speculative=speculative, prefill_row_tokens=row_max)
        self.spec_steps = 0          # speculative program calls
        self.spec_rounds = 0         # verify rounds (one per decoding slot per call)
        self.spec_accepted = 0       # drafts accepted
        self.spec_drafted = 0        # drafts verified
        self._ids = itertools.count()
        self._handles: dict[int, RequestHandle] = {}
        self.steps = 0
        self.tokens_generated = 0
        self.prompt_tokens_fed = 0

    def _make_prefix_cache(self, enabled: bool, budget_gib: float | None, every: int):
        """(PrefixCache, its snapshot rows), or (None, None) when off; every: tokens per snapshot
        a prefill row takes at most (min(prefill_row_tokens, snapshot_interval), `plan_snapshots`)."""
        if not isinstance(enabled, bool):
            raise ValueError(f"Engine prefix_cache must be a bool, got {enabled!r}")
        if not enabled:
            return None, None
        budget, rows = plan_snapshots(self.sizes, every, budget_gib)
        self._prefix_budget_given = budget_gib is not None
        cache = PrefixCache(self.alloc, num_snapshots=rows, page_bytes=self.sizes.page_bytes,
                            snapshot_bytes=self.sizes.snapshot_bytes, budget_bytes=budget,
                            lookahead=1 if self.sizes.with_mtp else 0)
        return cache, rows

    # -- start-up ------------------------------------------------------------------------------
    def describe(self) -> str:
        """Start-up report: pool sizes with their byte arithmetic, and the compiled shapes."""
        return self.runner.describe(self._describe_prefix())

    def _describe_prefix(self) -> str:
        if self.prefix is None:
            return "  prefix cache: off\n"
        pc, sz, interval = self.prefix, self.sizes, self.runner.snapshot_interval
        given = ("prefix_cache_memory_gib" if self._prefix_budget_given else
                 f"{DEFAULT_BUDGET_FRACTION} x the page pool")
        every = min(self.prefill_row_tokens, interval)
        chunk_pages = max(1, every // sz.page_size)
        return (f"  prefix cache: budget {pc.budget_bytes / GIB:.4f} GiB ({given}) for cached pages "
                f"({sz.page_bytes} B each, from the page pool) + snapshots ({sz.snapshot_bytes} B each);\n"
                f"    snapshot pool: {pc.num_snapshots} rows = budget // ({sz.snapshot_bytes} + {chunk_pages} pages x "
                f"{sz.page_bytes}) (one per {every} tokens: snapshots every {interval} tokens inside a "
                f"prefill chunk and at chunk ends) = {self.runner.snapshots.bytes / GIB:.4f} GiB beside the pools\n")

    # -- the runner's (runner.py) ---------------------------------------------------------------
    def warmup(self, progress=None) -> None:
        """Compile every step shape now, on padding rows that change no state (nothing on processes > 0
        of a multi-host run: they run process 0's warm-up inside `follow()`). progress(done, total,
        label, seconds): called after each item of `warmup_items()`."""
        self.runner.warmup(progress)

    def warmup_items(self) -> list:
        """The warm-up as [(label, call)]: one item per program shape, those a first short request needs
        first, then the prefix cache's copies and every program once more (compiling nothing: it
        records the steady-state argument placement in the dispatch cache). Run one by one between
        steps (`ling-jax serve --warmup lazy`) as safely as at start-up. Empty on a follower."""
        return self.runner.warmup_items()

    def program_calls(self) -> list:
        return self.runner.program_calls()

    def compiled_shapes(self) -> int:
        return self.runner.compiled_shapes()

    @property
    def is_follower(self) -> bool:
        return self.runner.is_follower

    def follow(self) -> None:
        self.runner.follow()

    def shutdown(self) -> None:
        """Process 0: release the followers (their `follow()` returns); the engine runs no more
        steps afterwards. Idempotent; does nothing single-process or on a follower."""
        self.runner.shutdown()

    # -- requests ------------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: RequestParams = RequestParams(),
               on_tokens: Callable[[RequestHandle, list], None] | None = None) -> RequestHandle:
        """Queue a request; it is admitted into a free slot at the next `step()`. on_tokens(handle,
        new tokens) is called from `step()` whenever the request emits (after its finish state is set)."""
        if not isinstance(params, RequestParams):
            raise TypeError(f"params must be a RequestParams, got {type(params).__name__}")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty (need at least one token)")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(prompt) + params.max_tokens > self.sizes.max_seq_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} exceeds the "
                             f"engine's max_seq_len={self.sizes.max_seq_len}")
        if self.speculative:
            _check_speculative_params(params)
        stop = self.cfg.eos_token_id if params.stop_ids is None else params.stop_ids
        req = Request(next(self._ids), prompt, params, frozenset(int(s) for s in stop))
        self.sched.queue.append(req)
        h = RequestHandle(self, req)
        h._on_tokens = on_tokens
        self._handles[req.id] = h
        return h

    def cancel(self, handle: RequestHandle) -> None:
        """Stop a request now (queued or running): its slot and pages are freed at once."""
        if handle._req.state != DONE:
            self.sched.finish(handle._req, "cancelled")
            self._handles.pop(handle.id, None)

    # -- stepping ------------------------------------------------------------------------------
    def _emit(self, req: Request, tok: int, out: dict, lp=None, i: int = 0) -> None:
        """Record req's new token; lp: the step's logprob arrays (numpy), row i is req's."""
        req.generated.append(tok)
        n = req.params.logprobs
        req.logprobs.append(None if n is None else
                            TokenLogprob(float(lp[0][i]), tuple((int(lp[1][i, j]), float(lp[2][i, j]))
                                                                for j in range(n))))
        self.tokens_generated += 1
        out.setdefault(self._handles[req.id], []).append(tok)
        if tok in req.stop:
            self.sched.finish(req, "stop")
        elif len(req.generated) >= req.params.max_tokens:
            self.sched.finish(req, "length")
        else:
            req.state = DECODE

    def step(self) -> dict:
        """One engine step: admit, decode one token (a verify round with speculation) for every
        decoding slot, feed one prefill chunk. Returns {handle: [new tokens]} (finished handles
        included, their last tokens)."""
        plan = self.sched.schedule()
        if self.prefix is not None:  # hits admitted by schedule(): their slots' KDA rows and page copies
            self.runner.restore(self.prefix.take_restores())
        out: dict = {}
        if plan.decode:
            self._decode(plan.decode, out)
        if plan.prefill:
            self._prefill(plan.prefill, out)
        if self.prefix is not None:
            self.prefix.commit(self.sched.running())
        self.steps += 1
        for h, toks in out.items():
            if h._on_tokens is not None:
                h._on_tokens(h, toks)
        for h in out:
            if h.finished:
                self._handles.pop(h.id, None)
        return out

    def _decode(self, decode: list, out: dict) -> None:
        """One decode step for the decoding requests (the scheduler ensured pages for 1 + drafts
        tokens each): each emitted run goes through the stop / max_tokens rules token by token, so a
        stop inside an accepted run ends it there."""
        drafts = {r.id: self.sched.drafts_for(r) for r in decode}
        reqs, emitted, n_emit, lp = self.runner.decode(decode, drafts)
        if self.speculative:
            self.spec_steps += 1
            self.spec_rounds += len(decode)
            self.spec_drafted += sum(drafts.values())
        for i, r in enumerate(reqs):
            if r is None:
                continue
            n = int(n_emit[i])
            self.spec_accepted += n - 1
            r.n_fed += n
            for j in range(n):
                self._emit(r, int(emitted[i, j]), out, None if lp is None else tuple(x[:, j] for x in lp), i)
                if r.state == DONE:
                    break

    def _prefill(self, chunk: list, out: dict) -> None:
        """Feed one prefill chunk [(request, n)]; with a prefix cache, snapshots inside the chunks
        are planned now, written by the program and inserted once fed, then those of chunks that
        ended on a page boundary are taken."""
        inner = self.prefix.plan_boundaries(chunk, self.runner.snapshot_interval) if self.prefix is not None else []
        tok, lp = self.runner.prefill(chunk, inner)
        for r, n in chunk:
            r.n_fed += n
            self.prompt_tokens_fed += n
        if self.prefix is not None:
            self.prefix.insert_boundaries(chunk, inner)
            self.runner.save(self.prefix.after_prefill([r for r, _ in chunk]))
        for i, (r, n) in enumerate(chunk):
            if r.n_fed == len(r.feed) and self.sched.holds_pending(r):
                r.state = DECODE  # a speculative recompute: its pending token decodes next
            elif r.n_fed == len(r.feed):
                self._emit(r, int(tok[i]), out, lp, i)

    def has_work(self) -> bool:
        return bool(self.sched.queue) or any(s is not None for s in self.sched.slots)

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    def stream(self, handle: RequestHandle) -> Iterator[int]:
        """The handle's tokens, from the first, stepping the engine while it runs (the other
        requests advance too)."""
        i = 0
        while True:
            toks = handle._req.generated
            while i < len(toks):
                yield toks[i]
                i += 1
            if handle.finished:
                return
            self.step()

    def stats(self) -> dict:
        running, pc = self.sched.running(), self.prefix
        return {
            "slots_total": self.sizes.max_slots,
            "slots_in_use": len(running),
            "prefilling": sum(r.state == PREFILL for r in running),
            "decoding": sum(r.state == DECODE for r in running),
            "pages_total": self.sizes.num_pages,
            "pages_in_use": self.alloc.used,
            "queue_depth": len(self.sched.queue),
            "tokens_generated": self.tokens_generated,
            "prompt_tokens_fed": self.prompt_tokens_fed,
            "preemptions": self.sched.preemptions,
            "steps": self.steps,
            "spec_steps": self.spec_steps,
            "spec_accepted_tokens": self.spec_accepted,
            "spec_acceptance_length": (self.spec_accepted + self.spec_rounds) / max(self.spec_rounds, 1),
            "prefix_hits": pc.hits if pc else 0, "prefix_tokens_saved": pc.tokens_saved if pc else 0,
            "prefix_cache_pages": pc.nodes if pc else 0, "prefix_cache_bytes": pc.bytes if pc else 0,
        }

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix no running request uses (its pages and snapshot rows are free)."""
        if self.prefix is not None:
            self.prefix.clear()


def _check_speculative_params(params: "RequestParams") -> None:
    """What the speculative program does not do yet, refused by field name: penalties (they would
    depend on the tokens drafted inside a round). Logprobs are the verify positions' (`step._verify`)."""
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(params, name) != neutral:
            raise RequestFieldError(name, f"RequestParams.{name}={getattr(params, name)!r} is not supported with speculative "
                             f"decoding (Engine speculative > 0); use {neutral} or an engine without speculation")


def default_snapshot_interval(page_size: int, kda_chunk: int) -> int:
    """lcm(page_size, kda_chunk): the page boundaries that are also ends of the chunked scan's chunks,
    so taking their states costs the scan nothing but the copies."""
    return math.lcm(page_size, kda_chunk)


def _check_snapshot_interval(interval, page_size: int, ex: ExecConfig) -> int:
    if interval is None:
        return default_snapshot_interval(page_size, ex.kda_chunk)
    return check_int(interval, "Engine snapshot_interval", field="snapshot_interval", low=1, multiple_of=page_size,
                     expected=f"a positive multiple of page_size={page_size} (snapshots are taken on page boundaries)")


def _check_speculative(speculative, model, with_mtp: bool) -> None:
    check_int(speculative, "Engine speculative", field="speculative", low=0, high=MAX_SPECULATIVE,
              expected=f"an int in [0, {MAX_SPECULATIVE}] (MTP drafts per decode step, 0 = off)")
    if speculative and model.mtp is None:
        raise ValueError("Engine speculative > 0 needs the MTP layer, and this model has none")
    if speculative and not with_mtp:
        raise ValueError("Engine speculative > 0 needs with_mtp=True (the MTP pages it drafts from)")
