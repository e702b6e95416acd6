"""`ModelRunner`: the device side of the engine, the model's compiled programs over the pools.

Why apart from the engine (`engine.py`, the request lifecycle): parameters, pools and their
placement, the compiled programs and their shapes, warm-up, the packing of a call's inputs and the
multi-host link are what a compile-only run (`ling-jax aot`: `program_calls()` on a shape-only
model), a multi-host follower (`follow()`, no requests at all) and a future second engine need,
without a queue, stop rules or handles. The engine decides what runs; `decode` and `prefill` take
a step's requests, pack them and return the tokens (and logprobs) on the host; `restore` / `save`
run the prefix cache's copy orders. The compiled shapes: `program_shapes()` (engine.py's docstring
says why these).
"""
from __future__ import annotations

import functools
import time

import jax
import numpy as np
from flax import nnx

from ling_jax.checks import FieldError, is_int
from ling_jax.exec_config import ExecConfig
from ling_jax.serve.allocator import PageAllocator, PoolSizes
from ling_jax.serve.buckets import row_buckets, token_buckets
from ling_jax.serve.multihost import OP_DECODE, OP_PREFILL, OP_RESTORE, OP_SAVE, OP_SPEC, ProgramShape, make_link
from ling_jax.serve.pools import (GIB, describe, init_pools, is_abstract, make_placed, per_device_bytes, placed_like,
                                  shardings_of, token_row_formats)
from ling_jax.serve.slot_sampling import SlotSampling
from ling_jax.serve.snapshots import SnapshotPool
from ling_jax.sampling import RowSampling
from ling_jax.serve.step import StepInputs, make_step_fns


def decode_widths(max_blocks: int, smallest: int) -> tuple[int, ...]:
    """Block-table widths the decode program is compiled for: powers of two from `smallest`
    below max_blocks, and max_blocks. Why: a decode step attends over width·page_size keys, so
    short sequences should not pay for the longest allowed one."""
    return token_buckets(max_blocks, max(1, smallest))


def check_row_buckets(rows, top: int, field: str, top_name: str, default=None) -> tuple[int, ...]:
    """Row counts compiled for one program family (decode: `decode_rows` up to max_slots; prefill:
    `prefill_row_buckets` up to prefill_rows): None = `default` (else `row_buckets(top)`); given
    ones must be positive ints ending at `top` (the most rows a step of that family runs)."""
    if rows is None:
        return tuple(default) if default is not None else row_buckets(top)
    out = tuple(sorted(set(rows)))
    if not out or not all(is_int(n) and n >= 1 for n in out) or out[-1] != top:
        raise FieldError(field, f"Engine {field} {tuple(rows)!r} must be positive ints ending at {top_name}={top}")
    return tuple(int(n) for n in out)


def host_logprobs(lp, reqs):
    """The step's logprob arrays on the host, fetched only when one of its requests asked."""
    return tuple(np.asarray(a) for a in lp) if any(r.params.logprobs is not None for r in reqs) else None


def _smallest(sizes, n: int) -> int:
    """The smallest of the compiled `sizes` that holds n."""
    return next(s for s in sizes if s >= n)


