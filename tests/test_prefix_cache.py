"""Exact hybrid prefix cache (serve/prefix_cache.py, serve/snapshots.py): a hit gives what a miss gives.

Model tests (float32, greedy, the tiny KDA + MLA + MTP model): shared-prefix requests equal the
same requests with `prefix_cache=False` token for token, logits within 1e-5, pages (MLA and MTP)
and KDA state equal the recomputed ones; LRU eviction under a tiny budget, preemption and
cancellation give the same tokens and leave nothing behind. Host test: the engine's policy under
a fake device that tracks what every page position and slot state depends on, so any sharing
error (a wrong page, a stale MTP slot, a wrong snapshot, a page with two writers) fails an
assertion; the tree's invariants are checked after every step.
"""
import jax
import numpy as np
import pytest

from conftest import is_compile_event, mla_layer_pages, rel_err
from ling_jax.config import KDA
from ling_jax.layer_stack import layer_plan
from ling_jax.serve import Engine, RequestParams
from ling_jax.serve.pools import GIB, plan_pools

KW = dict(max_slots=4, page_size=8, num_pages=24, prefill_chunk=16, prefill_rows=2, max_seq_len=96)
UNIT = 19456 + 2 * 6400  # a snapshot (6 KDA layers + hidden) and the 2 pages of its chunk (5 MLA layers)
ROWS = 8


def _compile_events():
    events = []
    listener = lambda name, *a, **k: events.append(name) if is_compile_event(name) else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    return events, listener


@pytest.fixture(scope="module")
def engines(tiny_model):
    """(hit, miss): the same engine with and without the prefix cache. The miss engine runs the hit
    engine's compiled decode programs (same shapes, same placement); its prefill is its own (the hit
    engine's also writes snapshot rows)."""
    hit = Engine(tiny_model, prefix_cache_memory_gib=ROWS * UNIT / GIB, **KW)
    assert hit.prefix.num_snapshots == ROWS and hit.runner.snapshot_interval == 16  # lcm(page 8, kda_chunk 16)
    hit.warmup()
    assert hit.runner.snapshots.compiled_shapes() == 2  # save and restore, one shape each
    miss = Engine(tiny_model, prefix_cache=False, **KW)
    miss.runner.decode_fn = hit.runner.decode_fn
    return hit, miss


def _kda_rows(pools, cfg, slot):
    """The slot's KDA state and conv states, every KDA layer, as float64 numpy."""
    out = []
    for b, block in enumerate(layer_plan(cfg)):
        for r, run in enumerate(block.runs):
            if run.attn == KDA:
                out += [np.asarray(x)[:, :, slot] for x in pools.layers[b][r]]
    return out


