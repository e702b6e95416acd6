"""The serving engine: continuous batching equals `generate` request by request, preemption,
seeded streams independent of the batch, no leaks after cancellations, no compiles after warm-up."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import mla_layer_pages, rel_err, xla_compiles
from ling_jax.config import KDA
from ling_jax.generate import generate, prefill
from ling_jax.mla import paged_gather
from ling_jax.model import init_cache, layer_cache
from ling_jax.sampling import SamplingParams
from ling_jax.serve import Engine, RequestParams

PAGE, MAX_SEQ, MAX_NEW = 8, 96, 20


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = Engine(tiny_model, max_slots=4, page_size=PAGE, num_pages=48, prefill_chunk=32, prefill_rows=2,
                 max_seq_len=MAX_SEQ, prefill_row_buckets=(1, 2))
    with xla_compiles() as events:
        eng.warmup()
    assert eng.runner.decode_rows == (1, 2, 4)  # row buckets: a step with 1 or 2 decoding slots runs 1 or 2 rows
    assert eng.runner.prefill_row_buckets == (1, 2)  # and a chunk of one prompt a 1-row prefill
    run = eng.runner
    n = (len(run.decode_rows) + len(run.prefill_row_buckets) * len(run.buckets)) * len(run.widths)
    # every step shape ((3 decode row buckets + 2 prefill row buckets x 3 token buckets) x 1 width) compiled at warm-up
    assert len(events) >= n == (3 + 2 * 3) * 1
    # dispatch signatures per shape: at most the first-call placement and the steady state (the second
    # round of warm-up records the latter and compiles nothing, see Engine.warmup)
    assert n <= eng.compiled_shapes() <= 2 * n
    # and its device work is done when it returns (dispatch is asynchronous: otherwise the first real
    # step pays for the warm-up's queued executions, 3.6-5.6 s on the mid config)
    assert all(x.is_ready() for x in jax.tree.leaves(run.pools))
    return eng


def _workload(seed, n, vocab):
    """n requests: prompts of 1 .. 60 tokens (up to 8 pages), max_tokens 1 .. 20, arrival steps."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 61, n)
    lens[:3] = (1, 8, 60)  # one token, exactly one page, several pages with a partial last one
    prompts = [rng.integers(0, vocab, int(m)).tolist() for m in lens]
    max_tokens = rng.integers(1, MAX_NEW + 1, n).tolist()
    arrivals = np.sort(rng.integers(0, 40, n)).tolist()
    return prompts, max_tokens, arrivals


def _run(eng, prompts, params, arrivals):
    """Submit request i at engine step arrivals[i]; run to the end; collect streamed tokens too."""
    handles, streamed, step = [None] * len(prompts), {}, 0
    while step <= max(arrivals) or eng.has_work():
        for i, a in enumerate(arrivals):
            if a == step:
                handles[i] = eng.submit(prompts[i], params[i])
        for h, toks in eng.step().items():
            streamed.setdefault(h.id, []).extend(toks)
        step += 1
    for h in handles:
        assert h.finished and streamed.get(h.id, []) == h.generated
    return handles


def _truncate(tokens, max_tokens, stop):
    out = []
    for t in tokens[:max_tokens]:
        out.append(t)
        if t in stop:
            break
    return out


@pytest.fixture(scope="module")
def reference(tiny_model, tiny_cfg):
    """generate() without stops for the whole workload in one batch (batch = alone is checked in
    test_generate); each request's expected tokens are these truncated at its own limit / stop."""
    prompts, max_tokens, arrivals = _workload(0, 32, tiny_cfg.vocab_size)
    full = generate(tiny_model, prompts, MAX_NEW, stop_ids=()).tokens
    rng = np.random.default_rng(1)  # stop ids: a token the request would emit, for every third request
    stops = [(int(full[i][rng.integers(0, len(full[i]))]),) if i % 3 == 0 else () for i in range(len(prompts))]
    expected = [_truncate(full[i], max_tokens[i], stops[i]) for i in range(len(prompts))]
    params = [RequestParams(max_tokens=max_tokens[i], stop_ids=stops[i]) for i in range(len(prompts))]
    return prompts, params, arrivals, expected, full


