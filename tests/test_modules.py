"""Each JAX module against the independent float64 NumPy reference (tests/np_reference.py).

Tolerances (relative Frobenius error ‖a−b‖/‖b‖): float32 ≤ 1e-4, bfloat16 ≤ 2e-2 per module.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_reference as R
from conftest import load_from_dict, rel_err
from ling_jax.call_mode import DECODE, PREFILL, CallMode
from ling_jax.exec_config import ExecConfig
from ling_jax.kda import kda_zero_state
from ling_jax.mla import mla_zero_cache
from ling_jax.norms import gated_rms_norm, l2_normalize, rms_norm
from pallas_kernels.kda.reference import kda_chunk_scan, kda_recurrent_scan

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


@pytest.mark.parametrize("gate_floor", [None, -5.0])
@pytest.mark.parametrize("chunk", [1, 16, 64])
@pytest.mark.parametrize("T", [1, 37, 130])
def test_kda_chunked_equals_recurrent(chunk, T, gate_floor):
    """The chunked WY form equals the token recurrence for any chunk size, incl. T % chunk != 0; with
    the gate's floor given, chunks of up to 16 tokens (5 x 16 <= 80) factor their decays as
    exp(Γ_r)·exp(−Γ_s) (two matmuls), longer ones keep the materialised pairwise form."""
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
    o_c, s_c = kda_chunk_scan(*args, chunk_size=chunk, gate_floor=gate_floor)
    # and both against the float64 reference recurrence, sequence by sequence
    for b in range(B):
        o_ref, s_ref = R.kda_recurrent(q[b], k[b], v[b], g[b], beta[b], s0[b], normalize=False)
        assert rel_err(o_c[b], o_ref) < 1e-4 and rel_err(s_c[b], s_ref) < 1e-4
    assert rel_err(o_c, o_r) < 1e-5 and rel_err(s_c, s_r) < 1e-5


def test_kda_factored_chunk_at_the_gate_floor():
    """The factored decays at their limit: every log-decay at the floor -5, 16-token chunks (Γ down to
    -80, exp(-Γ) ~ 5.5e34): finite, and equal to the materialised form and to float64."""
    from pallas_kernels.kda.reference import factorable
    assert factorable(16, -5.0) and not factorable(17, -5.0) and not factorable(16, None)
    rng = np.random.default_rng(7)
    B, T, H, dk, dv = 1, 48, 2, 16, 8
    q = R.l2_normalize(rng.standard_normal((B, T, H, dk))) / 4
    k = R.l2_normalize(rng.standard_normal((B, T, H, dk)))
    v = rng.standard_normal((B, T, H, dv))
    g = np.full((B, T, H, dk), -4.9999)
    g[:, :, :, :4] = -1e-3  # slow and fast channels side by side
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    s0 = rng.standard_normal((B, H, dk, dv)) * 0.5
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, s0)]
    o_f, s_f = kda_chunk_scan(*args, chunk_size=16, gate_floor=-5.0)
    o_m, s_m = kda_chunk_scan(*args, chunk_size=16)
    assert np.isfinite(np.asarray(o_f)).all() and np.isfinite(np.asarray(s_f)).all()
    o_ref, s_ref = R.kda_recurrent(q[0], k[0], v[0], g[0], beta[0], s0[0], normalize=False)
    assert rel_err(o_f[0], o_ref) < 1e-4 and rel_err(s_f[0], s_ref) < 1e-4
    assert rel_err(o_f, o_m) < 1e-5 and rel_err(s_f, s_m) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode,chunk", [("chunk", 64), ("chunk", 16), ("chunk", 1), ("recurrent", 0)])
def test_kda_layer(tiny_cfg, tiny_params, dtype, mode, chunk):
    model = tiny_model_for(tiny_cfg, tiny_params, dtype)
    att = model.model.layers[0].attention
    x = _x(5, (21, tiny_cfg.hidden_size))
    dt = jnp.dtype(dtype)
    # two calls with carried state (13 + 8 tokens) against one reference call
    st = kda_zero_state(tiny_cfg, 1, dt)
    ex = ExecConfig(kda_chunk=chunk or 64)
    call = DECODE if mode == "recurrent" else PREFILL  # the call mode picks the KDA form
    o1, st, _ = att(jnp.asarray(x[None, :13], dt), st, jnp.array([13]), ex, call)
    o2, st, _ = att(jnp.asarray(x[None, 13:], dt), st, jnp.array([8]), ex, call)
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
    out, st, _ = att(jnp.asarray(x, jnp.float32), kda_zero_state(tiny_cfg, 2, jnp.float32), n, ExecConfig.for_backend())
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
    out, _ = att(jnp.asarray(x[None], dt), None, jnp.zeros((1,), jnp.int32), jnp.array([17]), ExecConfig(mla_form=form))
    ref, _ = R.mla_layer(tiny_params, "model.layers.3.attention", x, np.arange(17), tiny_cfg)
    assert rel_err(out[0], ref) < TOL[dtype]
    # two calls through the latent cache
    cache = mla_zero_cache(tiny_cfg, 1, 32, dt)
    o1, cache = att(jnp.asarray(x[None, :10], dt), cache, jnp.array([0]), jnp.array([10]), ExecConfig(mla_form=form))
    o2, cache = att(jnp.asarray(x[None, 10:], dt), cache, jnp.array([10]), jnp.array([7]), ExecConfig(mla_form=form))
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
        out, _ = att(x, None, jnp.zeros((1,), jnp.int32), jnp.array([40]), ExecConfig(mla_form=form))
        assert rel_err(out[0], ref) < 1e-4


def test_mla_absorbed_gpu_query_rows_padded(tiny_cfg, tiny_params):
    """A verify-shaped call (8 rows x 3 tokens over a latent cache) with the GPU platform's choice:
    the query-through-W_UK matmul runs on 24 rows padded to 32 (XLA:GPU's Triton fusion with an FP8
    W_UK finds no tiling for 24) and gives the float64 reference's outputs, as without padding."""
    model = load_from_dict(tiny_cfg, tiny_params)
    att = model.model.layers[3].attention
    B, T0, T = 8, 5, 3
    x = _x(21, (B, T0 + T, tiny_cfg.hidden_size))
    outs = {}
    for platform in (None, "gpu"):
        ex = ExecConfig(mla_form="absorbed", platform=platform)
        cache = mla_zero_cache(tiny_cfg, B, 16, jnp.float32)
        _, cache = att(jnp.asarray(x[:, :T0], jnp.float32), cache, jnp.zeros((B,), jnp.int32),
                       jnp.full((B,), T0), ExecConfig(mla_form="absorbed"))
        call = lambda xs, c: att(xs, c, jnp.full((B,), T0), jnp.full((B,), T), ex)[0]
        jaxpr = str(jax.make_jaxpr(call)(jnp.asarray(x[:, T0:], jnp.float32), cache))
        assert ("pad[" in jaxpr) == (platform == "gpu"), platform
        outs[platform] = np.asarray(call(jnp.asarray(x[:, T0:], jnp.float32), cache))
    for b in range(B):
        ref, _ = R.mla_layer(tiny_params, "model.layers.3.attention", x[b], np.arange(T0 + T), tiny_cfg)
        for platform in outs:
            assert rel_err(outs[platform][b], ref[T0:]) < 1e-4, (platform, b)


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
        out, idx = moe(jnp.asarray(x[None], dt), ExecConfig.for_backend(experts=impl))
        assert np.array_equal(np.sort(np.asarray(idx[0]), -1), np.sort(ref_idx, -1))
    else:  # bf16 inputs can flip near-tie routing; pin it to compare the arithmetic
        out, idx = moe(jnp.asarray(x[None], dt), ExecConfig.for_backend(experts=impl), jnp.asarray(ref_idx[None]))
    assert rel_err(out[0], ref) < TOL[dtype]
    if layer == 9:  # the clamp is active: without it the result differs
        unclamped, _ = R.moe_layer(tiny_params, f"model.layers.{layer}.mlp", x, tiny_cfg, layer, clamp=False)
        assert rel_err(unclamped, ref) > 1e-3


