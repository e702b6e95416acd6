"""Each JAX module against the independent float64 NumPy reference (tests/np_reference.py).

Tolerances (relative Frobenius error ‖a−b‖/‖b‖): float32 ≤ 1e-4, bfloat16 ≤ 2e-2 per module.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_reference as R
from conftest import load_from_dict, rel_err
from ling_jax.kda import KDAState, kda_chunk_scan, kda_recurrent_scan, kda_zero_state
from ling_jax.mla import mla_zero_cache
from ling_jax.norms import gated_rms_norm, l2_normalize, rms_norm

TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def _x(seed, shape, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape) * scale


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norms(dtype):
    x, w, g = _x(1, (5, 128)), 1 + 0.1 * _x(2, (128,)), _x(3, (5, 128))
    dt = jnp.dtype(dtype)
    assert rel_err(rms_norm(jnp.asarray(x, dt), jnp.asarray(w, dt), 1e-6), R.rms_norm(x, w, 1e-6)) < TOL[dtype]
    assert rel_err(gated_rms_norm(jnp.asarray(x, dt), jnp.asarray(g, dt), jnp.asarray(w, dt), 1e-6),
                   R.gated_rms_norm(x, g, w, 1e-6)) < TOL[dtype]
    assert rel_err(l2_normalize(jnp.asarray(x, jnp.float32)), R.l2_normalize(x)) < 1e-6


@pytest.mark.parametrize("chunk", [1, 16, 64])
@pytest.mark.parametrize("T", [1, 37, 130])
def test_kda_chunked_equals_recurrent(chunk, T):
    """The chunked WY form equals the token recurrence for any chunk size, incl. T % chunk != 0."""
    rng = np.random.default_rng(T * 100 + chunk)
    B, H, dk, dv = 2, 3, 16, 8
    q = R.l2_normalize(rng.standard_normal((B, T, H, dk))) / 4
    k = R.l2_normalize(rng.standard_normal((B, T, H, dk)))
    v = rng.standard_normal((B, T, H, dv))
    g = -5 / (1 + np.exp(-rng.standard_normal((B, T, H, dk)) * 2))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    s0 = rng.standard_normal((B, H, dk, dv)) * 0.5
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, s0)]
    o_r, s_r = kda_recurrent_scan(*args)
    o_c, s_c = kda_chunk_scan(*args, chunk_size=chunk)
    # and both against the float64 reference recurrence, sequence by sequence
    for b in range(B):
        o_ref, s_ref = R.kda_recurrent(q[b], k[b], v[b], g[b], beta[b], s0[b], normalize=False)
        assert rel_err(o_c[b], o_ref) < 1e-4 and rel_err(s_c[b], s_ref) < 1e-4
    assert rel_err(o_c, o_r) < 1e-5 and rel_err(s_c, s_r) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode,chunk", [("chunk", 64), ("chunk", 16), ("chunk", 1), ("recurrent", 0)])
def test_kda_layer(tiny_cfg, tiny_params, dtype, mode, chunk):
    model = tiny_model_for(tiny_cfg, tiny_params, dtype)
    att = model.model.layers[0].attention
    x = _x(5, (21, tiny_cfg.hidden_size))
    dt = jnp.dtype(dtype)
    # two calls with carried state (13 + 8 tokens) against one reference call
    st = kda_zero_state(tiny_cfg, 1, dt)
    o1, st = att(jnp.asarray(x[None, :13], dt), st, jnp.array([13]), mode=mode, chunk_size=chunk or 64)
    o2, st = att(jnp.asarray(x[None, 13:], dt), st, jnp.array([8]), mode=mode, chunk_size=chunk or 64)
    ref, ref_state = R.kda_layer(tiny_params, "model.layers.0.attention", x, tiny_cfg)
    assert rel_err(jnp.concatenate([o1, o2], 1)[0], ref) < TOL[dtype]
    assert rel_err(st.recurrent[0], ref_state["recurrent"]) < TOL[dtype]
    assert rel_err(st.conv_q[0], ref_state["conv_q"]) < TOL[dtype]


def test_kda_padding_never_enters_state(tiny_cfg, tiny_params):
    """Right-padded rows leave the recurrent and conv state exactly as the unpadded sequence's."""
    model = tiny_model_for(tiny_cfg, tiny_params, "float32")
    att = model.model.layers[1].attention
    x = _x(7, (2, 19, tiny_cfg.hidden_size))
    n = jnp.array([19, 6])
    out, st = att(jnp.asarray(x, jnp.float32), kda_zero_state(tiny_cfg, 2, jnp.float32), n)
    ref, ref_state = R.kda_layer(tiny_params, "model.layers.1.attention", x[1, :6], tiny_cfg)
    assert rel_err(out[1, :6], ref) < 1e-4
    assert rel_err(st.recurrent[1], ref_state["recurrent"]) < 1e-4
    for name in ("conv_q", "conv_k", "conv_v"):
        assert rel_err(getattr(st, name)[1], ref_state[name]) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_mla_layer(tiny_cfg, tiny_params, dtype, form):
    model = tiny_model_for(tiny_cfg, tiny_params, dtype)
    att = model.model.layers[3].attention
    x = _x(9, (17, tiny_cfg.hidden_size))
    dt = jnp.dtype(dtype)
    # cache-free call
    out, _ = att(jnp.asarray(x[None], dt), None, jnp.zeros((1,), jnp.int32), jnp.array([17]), form=form)
    ref, _ = R.mla_layer(tiny_params, "model.layers.3.attention", x, np.arange(17), tiny_cfg)
    assert rel_err(out[0], ref) < TOL[dtype]
    # two calls through the latent cache
    cache = mla_zero_cache(tiny_cfg, 1, 32, dt)
    o1, cache = att(jnp.asarray(x[None, :10], dt), cache, jnp.array([0]), jnp.array([10]), form=form)
    o2, cache = att(jnp.asarray(x[None, 10:], dt), cache, jnp.array([10]), jnp.array([7]), form=form)
    assert rel_err(jnp.concatenate([o1, o2], 1)[0], ref) < TOL[dtype]