def test_random_requests_equal_generate_alone(engine, tiny_model, reference):
    """Every request's tokens equal `generate` on its prompt alone, whatever ran beside it; each
    decode step ran the fewest rows (row bucket) that hold its decoding slots, gathered (1, 2 rows)
    and in place (all 4)."""
    prompts, params, arrivals, expected, full = reference
    calls, program = [], engine.runner.decode_fn

    def spy(params_, pools, inp):  # (rows of the call, slots decoding in it)
        calls.append((inp.ids.shape[0], int((np.asarray(inp.n_valid) > 0).sum())))
        return program(params_, pools, inp)

    engine.runner.decode_fn = spy
    try:
        handles = _run(engine, prompts, params, arrivals)
    finally:
        engine.runner.decode_fn = program
    assert all(r == next(n for n in engine.runner.decode_rows if n >= k) for r, k in calls), calls
    assert {r for r, _ in calls} == {1, 2, 4}
    for i, h in enumerate(handles):
        assert h.generated == expected[i], i
        reason = "stop" if h.generated[-1] in params[i].stop_ids else "length"
        assert h.finish_reason == reason
    assert sum(h.finish_reason == "stop" and len(h.generated) < params[i].max_tokens
               for i, h in enumerate(handles)) >= 3  # some stop ids fired before the limit
    alone = generate(tiny_model, [prompts[2]], params[2].max_tokens, stop_ids=params[2].stop_ids).tokens[0]
    assert alone == handles[2].generated
    st = engine.stats()
    assert st["slots_in_use"] == st["pages_in_use"] == st["queue_depth"] == 0
    assert st["preemptions"] == 0


def test_preemption_under_tiny_pool_gives_same_tokens(tiny_model, reference):
    prompts, params, arrivals, expected, _ = reference
    # 10 pages x 8 = 80 tokens for 4 slots: requests of up to 80 tokens run, but not side by side
    eng = Engine(tiny_model, max_slots=4, page_size=PAGE, num_pages=10, prefill_chunk=16, prefill_rows=2,
                 max_seq_len=80, buckets=(16,), widths=(4, 10))
    handles = _run(eng, prompts, params, arrivals)
    assert [h.generated for h in handles] == expected
    assert 2 <= eng.runner.decode_fn._cache_size() <= len(eng.runner.decode_rows) * 2  # row buckets x the 2 widths
    st = eng.stats()
    assert st["preemptions"] >= 3, st
    assert st["slots_in_use"] == st["pages_in_use"] == st["queue_depth"] == 0
    assert sorted(eng.alloc.free) == list(range(10))


def test_seeded_request_same_alone_and_in_busy_batch(engine, tiny_cfg, tiny_model):
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, tiny_cfg.vocab_size, 21).tolist()
    p = RequestParams(max_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=1234, stop_ids=())
    h = engine.submit(prompt, p)
    engine.run_until_done()
    alone = h.generated
    others = [rng.integers(0, tiny_cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 50, 9)]
    kinds = [RequestParams(max_tokens=int(m), temperature=float(t), top_k=int(k), seed=int(s), stop_ids=())
             for m, t, k, s in zip(rng.integers(1, 20, 9), rng.choice([0.0, 0.8, 1.5], 9),
                                   rng.choice([0, 5], 9), rng.integers(0, 100, 9))]
    busy = _run(engine, others[:5] + [prompt] + others[5:], kinds[:5] + [p] + kinds[5:],
                [0, 0, 0, 1, 2, 3, 3, 4, 6, 9])
    assert busy[5].generated == alone
    other_seed = engine.submit(prompt, RequestParams(max_tokens=16, temperature=1.0, top_k=20, top_p=0.9,
                                                     seed=99, stop_ids=()))
    engine.run_until_done()
    assert other_seed.generated != alone  # the stream really depends on the seed
    # one row-sampling API: `generate`'s row b with seed s draws as an engine request with seed s + b
    sp = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=1233)
    assert generate(tiny_model, [others[0], prompt], 16, sampling=sp, stop_ids=()).tokens[1] == alone


