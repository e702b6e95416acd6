"""Tests for ling_jax.sampling: logit processing, sampling and speculative accept/reject."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.sampling import (
    SamplingParams,
    mask_top_k,
    mask_top_p,
    processed_logits,
    probs,
    sample,
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


# Jitted once at module level (params / k are static); jitting also checks traceability: no
# Python control flow on traced values anywhere in the sampling code.
_top_k = jax.jit(mask_top_k, static_argnums=1)
_top_p_traced = jax.jit(mask_top_p)  # p as an array: one compile for every p
_processed = jax.jit(processed_logits, static_argnums=1)
_probs = jax.jit(probs, static_argnums=1)
_sample = jax.jit(sample, static_argnums=2)
_spec = jax.jit(speculative_accept)


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


# One shared [16, 50] logits array, so the jitted helpers compile once per static argument.
_LOGITS = (np.random.default_rng(0).normal(size=(16, 50)) * 2.0).astype(np.float32)


def test_top_k_keeps_exactly_k():
    x = _LOGITS
    for k in (1, 10, 49):
        out = np.asarray(_top_k(jnp.asarray(x), k))
        assert (np.isfinite(out).sum(-1) == k).all()
        for b in range(x.shape[0]):
            kept = np.flatnonzero(np.isfinite(out[b]))
            np.testing.assert_array_equal(np.sort(kept), np.sort(np.argsort(-x[b])[:k]))
            np.testing.assert_array_equal(out[b, kept], x[b, kept])


def test_top_k_ties_keep_exactly_k_lowest_ids():
    x = jnp.array([[0.0, 1.0, 1.0, 1.0, 1.0, -1.0]])
    out = np.asarray(_top_k(x, 2))
    np.testing.assert_array_equal(np.isfinite(out)[0], [False, True, True, False, False, False])


def test_top_k_off():
    x = jnp.array([[0.3, -1.0, 2.0]])
    for k in (0, 3, 7):
        np.testing.assert_array_equal(np.asarray(mask_top_k(x, k)), np.asarray(x))


def _brute_top_p_keep(x, p):
    """Reference nucleus mask in float64; returns (keep, ambiguous-row flags)."""
    keep = np.zeros(x.shape, bool)
    ambiguous = np.zeros(x.shape[0], bool)
    for b in range(x.shape[0]):
        pr = _softmax64(x[b])
        order = np.argsort(-x[b], kind="stable")
        cum = np.cumsum(pr[order])
        n = int(np.argmax(cum >= p)) + 1 if (cum >= p).any() else len(order)
        keep[b, order[:n]] = True
        ambiguous[b] = np.min(np.abs(cum - p)) < 1e-5
    return keep, ambiguous


def test_top_p_matches_brute_force():
    x = _LOGITS
    pr = _softmax64(x)
    for p in (1e-6, 0.05, 0.3, 0.5, 0.8, 0.95, 0.999):
        out = np.asarray(_top_p_traced(jnp.asarray(x), jnp.float32(p)))
        keep, ambiguous = _brute_top_p_keep(x, p)
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
    np.testing.assert_array_equal(np.asarray(mask_top_p(x, 1.0)), _LOGITS)
    np.testing.assert_array_equal(np.asarray(_top_p_traced(x, jnp.float32(1.0))), _LOGITS)
    # a tiny p keeps only the top token; with ties that is the lowest id
    tied = np.zeros_like(_LOGITS)
    tied[:, 7] = tied[:, 9] = 1.0
    out = np.asarray(_top_p_traced(jnp.asarray(tied), jnp.float32(1e-6)))
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
    got = np.asarray(_processed(jnp.asarray(x), SamplingParams(temperature=0.7, top_k=10,
                                                                top_p=0.6)))
    scaled = jnp.asarray(x) / jnp.float32(0.7)
    ref = np.asarray(_top_p_traced(_top_k(scaled, 10), jnp.float32(0.6)))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    np.testing.assert_allclose(got[np.isfinite(got)], ref[np.isfinite(ref)], rtol=1e-6)
    assert (np.isfinite(got).sum(-1) <= 10).all()


def test_greedy_probs_are_one_hot_argmax():
    x = jnp.array([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 1.0, 2.0]])
    pr = np.asarray(_probs(x, SamplingParams()))
    np.testing.assert_array_equal(pr, [[0, 1, 0, 0], [1, 0, 0, 0]])
    ids = _sample(x, jax.random.key(0), SamplingParams())
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
    return sample(x, key, _SAMPLE_PARAMS), probs(x[:1], _SAMPLE_PARAMS)[0]


def _draws(key, n):
    """n independent draws (one batch row each; rows get independent noise) plus the probs."""
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
