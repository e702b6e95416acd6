"""Speculative decoding inside the engine: K = 1..3 gives exactly plain greedy decoding (with drafts
partly accepted and partly rejected, preemptions under a small pool, stops inside accepted runs),
the KDA state after a rolled-back verify equals plain decoding of the accepted tokens, a seeded
sampled request gives the same tokens alone, in a busy batch and after a preemption, logprobs equal
plain decoding's, no leaks after cancellations, no compiles after warm-up."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import np_reference as R
from conftest import is_compile_event, load_from_dict, rel_err, xla_compiles
from ling_jax.config import KDA
from ling_jax.kda import CONV_FIELDS, conv_window
from ling_jax.generate import generate, prefill
from ling_jax.layer_stack import layer_plan
from ling_jax.mla import paged_gather
from ling_jax.model import init_cache, layer_cache
from ling_jax.sampling import SamplingParams
from ling_jax.serve import Engine, RequestParams
from ling_jax.serve.allocator import PageAllocator
from ling_jax.serve.pools import plan_pools
from ling_jax.serve.scheduler import DECODE, PREFILL, Request, Scheduler
from ling_jax.speculation import MAX_SPECULATIVE

PAGE, MAX_SEQ, MAX_NEW, N_REQ = 8, 80, 20, 14


@pytest.fixture(scope="module")
def model(tiny_cfg):
    """The tiny config with weights under which the next token is mostly a function of the current
    one and the MTP layer (eh_proj ≈ [I, 0]) mostly predicts it, so drafts are accepted often enough
    (and rejected often enough) to exercise acceptance and rollback; the test checks both happen."""
    p = R.random_params(tiny_cfg, seed=7)
    for n in list(p):
        if n.endswith(("o_proj.weight", "dense.weight", "down_proj.weight")):
            p[n] = p[n] * 0.2
    D = tiny_cfg.hidden_size
    eh = f"model.layers.{tiny_cfg.num_hidden_layers}.eh_proj.weight"
    p[eh] = np.concatenate([np.eye(D), np.zeros((D, D))], 1) + 0.05 * p[eh]
    return load_from_dict(tiny_cfg, p)


_ENGINES = {}


def _spec_engine(model, k, **kw):
    """A K-draft speculative engine over a 12-page pool (96 tokens for 4 slots), two block-table widths."""
    return Engine(model, max_slots=4, page_size=PAGE, num_pages=12, prefill_chunk=16, prefill_rows=2,
                  max_seq_len=MAX_SEQ, buckets=(16,), widths=(4, 10), speculative=k, **kw)


@pytest.fixture(scope="module")
def engine_for(model):
    """engine_for(K): one warmed-up engine per K for the module, over a 12-page pool (96 tokens for
    4 slots: requests of up to 80 tokens preempt each other), two block-table widths. K = 2 compiles
    every row bucket (1, 2, 4); K = 1 and 3 only the 4-row one (fewer rows are padded to it): the
    row buckets are the same code for every K, the draft count is what those two check."""
    def get(k):
        if k not in _ENGINES:
            eng = _spec_engine(model, k, decode_rows=None if k == 2 else (4,))
            events = []
            listener = lambda name, *a, **kw: (events.append(name) if is_compile_event(name)
                                               else None)
            jax.monitoring.register_event_duration_secs_listener(listener)
            try:
                eng.warmup()
            finally:
                jax.monitoring.unregister_event_duration_listener(listener)
            n = len(eng.runner.decode_rows) * len(eng.runner.widths)  # speculative shapes: row buckets x widths
            assert len(events) >= n + len(eng.runner.buckets) * len(eng.runner.widths)  # prefill: buckets x widths
            assert eng.runner.decode_fn._cache_size() == 0  # the speculative program replaces decode
            assert n <= eng.runner.spec_fn._cache_size() <= 2 * n
            _ENGINES[k] = eng
        return _ENGINES[k]
    yield get
    _ENGINES.clear()


def _truncate(tokens, max_tokens, stop):
    out = []
    for t in tokens[:max_tokens]:
        out.append(t)
        if t in stop:
            break
    return out


@pytest.fixture(scope="module")
def reference(model, tiny_cfg):
    """N_REQ requests (prompts 1 .. 60 tokens, max_tokens 1 .. 20, a stop id for every third, random
    arrival steps) and their tokens from plain greedy `generate` (one batched call without stops,
    truncated per request: batched = alone is checked in test_generate / test_engine)."""
    rng = np.random.default_rng(3)
    lens = rng.integers(1, 61, N_REQ)
    lens[:3] = (1, 8, 60)
    prompts = [rng.integers(0, tiny_cfg.vocab_size, int(m)).tolist() for m in lens]
    max_tokens = rng.integers(1, MAX_NEW + 1, N_REQ).tolist()
    max_tokens[3:6] = [MAX_NEW] * 3
    arrivals = np.sort(rng.integers(0, 25, N_REQ)).tolist()
    full = generate(model, prompts, MAX_NEW, stop_ids=()).tokens
    stops = [(int(full[i][rng.integers(0, len(full[i]))]),) if i % 3 == 0 else () for i in range(N_REQ)]
    expected = [_truncate(full[i], max_tokens[i], stops[i]) for i in range(N_REQ)]
    params = [RequestParams(max_tokens=max_tokens[i], stop_ids=stops[i]) for i in range(N_REQ)]
    return prompts, params, arrivals, expected


def _run(eng, prompts, params, arrivals, between=None):
    """Submit request i at engine step arrivals[i], run to the end (between(step, handles) is called
    before each step); streamed tokens must equal the final ones."""
    handles, streamed, step = [None] * len(prompts), {}, 0
    while step <= max(arrivals) or eng.has_work():
        for i, a in enumerate(arrivals):
            if a == step:
                handles[i] = eng.submit(prompts[i], params[i])
        if between is not None:
            between(step, handles)
        for h, toks in eng.step().items():
            streamed.setdefault(h.id, []).extend(toks)
        step += 1
    for h in handles:
        assert h.finished and streamed.get(h.id, []) == h.generated
    return handles


def _assert_all_free(eng):
    st = eng.stats()
    assert st["slots_in_use"] == st["pages_in_use"] == st["queue_depth"] == 0
    assert sorted(eng.alloc.free) == list(range(eng.sizes.num_pages))
    assert not eng.alloc.pages and all(s is None for s in eng.sched.slots)


# K = 2 always; K = 1 and 3 each compile an engine of their own (slow: still run in CI)
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)])
def test_speculative_engine_equals_plain_greedy(engine_for, reference, k):
    prompts, params, arrivals, expected = reference
    eng = engine_for(k)
    before = (eng.spec_rounds, eng.spec_accepted, eng.spec_drafted, eng.sched.preemptions)
    handles = _run(eng, prompts, params, arrivals)
    for i, h in enumerate(handles):
        assert h.generated == expected[i], i
        assert h.finish_reason == ("stop" if h.generated[-1] in params[i].stop_ids else "length")
    assert sum(h.finish_reason == "stop" and len(h.generated) < params[i].max_tokens
               for i, h in enumerate(handles)) >= 2  # stops fired before the limit
    rounds, accepted, drafted, preempted = (a - b for a, b in zip(
        (eng.spec_rounds, eng.spec_accepted, eng.spec_drafted, eng.sched.preemptions), before))
    # not trivially plain: drafts were accepted on some steps (> 1 token per verify) and rejected on
    # others (fewer than drafts + 1), and the small pool preempted (recompute from prompt + tokens)
    assert 0 < accepted < drafted, (accepted, drafted)
    assert preempted >= 1
    st = eng.stats()
    assert st["spec_steps"] > 0 and st["spec_accepted_tokens"] == eng.spec_accepted
    assert st["spec_acceptance_length"] == pytest.approx((eng.spec_accepted + eng.spec_rounds) / eng.spec_rounds)
    assert 1.0 < (accepted + rounds) / rounds < k + 1
    _assert_all_free(eng)


def test_logprobs_with_speculation_equal_plain(engine_for, reference, model):
    """Logprobs of speculatively decoded tokens (drafts accepted and the verify's own token) are the
    verify position's raw distribution: equal to plain `generate`'s for the same tokens (float32,
    1e-4), with each request's own top-N, and None for a request that asked for none."""
    prompts, params, arrivals, expected = reference
    idx = list(range(8))
    ref = generate(model, [prompts[i] for i in idx], MAX_NEW, stop_ids=(), logprobs=5)
    asked = [(None, 0, 2, 5)[i % 4] for i in idx]
    ps = [RequestParams(max_tokens=params[i].max_tokens, stop_ids=params[i].stop_ids, logprobs=asked[j])
          for j, i in enumerate(idx)]
    eng = engine_for(2)
    before = eng.spec_accepted
    handles = _run(eng, [prompts[i] for i in idx], ps, [arrivals[i] for i in idx])
    assert eng.spec_accepted > before  # some tokens came from accepted drafts
    checked = 0
    for j, (i, h) in enumerate(zip(idx, handles)):
        assert h.generated == expected[i], i
        assert len(h.logprobs) == len(h.generated)
        if asked[j] is None:
            assert h.logprobs == [None] * len(h.generated)
            continue
        for g, w in zip(h.logprobs, ref.logprobs[j]):
            assert abs(g.logprob - w.logprob) < 1e-4 and len(g.top) == asked[j]
            assert [t for t, _ in g.top] == [t for t, _ in w.top[:asked[j]]], i
            assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(g.top, w.top))
            checked += 1
    assert checked >= 20
    _assert_all_free(eng)