def test_cancel_and_no_leak(engine, reference):
    prompts, params, _, expected, _ = reference
    handles = [engine.submit(prompts[i], params[i]) for i in range(12)]
    engine.cancel(handles[11])  # still queued
    for _ in range(3):
        engine.step()
    running = [h for h in handles[:11] if not h.finished and h._req.slot is not None]
    assert running
    engine.cancel(running[0])
    engine.cancel(running[0])  # twice is harmless
    engine.run_until_done()
    for i, h in enumerate(handles):
        if h in (handles[11], running[0]):
            assert h.finish_reason == "cancelled"
        else:
            assert h.generated == expected[i], i
    assert handles[11].generated == []
    st = engine.stats()
    assert st["slots_in_use"] == st["pages_in_use"] == st["queue_depth"] == 0
    assert sorted(engine.alloc.free) == list(range(engine.sizes.num_pages))
    assert not engine.alloc.pages and all(s is None for s in engine.sched.slots)


def test_no_compiles_after_warmup(engine, tiny_cfg):
    """50 random requests (lengths 1..76, greedy and sampled, with and without penalties and
    logprobs, random stops) compile nothing."""
    with xla_compiles() as events:
        rng = np.random.default_rng(7)
        before = engine.compiled_shapes()
        for _ in range(50):
            n = int(rng.integers(1, 77))
            engine.submit(rng.integers(0, tiny_cfg.vocab_size, n).tolist(),
                          RequestParams(max_tokens=int(rng.integers(1, MAX_SEQ - n + 1)),
                                        temperature=float(rng.choice([0.0, 0.7])), top_k=int(rng.choice([0, 3])),
                                        top_p=float(rng.choice([1.0, 0.8])), seed=int(rng.integers(0, 2 ** 31)),
                                        stop_ids=(int(rng.integers(0, tiny_cfg.vocab_size)),),
                                        presence_penalty=float(rng.choice([0.0, 0.5])),
                                        frequency_penalty=float(rng.choice([0.0, -0.3])),
                                        repetition_penalty=float(rng.choice([1.0, 1.2])),
                                        logprobs=(None, 0, 5)[int(rng.integers(3))]))
            if rng.random() < 0.5:
                engine.step()
        engine.run_until_done()
    assert engine.compiled_shapes() == before  # no new program or signature after warm-up
    assert events == []  # and no XLA compilation at all


def test_engine_pages_equal_contiguous_prefill(engine, tiny_model, tiny_cfg):
    """A running request's main-MLA and MTP pages equal the contiguous caches `generate.prefill`
    (fresh, with MTP) builds over the same tokens: prompt fed in 2 chunks (32 + 13), then decode steps."""
    cfg = tiny_cfg
    prompt = np.random.default_rng(11).integers(0, cfg.vocab_size, 45).tolist()
    h = engine.submit(prompt, RequestParams(max_tokens=30, stop_ids=()))
    while len(h.generated) < 6:
        engine.step()
    req = h._req
    fed = (prompt + h.generated)[:req.n_fed]
    assert req.n_fed == 45 + 5
    bt = jnp.asarray(engine.alloc.block_rows([req.slot]))
    graphdef, params = nnx.split(tiny_model)
    cache = init_cache(cfg, 1, 64, jnp.float32, with_mtp=True)
    cache, _, _, _ = prefill(graphdef, params, cache, jnp.asarray([fed], jnp.int32),
                             jnp.asarray([len(fed)], jnp.int32), jnp.zeros((1, cfg.hidden_size)),
                             sampling=SamplingParams(), with_mtp=True)
    n = len(fed)
    checked = 0
    for layer, c_pages, kpe_pages in mla_layer_pages(engine.runner.pools, cfg):
        ref = layer_cache(cache, cfg, layer)
        # not bit-equal: the engine fed 32 + 13 chunked, then 5 recurrent decode steps
        assert rel_err(paged_gather(c_pages, bt)[0, :n], ref.c[0, :n]) < 1e-5
        assert rel_err(paged_gather(kpe_pages, bt)[0, :n], ref.k_pe[0, :n]) < 1e-5
        checked += 1
    assert checked == sum(t != KDA for t in cfg.layer_types)
    m = n - 1  # MTP slot t pairs token t+1 with hidden t: n fed tokens complete n-1 slots
    assert rel_err(paged_gather(engine.runner.pools.mtp.c_pages, bt)[0, :m], cache.mtp.c[0, :m]) < 1e-5
    assert rel_err(paged_gather(engine.runner.pools.mtp.kpe_pages, bt)[0, :m], cache.mtp.k_pe[0, :m]) < 1e-5
    engine.cancel(h)
    assert engine.stats()["pages_in_use"] == 0