def _serve(eng, cfg, prompts, max_tokens):
    """Submit every prompt at once and run to the end. Per request: its tokens, the slot's hidden
    after each step that emitted a token but the last (the logits' input), and at its first token
    (prompt fed) its pages gathered through its block table (every MLA layer, then MTP) and its
    KDA rows. Only numpy reads between steps (no eager device op, so nothing compiles)."""
    hidden, first = [[] for _ in prompts], [None] * len(prompts)

    def record(i):
        def cb(h, toks):
            r = h._req
            if r.slot is None:
                return
            hidden[i].append(np.asarray(eng.runner.pools.hidden)[r.slot])
            if first[i] is None:
                bt, n = eng.alloc.block_rows([r.slot])[0], r.n_fed
                pools = jax.tree.map(np.asarray, eng.runner.pools)
                pages = [c[bt].reshape(-1, c.shape[-1])[:n] for _, c, _ in mla_layer_pages(pools, cfg)]
                pages += [k[bt].reshape(-1, k.shape[-1])[:n] for _, _, k in mla_layer_pages(pools, cfg)]
                pages += [x[bt].reshape(-1, x.shape[-1])[:n - 1] for x in (pools.mtp.c_pages, pools.mtp.kpe_pages)]
                first[i] = (pages, _kda_rows(pools, cfg, r.slot))
        return cb

    hs = [eng.submit(p, RequestParams(max_tokens=m, stop_ids=()), on_tokens=record(i))
          for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    eng.run_until_done()
    return [h.generated for h in hs], hidden, first


def test_shared_prefix_hits_equal_misses(engines, tiny_model, tiny_cfg):
    hit, miss = engines
    cfg = tiny_cfg
    rng = np.random.default_rng(0)
    A = rng.integers(0, cfg.vocab_size, 40).tolist()
    tail = lambda n: rng.integers(0, cfg.vocab_size, n).tolist()
    # A is fed 16 + 16 + 8 (chunks end on pages of 8): snapshots at 16 and 32
    prompts = [A[:36] + tail(9),   # diverges mid-page: restores at 32
               A[:32] + tail(5),   # diverges exactly on the snapshot boundary: restores at 32 (page copied)
               A[:32],             # equal to a cached prefix: at least one token is fed, restores at 16
               A[:33],             # restores at 32, feeds one token
               A[:5] + tail(20),   # diverges inside the first block: a miss
               A]                  # the same prompt again: restores at 32
    saved = [32, 32, 16, 32, 0, 32]

    # the snapshot A leaves at 32 equals the miss engine's slot state after A's first 32 tokens
    h = miss.submit(A, RequestParams(max_tokens=6, stop_ids=()))
    while h._req.n_fed < 32:
        miss.step()
    assert h._req.n_fed == 32
    state32 = _kda_rows(miss.runner.pools, cfg, h._req.slot) + [np.asarray(miss.runner.pools.hidden)[h._req.slot]]
    miss.run_until_done()
    ref_a = h.generated

    events, listener = _compile_events()
    try:
        h = hit.submit(A, RequestParams(max_tokens=6, stop_ids=()))
        hit.run_until_done()
        before = hit.stats()
        got, got_hidden, got_first = _serve(hit, cfg, prompts, [8] * len(prompts))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert events == []  # restores, snapshots and steps: all compiled at warm-up
    assert hit.runner.snapshots.compiled_shapes() == 2
    assert h.generated == ref_a
    st = hit.stats()
    assert st["prefix_hits"] - before["prefix_hits"] == sum(s > 0 for s in saved)
    assert st["prefix_tokens_saved"] - before["prefix_tokens_saved"] == sum(saved)
    assert st["prompt_tokens_fed"] - before["prompt_tokens_fed"] == sum(map(len, prompts)) - sum(saved)

    node = hit.prefix.lookup(A).node
    assert node.depth * KW["page_size"] == 32
    snap = hit.runner.snapshots.snaps
    snap_rows = [np.asarray(x)[:, :, node.snapshot] for x in jax.tree.leaves(snap.layers)]
    for a, b in zip(snap_rows + [np.asarray(snap.hidden)[node.snapshot]], state32, strict=True):
        assert rel_err(a, b) < 1e-5

    want, want_hidden, want_first = _serve(miss, cfg, prompts, [8] * len(prompts))
    assert got == want
    for i in range(len(prompts)):
        assert len(got_hidden[i]) == len(want_hidden[i]) == 7
        lg = np.asarray(tiny_model.logits(np.stack(got_hidden[i])))
        lw = np.asarray(tiny_model.logits(np.stack(want_hidden[i])))
        np.testing.assert_allclose(lg, lw, atol=1e-5 * np.abs(lw).max(), rtol=1e-5)  # 1e-5 of the logits' scale
        np.testing.assert_allclose(jax.nn.softmax(lg), jax.nn.softmax(lw), atol=1e-5)
        pages_g, kda_g = got_first[i]
        pages_w, kda_w = want_first[i]
        assert len(pages_g) == 2 * 4 + 2  # c and k_pe of 4 MLA layers, then the MTP layer's
        for a, b in zip(pages_g + kda_g, pages_w + kda_w, strict=True):
            assert rel_err(a, b) < 1e-5, i
    assert hit.stats()["pages_in_use"] == 0
    hit.prefix.check()


def test_hits_at_snapshots_inside_a_prefill_chunk(engines, tiny_model, tiny_cfg):
    """snapshot_interval=8 with chunks of 16: a prompt fed 16 + 16 + 8 leaves snapshots at 8 and 24
    (inside its chunks, written by the prefill program) as well as 16, 32 and 40 (chunk ends). Hits
    restoring at 8 and 24 equal the misses token for token and logits within 1e-5, and the snapshot
    at 24 equals the state of an engine that stopped after 24 tokens (chunks of 8), within 1e-5."""
    hit, miss = engines
    cfg = tiny_cfg
    inner = Engine(tiny_model, prefix_cache_memory_gib=ROWS * UNIT / GIB, snapshot_interval=8, **KW)
    inner.runner.decode_fn = hit.runner.decode_fn  # same decode shapes
    inner.warmup()
    rng = np.random.default_rng(5)
    A = rng.integers(0, cfg.vocab_size, 40).tolist()
    tail = lambda n: rng.integers(0, cfg.vocab_size, n).tolist()
    inner.submit(A, RequestParams(max_tokens=4, stop_ids=()))
    inner.run_until_done()
    assert sorted(n.depth * 8 for n in inner.prefix.row_owner.values()) == [8, 16, 24, 32, 40]
    inner.prefix.check()

    stop24 = Engine(tiny_model, prefix_cache=False, **{**KW, "prefill_chunk": 8})
    stop24.runner.decode_fn = hit.runner.decode_fn
    h24 = stop24.submit(A, RequestParams(max_tokens=1, stop_ids=()))
    while h24._req.n_fed < 24:
        stop24.step()
    assert h24._req.n_fed == 24
    pools24 = stop24.runner.pools
    state24 = _kda_rows(pools24, cfg, h24._req.slot) + [np.asarray(pools24.hidden)[h24._req.slot]]
    node = inner.prefix.lookup(A[:25]).node
    assert node.depth * 8 == 24
    snap = inner.runner.snapshots.snaps
    rows = [np.asarray(x)[:, :, node.snapshot] for x in jax.tree.leaves(snap.layers)]
    for a, b in zip(rows + [np.asarray(snap.hidden)[node.snapshot]], state24, strict=True):
        assert rel_err(a, b) < 1e-5

    prompts = [A[:27] + tail(6), A[:13] + tail(4), A[:25], A[:9]]
    saved = [24, 8, 24, 8]
    before = inner.stats()
    got, got_hidden, got_first = _serve(inner, cfg, prompts, [6] * len(prompts))
    st = inner.stats()
    assert st["prefix_hits"] - before["prefix_hits"] == 4
    assert st["prefix_tokens_saved"] - before["prefix_tokens_saved"] == sum(saved)
    # the miss: the same engine without the cache, its scan in the same chunks of gcd(16, 8) = 8 tokens
    # (the rounding of another chunking alone moves these logits by ~1.5e-5)
    miss8 = Engine(tiny_model, prefix_cache=False, exec=inner.exec.replace(kda_chunk=8), **KW)
    miss8.runner.decode_fn = hit.runner.decode_fn
    want, want_hidden, want_first = _serve(miss8, cfg, prompts, [6] * len(prompts))
    assert want == _serve(miss, cfg, prompts, [6] * len(prompts))[0]
    assert got == want
    for i in range(len(prompts)):
        lg = np.asarray(tiny_model.logits(np.stack(got_hidden[i])))
        lw = np.asarray(tiny_model.logits(np.stack(want_hidden[i])))
        np.testing.assert_allclose(lg, lw, atol=1e-5 * np.abs(lw).max(), rtol=1e-5)  # 1e-5 of the logits' scale
        for a, b in zip(got_first[i][0] + got_first[i][1], want_first[i][0] + want_first[i][1], strict=True):
            assert rel_err(a, b) < 1e-5, i
    assert inner.stats()["pages_in_use"] == 0
    inner.clear_prefix_cache()
    inner.prefix.check()
    assert inner.prefix.nodes == 0 and sorted(inner.prefix.free_rows) == list(range(inner.prefix.num_snapshots))


def test_lru_eviction_under_a_tiny_budget(engines, tiny_model, tiny_cfg):
    """A budget of 2.5 snapshots-with-their-chunk's-2-pages; 23-token prompts over three 20-token
    bases cache one snapshot each (at 16), so the cache holds two bases: the hits follow LRU (not
    insertion order), the bytes stay within the budget at every step, and every request gives the
    miss engine's tokens."""
    hit, miss = engines
    assert UNIT == hit.sizes.snapshot_bytes + 2 * hit.sizes.page_bytes
    small = Engine(tiny_model, prefix_cache_memory_gib=2.5 * UNIT / GIB, **KW)
    small.runner.decode_fn = hit.runner.decode_fn  # its prefill and snapshot copies compile (other snapshot rows)
    assert small.prefix.num_snapshots == 2
    rng = np.random.default_rng(1)
    bases = [rng.integers(0, tiny_cfg.vocab_size, 20).tolist() for _ in range(3)]
    order = [0, 1, 2, 1, 0, 2, 1, 1]
    # 2 evicts 0; 1 hits (and becomes the most recent); 0 evicts 2 (least recently used, though
    # inserted after 1); 2 evicts 1; 1 evicts 0; 1 hits
    hits = [0, 0, 0, 1, 0, 0, 0, 1]
    prompts = [bases[k] + rng.integers(0, tiny_cfg.vocab_size, 3).tolist() for k in order]
    want = []
    for p in prompts:
        h = miss.submit(p, RequestParams(max_tokens=4, stop_ids=()))
        miss.run_until_done()
        want.append(h.generated)
    got, got_hits = [], []
    for p in prompts:
        n = small.stats()["prefix_hits"]
        h = small.submit(p, RequestParams(max_tokens=4, stop_ids=()))
        while small.has_work():
            small.step()
            assert small.stats()["prefix_cache_bytes"] <= small.prefix.budget_bytes
        got.append(h.generated)
        got_hits.append(small.stats()["prefix_hits"] - n)
    assert got == want
    assert got_hits == hits
    assert small.prefix.evictions == 4  # one base (its snapshot node, then its parent pruned) each time
    assert small.stats()["prefix_cache_pages"] == 4
    small.prefix.check()


def test_preemption_and_cancels_with_prefix_cache_leave_nothing(engines, tiny_cfg):
    """Shared-prefix requests overflowing the 24-page pool (4 slots x up to 12 pages): cached pages
    are reclaimed, requests are preempted and recomputed (hitting their own prefix), a queued and
    a running request are cancelled; the rest equal the miss engine; afterwards every page, slot
    and snapshot row is free once the cache is cleared."""
    hit, miss = engines
    rng = np.random.default_rng(2)
    base = rng.integers(0, tiny_cfg.vocab_size, 48).tolist()
    tail = lambda: rng.integers(0, tiny_cfg.vocab_size, int(rng.integers(1, 12))).tolist()
    prompts = [base[:int(rng.integers(20, 49))] + tail() for _ in range(10)]
    max_tokens = [int(rng.integers(20, 96 - len(p) + 1)) for p in prompts]
    cancel_queued, cancel_running = 7, 1
    runs = {}
    for eng in (hit, miss):
        before = eng.stats()
        hs = [eng.submit(p, RequestParams(max_tokens=m, stop_ids=())) for p, m in zip(prompts, max_tokens)]
        eng.cancel(hs[cancel_queued])
        for _ in range(4):
            eng.step()
            if eng.prefix is not None:
                eng.prefix.check(eng.sched.running())
        assert hs[cancel_running]._req.slot is not None
        eng.cancel(hs[cancel_running])
        while eng.has_work():
            eng.step()
            if eng.prefix is not None:
                eng.prefix.check(eng.sched.running())
        runs[eng is hit] = ([h.generated for h in hs], {k: eng.stats()[k] - before[k]
                                                          for k in ("preemptions", "prefix_hits")})
        assert [h.finish_reason for h in hs].count("cancelled") == 2
        st = eng.stats()
        assert st["slots_in_use"] == st["pages_in_use"] == st["queue_depth"] == 0
        assert not eng.alloc.pages and sorted(eng.alloc.free) == list(range(eng.sizes.num_pages))
    (got, hit_st), (want, _) = runs[True], runs[False]
    keep = [i for i in range(len(prompts)) if i not in (cancel_queued, cancel_running)]
    assert [got[i] for i in keep] == [want[i] for i in keep]
    assert got[cancel_queued] == []
    assert hit_st["preemptions"] >= 2 and hit_st["prefix_hits"] >= 5, hit_st
    hit.clear_prefix_cache()
    hit.prefix.check()
    assert sorted(hit.alloc.empty) == list(range(hit.sizes.num_pages)) and not hit.alloc.cached
    assert sorted(hit.prefix.free_rows) == list(range(hit.prefix.num_snapshots))
    assert hit.stats()["prefix_cache_pages"] == hit.stats()["prefix_cache_bytes"] == 0


def test_prefix_cache_options_and_report(engines, tiny_model):
    hit, miss = engines
    assert "prefix cache: budget 0.0002 GiB (prefix_cache_memory_gib)" in hit.describe()
    text = Engine(tiny_model, **KW).describe()  # the default budget (not compiled: nothing runs)
    assert "prefix cache: budget 0.0001 GiB (0.5 x the page pool)" in text
    assert "snapshot pool: 2 rows = budget // (19456 + 2 pages x 6400) (one per 16 tokens: snapshots every 16" in text
    text = Engine(tiny_model, snapshot_interval=8, **KW).describe()
    assert "snapshot pool: 2 rows = budget // (19456 + 1 pages x 6400) (one per 8 tokens: snapshots every 8" in text
    for bad in (0, 12, 8.0, True):
        with pytest.raises(ValueError, match=f"snapshot_interval must be a positive multiple of page_size=8.*{bad!r}"):
            Engine(tiny_model, snapshot_interval=bad, **KW)
    assert "prefix cache: off" in miss.describe()
    assert {k: miss.stats()[k] for k in ("prefix_hits", "prefix_tokens_saved", "prefix_cache_pages",
                                         "prefix_cache_bytes")} == dict.fromkeys(
        ("prefix_hits", "prefix_tokens_saved", "prefix_cache_pages", "prefix_cache_bytes"), 0)
    with pytest.raises(ValueError, match="prefix_cache must be a bool, got 'no'"):
        Engine(tiny_model, prefix_cache="no", **KW)
    with pytest.raises(ValueError, match="prefix_cache_memory_gib must be a number > 0, got 0"):
        Engine(tiny_model, prefix_cache_memory_gib=0, **KW)
    with pytest.raises(ValueError, match=r"does not cover one snapshot \(19456 B\) plus one page \(6400 B\)"):
        Engine(tiny_model, prefix_cache_memory_gib=20000 / GIB, **KW)


# -- the host policy under a fake device -------------------------------------------------------

class FakeDevice:
    """Stands in for the compiled programs. A slot's "KDA state" is the tuple of tokens it was fed;
    a page position holds the token prefix its latent depends on (main latent at p: tokens [0, p];
    MTP slot t: tokens [0, t+1]). Every call first checks that each key a row attends over is its
    own sequence's, and that every page it writes is held by that slot alone and not cached; a
    restore checks the snapshot is the request's prefix. The next token is a hash of the state."""

    def __init__(self, eng, vocab):
        self.eng, self.vocab, self.mtp = eng, vocab, eng.sizes.with_mtp
        self.P, self.S = eng.sizes.page_size, eng.sizes.max_slots
        self.state = [()] * self.S
        self.snap, self.main, self.mtp_slots = {}, {}, {}
        self.writes = 0
        self.inner = 0  # snapshots taken inside a prefill chunk
        eng.runner.decode_fn = self.step
        eng.runner.prefill_fn = self.step if eng.runner.snapshots is None else self.prefill
        if eng.runner.snapshots is not None:
            eng.runner.snapshots.save, eng.runner.snapshots.restore = self.save, self.restore

    def _write(self, table, bt, pos, value):
        page = int(bt[pos // self.P])
        a = self.eng.alloc
        assert a.refs[page] == 1 and page not in a.cached, f"write into shared page {page}"
        table[(page, pos % self.P)] = value
        self.writes += 1

    def step(self, params, pools, inp):
        rows, ids, n_valid, lengths, bt = (np.asarray(x) for x in inp[:5])
        toks = np.zeros(len(rows), np.int32)
        for i, s in enumerate(rows.tolist()):
            n, L = int(n_valid[i]), int(lengths[i])
            if n == 0:
                continue
            st = () if L == 0 else self.state[s]
            assert len(st) == L
            for p in range(L):
                assert self.main[(int(bt[i, p // self.P]), p % self.P)] == st[:p + 1], ("stale latent", p)
            for t in range(L - 1 if self.mtp else 0):
                assert self.mtp_slots[(int(bt[i, t // self.P]), t % self.P)] == st[:t + 2], ("stale MTP slot", t)
            new = st + tuple(int(x) for x in ids[i, :n])
            for p in range(L, L + n):
                self._write(self.main, bt[i], p, new[:p + 1])
            for t in range(max(L - 1, 0), L + n - 1) if self.mtp else ():
                self._write(self.mtp_slots, bt[i], t, new[:t + 2])
            self.state[s] = new
            toks[i] = hash(new) % self.vocab
        return pools, toks, None  # (pools, tokens, logprob arrays: none asked for)

    def prefill(self, params, pools, inp, snaps):
        """`step`, plus the snapshots inside the chunk (`inp.snap_rows`: row i's state after
        (j+1)·interval of the tokens it is fed), as the compiled prefill writes them."""
        before = [self.state[s] if int(L) else () for s, L in zip(np.asarray(inp.rows).tolist(), inp.lengths)]
        pools, toks, lp = self.step(params, pools, inp)
        I = self.eng.runner.snapshot_interval
        for i, row_plan in enumerate(np.asarray(inp.snap_rows)):
            for j, row in enumerate(row_plan.tolist()):
                if row < self.eng.runner.snapshots.rows:
                    n = (j + 1) * I
                    assert n < int(inp.n_valid[i]), "a snapshot asked past the chunk's tokens"
                    self.snap[row] = before[i] + tuple(int(x) for x in inp.ids[i, :n])
                    self.inner += 1
        return pools, toks, lp, snaps

    def save(self, pools, copies):
        for slot, row in copies:
            self.snap[row] = self.state[slot]

    def restore(self, pools, ops):
        for op in ops:
            b = op.req.n_fed
            assert self.snap[op.snapshot] == tuple(op.req.feed[:b]), "restored the wrong state"
            self.state[op.slot] = self.snap[op.snapshot]
            for table in (self.main, self.mtp_slots):
                for o in range(self.P):
                    if (op.src_page, o) in table:
                        table[(op.dst_page, o)] = table[(op.src_page, o)]
        return pools


def _expected(prompt, max_tokens, vocab):
    seq, out = tuple(prompt), []
    for _ in range(max_tokens):
        out.append(hash(seq) % vocab)
        seq += (out[-1],)
    return out


@pytest.mark.parametrize("with_mtp,interval", [(True, None), (False, None), (True, 2), (False, 2)])
def test_policy_under_a_fake_device(tiny_model, with_mtp, interval):
    """60 requests over a 2-letter alphabet (blocks collide, continuations branch) into a pool too
    small for them, a budget of 4 snapshots, random cancels and random evictions: every check of
    FakeDevice and `PrefixCache.check` holds after every step, the tokens are the sequence's own,
    hits and preemptions happen, and everything is free at the end. interval=2: snapshots inside
    the chunks (of up to 4 tokens per row) too (every page boundary), checked by FakeDevice.prefill and at each restore."""
    vocab = 3
    sizes = plan_pools(tiny_model.cfg, tiny_model.dtype, max_slots=3, page_size=2, num_pages=24, with_mtp=with_mtp)
    unit = sizes.snapshot_bytes + 4 * sizes.page_bytes  # a snapshot and its chunk's pages (8 tokens)
    # chunk 8 over 2 rows: each row gets up to 4 tokens when two prompts feed (scheduler policy 3),
    # so interval=2 still takes snapshots inside chunks
    eng = Engine(tiny_model, max_slots=3, page_size=2, num_pages=24, prefill_chunk=8, prefill_rows=2,
                 max_seq_len=40, with_mtp=with_mtp, prefix_cache_memory_gib=4 * unit / GIB,
                 snapshot_interval=interval)
    rows = 4 if interval is None else (4 * unit) // (sizes.snapshot_bytes + sizes.page_bytes)
    assert eng.prefix.num_snapshots == rows and eng.prefix.lookahead == int(with_mtp)
    dev = FakeDevice(eng, vocab)
    rng = np.random.default_rng(3)
    bases = [rng.integers(0, 2, 24).tolist() for _ in range(3)]
    handles, expected = [], []
    for step in range(3000):
        if len(handles) < 60 and rng.random() < 0.35:
            b = bases[int(rng.integers(0, 3))]
            p = b[:int(rng.integers(1, 25))] + rng.integers(0, 2, int(rng.integers(0, 6))).tolist()
            m = int(rng.integers(1, 41 - len(p)))
            handles.append(eng.submit(p, RequestParams(max_tokens=m, stop_ids=())))
            expected.append(_expected(p, m, vocab))
        if handles and rng.random() < 0.02:
            eng.cancel(handles[int(rng.integers(0, len(handles)))])
        if rng.random() < 0.05:
            eng.prefix.evict_one()
        eng.step()
        eng.prefix.check(eng.sched.running())
        if len(handles) == 60 and not eng.has_work():
            break
    assert not eng.has_work()
    for h, want in zip(handles, expected):
        assert h.finished
        if h.finish_reason == "cancelled":
            assert h.generated == want[:len(h.generated)]
        else:
            assert h.generated == want
    st = eng.stats()
    assert st["prefix_hits"] >= 20 and st["preemptions"] > 0 and eng.prefix.evictions > 0, st
    assert st["pages_in_use"] == 0 and sorted(eng.alloc.free) == list(range(24))
    eng.clear_prefix_cache()
    eng.prefix.check()
    assert sorted(eng.alloc.empty) == list(range(24)) and eng.prefix.nodes == 0
    assert sorted(eng.prefix.free_rows) == list(range(rows))
    assert dev.writes > 1000  # the fake device really ran every step
    assert (dev.inner > 50) if interval else dev.inner == 0


def test_a_long_prompt_keeps_its_deepest_snapshots(tiny_model):
    """Two snapshot rows, one 39-token prompt fed in 10 chunks of 4 (snapshots at 4, 8, .., 36): each
    new snapshot takes the row of the shallowest one on its path, so the tree keeps the two deepest
    (32 and 36), and a prompt sharing 38 tokens restores at 36."""
    sizes = plan_pools(tiny_model.cfg, tiny_model.dtype, max_slots=2, page_size=2, num_pages=48)
    budget = 2 * sizes.snapshot_bytes + 18 * sizes.page_bytes + 100  # the 18 pages to 36 and 2 snapshots
    eng = Engine(tiny_model, max_slots=2, page_size=2, num_pages=48, prefill_chunk=4, prefill_rows=1,
                 max_seq_len=48, prefix_cache_memory_gib=budget / GIB)
    assert eng.prefix.num_snapshots == 2
    FakeDevice(eng, 3)
    prompt = np.random.default_rng(4).integers(0, 3, 39).tolist()
    h = eng.submit(prompt, RequestParams(max_tokens=2, stop_ids=()))
    eng.run_until_done()
    assert h.generated == _expected(prompt, 2, 3)
    assert sorted(n.depth * 2 for n in eng.prefix.row_owner.values()) == [32, 36]
    assert eng.prefix.nodes == 18 and eng.prefix.evictions == 7
    eng.prefix.check()
    h = eng.submit(prompt[:38] + [(prompt[38] + 1) % 3, 0, 1], RequestParams(max_tokens=3, stop_ids=()))
    eng.run_until_done()
    assert eng.stats()["prefix_tokens_saved"] == 36 and h.generated == _expected(h._req.prompt, 3, 3)


def test_requests_with_penalties_never_restore_and_equal_misses(engines, tiny_cfg):
    """A request with sampling penalties reads its slot's token statistics, which a restore would
    not rebuild for the skipped prefix: it prefills everything (no hit), and its greedy tokens equal
    the miss engine's; a plain request with the same prefix right after still hits."""
    hit, miss = engines
    hit.clear_prefix_cache()
    rng = np.random.default_rng(11)
    base = rng.integers(0, tiny_cfg.vocab_size, 40).tolist()
    pen = RequestParams(max_tokens=6, repetition_penalty=1.3, frequency_penalty=0.4)
    out = {}
    for name, eng in (("hit", hit), ("miss", miss)):
        first = eng.submit(base + [1, 2], RequestParams(max_tokens=3))
        eng.run_until_done()
        hits0 = eng.stats()["prefix_hits"]
        penal = eng.submit(base + [3, 4, 5], pen)
        eng.run_until_done()
        hits1 = eng.stats()["prefix_hits"]
        plain = eng.submit(base + [6], RequestParams(max_tokens=3))
        eng.run_until_done()
        out[name] = (first.generated, penal.generated, plain.generated, hits1 - hits0, eng.stats()["prefix_hits"] - hits1)
    assert out["hit"][:3] == out["miss"][:3]
    assert out["hit"][3] == 0 and out["hit"][4] == 1  # the penalised request did not restore; the plain one did
    hit.clear_prefix_cache()
    assert hit.stats()["pages_in_use"] == 0


def test_snapshots_inside_a_chunk_never_evict_other_prefixes(tiny_model):
    """Three snapshot rows, snapshots every page (2 tokens) inside chunks of 8. A 5-token prompt
    leaves snapshots at 2 and 4 (inside its one chunk); an unrelated 7-token prompt (boundaries 2, 4,
    6 inside its chunk) finds one free row and takes it for its deepest boundary, 6, evicting nothing;
    a 13-token continuation of it hits at 6 and, with no free row and no snapshot of its own below
    its restore point to recycle, takes none for 8, 10, 12 rather than evict the first prompt's. All
    tokens are the sequences' own; the first prompt still hits at 4 (its chunk end at 6 then takes a
    row by LRU, as chunk ends do)."""
    sizes = plan_pools(tiny_model.cfg, tiny_model.dtype, max_slots=2, page_size=2, num_pages=48)
    budget = 4 * (sizes.snapshot_bytes + sizes.page_bytes) - 1  # 3 rows; room for 3 snapshots + 16 pages
    eng = Engine(tiny_model, max_slots=2, page_size=2, num_pages=48, prefill_chunk=8, prefill_rows=1,
                 max_seq_len=40, prefix_cache_memory_gib=budget / GIB, snapshot_interval=2)
    assert eng.prefix.num_snapshots == 3
    dev = FakeDevice(eng, 3)
    depths = lambda: sorted((n.depth * 2, eng.prefix._path(n)[0].key[0]) for n in eng.prefix.row_owner.values())
    p1, p2 = [0, 0, 1, 1, 0], [2, 2, 1, 0, 2, 1, 1]
    p3 = p2 + [0, 1, 2, 0, 1, 2]
    for p, saved in ((p1, 0), (p2, 0), (p3, 6), (p1 + [1], 4)):
        before = eng.stats()["prefix_tokens_saved"]
        h = eng.submit(p, RequestParams(max_tokens=2, stop_ids=()))
        eng.run_until_done()
        assert h.generated == _expected(p, 2, 3)
        assert eng.stats()["prefix_tokens_saved"] - before == saved
        eng.prefix.check()
        if p is p2 or p is p3:
            assert depths() == [(2, 0), (4, 0), (6, 2)] and eng.prefix.evictions == 0
    assert dev.inner == 3  # 2 and 4 of the first prompt, 6 of the second