def _kda_layer_states(pools, cfg, slot):
    """{layer: KDAState of `slot`} for every main KDA layer of the engine's stacked pools."""
    out = {}
    for b_i, block in enumerate(layer_plan(cfg)):
        for r, run in enumerate(block.runs):
            if run.attn != KDA:
                continue
            for g, row in enumerate(block.layer_grid(r)):
                for i, layer in enumerate(row):
                    st = jax.tree.map(lambda x: x[g, i, slot], pools.layers[b_i][r])
                    out[layer] = st._replace(**{f: conv_window(getattr(st, f)) for f in CONV_FIELDS})  # taps
    return out


def test_kda_state_after_rollback_equals_plain(engine_for, model, tiny_cfg):
    """Step a request until a verify rejects a draft after accepting at least one (rollback into the
    middle of the verify chunk); then the slot's KDA recurrent + conv states, its hidden and its MTP
    pages equal a plain (chunked, contiguous) prefill of exactly the tokens accepted so far."""
    _check_rollback_equals_plain(engine_for(2), model, tiny_cfg)


def test_kda_state_after_rollback_into_conv_taps_equals_plain(model, tiny_cfg):
    """The same with `pool_layout="token_rows"` (the TPU default), whose pools keep each KDA conv
    window as lane-dense taps (`kda.conv_taps`): the verify's rollback, a window per row, is written
    back as taps, and the slot's states still equal the plain prefill's."""
    eng = _spec_engine(model, 2, exec=model.exec.replace(pool_layout="token_rows"), decode_rows=(4,),
                       prefix_cache=False)
    conv = [x for p, x in jax.tree_util.tree_leaves_with_path(eng.runner.pools) if "conv_q" in jax.tree_util.keystr(p)]
    assert len(conv) == 3 * sum(1 for b in layer_plan(tiny_cfg) for r in b.runs if r.attn == KDA)  # K-1 = 3 taps
    assert all(x.ndim == 4 for x in conv)  # [repeats, n, slots, H·dk]
    _check_rollback_equals_plain(eng, model, tiny_cfg)