def test_engine_bad_input(engine, tiny_model, tiny_cfg):
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.submit([], RequestParams())
    with pytest.raises(ValueError, match=r"token id 97 is outside the vocabulary \[0, 97\)"):
        engine.submit([1, 97], RequestParams())
    with pytest.raises(ValueError, match="exceeds the engine's max_seq_len=96"):
        engine.submit([1] * 90, RequestParams(max_tokens=7))
    with pytest.raises(TypeError, match="params must be a RequestParams"):
        engine.submit([1], {"max_tokens": 3})
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        RequestParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        RequestParams(top_p=0.0)
    with pytest.raises(ValueError, match="needs num_pages or cache_memory_gib"):
        Engine(tiny_model, max_slots=2)
    with pytest.raises(ValueError, match="max_seq_len=200 exceeds the pool"):
        Engine(tiny_model, max_slots=2, page_size=8, num_pages=10, max_seq_len=200)
    assert "pages: 48 x 8 tokens x 5 MLA layers (incl. MTP)" in engine.describe()
    with pytest.raises(ValueError, match="must be positive and end at max_blocks=10"):
        Engine(tiny_model, max_slots=2, page_size=8, num_pages=10, widths=(4, 8))


def test_handle_tokens_iterates_while_the_engine_steps(engine, reference):
    prompts, params, _, expected, _ = reference
    seen = []
    h1 = engine.submit(prompts[3], params[3])
    h2 = engine.submit(prompts[4], params[4], on_tokens=lambda h, t: seen.append((h.id, list(t), h.finished)))
    assert list(h1.tokens()) == expected[3] and h1.finished
    assert list(h2.tokens()) == expected[4] and h2.finished  # h2 advanced while h1 was iterated
    assert [t for _, ts, _ in seen for t in ts] == expected[4] and {i for i, _, _ in seen} == {h2.id}
    assert [f for _, _, f in seen] == [False] * (len(seen) - 1) + [True]
    assert engine.stats()["slots_in_use"] == 0


def test_unrolled_layer_loop_gives_the_same_tokens(tiny_model, reference):
    prompts, params, _, expected, _ = reference
    unrolled = nnx.clone(tiny_model).set_layer_loop("unroll")  # each layer stored (and run) on its own
    eng = Engine(unrolled, max_slots=2, page_size=PAGE, num_pages=24, prefill_chunk=16, max_seq_len=80,
                 buckets=(16,))
    picks = [0, 1, 2, 5]
    handles = [eng.submit(prompts[i], params[i]) for i in picks]
    eng.run_until_done()
    assert [h.generated for h in handles] == [expected[i] for i in picks]


def test_prefill_rows_never_exceed_the_slots(tiny_model, reference):
    """A 1-slot engine prefills [1, T], not [2, T] with an idle row (which doubled a long prompt's
    prefill through `ling-jax serve --max-slots 1`), and gives the same tokens."""
    prompts, params, _, expected, _ = reference
    eng = Engine(tiny_model, max_slots=1, page_size=PAGE, num_pages=12, prefill_chunk=16, prefill_rows=2,
                 max_seq_len=80, buckets=(16,))
    assert eng.runner.prefill_rows == eng.sched.prefill_rows == 1
    assert all(args[2].ids.shape[0] == 1 for name, _, args in eng.runner.program_calls() if name.startswith("prefill"))
    h = eng.submit(prompts[2], params[2])
    eng.run_until_done()
    assert h.generated == expected[2]


