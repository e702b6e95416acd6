"""Tests for ling_jax.sampling: logit processing, sampling and speculative accept/reject.

The one sampling API is by rows (`processed_logits_rows`, `sample_rows`, `RowSampling`); one
`SamplingParams` is a broadcast row. The masks are checked against a float64 NumPy reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.sampling import (
    RowSampling,
    SamplingParams,
    processed_logits_rows,
    sample_rows,
    speculative_accept,
    speculative_accept_greedy,
)


def _softmax64(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _random_dist(rng, v, zeros=0):
    """A random distribution over v tokens with `zeros` entries exactly zero."""
    p = rng.gamma(1.0, size=v)
    if zeros:
        p[rng.choice(v, zeros, replace=False)] = 0.0
    return (p / p.sum()).astype(np.float32)


def _broadcast_processed(x, params: SamplingParams):
    """`processed_logits_rows` with one SamplingParams as every row (`RowSampling.broadcast`)."""
    rs = RowSampling.broadcast(params, x.shape[0])
    return processed_logits_rows(x, rs.temperature, rs.top_k, rs.top_p)


def _masked_rows(x, k, p):
    """Temperature 1, top_k k (traced: one compile for every k), top_p p, on every row."""
    B = x.shape[0]
    return processed_logits_rows(x, jnp.ones((B,)), jnp.full((B,), k, jnp.int32), jnp.full((B,), p, jnp.float32))


# Jitted once at module level (params are static, k / p traced); jitting also checks traceability:
# no Python control flow on traced values anywhere in the sampling code.
_processed = jax.jit(_broadcast_processed, static_argnums=1)
_masked = jax.jit(_masked_rows)
_probs = jax.jit(lambda x, params: RowSampling.broadcast(params, x.shape[0]).probs(x), static_argnums=1)
_spec = jax.jit(speculative_accept)


def _processed_np(x, temperature, k, p):
    """Independent float64 reference of temperature -> top-k -> top-p on every row of x [B, V]:
    (keep mask [B, V], scaled logits, ambiguous-row flags: a cumulative mass within 1e-5 of p,
    where float32 rounding may decide either way)."""
    x = np.asarray(x, np.float64) / temperature
    B, V = x.shape
    k = V if k <= 0 or k >= V else k
    keep = np.zeros(x.shape, bool)
    ambiguous = np.zeros(B, bool)
    for b in range(B):
        order = np.argsort(-x[b], kind="stable")[:k]
        cum = np.cumsum(_softmax64(x[b, order]))
        n = len(order) if p >= 1.0 else int(np.argmax(cum >= p)) + 1 if (cum >= p).any() else len(order)
        keep[b, order[:n]] = True
        ambiguous[b] = p < 1.0 and np.min(np.abs(cum - p)) < 1e-5
    return keep, x, ambiguous


# --------------------------------------------------------------------------- params


def test_params_hashable_and_greedy():
    a = SamplingParams()
    assert a.greedy and hash(a) == hash(SamplingParams())
    b = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3)
    assert not b.greedy
    assert {a, b} == {SamplingParams(), SamplingParams(0.7, 5, 0.9, 3)}
    for bad in (dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_params_as_static_jit_arg():
    x = jnp.array([[1.0, 2.0, 3.0, 0.5]])
    out = _processed(x, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_array_equal(np.isfinite(np.asarray(out)), [[False, True, True, False]])


# --------------------------------------------------------------------------- top-k / top-p


# One shared [16, 50] logits array, so the jitted helpers compile once.
_LOGITS = (np.random.default_rng(0).normal(size=(16, 50)) * 2.0).astype(np.float32)


def test_top_k_keeps_exactly_k():
    x = _LOGITS
    for k in (1, 10, 49):
        out = np.asarray(_masked(jnp.asarray(x), k, 1.0))
        assert (np.isfinite(out).sum(-1) == k).all()
        for b in range(x.shape[0]):
            kept = np.flatnonzero(np.isfinite(out[b]))
            np.testing.assert_array_equal(np.sort(kept), np.sort(np.argsort(-x[b])[:k]))
            np.testing.assert_array_equal(out[b, kept], x[b, kept])


def test_top_k_ties_keep_exactly_k_lowest_ids():
    x = jnp.array([[0.0, 1.0, 1.0, 1.0, 1.0, -1.0]])
    out = np.asarray(_masked(x, 2, 1.0))
    np.testing.assert_array_equal(np.isfinite(out)[0], [False, True, True, False, False, False])


def test_top_k_off():
    x = jnp.array([[0.3, -1.0, 2.0]])
    for k in (0, 3, 7):
        np.testing.assert_array_equal(np.asarray(_masked(x, k, 1.0)), np.asarray(x))


def test_top_p_matches_brute_force():
    x = _LOGITS
    pr = _softmax64(x)
    for p in (1e-6, 0.05, 0.3, 0.5, 0.8, 0.95, 0.999):
        out = np.asarray(_masked(jnp.asarray(x), 0, p))
        keep, _, ambiguous = _processed_np(x, 1.0, 0, p)
        assert ambiguous.sum() <= 2
        got = np.isfinite(out)
        np.testing.assert_array_equal(got[~ambiguous], keep[~ambiguous], err_msg=f"p={p}")
        np.testing.assert_array_equal(out[got], x[got])
        # the kept set reaches p and is minimal
        for b in np.flatnonzero(~ambiguous):
            mass = pr[b][got[b]].sum()
            assert mass >= p - 1e-6
            assert mass - pr[b][got[b]].min() < p


def test_top_p_one_is_no_op_and_top_token_always_kept():
    x = jnp.asarray(_LOGITS)
    np.testing.assert_array_equal(np.asarray(_masked(x, 0, 1.0)), _LOGITS)
    # a tiny p keeps only the top token; with ties that is the lowest id
    tied = np.zeros_like(_LOGITS)
    tied[:, 7] = tied[:, 9] = 1.0
    out = np.asarray(_masked(jnp.asarray(tied), 0, 1e-6))
    assert (np.flatnonzero(np.isfinite(out).any(0)) == [7]).all()
    assert np.isfinite(out).sum() == tied.shape[0]


def test_temperature_scaling():
    x = jnp.array([[1.0, 2.0, -3.0, 0.5]], jnp.bfloat16)
    out = _processed(x, SamplingParams(temperature=0.5))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(x, np.float32) / 0.5, rtol=1e-6)
    pr_hot = np.asarray(_probs(x, SamplingParams(temperature=2.0)))
    np.testing.assert_allclose(pr_hot, _softmax64(np.asarray(x, np.float32) / 2.0), atol=1e-6)


def test_processed_logits_order_top_k_then_top_p():
    x = _LOGITS
    got = np.asarray(_processed(jnp.asarray(x), SamplingParams(temperature=0.7, top_k=10, top_p=0.6)))
    keep, scaled, ambiguous = _processed_np(x, 0.7, 10, 0.6)
    assert ambiguous.sum() <= 2
    np.testing.assert_array_equal(np.isfinite(got)[~ambiguous], keep[~ambiguous])
    fin = np.isfinite(got)
    np.testing.assert_allclose(got[fin], scaled[fin], rtol=1e-6)
    assert (fin.sum(-1) <= 10).all()
    assert (fin.sum(-1) < 10).any()  # top-p cut inside the top 10 somewhere


def test_greedy_probs_are_one_hot_argmax():
    x = jnp.array([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 1.0, 2.0]])
    pr = np.asarray(_probs(x, SamplingParams()))
    np.testing.assert_array_equal(pr, [[0, 1, 0, 0], [1, 0, 0, 0]])
    ids = RowSampling.broadcast(SamplingParams(), 2).draw(x)
    assert ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), [1, 0])


# --------------------------------------------------------------------------- sampling

_V = 6
_N_DRAWS = 60_000
_X = np.array([0.5, 1.5, -0.3, 1.0, 0.0, 2.0], np.float32)
# temperature, top-k and top-p all active: top-k drops 1 token, top-p at least one more
_SAMPLE_PARAMS = SamplingParams(temperature=1.3, top_k=5, top_p=0.75)


@jax.jit
def _draws_jit(x, key):
    rs = RowSampling.broadcast(_SAMPLE_PARAMS, x.shape[0])
    drawn = sample_rows(x, jax.random.split(key, x.shape[0]), rs.temperature, rs.top_k, rs.top_p)
    return drawn, RowSampling.broadcast(_SAMPLE_PARAMS, 1).probs(x[:1])[0]


def _draws(key, n):
    """n independent draws (one batch row each, its own key) plus the probs."""
    # the logits are an argument, not a constant, so XLA does not constant-fold the sampler
    return _draws_jit(jnp.asarray(np.broadcast_to(_X, (n, _V))), key)


def test_sample_reproducible_and_seed_dependent():
    a, _ = _draws(jax.random.key(7), _N_DRAWS)
    b, _ = _draws(jax.random.key(7), _N_DRAWS)
    c, _ = _draws(jax.random.key(8), _N_DRAWS)
    assert a.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (np.asarray(a) != np.asarray(c)).any()


def test_sample_matches_probs():
    n = _N_DRAWS
    ids, pr = _draws(jax.random.key(42), n)
    ids, expected = np.asarray(ids), np.asarray(pr, np.float64)
    assert ids.shape == (n,)
    assert 2 <= (expected == 0).sum() <= 3  # top-k and top-p both masked something
    scaled = _softmax64(_X / 1.3)
    kept = expected > 0
    np.testing.assert_allclose(expected[kept], scaled[kept] / scaled[kept].sum(), rtol=1e-5)
    counts = np.bincount(ids, minlength=_V)
    assert counts[~kept].sum() == 0
    chi2 = np.sum((counts[kept] - n * expected[kept]) ** 2 / (n * expected[kept]))
    assert chi2 < 30.0, (chi2, counts / n, expected)  # dof <= 3: p < 1e-5
    np.testing.assert_allclose(counts / n, expected, atol=0.01)


# --------------------------------------------------------------------------- speculative


# Every speculative_accept call below uses the same shapes, so `_spec` compiles once.
_SPEC_N, _SPEC_K, _SPEC_V = 200_000, 2, 5


def _spec_np(draft, q, p, seed):
    """Run the jitted accept step on numpy inputs broadcast to the shared shapes."""
    n, k, v = _SPEC_N, _SPEC_K, _SPEC_V
    args = (
        np.broadcast_to(draft, (n, k)).astype(np.int32),
        np.broadcast_to(q, (n, k, v)).astype(np.float32),
        np.broadcast_to(p, (n, k + 1, v)).astype(np.float32),
    )
    nacc, nxt = _spec(*map(jnp.asarray, args), jax.random.key(seed))
    assert nacc.dtype == jnp.int32 and nxt.dtype == jnp.int32
    assert nacc.shape == nxt.shape == (n,)
    return np.asarray(nacc), np.asarray(nxt)


def _simulate(q, p, seed):
    """_SPEC_N independent speculative steps with fixed draft q [k, V] / target p [k+1, V].

    Draft tokens are drawn with numpy (inverse CDF); the accept/reject step is one batched
    call. Returns (num_accepted [n], emitted tokens [n, k+1] padded with -1).
    """
    n, k, v = _SPEC_N, _SPEC_K, _SPEC_V
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(q.astype(np.float64), axis=-1)
    draft = np.stack([np.minimum(np.searchsorted(cdf[i], rng.random(n) * cdf[i, -1],
                                                 side="right"), v - 1) for i in range(k)], 1)
    nacc, nxt = _spec_np(draft, q, p, seed)
    pos = np.arange(k + 1)[None]
    padded = np.concatenate([draft, np.zeros((n, 1), draft.dtype)], axis=1)
    emitted = np.where(pos < nacc[:, None], padded,
                       np.where(pos == nacc[:, None], nxt[:, None], -1))
    return nacc, emitted


def _marginal(tokens, mask, v):
    sel = tokens[mask]
    return np.bincount(sel, minlength=v) / max(len(sel), 1), len(sel)


def test_speculative_accept_preserves_target_distribution():
    n, k, v = _SPEC_N, _SPEC_K, _SPEC_V
    rng = np.random.default_rng(11)
    q = np.stack([_random_dist(rng, v) for _ in range(k)])
    p = np.stack([_random_dist(rng, v, zeros=1) for _ in range(k + 1)])
    # the draft puts mass on a token the target never emits
    q[0, 0] = 0.3
    q[0] /= q[0].sum()
    p[0, 0] = 0.0
    p[0] /= p[0].sum()
    nacc, emitted = _simulate(q, p, seed=1)
    assert nacc.min() >= 0 and nacc.max() <= k
    assert all((nacc == j).sum() > 10_000 for j in range(k + 1))

    # the first emitted token follows target[0] exactly (std of each frequency ~0.001)
    first, _ = _marginal(emitted[:, 0], np.ones(n, bool), v)
    np.testing.assert_allclose(first, p[0], atol=0.006)
    assert first[0] == 0.0
    # the second emitted token (present when position 0 was accepted) follows target[1] ...
    second, cnt = _marginal(emitted[:, 1], nacc >= 1, v)
    assert cnt > 20_000
    np.testing.assert_allclose(second, p[1], atol=0.012)
    # ... and the third (the bonus token when both drafts were accepted) follows target[2]
    third, cnt = _marginal(emitted[:, 2], nacc >= 2, v)
    assert cnt > 10_000
    np.testing.assert_allclose(third, p[2], atol=0.015)
    # the acceptance rate at position 0 is sum_x min(p, q)
    np.testing.assert_allclose((nacc >= 1).mean(), np.minimum(p[0], q[0]).sum(), atol=0.006)


def test_speculative_accept_hand_made():
    n, k, v = _SPEC_N, _SPEC_K, _SPEC_V
    rng = np.random.default_rng(3)
    # identical draft and target distributions: every draft token is accepted
    dist = rng.gamma(1.0, size=(n, k + 1, v))
    dist /= dist.sum(-1, keepdims=True)
    draft = rng.integers(0, v, size=(n, k))
    nacc, _ = _spec_np(draft, dist[:, :k], dist, seed=1)
    assert (nacc == k).all()

    # a draft token the target gives zero probability is always rejected, and the replacement
    # comes from max(0, p - q) normalised: here tokens 0 and 2 only
    q = np.array([[0.0, 1.0, 0.0, 0.0, 0.0], [0.2] * 5])
    p = np.array([[0.5, 0.0, 0.5, 0.0, 0.0], [0.2] * 5, [0.2] * 5])
    nacc, nxt = _spec_np(np.array([1, 3]), q, p, seed=2)
    assert (nacc == 0).all()
    assert set(np.unique(nxt).tolist()) == {0, 2}

    # first draft matches the target exactly, second has zero target mass: n == 1 always,
    # and the replacement at position 1 avoids token 4
    q = np.array([[0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    p = np.array([[0.0, 0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0], [0.2] * 5])
    nacc, nxt = _spec_np(np.array([2, 4]), q, p, seed=3)
    assert (nacc == 1).all()
    assert set(np.unique(nxt).tolist()) == {0, 1, 2, 3}


def test_speculative_accept_greedy_hand_made():
    v = 6
    best = np.array(
        [
            [2, 3, 4],  # both drafts match -> n=2, bonus 4
            [2, 5, 1],  # first matches, second not -> n=1, next 5
            [0, 3, 1],  # first mismatches (later match ignored) -> n=0, next 0
        ]
    )
    logits = np.full((3, 3, v), -1.0, np.float32)
    for b in range(3):
        for i in range(3):
            logits[b, i, best[b, i]] = 2.0
    draft = jnp.array([[2, 3], [2, 3], [1, 3]])
    n, nxt = jax.jit(speculative_accept_greedy)(draft, jnp.asarray(logits))
    np.testing.assert_array_equal(np.asarray(n), [2, 1, 0])
    np.testing.assert_array_equal(np.asarray(nxt), [4, 5, 0])
    assert n.dtype == jnp.int32 and nxt.dtype == jnp.int32


# --------------------------------------------------------------------------- penalties / logprobs


def _penalties_np(logits, counts, seen, presence, frequency, repetition):
    """Independent float64 reference, entry by entry: HF repetition over prompt + generated tokens,
    then OpenAI frequency / presence over the generated ones."""
    x = np.asarray(logits, np.float64).copy()
    B, V = x.shape
    for b in range(B):
        for v in range(V):
            if seen[b, v] or counts[b, v] > 0:
                x[b, v] = x[b, v] / repetition[b] if x[b, v] > 0 else x[b, v] * repetition[b]
            x[b, v] -= frequency[b] * counts[b, v] + presence[b] * (1.0 if counts[b, v] > 0 else 0.0)
    return x


def _histories(rng, B, V):
    """Random prompt / generated token histories (with repeats) as ids, lengths, counts, seen."""
    gen = rng.integers(0, V, (B, 30))
    n_gen = rng.integers(0, 31, B)
    prompt = rng.integers(0, V, (B, 12))
    n_prompt = rng.integers(1, 13, B)
    counts = np.stack([np.bincount(gen[b, :n_gen[b]], minlength=V) for b in range(B)])
    seen = np.stack([np.bincount(prompt[b, :n_prompt[b]], minlength=V) > 0 for b in range(B)])
    return gen, n_gen, prompt, n_prompt, counts, seen


def test_penalties_match_numpy_reference():
    from ling_jax.sampling import apply_penalties_rows
    from ling_jax.token_stats import init_token_stats, update_rows
    rng = np.random.default_rng(21)
    B, V = 16, 50
    gen, n_gen, prompt, n_prompt, counts, seen = _histories(rng, B, V)
    # the statistics the penalties read: a prompt fed (positions < prompt_len), then generated tokens
    zeros = np.zeros(B, np.int32)
    st = update_rows(init_token_stats(B, V), jnp.asarray(prompt), jnp.asarray(n_prompt), jnp.asarray(zeros),
                     jnp.asarray(n_prompt), jnp.ones(B, bool))
    np.testing.assert_array_equal(np.asarray(st.prompt_seen), seen)
    assert not np.asarray(st.gen_counts).any()
    st = update_rows(st, jnp.asarray(gen), jnp.asarray(n_gen), jnp.asarray(n_prompt), jnp.asarray(n_prompt),
                     jnp.zeros(B, bool))
    np.testing.assert_array_equal(np.asarray(st.gen_counts), counts)
    np.testing.assert_array_equal(np.asarray(st.prompt_seen), seen)
    presence, frequency = rng.uniform(-2, 2, B), rng.uniform(-2, 2, B)
    repetition = rng.uniform(0.5, 2.0, B)
    presence[:3], frequency[:3], repetition[:3] = 0.0, 0.0, 1.0  # neutral rows
    x = _LOGITS
    got = np.asarray(jax.jit(apply_penalties_rows)(x, counts, seen, presence.astype(np.float32),
                                                   frequency.astype(np.float32), repetition.astype(np.float32)))
    ref = _penalties_np(x, counts, seen, presence.astype(np.float32), frequency.astype(np.float32),
                        repetition.astype(np.float32))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[:3], x[:3])  # neutral rows are untouched, bit for bit
    assert (np.abs(got[3:] - x[3:]) > 1e-3).any(1).all()  # every other row was penalised
    # one SamplingParams for all rows = a broadcast row
    rs = RowSampling.broadcast(SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25,
                                              repetition_penalty=1.3), B)
    ones = np.ones(B)
    np.testing.assert_allclose(np.asarray(apply_penalties_rows(x, counts, seen, rs.presence, rs.frequency,
                                                               rs.repetition)),
                               _penalties_np(x, counts, seen, 0.5 * ones, -0.25 * ones, 1.3 * ones),
                               rtol=1e-5, atol=1e-6)
    assert RowSampling.broadcast(SamplingParams(), B).presence is None  # no penalty rows: nothing to apply


def test_token_logprobs_are_the_raw_log_softmax_and_its_top_n():
    from ling_jax.sampling import token_logprobs
    x = _LOGITS
    toks = np.random.default_rng(2).integers(0, x.shape[1], x.shape[0])
    lp, top_ids, top_lp = jax.jit(token_logprobs, static_argnums=2)(x, toks, 20)
    x64 = x.astype(np.float64)
    ref = x64 - x64.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp), ref[np.arange(len(toks)), toks], rtol=1e-5, atol=1e-5)
    order = np.argsort(-x64, axis=-1, kind="stable")[:, :20]
    np.testing.assert_array_equal(np.asarray(top_ids), order)
    np.testing.assert_allclose(np.asarray(top_lp), np.take_along_axis(ref, order, -1), rtol=1e-5, atol=1e-5)
    assert token_logprobs(x[:, :7], toks % 7, 20)[1].shape == (x.shape[0], 7)  # N capped at the vocabulary


def test_penalty_and_logprobs_validation_names_the_field():
    from ling_jax.sampling import check_logprobs
    for bad, field in ((dict(presence_penalty=2.5), "presence_penalty"),
                       (dict(frequency_penalty=-3.0), "frequency_penalty"),
                       (dict(presence_penalty=float("nan")), "presence_penalty"),
                       (dict(repetition_penalty=0.0), "repetition_penalty"),
                       (dict(repetition_penalty=float("inf")), "repetition_penalty")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    assert SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.5).penalized
    assert not SamplingParams(temperature=1.0).penalized
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="logprobs must be None"):
            check_logprobs(bad)
    check_logprobs(None), check_logprobs(0), check_logprobs(20)


# --------------------------------------------------------------------------- generate() with them

_PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.6, repetition_penalty=1.4)


def _full_logits(model, prompts, tokens):
    """Logits of the full-sequence forward over prompt + generated tokens (no cache): [B, L, V]."""
    from ling_jax.forward import forward
    seqs = [list(p) + list(t) for p, t in zip(prompts, tokens)]
    lens = np.array([len(s) for s in seqs])
    ids = np.zeros((len(seqs), lens.max()), np.int32)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
    return np.asarray(forward(model, ids, n_valid=lens)["logits"], np.float64)


def test_generate_penalised_greedy_and_logprobs_against_reference(tiny_model, tiny_cfg):
    """Every token of greedy decoding with penalties is the argmax of the NumPy-penalised
    full-forward logits over its own history; logprobs are log_softmax of those raw logits. A
    top_k=1 sampled run (the sampled path through the penalties) gives the same tokens."""
    from ling_jax.generate import generate
    V = tiny_cfg.vocab_size
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, V, n).tolist() for n in (3, 19)]
    prompts[0] = [5, 5, 9]  # repeated prompt tokens
    sp = SamplingParams(**_PENALTIES)
    res = generate(tiny_model, prompts, 16, sampling=sp, stop_ids=(), logprobs=4)
    logits = _full_logits(tiny_model, prompts, res.tokens)
    raw_argmax = [logits[b, len(p) - 1:len(p) - 1 + 16].argmax(-1).tolist() for b, p in enumerate(prompts)]
    assert sum(r != t for b in range(2) for r, t in zip(raw_argmax[b], res.tokens[b])) >= 4  # penalties acted
    one = lambda v: np.array([v])
    for b, (p, toks) in enumerate(zip(prompts, res.tokens)):
        assert len(toks) == len(res.logprobs[b]) == 16
        seen = np.bincount(p, minlength=V)[None] > 0
        for i, t in enumerate(toks):
            row = logits[b, len(p) - 1 + i][None]
            counts = np.bincount(toks[:i], minlength=V)[None]
            pen = _penalties_np(row, counts, seen, one(_PENALTIES["presence_penalty"]),
                                one(_PENALTIES["frequency_penalty"]), one(_PENALTIES["repetition_penalty"]))
            assert np.sort(pen[0])[-1] - np.sort(pen[0])[-2] > 1e-4  # no near-tie hides a mismatch
            assert int(pen[0].argmax()) == t, (b, i)
            lsm = row[0] - row[0].max() - np.log(np.exp(row[0] - row[0].max()).sum())
            entry = res.logprobs[b][i]
            assert abs(entry.logprob - lsm[t]) < 1e-4
            assert [j for j, _ in entry.top] == np.argsort(-lsm, kind="stable")[:4].tolist()
            np.testing.assert_allclose([v for _, v in entry.top], lsm[[j for j, _ in entry.top]], atol=1e-4)
    top1 = generate(tiny_model, prompts, 16, sampling=SamplingParams(temperature=0.9, top_k=1, seed=3, **_PENALTIES),
                    stop_ids=())
    assert top1.tokens == res.tokens
    with pytest.raises(ValueError, match="not supported with speculative"):
        generate(tiny_model, prompts, 4, sampling=sp, speculative=1)
    with pytest.raises(ValueError, match="logprobs must be None"):
        generate(tiny_model, prompts, 4, logprobs=21)


def test_generate_logprobs_speculative_equal_plain(tiny_model):
    """Speculative greedy emits the plain tokens; their logprobs (from the verify logits) agree."""
    from ling_jax.generate import generate
    prompts = [[1, 2, 3, 4, 5], [17, 3]]
    plain = generate(tiny_model, prompts, 10, stop_ids=(), logprobs=2)
    spec = generate(tiny_model, prompts, 10, stop_ids=(), logprobs=2, speculative=2)
    assert spec.tokens == plain.tokens
    for a, b in zip(plain.logprobs, spec.logprobs):
        assert len(a) == len(b) == 10
        np.testing.assert_allclose([e.logprob for e in a], [e.logprob for e in b], atol=1e-4)
        assert [[j for j, _ in e.top] for e in a] == [[j for j, _ in e.top] for e in b]


# --------------------------------------------------------------------------- sort-free masking

def _reference_keep(x, k, p):
    """float64 NumPy: which entries of x [V] (already temperature-scaled) top-k (0 = off) then
    top-p keep, in the lower-id-first order; and whether the nucleus cut is ambiguous (a
    cumulative mass within 1e-6 of p, where float32 rounding may decide either way)."""
    V = x.shape[0]
    order = np.argsort(-np.asarray(x, np.float64), kind="stable")
    k = k if 0 < k < V else V
    top = order[:k]
    pr = _softmax64(x[top])
    cum = np.cumsum(pr)
    n = k if p >= 1.0 else min(k, int(np.argmax(cum >= p)) + 1 if (cum >= p).any() else k)
    keep = np.zeros(V, bool)
    keep[top[:n]] = True
    return keep, p < 1.0 and np.min(np.abs(cum - p)) < 1e-6


def test_sort_free_masking_equals_the_reference_and_the_full_sort():
    """`processed_logits_rows` masks rows whose kept set lies within their best C candidates by a
    threshold, else by a sort of the whole row. Against float64 NumPy (top-k, then the nucleus of
    the survivors, lower ids first on ties) at C = 4, 16, 64 and V, over a mix of rows that stay
    within C and rows that run past it (a large top-k, a wide nucleus): the same kept set, the kept
    values those of the scaled row; ties (duplicated logits) keep exactly the lower ids; greedy rows the argmax."""
    from ling_jax.sampling import _best_candidates, _processed_logits_rows_sort_free, processed_logits_rows

    rng = np.random.default_rng(11)
    V = 300
    rows = [(1.0, 0, 1.0), (0.8, 3, 1.0), (1.2, 10, 0.9), (1.0, 0, 0.5), (0.0, 0, 1.0), (1.5, 200, 1.0),
            (1.0, 0, 0.97), (0.6, 40, 0.7), (2.0, 0, 0.999), (1.0, 7, 0.3)]
    t = np.array([r[0] for r in rows], np.float32)
    k = np.array([r[1] for r in rows], np.int32)
    p = np.array([r[2] for r in rows], np.float32)
    x = (rng.standard_normal((len(rows), V)) * 3).astype(np.float32)
    x[:, 150:160] = x[:, 10:20]  # ties across the row
    x[1, [5, 6, 7, 8]] = x[1].max() + 1.0  # 4 tied best, top-3 keeps ids 5, 6, 7
    fn = jax.jit(processed_logits_rows, static_argnames="candidates")
    full = np.asarray(fn(x, t, k, p, candidates=V))
    for C in (4, 16, 64, V):
        out = np.asarray(fn(x, t, k, p, candidates=C))
        np.testing.assert_array_equal(out, full, err_msg=f"C={C}")
    for b, (tb, kb, pb) in enumerate(rows):
        got = np.isfinite(full[b])
        if tb == 0.0:
            assert got.sum() == 1 and got[np.argmax(x[b])]
            continue
        xs = x[b] / np.float32(tb)
        keep, ambiguous = _reference_keep(xs, kb, pb)
        assert not ambiguous, f"row {b}: pick another seed"
        np.testing.assert_array_equal(got, keep, err_msg=f"row {b}")
        np.testing.assert_allclose(full[b][got], xs[got], rtol=1e-6)  # XLA may divide by a reciprocal
    assert np.flatnonzero(np.isfinite(full[1])).tolist() == [5, 6, 7]
    # which rows the threshold form serves at C = 16: within (no mask, top-k <= 16, a nucleus that
    # closes within 16) and not (top-k 40 or 200 past 16, wide nuclei)
    xs = jnp.asarray(x / np.where(t == 0, 1, t)[:, None])
    kk = jnp.where((k > 0) & (k < V), k, V)
    vals, ids = _best_candidates(xs, 16)
    _, exact = _processed_logits_rows_sort_free(xs, kk, jnp.asarray(p), vals, ids)
    exact = np.asarray(exact)
    assert exact[[0, 1, 2, 4, 9]].all() and not exact[[5, 7]].any()
    for b in (3, 6, 8):  # a nucleus of the whole row: within 16 iff the 16 best reach p
        keep, _ = _reference_keep(np.asarray(xs[b]), 0, p[b])
        assert exact[b] == (keep.sum() <= 16), b


def test_best_candidates_per_shard_equal_one_device():
    """On a mesh that splits the vocabulary (model=4, and V = 301 padded to 4 × 76), the candidates
    taken per shard then merged are the one-device best n in the lower-id-first order, ties
    included; and a sampled draw over the split logits is the one-device draw."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from ling_jax.sampling import _best_candidates, request_keys, sample_rows

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    rng = np.random.default_rng(5)
    V = 301
    x = rng.standard_normal((3, V)).astype(np.float32)
    x[:, 200:260] = x[:, 0:60]  # ties across shards
    x[2, -1] = x[2].max() + 1
    vs = NamedSharding(mesh, P(None, "model"))
    xp = jax.device_put(np.pad(x, ((0, 0), (0, 3))), vs)[:, :V]
    for n in (1, 8, 76, 100, V):
        v1, i1 = _best_candidates(jnp.asarray(x), n)
        v4, i4 = jax.jit(lambda a: _best_candidates(a, n, vs))(xp)
        np.testing.assert_array_equal(np.asarray(i4), np.asarray(i1), err_msg=f"n={n}")
        np.testing.assert_array_equal(np.asarray(v4), np.asarray(v1))
        order = np.lexsort((np.arange(V)[None, :].repeat(3, 0), -x))[:, :n]
        np.testing.assert_array_equal(np.asarray(i1), order)
    t, k, p = jnp.asarray([1.0, 0.7, 1.3]), jnp.asarray([0, 5, 0], jnp.int32), jnp.asarray([1.0, 0.9, 0.8])
    keys = request_keys(jnp.asarray([1, 2, 3], jnp.uint32), jnp.asarray([0, 4, 9]))
    one = np.asarray(sample_rows(jnp.asarray(x), keys, t, k, p))
    four = np.asarray(jax.jit(lambda a: sample_rows(a, keys, t, k, p, vs))(xp))
    np.testing.assert_array_equal(four, one)