@pytest.mark.parametrize("impl", ["auto", "grouped", "gather"])
def test_moe_padding_tokens_reach_no_routed_expert(tiny_cfg, tiny_params, impl):
    """n_valid: right padding goes to no routed expert (an idle engine row or a prefill row's
    padding costs no expert work): real tokens equal float64, padding gets the shared expert only,
    and the router's ids come back for every token. "auto" on CPU: the native kernel (few tokens)."""
    model = tiny_model_for(tiny_cfg, tiny_params, "float32")
    moe = model.model.layers[9].mlp
    x = _x(17, (2, 7, tiny_cfg.hidden_size))
    n_valid = np.array([7, 3])
    ex = ExecConfig.for_backend(experts=impl)
    out, idx = moe(jnp.asarray(x, jnp.float32), ex, None, jnp.asarray(n_valid))
    unmasked, all_idx = moe(jnp.asarray(x, jnp.float32), ex)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(all_idx))
    shared = np.asarray(moe.shared_experts(jnp.asarray(x[1, 3:], jnp.float32), ex))
    for b in range(2):
        ref, _ = R.moe_layer(tiny_params, "model.layers.9.mlp", x[b, :n_valid[b]], tiny_cfg, 9)
        assert rel_err(out[b, :n_valid[b]], ref) < 1e-5, b
    assert rel_err(out[1, 3:], shared) < 1e-6
    assert rel_err(unmasked[1, 3:], shared) > 1e-3  # without n_valid the padding is routed