def test_prefill_runs_the_fewest_rows_that_hold_its_prompts(engine, reference):
    """A chunk of one prompt runs the [1, T] program, of two the [2, T] one (a prefill program
    computes its idle rows: BENCHMARKS.md, "Prefill programs per row count"), with the tokens of
    each request alone; and no step compiles anything after warm-up."""
    prompts, params, _, expected, _ = reference
    run, shapes = engine.runner, []
    before = engine.compiled_shapes()
    real = run._run_prefill

    def spy(inp):
        shapes.append((inp.ids.shape[0], int((inp.n_valid > 0).sum())))
        return real(inp)
    run._run_prefill = spy
    try:
        alone = engine.submit(prompts[2], params[2])  # 60 tokens: two chunks of 32, alone
        engine.run_until_done()
        pair = [engine.submit(prompts[i], params[i]) for i in (3, 4)]  # fed side by side
        engine.run_until_done()
    finally:
        run._run_prefill = real
    assert alone.generated == expected[2] and [h.generated for h in pair] == [expected[3], expected[4]]
    assert shapes[:2] == [(1, 1), (1, 1)], shapes
    assert (2, 2) in shapes[2:] and all(rows == max(1, used) for rows, used in shapes), shapes
    assert engine.compiled_shapes() == before


# --------------------------------------------------------------------------- penalties and logprobs

PEN_A = dict(presence_penalty=0.4, frequency_penalty=0.6, repetition_penalty=1.4)
PEN_B = dict(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=0.8)
# (penalties, logprobs) per request kind: neutral / A with top 3 / B without logprobs / neutral with top 5
KINDS = (({}, None), (PEN_A, 3), (PEN_B, None), ({}, 5))


def _check_token_stats(eng):
    """Every running slot's device statistics are exactly those of the tokens it has fed: counts of
    the generated ones, the seen-mask of the prompt ones (nothing of a previous owner; a slot whose
    new request has fed nothing yet is cleared by its first chunk)."""
    stats = jax.device_get(eng.runner.pools.stats)
    V = stats.gen_counts.shape[1]
    checked = 0
    for r in eng.sched.running():
        if r.n_fed == 0:
            continue
        fed = (r.prompt + r.generated)[:r.n_fed]
        np.testing.assert_array_equal(stats.gen_counts[r.slot], np.bincount(fed[len(r.prompt):], minlength=V))
        np.testing.assert_array_equal(stats.prompt_seen[r.slot], np.bincount(fed[:len(r.prompt)], minlength=V) > 0)
        checked += 1
    return checked


@pytest.fixture(scope="module")
def penalty_workload(tiny_model, tiny_cfg):
    """10 greedy requests of the four KINDS, arrival steps, and what `generate` gives each alone
    (one batched call per penalty setting, truncated per request; batch = alone is checked in
    test_generate)."""
    rng = np.random.default_rng(3)
    n = 10
    prompts = [rng.integers(0, tiny_cfg.vocab_size, int(m)).tolist() for m in rng.integers(1, 61, n)]
    prompts[1] = [7, 7, 7, 9, 7]  # a prompt with repeats under PEN_A
    max_tokens = rng.integers(4, MAX_NEW + 1, n).tolist()
    arrivals = np.sort(rng.integers(0, 10, n)).tolist()
    kinds = [KINDS[i % len(KINDS)] for i in range(n)]
    params = [RequestParams(max_tokens=max_tokens[i], stop_ids=(), logprobs=kinds[i][1], **kinds[i][0])
              for i in range(n)]
    expected = {}
    for pen in ({}, PEN_A, PEN_B):
        idx = [i for i in range(n) if kinds[i][0] == pen]
        ref = generate(tiny_model, [prompts[i] for i in idx], MAX_NEW, sampling=SamplingParams(**pen), stop_ids=(),
                       logprobs=5)
        for j, i in enumerate(idx):
            expected[i] = (ref.tokens[j][:max_tokens[i]], ref.logprobs[j][:max_tokens[i]])
    return prompts, params, arrivals, [expected[i] for i in range(n)]


