"""`Engine`: continuous batching over paged latent pages and KDA state slots (the Python API).

    engine = Engine(model, max_slots=8, page_size=16, num_pages=256, prefill_chunk=64)
    engine.warmup()                                   # compiles every shape it will ever run
    h = engine.submit(prompt_ids, RequestParams(max_tokens=32, temperature=0.7, seed=1))
    for tok in h.tokens(): ...                        # drives engine.step() until h finishes
    engine.run_until_done(); engine.stats()

Single-threaded and deterministic: nothing runs between calls, and the same submissions in the
same order give the same tokens. A server drives `step()` from one thread and routes the
`{handle: new tokens}` it returns; `submit` / `cancel` are called between steps.

Compile bound: the decode program has one shape ([R, 1]) per row bucket R in `decode_rows` and
block-table width in `widths` (a step runs the fewest rows that hold its decoding slots, so idle
slots cost nothing, and attends over the pages of its longest decoding sequence, rounded up to a
width); the prefill program one per token bucket and width ([prefill_rows, T], T in `buckets`: powers of
two up to `prefill_chunk`; its block table cut to the width that holds its rows' pages after the
chunk, so a chunk gathers the pages its keys need, not all max_blocks). `warmup()`
runs each once on padding rows (which change nothing), so afterwards no request of any length
within `max_seq_len` compiles anything (`compiled_shapes()` counts them). With `speculative=K`
the speculative program (`speculative.py`: [R, K+1] verify) takes decode's place, one per row
bucket and width. The prefix cache adds two copy programs of one shape each (snapshots.py), warmed up
with them.

Multi-host (`serve/multihost.py`): every process builds the same Engine; process 0 drives it as
above and broadcasts each program call (the snapshot copies included); processes > 0 call
`follow()` until process 0's `shutdown()`.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Callable, Iterator, Optional, Sequence

import jax
import numpy as np
from flax import nnx

from ling_jax.checks import FieldError, check_int, is_int
from ling_jax.exec_config import ExecConfig
from ling_jax.sampling_params import TokenLogprob
from ling_jax.serve.allocator import PageAllocator
from ling_jax.serve.multihost import OP_DECODE, OP_PREFILL, OP_RESTORE, OP_SAVE, OP_SPEC, ProgramShape, make_link
from ling_jax.serve.pools import (GIB, describe, init_pools, is_abstract, make_placed, per_device_bytes,
                                  placed_like, plan_pools)
from ling_jax.serve.prefix_cache import PrefixCache
from ling_jax.serve.request import RequestFieldError, RequestParams
from ling_jax.serve.slot_sampling import SlotSampling
from ling_jax.serve.scheduler import DECODE, DONE, PREFILL, Request, Scheduler
from ling_jax.serve.snapshots import DEFAULT_BUDGET_FRACTION, SnapshotPool, plan_snapshots
from ling_jax.serve.speculative import MAX_SPECULATIVE, make_spec_fn
from ling_jax.serve.step import RowSampling, StepInputs, make_step_fns


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


def decode_widths(max_blocks: int, smallest: int) -> tuple[int, ...]:
    """Block-table widths the decode program is compiled for: powers of two from `smallest`
    below max_blocks, and max_blocks. Why: a decode step attends over width·page_size keys, so
    short sequences should not pay for the longest allowed one."""
    out, w = [], max(1, min(smallest, max_blocks))
    while w < max_blocks:
        out.append(w)
        w *= 2
    return tuple(out) + (max_blocks,)


def row_buckets(max_slots: int) -> tuple[int, ...]:
    """Decode row counts compiled: powers of two below max_slots, and max_slots. Why: a decode
    step's cost is its rows' (every row streams the weights through the same GEMMs and reads and
    writes its KDA state), so 3 requests on a 32-slot engine should run 4 rows, not 32."""
    out, r = [], 1
    while r < max_slots:
        out.append(r)
        r *= 2
    return tuple(out) + (max_slots,)


def token_buckets(prefill_chunk: int, smallest: int = 8) -> tuple[int, ...]:
    """Prefill widths compiled: powers of two from `smallest` below `prefill_chunk`, and the chunk."""
    out, t = [], min(smallest, prefill_chunk)
    while t < prefill_chunk:
        out.append(t)
        t *= 2
    return tuple(out) + (prefill_chunk,)


class Engine:
    """Continuous-batching engine over one model (see the module docstring and serve/README.md).

    max_slots: sequences in flight; page_size: tokens per latent page; num_pages or
    cache_memory_gib: the page pool (pages cost `describe()`'s bytes); prefill_chunk: prompt
    tokens fed per step at most (a running decode waits at most one chunk); prefill_rows:
    prompts fed side by side in one chunk; max_seq_len: prompt + new tokens of one request;
    with_mtp: keep the MTP layer's pages filled too (for speculative decoding; default: the
    model has an MTP layer); exec: how to run (default `model.exec`); buckets: prefill widths
    (default `token_buckets(prefill_chunk)`); widths: decode block-table widths in pages (default
    `decode_widths(max_blocks, 256 // page_size)`; prefill chunks are bucketed by the same widths);
    decode_rows: decode row counts (default `row_buckets(max_slots)`; must end at max_slots);
    speculative: MTP drafts verified per decode step, 0 (off) … `MAX_SPECULATIVE` (needs the MTP
    layer and with_mtp; the speculative program then replaces decode, one per width; README).
    prefix_cache: keep an exact prefix cache (shared pages + KDA snapshots, prefix_cache.py);
    prefix_cache_memory_gib: its byte budget (pages + snapshots; default `DEFAULT_BUDGET_FRACTION`
    of the page pool), which also sizes the snapshot pool (`snapshots.plan_snapshots`).
    snapshot_interval: tokens between the KDA snapshots a prefill chunk takes inside itself (a
    multiple of page_size; default `default_snapshot_interval`: lcm(page_size, exec.kda_chunk), the
    block boundaries the chunked scan passes through anyway); chunk ends on a page are snapshotted too.
    """

    def __init__(self, model, *, max_slots: int = 8, page_size: int = 16, num_pages: int | None = None,
                 cache_memory_gib: float | None = None, prefill_chunk: int = 64, prefill_rows: int = 2,
                 max_seq_len: int | None = None, with_mtp: bool | None = None, exec: ExecConfig | None = None,
                 buckets: Sequence[int] | None = None, widths: Sequence[int] | None = None,
                 decode_rows: Sequence[int] | None = None, speculative: int = 0, prefix_cache: bool = True,
                 prefix_cache_memory_gib: float | None = None, snapshot_interval: int | None = None,
                 kv_cache_dtype: str | None = None):
        cfg = model.cfg
        self.cfg = cfg
        if num_pages is None and cache_memory_gib is None:
            raise ValueError("Engine needs num_pages or cache_memory_gib (the page pool's size)")
        for name, v in (("prefill_chunk", prefill_chunk), ("prefill_rows", prefill_rows)):
            check_int(v, f"Engine {name}", field=name, low=1)
        with_mtp = (model.mtp is not None) if with_mtp is None else bool(with_mtp)
        if with_mtp and model.mtp is None:
            raise ValueError("Engine with_mtp=True needs the MTP layer, and this model has none")
        _check_speculative(speculative, model, with_mtp)
        self.sizes = plan_pools(cfg, model.dtype, max_slots=max_slots, page_size=page_size, num_pages=num_pages,
                                cache_memory_gib=cache_memory_gib, max_seq_len=max_seq_len, with_mtp=with_mtp,
                                kv_cache_dtype=kv_cache_dtype)
        if self.sizes.max_seq_len > self.sizes.num_pages * page_size:
            raise ValueError(f"max_seq_len={self.sizes.max_seq_len} exceeds the pool "
                             f"({self.sizes.num_pages} pages x {page_size} tokens)")
        self.buckets = tuple(sorted(set(buckets))) if buckets else token_buckets(prefill_chunk)
        if self.buckets[-1] < prefill_chunk:
            raise ValueError(f"the largest bucket {self.buckets[-1]} is below prefill_chunk={prefill_chunk}")
        mb = self.sizes.max_blocks
        self.widths = tuple(sorted(set(widths))) if widths else decode_widths(mb, max(1, 256 // page_size))
        if self.widths[-1] != mb or self.widths[0] < 1:
            raise ValueError(f"decode widths {self.widths} must be positive and end at max_blocks={mb}")
        self.decode_rows = _check_decode_rows(decode_rows, max_slots)
        self.prefill_chunk, self.prefill_rows = prefill_chunk, prefill_rows
        self.exec = exec or model.exec
        if self.exec.layer_loop != model.model.layers.loop:
            raise ValueError(f"exec.layer_loop={self.exec.layer_loop!r}, but the model's layers are stored for "
                             f"{model.model.layers.loop!r} (a load-time choice: load with that layer loop, or "
                             f"model.set_layer_loop({self.exec.layer_loop!r}) before building the engine)")
        self.snapshot_interval = _check_snapshot_interval(snapshot_interval, page_size, self.exec)
        self.graphdef, self.params = nnx.split(model)
        # compile-only (`ling-jax aot`): shape-only parameters on devices that cannot hold data; the
        # pools are then shapes too, and `program_calls()` lists what warmup() would compile
        self.abstract = is_abstract(self.params)
        # Placed next to the parameters (a loaded model lives on a mesh, one device by default): KDA
        # states split by head over `model`, the rest replicated (`pools.pool_shardings`). Every program
        # that returns pools returns them with exactly these shardings (out_shardings), so the first call
        # of each shape and every later call run one compiled program.
        self.pools, self._pool_sharding = make_placed(lambda: init_pools(cfg, self.sizes, model.dtype),
                                                      lambda pools: placed_like(cfg, pools, self.params),
                                                      self.abstract)
        self.alloc = PageAllocator(self.sizes)
        self.slot_sampling = SlotSampling(max_slots)
        self.prefix, self.snapshots = self._make_prefix_cache(prefix_cache, prefix_cache_memory_gib, model.dtype)
        self.sched = Scheduler(self.alloc, max_slots, prefill_chunk, prefill_rows, self.prefix,
                               speculative=speculative)
        self._prefill, self._decode = make_step_fns(
            self.graphdef, self.exec, self.snapshot_interval if self.prefix is not None else 0,
            self.snapshots.sharding if self.snapshots is not None else None, self._pool_sharding)
        self.speculative = speculative
        self._spec = make_spec_fn(self.graphdef, self.exec, speculative, self._pool_sharding) if speculative else None
        self.spec_steps = 0          # speculative program calls
        self.spec_rounds = 0         # verify rounds (one per decoding slot per call)
        self.spec_accepted = 0       # drafts accepted
        self.spec_drafted = 0        # drafts verified
        self._link = make_link(self._padding_inputs, self._program_shapes(),
                               self.snapshots.index_words if self.snapshots is not None else 0)
        if self._link is not None:  # multi-process: process 0 broadcasts each program call (serve/multihost.py)
            self._prefill = self._link.wrap(OP_PREFILL, self._prefill)
            self._decode = self._link.wrap(OP_DECODE, self._decode)
            if self._spec is not None:
                self._spec = self._link.wrap(OP_SPEC, self._spec)
            if self.snapshots is not None:
                self.snapshots.link = self._link
        self._ids = itertools.count()
        self._handles: dict[int, RequestHandle] = {}
        self.steps = 0
        self.tokens_generated = 0
        self.prompt_tokens_fed = 0

    def _make_prefix_cache(self, enabled: bool, budget_gib: float | None, dtype):
        """(PrefixCache, SnapshotPool), or (None, None) when off."""
        if not isinstance(enabled, bool):
            raise ValueError(f"Engine prefix_cache must be a bool, got {enabled!r}")
        if not enabled:
            return None, None
        budget, rows = plan_snapshots(self.sizes, min(self.prefill_chunk, self.snapshot_interval), budget_gib)
        self._prefix_budget_given = budget_gib is not None
        snapshots = SnapshotPool(self.cfg, self.sizes, rows, dtype, self.prefill_rows,
                                 lambda snaps: placed_like(self.cfg, snaps, self.params), self._pool_sharding,
                                 abstract=self.abstract)
        cache = PrefixCache(self.alloc, num_snapshots=rows, page_bytes=self.sizes.page_bytes,
                            snapshot_bytes=self.sizes.snapshot_bytes, budget_bytes=budget,
                            lookahead=1 if self.sizes.with_mtp else 0)
        return cache, snapshots

    # -- start-up ------------------------------------------------------------------------------
    def describe(self) -> str:
        """Start-up report: pool sizes with their byte arithmetic, and the compiled shapes."""
        decode = (f"speculative decode (K={self.speculative}: [R, {self.speculative + 1}] verify)"
                  if self.speculative else "decode [R, 1]")
        return (describe(self.cfg, self.sizes, self.pools.hidden.dtype) + "\n" + self._describe_placement() +
                self._describe_prefix() +
                f"  compiled shapes: {decode} for R in {list(self.decode_rows)} over block-table widths "
                f"{list(self.widths)}; prefill [{self.prefill_rows}, T] for T in {list(self.buckets)}")

    def _describe_placement(self) -> str:
        sh = jax.tree.leaves(self._pool_sharding)[0]
        if not isinstance(sh, jax.sharding.NamedSharding) or sh.mesh.size == 1:
            return ""
        split = {str(s.spec) for s, x in zip(jax.tree.leaves(self._pool_sharding), jax.tree.leaves(self.pools))
                 if s.shard_shape(x.shape) != x.shape}
        total = sum(x.nbytes for x in jax.tree.leaves(self.pools))
        return (f"  placement: mesh {dict(sh.mesh.shape)}; KDA states split by head over 'model' "
                f"({len(split)} spec(s) {sorted(split)}), latent pages, hidden and token stats replicated: "
                f"{per_device_bytes(self.pools) / GIB:.4f} GiB of the pools' {total / GIB:.4f} GiB per device\n")

    def _describe_prefix(self) -> str:
        if self.prefix is None:
            return "  prefix cache: off\n"
        pc, sz = self.prefix, self.sizes
        given = ("prefix_cache_memory_gib" if self._prefix_budget_given else
                 f"{DEFAULT_BUDGET_FRACTION} x the page pool")
        every = min(self.prefill_chunk, self.snapshot_interval)
        chunk_pages = max(1, every // sz.page_size)
        return (f"  prefix cache: budget {pc.budget_bytes / GIB:.4f} GiB ({given}) for cached pages "
                f"({sz.page_bytes} B each, from the page pool) + snapshots ({sz.snapshot_bytes} B each);\n"
                f"    snapshot pool: {pc.num_snapshots} rows = budget // ({sz.snapshot_bytes} + {chunk_pages} pages x "
                f"{sz.page_bytes}) (one per {every} tokens: snapshots every {self.snapshot_interval} tokens inside a "
                f"prefill chunk and at chunk ends) = {self.snapshots.bytes / GIB:.4f} GiB beside the pools\n")

    def warmup(self, progress=None) -> None:
        """Compile every step shape now, on padding rows that change no state. On processes > 0 of
        a multi-host run it does nothing: they run process 0's warm-up calls inside `follow()`.
        progress(done, total, label, seconds): called after each item of `warmup_items()`."""
        items = self.warmup_items()
        for i, (label, call) in enumerate(items):
            t = time.perf_counter()
            call()
            if progress is not None:
                progress(i + 1, len(items), label, time.perf_counter() - t)

    def warmup_items(self) -> list:
        """The warm-up as [(label, call)]: one item per step program (each call compiles it, on
        padding rows that change no state), those a first short request needs first (the smallest
        prefill bucket, then one-row decode at the narrowest width), then the rest, the prefix
        cache's copies, and a last item running every program once more (it compiles nothing: it
        records the steady-state argument placement in the dispatch cache). Running them one by one
        between steps (`ling-jax serve --warmup lazy`) is as safe as at start-up. Empty on
        processes > 0 of a multi-host run."""
        if self.is_follower:
            return []
        S, R = self.sizes.max_slots, self.prefill_rows
        spec = self.speculative

        def decode(n, w):
            def call():
                program = self._spec if self.speculative else self._decode
                self.pools = program(self.params, self.pools, self._padding_inputs(OP_DECODE, n, 1, w))[0]
            return (f"{'speculative decode' if spec else 'decode'} {n} row(s) x {w} page(s)", call)

        def prefill(T, w):
            return (f"prefill {R} row(s) x {T} tokens x {w} page(s)",
                    lambda: self._run_prefill(self._padding_inputs(OP_PREFILL, R, T, w)))

        first = [prefill(self.buckets[0], self.widths[0]), decode(self.decode_rows[0], self.widths[0])]
        rest = ([decode(n, w) for w in self.widths for n in self.decode_rows
                 if (n, w) != (self.decode_rows[0], self.widths[0])]
                + [prefill(T, w) for w in self.widths for T in self.buckets
                   if (T, w) != (self.buckets[0], self.widths[0])])
        items = first + rest
        if self.snapshots is not None:
            items.append(("prefix-cache snapshot copies", self._warmup_snapshots))

        def again():
            self._warmup_round(S, R)
            if self.snapshots is not None:
                self._warmup_snapshots()
        return items + [("every program once more (placement; no compile)", again)]

    def _warmup_snapshots(self) -> None:
        self.pools = self.snapshots.warmup(self.pools)

    def program_calls(self) -> list:
        """[(name, jitted program, arguments)] of every program `warmup()` compiles, in its order:
        decode (or the speculative verify) per row bucket R and block-table width W, prefill per token
        bucket T and width W, and the prefix cache's two copy programs. A compile-only run (`ling-jax
        aot`) lowers each with `program.lower(*arguments)`; the arguments are the warm-up's padding inputs."""
        name, program = ("verify", self._spec) if self.speculative else ("decode", self._decode)
        calls = [(f"{name}[R={n},W={w}]", program, (self.params, self.pools, self._padding_inputs(OP_DECODE, n, 1, w)))
                 for n in self.decode_rows for w in self.widths]
        snaps = (self.snapshots.snaps,) if self.snapshots is not None else ()
        calls += [(f"prefill[T={T},W={w}]", self._prefill,
                   (self.params, self.pools, self._padding_inputs(OP_PREFILL, self.prefill_rows, T, w)) + snaps)
                  for T in self.buckets for w in self.widths]
        if self.snapshots is not None:
            calls += self.snapshots.program_calls(self.pools)
        return calls

    def _warmup_round(self, S: int, R: int) -> None:
        program = self._spec if self.speculative else self._decode  # speculative replaces decode
        for n in self.decode_rows:
            for w in self.widths:
                self.pools = program(self.params, self.pools, self._padding_inputs(OP_DECODE, n, 1, w))[0]
        for T in self.buckets:
            for w in self.widths:
                self._run_prefill(self._padding_inputs(OP_PREFILL, R, T, w))

    # -- multi-host (serve/multihost.py) ----------------------------------------------------
    @property
    def is_follower(self) -> bool:
        """True on processes > 0 of a multi-process run: they call `follow()`, not submit / step."""
        return self._link is not None and not self._link.is_leader

    def follow(self) -> None:
        """Processes > 0: run every program call process 0 broadcasts (its warm-up and steps), on
        the same global params and pools, until process 0 calls `shutdown()`; then return."""
        if not self.is_follower:
            raise RuntimeError("Engine.follow() is for processes > 0 of a multi-process run (jax.distributed); "
                               "process 0 drives submit() / step()")
        programs = {OP_DECODE: self._decode.program, OP_PREFILL: self._prefill.program}
        if self._spec is not None:
            programs[OP_SPEC] = self._spec.program
        for op, inputs in self._link.messages():
            if op in (OP_SAVE, OP_RESTORE):  # the prefix cache's copies (snapshots.py)
                self.pools = self.snapshots.follow(self.pools, op, inputs)
            elif op == OP_PREFILL and self.snapshots is not None:  # it writes snapshot rows too
                self.pools, _, _, self.snapshots.snaps = self._prefill.program(
                    self.params, self.pools, inputs, self.snapshots.snaps)
            else:
                self.pools = programs[op](self.params, self.pools, inputs)[0]

    def shutdown(self) -> None:
        """Process 0: release the followers (their `follow()` returns); the engine runs no more
        steps afterwards. Idempotent; does nothing single-process or on a follower."""
        if self._link is not None:
            self._link.shutdown()

    def _program_shapes(self) -> list:
        """Every (op, R, T, W) the engine runs: decode [R, 1] per row bucket and width, prefill
        [prefill_rows, T] per bucket and width."""
        R = self.prefill_rows
        dec = OP_SPEC if self.speculative else OP_DECODE
        return ([ProgramShape(dec, n, 1, w) for n in self.decode_rows for w in self.widths]
                + [ProgramShape(OP_PREFILL, R, t, w) for t in self.buckets for w in self.widths])

    def _padding_inputs(self, op: int, rows: int, tokens: int, width: int | None = None) -> StepInputs:
        """A StepInputs of program `op`'s shapes [rows, tokens] on padding rows (warm-up, and the
        followers' unpacking template); a decode over every slot runs them in place (arange)."""
        S = self.sizes.max_slots
        slots = np.arange(S) if op in (OP_DECODE, OP_SPEC) and rows == S else np.full(rows, S)
        snap_rows = self._snap_rows(rows, tokens, []) if op == OP_PREFILL else None
        return self._inputs(slots, np.zeros((rows, tokens), np.int32), np.zeros(rows, np.int32), [None] * rows, width,
                            snap_rows)

    def _snap_rows(self, rows: int, tokens: int, plans: list) -> np.ndarray | None:
        """A prefill's `snap_rows` [rows, tokens // snapshot_interval] from `PrefixCache.plan_boundaries`'
        plans (row i: [(j, boundary, snapshot row)]); unused entries = the pool's row count (dropped).
        None without a prefix cache."""
        if self.snapshots is None:
            return None
        out = np.full((rows, tokens // self.snapshot_interval), self.snapshots.rows, np.int32)
        for i, plan in enumerate(plans):
            for j, _, row in plan:
                out[i, j] = row
        return out

    def _run_prefill(self, inp: StepInputs):
        """The prefill program on `inp` (with a prefix cache it also writes `inp.snap_rows`' snapshot
        rows); returns (tokens, logprob arrays)."""
        if self.snapshots is None:
            self.pools, tok, lp = self._prefill(self.params, self.pools, inp)
        else:
            self.pools, tok, lp, self.snapshots.snaps = self._prefill(self.params, self.pools, inp,
                                                                      self.snapshots.snaps)
        return tok, lp

    def prefill_width(self, chunk: list) -> int:
        """The block-table width (pages) a prefill chunk [(request, tokens fed now)] runs at: the
        smallest of `widths` holding every row's pages up to the chunk's last token. Why: the chunk
        attends over (and gathers) width·page_size keys per row, so its cost and temporaries follow
        its rows' lengths, not `max_seq_len`."""
        P = self.sizes.page_size
        need = max(-(-(r.n_fed + n) // P) for r, n in chunk)
        return next(w for w in self.widths if w >= need)

    def _decode_rows_for(self, reqs: list) -> tuple[int, np.ndarray, list]:
        """(R, rows [R], requests by row) for a decode-like step over `reqs`: the smallest row bucket
        that holds them; with R = max_slots every request sits at its slot's row (in place),
        otherwise they are packed into the first rows and the rest are padding (slot max_slots)."""
        S = self.sizes.max_slots
        R = next(n for n in self.decode_rows if n >= len(reqs))
        if R == S:
            by_row = [None] * S
            for r in reqs:
                by_row[r.slot] = r
            return R, np.arange(S), by_row
        rows = np.full(R, S)
        rows[:len(reqs)] = [r.slot for r in reqs]
        return R, rows, list(reqs) + [None] * (R - len(reqs))

    def compiled_shapes(self) -> int:
        """How many programs the step functions hold ((len(decode_rows) + len(buckets)) x len(widths)
        after warmup; the prefix cache's two copy programs: `snapshots.compiled_shapes()`)."""
        return (self._prefill._cache_size() + self._decode._cache_size()
                + (self._spec._cache_size() if self._spec is not None else 0))

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
    def _inputs(self, rows, ids, n_valid, reqs, width: int | None = None, snap_rows=None) -> StepInputs:
        """Numpy StepInputs for rows (`reqs[i]` None = padding: greedy, nothing fed); the block
        table cut to `width` pages (default all max_blocks); snap_rows: a prefill's (`_snap_rows`)."""
        n = len(reqs)
        n_gen, lengths = np.zeros(n, np.int32), np.zeros(n, np.int32)  # what changes every step
        for i, r in enumerate(reqs):
            if r is not None:
                n_gen[i], lengths[i] = len(r.generated), r.n_fed
        static = self.slot_sampling.rows(reqs)  # written once per admission (`slot_sampling.py`)
        bt = self.alloc.block_rows([None if r is None else r.slot for r in reqs])[:, :width]
        return StepInputs(np.asarray(rows, np.int32), ids, n_valid, lengths, bt,
                          RowSampling(n_gen=n_gen, **static), snap_rows)

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
        """One engine step: admit, decode one token for every decoding slot, feed one prefill
        chunk. Returns {handle: [new tokens]} (finished handles included, their last tokens)."""
        plan = self.sched.schedule()
        if self.prefix is not None:  # hits admitted by schedule(): their slots' KDA rows and page copies
            self.pools = self.snapshots.restore(self.pools, self.prefix.take_restores())
        out: dict = {}
        S = self.sizes.max_slots
        if plan.decode and self.speculative:
            self._spec_decode(plan.decode, out)
        elif plan.decode:
            R, rows, reqs = self._decode_rows_for(plan.decode)
            ids, n_valid = np.zeros((R, 1), np.int32), np.zeros(R, np.int32)
            for i, r in enumerate(reqs):
                if r is not None:
                    ids[i, 0], n_valid[i] = r.generated[-1], 1
            held = max(len(self.alloc.pages[r.slot]) for r in plan.decode)
            width = next(w for w in self.widths if w >= held)
            self.pools, tok, lp = self._decode(self.params, self.pools, self._inputs(rows, ids, n_valid, reqs, width))
            tok, lp = np.asarray(tok), _host_logprobs(lp, plan.decode)
            for i, r in enumerate(reqs):
                if r is not None:
                    r.n_fed += 1
                    self._emit(r, int(tok[i]), out, lp, i)
        if plan.prefill:
            R = self.prefill_rows
            need = max(n for _, n in plan.prefill)
            T = next(b for b in self.buckets if b >= need)
            reqs, rows = [None] * R, np.full(R, S)
            ids, n_valid = np.zeros((R, T), np.int32), np.zeros(R, np.int32)
            for i, (r, n) in enumerate(plan.prefill):
                reqs[i], rows[i] = r, r.slot
                ids[i, :n], n_valid[i] = r.feed[r.n_fed:r.n_fed + n], n
            # snapshots inside the chunks: planned now, written by the program, inserted once fed
            inner = self.prefix.plan_boundaries(plan.prefill, self.snapshot_interval) if self.prefix is not None else []
            width = self.prefill_width(plan.prefill)
            tok, lp = self._run_prefill(self._inputs(rows, ids, n_valid, reqs, width, self._snap_rows(R, T, inner)))
            tok, lp = np.asarray(tok), _host_logprobs(lp, [r for r, _ in plan.prefill])
            for r, n in plan.prefill:
                r.n_fed += n
                self.prompt_tokens_fed += n
            if self.prefix is not None:  # then the snapshots of chunks that ended on a page boundary
                self.prefix.insert_boundaries(plan.prefill, inner)
                self.snapshots.save(self.pools, self.prefix.after_prefill([r for r, _ in plan.prefill]))
            for i, (r, n) in enumerate(plan.prefill):
                if r.n_fed == len(r.feed) and self.sched.holds_pending(r):
                    r.state = DECODE  # a speculative recompute: its pending token decodes next
                elif r.n_fed == len(r.feed):
                    self._emit(r, int(tok[i]), out, lp, i)
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

    def _spec_decode(self, decode: list, out: dict) -> None:
        """One speculative step for the decoding requests (pages for 1 + drafts tokens each were
        ensured by the scheduler): every slot's emitted run goes through the stop / max_tokens
        rules token by token, so a stop inside an accepted run ends it there."""
        R, rows, reqs = self._decode_rows_for(decode)
        ids, n_valid = np.zeros((R, 1), np.int32), np.zeros(R, np.int32)
        for i, r in enumerate(reqs):
            if r is not None:
                ids[i, 0], n_valid[i] = r.generated[-1], 1 + self.sched.drafts_for(r)
        held = max(len(self.alloc.pages[r.slot]) for r in decode)
        width = next(w for w in self.widths if w >= held)
        self.pools, emitted, n_emit, lp = self._spec(self.params, self.pools,
                                                     self._inputs(rows, ids, n_valid, reqs, width))
        emitted, n_emit, lp = np.asarray(emitted), np.asarray(n_emit), _host_logprobs(lp, decode)
        self.spec_steps += 1
        for i, r in enumerate(reqs):
            if r is None:
                continue
            n = int(n_emit[i])
            self.spec_rounds += 1
            self.spec_accepted += n - 1
            self.spec_drafted += int(n_valid[i]) - 1
            r.n_fed += n
            for j, t in enumerate(emitted[i, :n]):
                self._emit(r, int(t), out, None if lp is None else tuple(x[:, j] for x in lp), i)
                if r.state == DONE:
                    break

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
        running = self.sched.running()
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
            **self._prefix_stats(),
        }

    def _prefix_stats(self) -> dict:
        pc = self.prefix
        return {"prefix_hits": pc.hits if pc else 0, "prefix_tokens_saved": pc.tokens_saved if pc else 0,
                "prefix_cache_pages": pc.nodes if pc else 0, "prefix_cache_bytes": pc.bytes if pc else 0}

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix no running request uses (its pages and snapshot rows are free)."""
        if self.prefix is not None:
            self.prefix.clear()


def _check_speculative_params(params: "RequestParams") -> None:
    """What the speculative program does not do yet, refused by field name: penalties (they would
    depend on the tokens drafted inside a round). Logprobs are the verify positions' (`_spec`)."""
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(params, name) != neutral:
            raise RequestFieldError(name, f"RequestParams.{name}={getattr(params, name)!r} is not supported with speculative "
                             f"decoding (Engine speculative > 0); use {neutral} or an engine without speculation")


def _host_logprobs(lp, reqs):
    """The step's logprob arrays on the host, fetched only when one of its requests asked."""
    return tuple(np.asarray(a) for a in lp) if any(r.params.logprobs is not None for r in reqs) else None


def default_snapshot_interval(page_size: int, kda_chunk: int) -> int:
    """lcm(page_size, kda_chunk): the page boundaries that are also ends of the chunked scan's chunks,
    so taking their states costs the scan nothing but the copies."""
    return math.lcm(page_size, kda_chunk)


def _check_snapshot_interval(interval, page_size: int, ex: ExecConfig) -> int:
    if interval is None:
        return default_snapshot_interval(page_size, ex.kda_chunk)
    return check_int(interval, "Engine snapshot_interval", field="snapshot_interval", low=1, multiple_of=page_size,
                     expected=f"a positive multiple of page_size={page_size} (snapshots are taken on page boundaries)")


def _check_decode_rows(decode_rows, max_slots: int) -> tuple[int, ...]:
    """The decode row buckets: default `row_buckets(max_slots)`; given ones must be positive ints
    ending at max_slots (the most slots a step can decode)."""
    if decode_rows is None:
        return row_buckets(max_slots)
    rows = tuple(sorted(set(decode_rows)))
    if not rows or not all(is_int(n) and n >= 1 for n in rows) or rows[-1] != max_slots:
        raise FieldError("decode_rows", f"Engine decode_rows {tuple(decode_rows)!r} must be positive ints ending at "
                                        f"max_slots={max_slots}")
    return tuple(int(n) for n in rows)


def _check_speculative(speculative, model, with_mtp: bool) -> None:
    check_int(speculative, "Engine speculative", field="speculative", low=0, high=MAX_SPECULATIVE,
              expected=f"an int in [0, {MAX_SPECULATIVE}] (MTP drafts per decode step, 0 = off)")
    if speculative and model.mtp is None:
        raise ValueError("Engine speculative > 0 needs the MTP layer, and this model has none")
    if speculative and not with_mtp:
        raise ValueError("Engine speculative > 0 needs with_mtp=True (the MTP pages it drafts from)")