def test_mla_absorbed_equals_expanded_yarn(tiny_params):
    rs = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
          "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    cfg = R.tiny_config(rope_scaling=rs)
    model = load_from_dict(cfg, tiny_params)
    att = model.model.layers[3].attention
    x = jnp.asarray(_x(11, (1, 40, cfg.hidden_size)), jnp.float32)
    ref, _ = R.mla_layer(tiny_params, "model.layers.3.attention", np.asarray(x[0], np.float64), np.arange(40), cfg)
    for form in ("expanded", "absorbed"):
        out, _ = att(x, None, jnp.zeros((1,), jnp.int32), jnp.array([40]), form=form)
        assert rel_err(out[0], ref) < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["grouped", "gather"])
@pytest.mark.parametrize("layer", [4, 9])  # 9 is clamped (routed and shared)
def test_moe_layer(tiny_cfg, tiny_params, dtype, impl, layer):
    model = tiny_model_for(tiny_cfg, tiny_params, dtype)
    moe = model.model.layers[layer].mlp
    x = _x(13, (23, tiny_cfg.hidden_size))
    dt = jnp.dtype(dtype)
    ref, ref_idx = R.moe_layer(tiny_params, f"model.layers.{layer}.mlp", x, tiny_cfg, layer)
    if dtype == "float32":
        out, idx = moe(jnp.asarray(x[None], dt), impl=impl)
        assert np.array_equal(np.sort(np.asarray(idx[0]), -1), np.sort(ref_idx, -1))
    else:  # bf16 inputs can flip near-tie routing; pin it to compare the arithmetic
        out, idx = moe(jnp.asarray(x[None], dt), forced_idx=jnp.asarray(ref_idx[None]), impl=impl)
    assert rel_err(out[0], ref) < TOL[dtype]
    if layer == 9:  # the clamp is active: without it the result differs
        unclamped, _ = R.moe_layer(tiny_params, f"model.layers.{layer}.mlp", x, tiny_cfg, layer, clamp=False)
        assert rel_err(unclamped, ref) > 1e-3


_MODELS = {}


def tiny_model_for(cfg, params, dtype):
    key = (id(params), dtype, cfg)
    if key not in _MODELS:
        _MODELS[key] = load_from_dict(cfg, params, dtype)
    return _MODELS[key]


@pytest.mark.parametrize("M,G,tile", [(37, 5, None), (64, 8, 8), (200, 16, 16), (9, 12, None)])
def test_grouped_matmul_tiled_equals_ragged_dot(M, G, tile):
    """The CPU tiled grouped matmul equals jax.lax.ragged_dot, empty groups included."""
    from ling_jax.moe import grouped_matmul_tiled
    rng = np.random.default_rng(M + G)
    sizes = rng.multinomial(M, rng.dirichlet(np.ones(G) * 0.5))
    xs = jnp.asarray(rng.standard_normal((M, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((G, 24, 10)), jnp.float32)
    ref = jax.lax.ragged_dot(xs, w, jnp.asarray(sizes, jnp.int32), precision=jax.lax.Precision.HIGHEST)
    got = grouped_matmul_tiled(xs, w, jnp.asarray(sizes, jnp.int32), tile)
    assert rel_err(got, ref) < 1e-6


@pytest.mark.parametrize("M,G,top", [(1024, 64, 0.0), (64, 64, 0.0), (69, 8, 0.3), (69, 8, 1.0), (30, 4, 1.0)])
def test_grouped_matmul_cpu_every_branch(M, G, top):
    """The CPU grouped matmul (capacity levels, tiled fallback) equals a float64 per-group product.

    `top` puts that share of the rows on group 0, so the largest group moves past the capacity
    level (tiled fallback); 3 trailing rows are in no group and must come out 0."""
    from ling_jax.moe import capacity_levels, grouped_matmul_cpu
    rng = np.random.default_rng(M + G)
    p = np.full(G, 1.0 / G) if top == 0 else np.r_[top, np.full(G - 1, (1 - top) / (G - 1))]
    sizes = rng.multinomial(M - 3, p)
    levels = capacity_levels(M, G)
    branch = int(np.sum(sizes.max() > np.asarray(levels)))
    xs = rng.standard_normal((M, 24))
    w = rng.standard_normal((G, 24, 10))
    ref = np.zeros((M, 10))
    ends = np.cumsum(sizes)
    for g in range(G):
        ref[ends[g] - sizes[g]:ends[g]] = xs[ends[g] - sizes[g]:ends[g]] @ w[g]
    got = jax.jit(grouped_matmul_cpu)(jnp.asarray(xs, jnp.float32), jnp.asarray(w, jnp.float32),
                                      jnp.asarray(sizes, jnp.int32))
    assert rel_err(got, ref) < 1e-5
    assert np.all(np.asarray(got[M - 3:]) == 0)
    expected = {(1024, 64, 0.0): 0, (64, 64, 0.0): 0, (69, 8, 0.3): 0, (69, 8, 1.0): "tiled", (30, 4, 1.0): "tiled"}
    want = expected[(M, G, top)]
    assert branch == (len(levels) if want == "tiled" else want), (sizes.max(), levels)