def _run_checking_stats(eng, prompts, params, arrivals):
    handles, step, checked = [None] * len(prompts), 0, 0
    while step <= max(arrivals) or eng.has_work():
        for i, a in enumerate(arrivals):
            if a == step:
                handles[i] = eng.submit(prompts[i], params[i])
        eng.step()
        checked += _check_token_stats(eng)
        step += 1
    assert checked >= 20
    return handles


def _assert_equal_generate(handles, params, expected):
    for i, (toks, lps) in enumerate(expected):
        got, want_n = handles[i], params[i].logprobs
        assert got.generated == toks, i
        assert len(got.logprobs) == len(got.generated)
        if want_n is None:
            assert got.logprobs == [None] * len(toks)
            continue
        for g, w in zip(got.logprobs, lps):
            assert abs(g.logprob - w.logprob) < 1e-4 and len(g.top) == want_n
            assert [j for j, _ in g.top] == [j for j, _ in w.top[:want_n]], i
            np.testing.assert_allclose([v for _, v in g.top], [v for _, v in w.top[:want_n]], atol=1e-4)


def test_penalties_and_logprobs_mixed_batch_equal_generate(engine, penalty_workload):
    """Greedy requests with and without penalties and logprobs in one busy batch: each equals
    `generate` alone with the same parameters, token for token (logprobs within 1e-4, the same top
    ids); the slots' token statistics are checked after every step."""
    prompts, params, arrivals, expected = penalty_workload
    _assert_equal_generate(_run_checking_stats(engine, prompts, params, arrivals), params, expected)
    with pytest.raises(ValueError, match="RequestParams.presence_penalty must be a number in"):
        RequestParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match="RequestParams.repetition_penalty must be a finite number > 0"):
        RequestParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match=r"RequestParams.logprobs must be None \(off\) or an int in \[0, 20\]"):
        RequestParams(logprobs=21)


def test_penalties_exact_under_preemption(engine, tiny_model, penalty_workload):
    """The same workload under a pool small enough to preempt (recompute rebuilds the statistics
    from prompt + generated tokens), plus a seeded sampled request with penalties: the same tokens
    as `generate` alone, and the sampled one as alone on the big pool."""
    prompts, params, arrivals, expected = penalty_workload
    sampled = RequestParams(max_tokens=MAX_NEW, temperature=1.0, top_p=0.95, seed=77, stop_ids=(), **PEN_A)
    h = engine.submit(prompts[0], sampled)
    engine.run_until_done()
    eng = Engine(tiny_model, max_slots=4, page_size=PAGE, num_pages=10, prefill_chunk=16, prefill_rows=2,
                 max_seq_len=80, buckets=(16,), widths=(4, 10), decode_rows=(4,))  # one row bucket: fewer compiles
    handles = _run_checking_stats(eng, prompts + [prompts[0]], params + [sampled], arrivals + [2])
    assert eng.stats()["preemptions"] >= 2
    assert any(h._req.preemptions for h in handles) and any(not h._req.preemptions for h in handles)
    _assert_equal_generate(handles, params, expected)
    assert handles[-1].generated == h.generated


def test_prefill_row_buckets_default_and_refusal(tiny_model):
    """Default: one prefill row count (prefill_rows; BENCHMARKS.md "Prefill programs per row count"
    says why); row buckets that do not end at prefill_rows are refused by name."""
    eng = Engine(tiny_model, max_slots=4, page_size=PAGE, num_pages=16, prefill_chunk=16, prefill_rows=2)
    assert eng.runner.prefill_row_buckets == (2,)
    assert all(args[2].ids.shape[0] == 2 for name, _, args in eng.program_calls() if name.startswith("prefill"))
    msg = r"prefill_row_buckets \(1, 4\) must be positive ints ending at prefill_rows=2"
    with pytest.raises(ValueError, match=msg):
        Engine(tiny_model, max_slots=4, page_size=PAGE, num_pages=16, prefill_chunk=16, prefill_rows=2,
               prefill_row_buckets=(1, 4))