def _check_rollback_equals_plain(eng, model, cfg):
    prompt = np.random.default_rng(11).integers(0, cfg.vocab_size, 13).tolist()
    h = eng.submit(prompt, RequestParams(max_tokens=60, stop_ids=()))
    req = h._req
    found = False
    for _ in range(60):
        drafts = eng.sched.drafts_for(req) if req.state == DECODE else None
        n0 = req.n_fed
        eng.step()
        if drafts and 1 <= req.n_fed - n0 - 1 < drafts:
            found = True
            break
    assert found, "no partly rejected verify step"
    n = req.n_fed
    fed = (prompt + h.generated)[:n]
    assert n == len(prompt) + len(h.generated) - 1  # the last emitted token is pending
    graphdef, params = nnx.split(model)
    cache = init_cache(cfg, 1, 80, jnp.float32, with_mtp=True)
    cache, _, _, hid = prefill(graphdef, params, cache, jnp.asarray([fed], jnp.int32), jnp.asarray([n], jnp.int32),
                               jnp.zeros((1, cfg.hidden_size)), sampling=SamplingParams(),
                               with_mtp=True)
    states = _kda_layer_states(eng.runner.pools, cfg, req.slot)
    assert len(states) == sum(t == KDA for t in cfg.layer_types)
    for layer, st in states.items():
        ref = layer_cache(cache, cfg, layer)
        for name in ("recurrent", "conv_q", "conv_k", "conv_v"):
            assert rel_err(getattr(st, name), getattr(ref, name)[0]) < 1e-5, (layer, name)
    assert rel_err(eng.runner.pools.hidden[req.slot], hid[0]) < 1e-5
    bt = jnp.asarray(eng.alloc.block_rows([req.slot]))
    m = n - 1  # MTP slots 0..n-2 are complete (the drafts' own writes past them were re-written)
    assert rel_err(paged_gather(eng.runner.pools.mtp.c_pages, bt)[0, :m], cache.mtp.c[0, :m]) < 1e-5
    assert rel_err(paged_gather(eng.runner.pools.mtp.kpe_pages, bt)[0, :m], cache.mtp.k_pe[0, :m]) < 1e-5
    eng.cancel(h)
    _assert_all_free(eng)