class ModelRunner:
    """The model's programs over the pools (module docstring), built by `Engine` from its checked
    settings: the pools' sizes, exec, the page allocator (its block table), the compiled shapes,
    speculative (drafts per verify), snapshot_rows (None = no prefix cache) and snapshot_interval.
    Of a request it reads the slot, feed, tokens fed and generated and sampling parameters only."""

    def __init__(self, model, sizes: PoolSizes, exec: ExecConfig, alloc: PageAllocator, *, buckets, widths,
                 decode_rows, prefill_row_buckets, speculative: int = 0, snapshot_rows: int | None = None,
                 snapshot_interval: int = 0):
        cfg = self.cfg = model.cfg
        self.sizes, self.exec, self.alloc = sizes, exec, alloc
        self.buckets, self.widths, self.decode_rows = tuple(buckets), tuple(widths), tuple(decode_rows)
        self.prefill_row_buckets = tuple(prefill_row_buckets)
        self.prefill_rows = self.prefill_row_buckets[-1]
        self.speculative, self.snapshot_interval = speculative, snapshot_interval
        self.graphdef, self.params = nnx.split(model)
        # compile-only (`ling-jax aot`): shape-only parameters, so the pools are shapes too
        self.abstract = is_abstract(self.params)
        # Placed next to the parameters (`pools.pool_shardings`); every program returns the pools with
        # exactly these shardings (out_shardings), so the first call of a shape and every later one run
        # one compiled program. "token_rows" (TPU): the KDA conv windows as lane-dense taps and the k_pe
        # pages row-major, every program pinned to it (`pools.token_row_formats` says why)
        token_rows = exec.pool_layout == "token_rows"
        make = lambda: init_pools(cfg, sizes, model.dtype, token_rows)  # noqa: E731
        placement = lambda pools: placed_like(cfg, pools, self.params)  # noqa: E731
        if token_rows:
            shapes, sharding = make_placed(make, placement, abstract=True)
            self.pool_sharding = token_row_formats(shapes, sharding)
            self.pools = shapes if self.abstract else jax.device_put(make(), self.pool_sharding)
        else:
            self.pools, self.pool_sharding = make_placed(make, placement, self.abstract)
        self.slot_sampling = SlotSampling(sizes.max_slots)
        self.snapshots = None if snapshot_rows is None else SnapshotPool(
            cfg, sizes, snapshot_rows, model.dtype, self.prefill_rows,
            lambda snaps: placed_like(cfg, snaps, self.params), self.pool_sharding, abstract=self.abstract,
            conv_taps=token_rows)
        self.prefill_fn, self.decode_fn, self.spec_fn = make_step_fns(
            self.graphdef, exec, snapshot_interval if self.snapshots is not None else 0,
            self.snapshots.sharding if self.snapshots is not None else None, self.pool_sharding, speculative)
        self._link = make_link(self.padding_inputs, self.program_shapes(),
                               self.snapshots.index_words if self.snapshots is not None else 0)
        if self._link is not None:  # multi-process: process 0 broadcasts each program call (serve/multihost.py)
            self.prefill_fn = self._link.wrap(OP_PREFILL, self.prefill_fn)
            self.decode_fn = self._link.wrap(OP_DECODE, self.decode_fn)
            if self.spec_fn is not None:
                self.spec_fn = self._link.wrap(OP_SPEC, self.spec_fn)
            if self.snapshots is not None:
                self.snapshots.link = self._link

    # -- start-up report -----------------------------------------------------------------------
    def describe(self, prefix_cache: str = "") -> str:
        """Pool sizes with their byte arithmetic, their placement on a mesh, `prefix_cache` (the engine's
        lines on it), the compiled shapes."""
        decode = (f"speculative decode (K={self.speculative}: [R, {self.speculative + 1}] verify)"
                  if self.speculative else "decode [R, 1]")
        pools = describe(self.cfg, self.sizes, self.pools.hidden.dtype) + "\n" + self._describe_placement()
        return (pools + prefix_cache + f"  compiled shapes: {decode} for R in {list(self.decode_rows)} over "
                f"block-table widths {list(self.widths)}; prefill [R, T] for R in {list(self.prefill_row_buckets)}, "
                f"T in {list(self.buckets)}")

    def _describe_placement(self) -> str:
        shardings = jax.tree.leaves(shardings_of(self.pool_sharding))
        sh = shardings[0]
        if not isinstance(sh, jax.sharding.NamedSharding) or sh.mesh.size == 1:
            return ""
        split = {str(s.spec) for s, x in zip(shardings, jax.tree.leaves(self.pools))
                 if s.shard_shape(x.shape) != x.shape}
        total = sum(x.nbytes for x in jax.tree.leaves(self.pools))
        return (f"  placement: mesh {dict(sh.mesh.shape)}; KDA states split by head over 'model' "
                f"({len(split)} spec(s) {sorted(split)}), latent pages, hidden and token stats replicated: "
                f"{per_device_bytes(self.pools) / GIB:.4f} GiB of the pools' {total / GIB:.4f} GiB per device\n")

    # -- shapes ---------------------------------------------------------------------------------
    def program_shapes(self) -> list[ProgramShape]:
        """Every (op, R, T, W) compiled, narrow block tables first: decode (`OP_SPEC`: the verify
        program [R, K+1] in its place) [R, 1] per row bucket R in `decode_rows` and width W in
        `widths`; prefill [R, T] per row bucket in `prefill_row_buckets`, token bucket T in `buckets`
        and width."""
        dec = OP_SPEC if self.speculative else OP_DECODE
        return ([ProgramShape(dec, n, 1, w) for w in self.widths for n in self.decode_rows]
                + [ProgramShape(OP_PREFILL, n, t, w) for w in self.widths for t in self.buckets
                   for n in self.prefill_row_buckets])

    def width_for(self, pages: int) -> int:
        """The smallest block-table width (pages) of `widths` holding `pages`."""
        return _smallest(self.widths, pages)

    def decode_rows_for(self, reqs: list) -> tuple[int, np.ndarray, list]:
        """(R, rows [R], requests by row) for a decode-like step over `reqs`: the smallest row bucket
        that holds them; with R = max_slots every request sits at its slot's row (in place),
        otherwise they are packed into the first rows and the rest are padding (slot max_slots)."""
        S = self.sizes.max_slots
        R = _smallest(self.decode_rows, len(reqs))
        if R == S:
            by_row = [None] * S
            for r in reqs:
                by_row[r.slot] = r
            return R, np.arange(S), by_row
        rows = np.full(R, S)
        rows[:len(reqs)] = [r.slot for r in reqs]
        return R, rows, list(reqs) + [None] * (R - len(reqs))

    # -- one call's inputs ------------------------------------------------------------------------
    def inputs(self, rows, ids, n_valid, reqs, width: int | None = None, snap_rows=None) -> StepInputs:
        """Numpy StepInputs for rows (`reqs[i]` None = padding: greedy, nothing fed); the block
        table cut to `width` pages (default all max_blocks); snap_rows: a prefill's (`_snap_rows`)."""
        n = len(reqs)
        n_gen, lengths = np.zeros(n, np.int32), np.zeros(n, np.int32)  # what changes every step
        for i, r in enumerate(reqs):
            if r is not None:
                n_gen[i], lengths[i] = len(r.generated), r.n_fed
        static = self.slot_sampling.rows(reqs)  # written once per admission (`slot_sampling.py`)
        bt = self.alloc.block_rows([None if r is None else r.slot for r in reqs], width)
        return StepInputs(np.asarray(rows, np.int32), ids, n_valid, lengths, bt,
                          RowSampling(n_gen=n_gen, **static), snap_rows)

    def padding_inputs(self, op: int, rows: int, tokens: int, width: int | None = None) -> StepInputs:
        """A StepInputs of program `op`'s shapes [rows, tokens] on padding rows (warm-up, and the
        followers' unpacking template); a decode over every slot runs them in place (arange)."""
        S = self.sizes.max_slots
        slots = np.arange(S) if op in (OP_DECODE, OP_SPEC) and rows == S else np.full(rows, S)
        snap_rows = self._snap_rows(rows, tokens, []) if op == OP_PREFILL else None
        return self.inputs(slots, np.zeros((rows, tokens), np.int32), np.zeros(rows, np.int32), [None] * rows, width,
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

    # -- running one program ----------------------------------------------------------------------
    def decode(self, reqs: list, drafts: dict):
        """One decode step over the decoding requests (the verify program with speculation: request r
        verifies drafts[r.id] drafts) at the smallest row bucket and width holding them. Returns on the
        host (requests by row, None = padding; emitted [R, K+1]; n_emitted [R]; logprob arrays
        [R, K+1, ...] or None when no row asked), K = 0 without speculation."""
        R, rows, by_row = self.decode_rows_for(reqs)
        ids, n_valid = np.zeros((R, 1), np.int32), np.zeros(R, np.int32)
        for i, r in enumerate(by_row):
            if r is not None:
                ids[i, 0], n_valid[i] = r.generated[-1], 1 + drafts.get(r.id, 0)
        inp = self.inputs(rows, ids, n_valid, by_row, self.width_for(max(len(self.alloc.pages[r.slot]) for r in reqs)))
        if self.spec_fn is not None:
            self.pools, emitted, n_emit, lp = self.spec_fn(self.params, self.pools, inp)
            return by_row, np.asarray(emitted), np.asarray(n_emit), host_logprobs(lp, reqs)
        self.pools, tok, lp = self.decode_fn(self.params, self.pools, inp)
        lp = host_logprobs(lp, reqs)
        return by_row, np.asarray(tok)[:, None], np.ones(R, np.int32), lp and tuple(x[:, None] for x in lp)

    def prefill(self, chunk: list, boundaries: list = ()):
        """The prefill program on a chunk [(request, n)] (row i feeds the next n tokens of chunk[i]'s
        `feed`) at the smallest row bucket, token bucket and block-table width that hold it (the
        width: every row's pages up to the chunk's last token, so a chunk attends over its rows'
        lengths, not max_seq_len); boundaries: `PrefixCache.plan_boundaries`' plans (the snapshots
        it takes inside the chunks). Returns (tokens [R], logprob arrays or None) on the host."""
        R = _smallest(self.prefill_row_buckets, len(chunk))
        T = _smallest(self.buckets, max(n for _, n in chunk))
        reqs, rows = [None] * R, np.full(R, self.sizes.max_slots)
        ids, n_valid = np.zeros((R, T), np.int32), np.zeros(R, np.int32)
        for i, (r, n) in enumerate(chunk):
            reqs[i], rows[i] = r, r.slot
            ids[i, :n], n_valid[i] = r.feed[r.n_fed:r.n_fed + n], n
        width = self.width_for(max(-(-(r.n_fed + n) // self.sizes.page_size) for r, n in chunk))
        tok, lp = self._run_prefill(self.inputs(rows, ids, n_valid, reqs, width, self._snap_rows(R, T, boundaries)))
        return np.asarray(tok), host_logprobs(lp, [r for r, _ in chunk])

    def _run_prefill(self, inp: StepInputs):
        """The prefill program on `inp` (with a prefix cache it also writes `inp.snap_rows`' snapshot
        rows); returns (tokens, logprob arrays)."""
        if self.snapshots is None:
            self.pools, tok, lp = self.prefill_fn(self.params, self.pools, inp)
        else:
            self.pools, tok, lp, self.snapshots.snaps = self.prefill_fn(self.params, self.pools, inp,
                                                                        self.snapshots.snaps)
        return tok, lp

    def _run_padding(self, shape: ProgramShape) -> None:
        """Program `shape.op` on padding rows of that shape (they change no state)."""
        inp = self.padding_inputs(*shape)
        if shape.op == OP_PREFILL:
            self._run_prefill(inp)
        else:
            self.pools = (self.spec_fn or self.decode_fn)(self.params, self.pools, inp)[0]

    def restore(self, ops: list) -> None:
        """The prefix cache's restore orders (`PrefixCache.take_restores`): snapshot rows -> slots, page copies."""
        self.pools = self.snapshots.restore(self.pools, ops)

    def save(self, copies: list) -> None:
        """The prefix cache's (slot, snapshot row) copies (`PrefixCache.after_prefill`)."""
        self.snapshots.save(self.pools, copies)

    def compiled_shapes(self) -> int:
        """How many programs the step functions hold (len(program_shapes()) after warm-up; the prefix
        cache's two copy programs: `snapshots.compiled_shapes()`)."""
        return sum(f._cache_size() for f in (self.prefill_fn, self.decode_fn, self.spec_fn) if f is not None)

    # -- warm-up ----------------------------------------------------------------------------------
    def warmup(self, progress=None) -> None:
        """Run every item of `warmup_items()`; progress(done, total, label, seconds) after each."""
        items = self.warmup_items()
        for i, (label, call) in enumerate(items):
            t = time.perf_counter()
            call()
            if progress is not None:
                progress(i + 1, len(items), label, time.perf_counter() - t)

    def warmup_items(self) -> list:
        """The warm-up as [(label, call)] (see `Engine.warmup_items`); empty on a follower."""
        if self.is_follower:
            return []
        shapes = self.program_shapes()
        first = [next(s for s in shapes if s.op == OP_PREFILL), shapes[0]]  # what a first short request runs
        items = [(_label(s), functools.partial(self._run_padding, s))
                 for s in first + [s for s in shapes if s not in first]]
        if self.snapshots is not None:
            items.append(("prefix-cache snapshot copies", self._warmup_snapshots))

        def again():
            for s in shapes:
                self._run_padding(s)
            if self.snapshots is not None:
                self._warmup_snapshots()
        items.append(("every program once more (placement; no compile)", again))
        return [(label, self._finished(call)) for label, call in items]

    def _finished(self, call):
        """`call`, then wait for the device work it queued: without the wait the first real step paid
        for the warm-up's last executions (the mid config's first prefill took 3.6-5.6 s instead of
        ~0.6 s), and each item's reported seconds are then its own."""
        def run():
            call()
            jax.block_until_ready((self.pools, self.snapshots.snaps if self.snapshots is not None else None))
        return run

    def _warmup_snapshots(self) -> None:
        self.pools = self.snapshots.warmup(self.pools)

    def program_calls(self) -> list:
        """[(name, jitted program, arguments)] of every program `warmup()` compiles (`program_shapes()`,
        then the prefix cache's two copy programs), on the warm-up's padding inputs. A compile-only
        run (`ling-jax aot`) lowers each with `program.lower(*arguments)`."""
        snaps = (self.snapshots.snaps,) if self.snapshots is not None else ()
        calls = []
        for s in self.program_shapes():
            args = (self.params, self.pools, self.padding_inputs(*s))
            if s.op == OP_PREFILL:
                calls.append((f"prefill[R={s.rows},T={s.tokens},W={s.width}]", self.prefill_fn, args + snaps))
            else:
                name = "verify" if self.speculative else "decode"
                calls.append((f"{name}[R={s.rows},W={s.width}]", self.spec_fn or self.decode_fn, args))
        return calls + (self.snapshots.program_calls(self.pools) if self.snapshots is not None else [])

    # -- multi-host (serve/multihost.py) ------------------------------------------------------------
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
        programs = {OP_DECODE: self.decode_fn, OP_PREFILL: self.prefill_fn, OP_SPEC: self.spec_fn}
        for op, inputs in self._link.messages():
            if op in (OP_SAVE, OP_RESTORE):  # the prefix cache's copies (snapshots.py)
                self.pools = self.snapshots.follow(self.pools, op, inputs)
            elif op == OP_PREFILL and self.snapshots is not None:  # it writes snapshot rows too
                self.pools, _, _, self.snapshots.snaps = self.prefill_fn.program(
                    self.params, self.pools, inputs, self.snapshots.snaps)
            else:
                self.pools = programs[op].program(self.params, self.pools, inputs)[0]

    def shutdown(self) -> None:
        """Process 0: release the followers (their `follow()` returns). Idempotent; does nothing
        single-process or on a follower."""
        if self._link is not None:
            self._link.shutdown()


def _label(s: ProgramShape) -> str:
    """A warm-up item's name for program shape `s`."""
    if s.op == OP_PREFILL:
        return f"prefill {s.rows} row(s) x {s.tokens} tokens x {s.width} page(s)"
    return f"{'speculative decode' if s.op == OP_SPEC else 'decode'} {s.rows} row(s) x {s.width} page(s)"
