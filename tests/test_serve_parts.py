"""Serving engine parts: paged MLA cache = contiguous cache, per-row sampling = `sample`, page
allocator and scheduler policy (host only)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import mla_layer_pages
from ling_jax.mla import paged_gather
from ling_jax.model import init_cache, layer_cache
from ling_jax.sampling import (SamplingParams, processed_logits_rows, request_keys,
                               sample_rows)
from ling_jax.serve import Engine, RequestParams
from ling_jax.serve.allocator import PageAllocator
from ling_jax.serve.pools import as_cache, init_pools, plan_pools, with_cache
from ling_jax.serve.scheduler import DECODE, PREFILL, QUEUED, Request, Scheduler


def test_paged_mla_equals_contiguous_cache(tiny_model, tiny_cfg):
    """Two calls (a 13-token chunk, then 6 more with row 1 padded) over 4-token pages in a scattered
    block table: logits within 1e-5 and page latents within 1e-4 relative of the contiguous cache (~1e-6:
    both programs compiled at XLA:CPU's default optimisation, since the suite's -O0 rounds the two
    programs apart by up to 1.8e-5, measured), and no
    page outside the block table is written (padding included)."""
    cfg, P, NP = tiny_cfg, 4, 16
    sizes = plan_pools(cfg, jnp.float32, max_slots=2, page_size=P, num_pages=NP, max_seq_len=24, with_mtp=False)
    graphdef, params = nnx.split(tiny_model)
    pages = np.array([[9, 2, 14, 5, 0, 11], [3, 7, 12, 1, 8, 4]], np.int32)  # 6 blocks each, none shared
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 19)).astype(np.int32)
    n2 = np.array([6, 4], np.int32)  # row 1: 2 padding tokens in the second call

    @jax.jit
    def contiguous(params, cache, ids, n_valid):
        out = nnx.merge(graphdef, params)(ids, cache, n_valid)
        return out["logits"], out["cache"]

    @jax.jit
    def paged(params, pools, ids, n_valid, lengths):
        cache = as_cache(cfg, pools, jnp.asarray(pages), lengths)
        out = nnx.merge(graphdef, params)(ids, cache, n_valid)
        return out["logits"], with_cache(cfg, pools, out["cache"])

    def run(fn, *args):  # at XLA:CPU's default optimisation: the suite's -O0 rounds each program its own way
        return fn.lower(*args).compile(compiler_options={"xla_backend_optimization_level": 3})(*args)

    cache = init_cache(cfg, 2, 24, jnp.float32, with_mtp=False)
    l1, cache = run(contiguous, params, cache, ids[:, :13], np.full(2, 13, np.int32))
    l2, cache = run(contiguous, params, cache, ids[:, 13:], n2)
    pools = init_pools(cfg, sizes, jnp.float32)
    m1, pools = run(paged, params, pools, ids[:, :13], np.full(2, 13, np.int32), np.zeros(2, np.int32))
    m2, pools = run(paged, params, pools, ids[:, 13:], n2, np.full(2, 13, np.int32))
    np.testing.assert_allclose(np.asarray(m1), np.asarray(l1), atol=1e-5, rtol=1e-5)
    for b in range(2):  # padded logits of row 1 are not compared
        np.testing.assert_allclose(np.asarray(m2)[b, :n2[b]], np.asarray(l2)[b, :n2[b]], atol=1e-5, rtol=1e-5)
    lengths = 13 + n2
    for layer, c_pg, kpe_pg in mla_layer_pages(pools, cfg):
        ref = layer_cache(cache, cfg, layer)
        got_c = np.asarray(paged_gather(c_pg, jnp.asarray(pages)))
        got_k = np.asarray(paged_gather(kpe_pg, jnp.asarray(pages)))
        for b in range(2):
            np.testing.assert_allclose(got_c[b, :lengths[b]], np.asarray(ref.c)[b, :lengths[b]], atol=1e-5, rtol=1e-4)
            np.testing.assert_allclose(got_k[b, :lengths[b]], np.asarray(ref.k_pe)[b, :lengths[b]], atol=1e-5, rtol=1e-4)
        c_pages = np.asarray(c_pg)
        used = set(pages.ravel().tolist())
        assert not c_pages[[p for p in range(NP) if p not in used]].any()
        # row 1 holds 17 tokens: its block 4 (page 8) has one token, block 5 (page 4) none
        assert c_pages[8, 0].any() and not c_pages[8, 1:].any() and not c_pages[4].any()
        assert np.abs(c_pages[0]).sum() > 0 and not c_pages[0, 3:].any()  # row 0: 19 = 4·4 + 3


def test_sample_rows_draws_each_row_as_alone():
    rng = np.random.default_rng(0)
    ps = [SamplingParams(), SamplingParams(1.0, 0, 1.0, 3), SamplingParams(0.7, 5, 1.0, 1),
          SamplingParams(1.3, 0, 0.8, 9), SamplingParams(0.9, 10, 0.6, 2), SamplingParams(2.0, 1, 0.5, 5)]
    logits = jnp.asarray(rng.standard_normal((len(ps), 97)) * 2, jnp.float32)
    arr = lambda f, dt: jnp.asarray([getattr(p, f) for p in ps], dt)
    t, k, p = arr("temperature", jnp.float32), arr("top_k", jnp.int32), arr("top_p", jnp.float32)
    pr = processed_logits_rows(logits, t, k, p)
    alone = [np.asarray(processed_logits_rows(logits[b:b + 1], t[b:b + 1], k[b:b + 1], p[b:b + 1])[0])
             for b in range(len(ps))]
    for b in range(len(ps)):  # a row's mask does not depend on its neighbours, bit for bit
        np.testing.assert_array_equal(np.asarray(pr[b]), alone[b])
    draws = []
    for n in range(12):
        keys = request_keys(arr("seed", jnp.uint32), jnp.full((len(ps),), n))
        got = np.asarray(sample_rows(logits, keys, t, k, p))
        # greedy: the argmax; sampled: the categorical draw of the row's own key from its processed row
        want = [int(jnp.argmax(logits[b])) if ps[b].greedy else
                int(jax.random.categorical(keys[b], jnp.asarray(alone[b])[None], axis=-1)[0]) for b in range(len(ps))]
        assert got.tolist() == want
        draws.append(got)
    draws = np.array(draws)
    assert (draws[:, 0] == int(jnp.argmax(logits[0]))).all() and (draws[:, 5] == int(jnp.argmax(logits[5]))).all()
    assert len(set(draws[:, 1].tolist())) > 3  # temperature 1, no truncation: the draws vary with n
    # a row's key depends on its own seed and count only
    k1 = request_keys(jnp.asarray([7, 1], jnp.uint32), jnp.asarray([4, 0]))
    k2 = request_keys(jnp.asarray([2, 7], jnp.uint32), jnp.asarray([9, 4]))
    assert (jax.random.key_data(k1[0]) == jax.random.key_data(k2[1])).all()


def _sizes(cfg, **kw):
    return plan_pools(cfg, jnp.float32, **{"max_slots": 2, "page_size": 4, "num_pages": 6, "with_mtp": False, **kw})


def test_page_allocator_and_sizes(tiny_cfg):
    s = _sizes(tiny_cfg)
    a = PageAllocator(s)
    assert a.ensure(0, 5) and a.pages[0] == [0, 1] and a.used == 2
    assert a.ensure(1, 16) and a.used == 6 and not a.ensure(0, 9) and a.pages[0] == [0, 1]  # all or nothing
    assert a.block_rows([0, None]).tolist() == [[0, 1, 0, 0, 0, 0], [0] * 6]
    a.release(1)
    assert a.used == 2 and a.ensure(0, 9) and len(a.pages[0]) == 3
    a.release(0)
    assert sorted(a.free) == list(range(6))
    # the block-table rows kept beside the page lists (a step takes them, no list conversion) follow
    # every grow, share and release; random operations against the lists themselves
    big = PageAllocator(_sizes(tiny_cfg, max_slots=3, num_pages=12, max_seq_len=24))
    rng = np.random.default_rng(0)
    for _ in range(200):
        slot, op = int(rng.integers(3)), rng.integers(3)
        if op == 0:
            big.ensure(slot, int(rng.integers(1, 25)))
        elif op == 1:
            big.release(slot)
        elif not big.pages.get(slot) and big.pages.get((slot + 1) % 3):
            big.share(slot, big.pages[(slot + 1) % 3][:2])
        for width in (None, 3):
            rows = big.block_rows([0, None, 1, 2], width)
            want = np.zeros((4, big.sizes.max_blocks), np.int32)
            for i, sl in enumerate((0, None, 1, 2)):
                pg = big.pages.get(sl, []) if sl is not None else []
                want[i, :len(pg)] = pg
            assert (rows == want[:, :width]).all()
    by_mem = plan_pools(tiny_cfg, jnp.float32, max_slots=2, page_size=4, cache_memory_gib=1e-4)
    assert by_mem.num_pages == (int(1e-4 * 1024 ** 3) - 2 * by_mem.slot_bytes) // by_mem.page_bytes
    assert by_mem.page_bytes == 4 * 5 * (tiny_cfg.kv_lora_rank + tiny_cfg.qk_rope_head_dim) * 4  # 4 MLA + MTP
    with pytest.raises(ValueError, match="exactly one of num_pages or cache_memory_gib"):
        plan_pools(tiny_cfg, jnp.float32, max_slots=2, page_size=4)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        plan_pools(tiny_cfg, jnp.float32, max_slots=2, page_size=0, num_pages=3)
    with pytest.raises(ValueError, match="does not cover"):
        plan_pools(tiny_cfg, jnp.float32, max_slots=2, page_size=4, cache_memory_gib=1e-9)


def test_scheduler_preempts_youngest_and_chunks(tiny_cfg):
    s = _sizes(tiny_cfg, max_slots=3)  # 6 pages of 4 tokens
    sch = Scheduler(PageAllocator(s), 3, prefill_chunk=6, prefill_rows=2)
    reqs = [Request(i, list(range(n)), None, frozenset()) for i, n in enumerate((7, 3, 9))]
    a, b, c = reqs
    sch.queue.extend(reqs)
    plan = sch.schedule()  # admission checks fit (a 2 pages, b 1, c 3 of 6) but allocates nothing
    assert [r.state for r in reqs] == [PREFILL] * 3
    # three prompts wait, two rows: the budget of 6 is split over the two oldest (3 each), so the
    # [2, T] prefill program is full, not [2, 6] with one row idle
    assert [(r.id, n) for r, n in plan.prefill] == [(0, 3), (1, 3)] and sch.alloc.used == 2
    a.n_fed, b.n_fed = 3, 3
    b.state, b.generated = DECODE, [6]
    plan = sch.schedule()  # b decodes (4 tokens: its page); a and c share the budget, 3 each
    assert plan.decode == [b] and [(r.id, n) for r, n in plan.prefill] == [(0, 3), (2, 3)]
    assert sch.alloc.used == 4
    a.n_fed, c.n_fed, b.n_fed = 6, 3, 4
    b.generated = [6, 7]
    plan = sch.schedule()  # b: 5 tokens, a 2nd page; a's last token; c capped at 3 (two rows wait)
    assert plan.decode == [b] and [(r.id, n) for r, n in plan.prefill] == [(0, 1), (2, 3)]
    assert sch.alloc.used == 6
    a.n_fed, c.n_fed, b.n_fed = 7, 6, 5
    a.state, a.generated = DECODE, [5]
    b.generated = [6, 7, 8]
    plan = sch.schedule()  # a: 8 tokens, b: 7 (their 2 pages each); c, alone, gets the 2 tokens its pages hold
    assert plan.decode == [a, b] and [(r.id, n) for r, n in plan.prefill] == [(2, 2)]
    assert sch.alloc.used == 6
    a.n_fed, b.n_fed, c.n_fed = 8, 7, 8
    plan = sch.schedule()  # a needs a 3rd page: none free -> c (youngest, still prefilling) preempted
    assert c.state == QUEUED and c.slot is None and sch.preemptions == 1
    assert plan.decode == [a, b] and sch.queue[0] is c and plan.prefill == []
    assert sch.alloc.used == 5



def test_scheduler_caps_the_tokens_one_prompt_is_fed(tiny_cfg):
    """prefill_row_tokens: a lone prompt is fed at most that many tokens a step (the decoding requests
    beside it wait for a short chunk), a backlog fills the rows, prefill_chunk tokens in all."""
    s = plan_pools(tiny_cfg, jnp.float32, max_slots=6, page_size=4, num_pages=200)
    sch = Scheduler(PageAllocator(s), 6, prefill_chunk=32, prefill_rows=4, prefill_row_tokens=8)
    lone = Request(0, list(range(30)), None, frozenset())
    sch.queue.append(lone)
    assert [(r.id, n) for r, n in sch.schedule().prefill] == [(0, 8)]  # not 30 (the whole chunk)
    lone.n_fed = 8
    more = [Request(i, list(range(n)), None, frozenset()) for i, n in ((1, 20), (2, 5), (3, 40), (4, 12))]
    sch.queue.extend(more)
    plan = sch.schedule()  # four rows: 8 each (32 / 4), the 5-token prompt whole
    assert [(r.id, n) for r, n in plan.prefill] == [(0, 8), (1, 8), (2, 5), (3, 8)]
    # without the cap, the lone prompt would have taken the whole chunk
    free = Scheduler(PageAllocator(s), 6, prefill_chunk=32, prefill_rows=4)
    free.queue.append(Request(0, list(range(30)), None, frozenset()))
    assert [n for _, n in free.schedule().prefill] == [30]


def test_engine_policy_stress_with_a_stub_model(tiny_model):
    """The host side of the engine under a stub model (the compiled steps replaced by a function
    returning token 1): 60 requests into a pool far too small, random cancels. After every step
    no page has two owners, every running slot holds the pages its tokens need, and the run ends
    with everything free; preemptions happen and every request ends. Without the prefix cache, so no
    page is shared (tests/test_prefix_cache.py runs the same policy with it, under a fake device)."""
    eng = Engine(tiny_model, max_slots=3, page_size=4, num_pages=9, prefill_chunk=8, prefill_rows=2,
                 max_seq_len=36, prefix_cache=False)
    fake = lambda params, pools, inp: (pools, np.ones(len(inp.rows), np.int32), None)  # no logprobs asked
    eng.runner.prefill_fn = eng.runner.decode_fn = fake
    rng = np.random.default_rng(0)
    handles = []
    for step in range(4000):
        if len(handles) < 60 and rng.random() < 0.3:
            n = int(rng.integers(1, 30))
            handles.append(eng.submit([2] * n, RequestParams(max_tokens=int(rng.integers(1, 37 - n)),
                                                             stop_ids=())))
        if handles and rng.random() < 0.02:
            eng.cancel(handles[int(rng.integers(0, len(handles)))])
        eng.step()
        owned = [p for ps in eng.alloc.pages.values() for p in ps]
        assert len(owned) == len(set(owned)) and not set(owned) & set(eng.alloc.free)
        assert len(owned) + len(eng.alloc.free) == 9
        for s, r in enumerate(eng.sched.slots):
            if r is not None:
                assert r.slot == s and r not in eng.sched.queue
                assert len(eng.alloc.pages.get(s, [])) >= eng.alloc.pages_for(r.n_fed)
        if len(handles) == 60 and not eng.has_work():
            break
    assert not eng.has_work() and eng.stats()["pages_in_use"] == 0 and sorted(eng.alloc.free) == list(range(9))
    assert eng.stats()["preemptions"] > 0
    for h in handles:
        assert h.finished
        if h.finish_reason != "cancelled":
            assert h.finish_reason == "length" and h.generated == [1] * h._req.params.max_tokens


def test_padded_kpe_rows_are_counted(tiny_cfg):
    """`ExecConfig.pool_layout="token_rows"` on TPU stores each k_pe row padded to 128 lanes
    (`pools.token_row_formats`): `stored_kpe_values` says so for bf16 / float32 pages on TPU only, and
    `plan_pools` / `describe` count the padding in every MLA layer's page (the budget buys fewer pages)."""
    from ling_jax.exec_config import ExecConfig
    from ling_jax.serve.pools import describe, stored_kpe_values

    dr = tiny_cfg.qk_rope_head_dim
    tpu, cpu = ExecConfig.for_backend("tpu"), ExecConfig.for_backend("cpu")
    assert stored_kpe_values(tiny_cfg, tpu, jnp.bfloat16) == stored_kpe_values(tiny_cfg, tpu, jnp.float32) == 128
    assert stored_kpe_values(tiny_cfg, cpu, jnp.bfloat16) == dr  # row-major is the default there
    assert stored_kpe_values(tiny_cfg, tpu.replace(pool_layout="default"), jnp.bfloat16) == dr
    assert stored_kpe_values(tiny_cfg, tpu, jnp.bfloat16, "fp8") == dr  # float8 pages keep the default layout
    plain = _sizes(tiny_cfg, num_pages=None, cache_memory_gib=1e-3)
    padded = _sizes(tiny_cfg, num_pages=None, cache_memory_gib=1e-3, kpe_stored=128)
    n_mla = sum(t == "mla" for t in tiny_cfg.layer_types)  # no MTP pages here (with_mtp=False)
    assert padded.page_bytes - plain.page_bytes == 4 * n_mla * (128 - dr) * 4  # P=4 tokens, float32
    assert padded.num_pages < plain.num_pages and padded.kpe_stored == 128 and plain.kpe_stored == 0
    assert "k_pe rows stored row-major as 128 values" in describe(tiny_cfg, padded, jnp.float32)
    assert "k_pe rows" not in describe(tiny_cfg, plain, jnp.float32)


def test_decode_row_buckets_pad_at_most_a_third_from_eight_rows():
    """`row_buckets`: 1, 2, 4, 8, then powers of two and 1.5x them, ending at max_slots; so a step of
    n >= 8 decoding rows runs a bucket padded by at most a third (powers of two alone: up to half)."""
    from ling_jax.serve.runner import row_buckets
    assert row_buckets(1) == (1,) and row_buckets(8) == (1, 2, 4, 8)
    assert row_buckets(32) == (1, 2, 4, 8, 12, 16, 24, 32)
    assert row_buckets(40) == (1, 2, 4, 8, 12, 16, 24, 32, 40)
    for top in (3, 8, 13, 32, 64, 100):
        b = row_buckets(top)
        assert b == tuple(sorted(set(b))) and b[-1] == top and b[0] == 1
        for n in range(8, top + 1):
            r = next(x for x in b if x >= n)
            assert (r - n) * 3 <= r, (top, n, r)