def test_seeded_sampled_request_alone_busy_and_preempted(engine_for, reference, tiny_cfg, model):
    """Speculative sampling: a seeded request's tokens are the same alone, in a busy mixed batch and
    when it is preempted (recomputed) mid-way; greedy neighbours still equal plain decoding."""
    prompts, params, _, expected = reference
    eng = engine_for(2)
    prompt = np.random.default_rng(5).integers(0, tiny_cfg.vocab_size, 21).tolist()
    p = RequestParams(max_tokens=18, temperature=0.8, top_k=20, top_p=0.9, seed=1234, stop_ids=())
    h = eng.submit(prompt, p)
    accepted0 = eng.spec_accepted
    eng.run_until_done()
    alone = h.generated
    assert len(alone) == 18 and eng.spec_accepted > accepted0  # sampled drafts were accepted too
    # one speculation module: `generate`'s row b with seed s draws as an engine request with seed s + b
    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1233)
    assert generate(model, [prompts[3], prompt], 18, sampling=sp, speculative=2, stop_ids=()).tokens[1] == alone
    rng = np.random.default_rng(6)
    others = [prompts[i] for i in range(8)]
    kinds = [params[i] if i % 2 == 0 else
             RequestParams(max_tokens=int(rng.integers(1, 20)), temperature=float(rng.choice([0.7, 1.5])),
                           top_k=int(rng.choice([0, 5])), seed=int(rng.integers(0, 100)), stop_ids=())
             for i in range(8)]
    preempted = []

    def preempt_it(step, handles):
        req = handles[4]._req if handles[4] is not None else None
        if not preempted and req is not None and req.state == DECODE and len(req.generated) >= 2:
            eng.sched.preempt(req)
            preempted.append(len(req.generated))

    busy = _run(eng, others[:4] + [prompt] + others[4:], kinds[:4] + [p] + kinds[4:], [0, 0, 1, 1, 2, 2, 3, 5, 6],
                between=preempt_it)
    assert preempted and preempted[0] < p.max_tokens, "the sampled request was not preempted mid-way"
    assert busy[4].generated == alone
    for i in (0, 2, 4, 6):  # the greedy neighbours (busy[4] is the sampled request)
        assert busy[i if i < 4 else i + 1].generated == expected[i], i
    other_seed = eng.submit(prompt, RequestParams(max_tokens=18, temperature=0.8, top_k=20, top_p=0.9, seed=99,
                                                  stop_ids=()))
    eng.run_until_done()
    assert other_seed.generated != alone  # the stream really depends on the seed
    _assert_all_free(eng)


def test_cancel_and_no_leak_with_speculation(engine_for, reference):
    prompts, params, _, expected = reference
    eng = engine_for(2)
    handles = [eng.submit(prompts[i], params[i]) for i in range(10)]
    eng.cancel(handles[9])  # still queued
    for _ in range(4):
        eng.step()
    running = [h for h in handles[:9] if not h.finished and h._req.state == DECODE]
    assert running
    eng.cancel(running[0])
    eng.run_until_done()
    for i, h in enumerate(handles):
        if h in (handles[9], running[0]):
            assert h.finish_reason == "cancelled"
        else:
            assert h.generated == expected[i], i
    _assert_all_free(eng)