_MODELS = {}


def tiny_model_for(cfg, params, dtype):
    key = (id(params), dtype, cfg)
    if key not in _MODELS:
        _MODELS[key] = load_from_dict(cfg, params, dtype)
    return _MODELS[key]


@pytest.mark.parametrize("N,E,k,top,capacity", [(128, 64, 8, 0.0, None), (69, 8, 2, 0.6, 16), (30, 4, 2, 1.0, 3),
                                                (8, 64, 8, 0.0, None), (5, 6, 3, 0.5, 1)])
def test_routed_expert_paths_equal_float64(N, E, k, top, capacity):
    """The CPU capacity path (one round, or several `while` rounds when an expert overflows its
    capacity), the ragged_dot_general path (TPU/GPU) and the gather path equal a float64 per-assignment
    product. `top` sends that share of the tokens to expert 0 (skewed routing); one assignment in
    seven goes to no expert (id E, as on other devices' experts) and must come out 0."""
    from ling_jax.moe import experts_gathered, experts_ragged
    from ling_jax.moe_capacity import expert_capacity, experts_capacity
    rng = np.random.default_rng(N + E)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(N)])
    idx[rng.random(N) < top, 0] = 0
    flat = idx.reshape(-1).copy()
    flat[::7] = E
    D, I, lim = 24, 10, 0.7
    x = rng.standard_normal((N, D))
    wg, wu, wd = rng.standard_normal((E, I, D)), rng.standard_normal((E, I, D)), rng.standard_normal((E, D, I))
    ref = np.zeros((N * k, D))
    for m, e in enumerate(flat):
        if e < E:
            xv = x[m // k]
            a = np.minimum(R.silu(wg[e] @ xv), lim) * np.clip(wu[e] @ xv, -lim, lim)
            ref[m] = wd[e] @ a
    cap = capacity or expert_capacity(N, k, E)
    sizes = np.bincount(flat[flat < E], minlength=E)
    assert (sizes.max() > cap) == (top > 0), (sizes.max(), cap)  # skewed cases really take several rounds
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    fl = jnp.asarray(flat, jnp.int32)
    got = jax.jit(lambda *a: experts_capacity(*a[:2], k, *a[2:], lim, cap))(f32(x), fl, f32(wg), f32(wu), f32(wd))
    assert rel_err(got, ref) < 1e-5
    assert np.all(np.asarray(got)[flat == E] == 0)
    got = jax.jit(lambda *a: experts_ragged(*a[:2], k, *a[2:], lim))(f32(x), fl, f32(wg), f32(wu), f32(wd))
    assert rel_err(got, ref) < 1e-5
    ok = flat < E
    gi = jnp.asarray(np.where(ok, flat, 0).reshape(N, k), jnp.int32)
    got = np.asarray(experts_gathered(f32(x), gi, f32(wg), f32(wu), f32(wd), lim)).reshape(N * k, D)
    assert rel_err(got[ok], ref[ok]) < 1e-5


def test_spilled_expert_gradients_equal_ragged():
    """Gradients through the CPU capacity path with spilled rows (custom VJP over the `while` spill
    loop) equal those through ragged_dot_general, for inputs, all three expert weights and the limit."""
    from ling_jax.moe import experts_ragged
    from ling_jax.moe_capacity import experts_capacity
    rng = np.random.default_rng(7)
    N, E, k, D, I = 40, 6, 2, 16, 8
    idx = np.stack([rng.permutation(E)[:k] for _ in range(N)])
    idx[: N // 2, 0] = 0
    idx[: N // 2, 1] = np.where(idx[: N // 2, 1] == 0, 1, idx[: N // 2, 1])  # expert 0 gets ~N/2 rows
    flat = jnp.asarray(idx.reshape(-1), jnp.int32)
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((N, D), (E, I, D), (E, I, D), (E, D, I))]
    ct = jnp.asarray(rng.standard_normal((N * k, D)), jnp.float32)
    lim = jnp.asarray(0.8, jnp.float32)
    cap = 8  # expert 0 holds ~20 rows: two spill rounds of C2 = 8
    f = lambda x, g, u, d, l: jnp.sum(ct * experts_capacity(x, flat, k, g, u, d, l, cap))
    r = lambda x, g, u, d, l: jnp.sum(ct * experts_ragged(x, flat, k, g, u, d, l))
    got = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(*args, lim)
    ref = jax.jit(jax.grad(r, argnums=(0, 1, 2, 3, 4)))(*args, lim)
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-5
    assert np.bincount(idx.ravel())[0] > 2 * cap  # rows really spill (two rounds past the capacity)


@pytest.mark.parametrize("stride,chunk", [(8, 16), (16, 16), (12, 8)])
def test_kda_layer_boundary_states(tiny_cfg, tiny_params, stride, chunk):
    """A prefill with `CallMode.snapshot_every`: the states after every `stride` tokens of a chunked call equal
    the float64 reference's state after that prefix (from a carried state), recurrent and conv; the
    call's output and final state are unchanged."""
    model = tiny_model_for(tiny_cfg, tiny_params, "float32")
    att = model.model.layers[1].attention
    x = _x(13, (2, 5 + 29, tiny_cfg.hidden_size))
    n = np.array([29, 20])
    st = kda_zero_state(tiny_cfg, 2, jnp.float32)
    ex = ExecConfig(kda_chunk=chunk)
    _, st, _ = att(jnp.asarray(x[:, :5], jnp.float32), st, jnp.array([5, 5]), ex, PREFILL)  # a carried state
    xs = jnp.asarray(x[:, 5:], jnp.float32)
    out, final, bounds = att(xs, st, jnp.asarray(n), ex, CallMode.prefill(stride))
    out0, final0, none = att(xs, st, jnp.asarray(n), ex, PREFILL)
    assert none is None and rel_err(out, out0) < 1e-5 and rel_err(final.recurrent, final0.recurrent) < 1e-5
    J = 29 // stride
    assert bounds.recurrent.shape[:2] == (2, J) and bounds.conv_q.shape[:3] == (2, J, tiny_cfg.short_conv_kernel_size - 1)
    checked = 0
    for b in range(2):
        for j in range(J):
            e = (j + 1) * stride
            if e > n[b]:
                continue
            _, ref = R.kda_layer(tiny_params, "model.layers.1.attention", x[b, :5 + e], tiny_cfg)
            assert rel_err(bounds.recurrent[b, j], ref["recurrent"]) < 1e-4
            for name in ("conv_q", "conv_k", "conv_v"):
                assert rel_err(getattr(bounds, name)[b, j], ref[name]) < 1e-5
            checked += 1
    assert checked >= 2