def test_token_rows_pool_layout_gives_the_same_tokens(tiny_model, reference):
    """`ExecConfig.pool_layout="token_rows"` (the TPU default): the k_pe page pools are allocated
    row-major and every program (prefill, decode, snapshot save / restore) is pinned to that layout.
    On CPU row-major is the default, so this checks the plumbing: the k_pe pools carry `Format`s,
    the tokens equal `generate` alone, a prefix-cache hit restores into the pinned pools, and nothing
    compiles after warm-up; the KDA conv windows are kept as taps [.., slots, H·dk] (`kda.conv_taps`)
    through prefill, decode, the snapshots inside chunks and their restore. (That it removes the
    relayouts on TPU: tests/test_aot.py.)"""
    from jax.experimental.layout import Format
    from sharding.rules import path_str

    prompts, params, _, expected, _ = reference
    ex = tiny_model.exec.replace(pool_layout="token_rows")
    eng = Engine(tiny_model, exec=ex, max_slots=2, page_size=PAGE, num_pages=24, prefill_chunk=16, max_seq_len=80,
                 buckets=(16,), snapshot_interval=16)
    kpe = [path_str(p).endswith("kpe_pages") for p, _ in jax.tree_util.tree_leaves_with_path(eng.runner.pools)]
    assert any(kpe) and [isinstance(f, Format) for f in jax.tree.leaves(eng.runner.pool_sharding)] == kpe
    for x, f in zip(jax.tree.leaves(eng.runner.pools), jax.tree.leaves(eng.runner.pool_sharding)):
        if isinstance(f, Format):
            assert x.format.layout.major_to_minor == tuple(range(x.ndim))
    for tree in (eng.runner.pools, eng.runner.snapshots.snaps):  # the snapshot rows as the slots
        convs = [x for p, x in jax.tree_util.tree_leaves_with_path(tree) if "/conv_" in path_str(p)]
        assert convs and all(x.ndim == 4 for x in convs)  # [repeats, n, rows, H·dk]
    eng.warmup()
    picks = [0, 1, 2, 5]
    with xla_compiles() as events:
        handles = [eng.submit(prompts[i], params[i]) for i in picks]
        eng.run_until_done()
        again = eng.submit(prompts[2], params[2])  # its snapshots were saved: a hit, restored into the pools
        eng.run_until_done()
    assert [h.generated for h in handles] == [expected[i] for i in picks]
    assert again.generated == expected[2]
    assert eng.stats()["prefix_hits"] >= 1, eng.stats()
    assert not events, events


def test_prefill_row_tokens_caps_a_lone_prompt_and_keeps_the_tokens(tiny_model, reference):
    """`prefill_row_tokens`: a step feeds one prompt at most that many tokens (the prefill programs are
    compiled up to it, not up to prefill_chunk) while a backlog fills prefill_rows rows of them; the
    tokens still equal `generate` alone, for a prompt fed alone and for several fed side by side."""
    prompts, params, _, expected, _ = reference
    eng = Engine(tiny_model, max_slots=4, page_size=PAGE, num_pages=48, prefill_chunk=32, prefill_rows=4,
                 prefill_row_buckets=(1, 4), prefill_row_tokens=8, max_seq_len=MAX_SEQ, prefix_cache=False)
    assert eng.runner.buckets == (8,) and eng.sched.prefill_row_tokens == 8
    shapes = []
    fn = eng.runner._run_prefill

    def spy(inp):
        shapes.append(inp.ids.shape)
        return fn(inp)
    eng.runner._run_prefill = spy
    long_one = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    h = eng.submit(prompts[long_one], params[long_one])
    eng.run_until_done()
    assert h.generated == expected[long_one]
    assert len(prompts[long_one]) > 8 and set(shapes) == {(1, 8)}, shapes  # fed alone: [1, 8] chunks
    shapes.clear()
    picks = [0, 1, 2, 5, 7]
    handles = [eng.submit(prompts[i], params[i]) for i in picks]
    eng.run_until_done()
    assert [x.generated for x in handles] == [expected[i] for i in picks]
    assert (4, 8) in shapes and all(T == 8 for _, T in shapes), shapes  # a backlog: four rows of 8