def test_no_compiles_after_warmup_with_speculation(engine_for, tiny_cfg):
    """25 random requests (lengths 1..76, greedy and sampled, random stops and max_tokens up to the
    limit) on the K=2 engine compile nothing."""
    eng = engine_for(2)
    with xla_compiles() as events:
        rng = np.random.default_rng(7)
        before = eng.compiled_shapes()
        for _ in range(25):
            n = int(rng.integers(1, 77))
            eng.submit(rng.integers(0, tiny_cfg.vocab_size, n).tolist(),
                       RequestParams(max_tokens=int(rng.integers(1, MAX_SEQ - n + 1)),
                                     temperature=float(rng.choice([0.0, 0.7])), top_k=int(rng.choice([0, 3])),
                                     top_p=float(rng.choice([1.0, 0.8])), seed=int(rng.integers(0, 2 ** 31)),
                                     stop_ids=(int(rng.integers(0, tiny_cfg.vocab_size)),)))
            if rng.random() < 0.5:
                eng.step()
        eng.run_until_done()
    assert eng.compiled_shapes() == before
    assert events == []
    _assert_all_free(eng)


def test_speculative_argument_checks(model, tiny_cfg, tiny_params):
    kw = dict(max_slots=2, page_size=8, num_pages=10)
    for bad in (-1, MAX_SPECULATIVE + 1, True, 1.0, "2"):
        with pytest.raises(ValueError, match=r"Engine speculative must be an int in \[0, 3\]"):
            Engine(model, speculative=bad, **kw)
    with pytest.raises(ValueError, match="speculative > 0 needs with_mtp=True"):
        Engine(model, speculative=1, with_mtp=False, **kw)
    no_mtp = load_from_dict(tiny_cfg, tiny_params, with_mtp=False)
    with pytest.raises(ValueError, match="speculative > 0 needs the MTP layer"):
        Engine(no_mtp, speculative=2, **kw)
    eng = Engine(model, speculative=2, **kw)
    assert "speculative decode (K=2: [R, 3] verify) for R in [1, 2]" in eng.describe()
    # what the verify program does not do is refused by field name, and nothing is queued
    for field, value in (("presence_penalty", 0.5), ("frequency_penalty", -0.5), ("repetition_penalty", 1.2)):
        with pytest.raises(ValueError, match=f"RequestParams.{field}.*not supported with speculative"):
            eng.submit([1, 2, 3], RequestParams(max_tokens=2, **{field: value}))
    assert not eng.sched.queue
    st = eng.stats()
    assert (st["spec_steps"], st["spec_accepted_tokens"], st["spec_acceptance_length"]) == (0, 0, 0.0)  # no verify yet


def test_scheduler_speculative_pages_and_recompute_feed(tiny_cfg):
    """Host policy alone: a decoding request gets pages for 1 + drafts tokens, drafts cut by the
    remaining max_tokens; a preempted request is recomputed without its last token (pending)."""
    sizes = plan_pools(tiny_cfg, jnp.float32, max_slots=2, page_size=4, num_pages=6, max_seq_len=24)
    sch = Scheduler(PageAllocator(sizes), 2, prefill_chunk=8, prefill_rows=1, speculative=3)
    a = Request(0, [1, 2, 3], RequestParams(max_tokens=6), frozenset())
    sch.queue.append(a)
    plan = sch.schedule()
    assert plan.prefill == [(a, 3)] and sch.feed_of(a) == [1, 2, 3]
    a.n_fed, a.state, a.generated = 3, DECODE, [7]
    assert sch.drafts_for(a) == 3
    plan = sch.schedule()
    assert plan.decode == [a] and len(sch.alloc.pages[a.slot]) == 2  # 3 fed + 1 pending + 3 drafts = 7
    a.n_fed, a.generated = 6, [7, 8, 9, 10]
    assert sch.drafts_for(a) == 1  # 2 tokens left: 1 draft + the token after it
    a.generated = [7, 8, 9, 10, 11]
    assert sch.drafts_for(a) == 0
    sch.preempt(a)
    plan = sch.schedule()
    assert a.state == PREFILL and a.feed == [1, 2, 3, 7, 8, 9, 10] and sch.holds_pending(a)
    plain = Scheduler(PageAllocator(sizes), 2, prefill_chunk=8, prefill_rows=1)
    assert plain.feed_of(a) == [1, 2, 3, 7, 8, 9, 10, 11] and plain.drafts_for(a) == 0
