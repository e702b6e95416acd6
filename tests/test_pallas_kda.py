"""KDA Pallas kernels (interpret mode on CPU) against their XLA references in pallas_kernels.kda.reference.

Tolerances (relative Frobenius error ‖a−b‖/‖b‖): float32 1e-5, bfloat16 inputs 1e-2.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from pallas_kernels.kda.chunk_kernel import kda_chunk_scan_pallas
from pallas_kernels.kda.reference import kda_chunk_scan, kda_recurrent_scan, kda_recurrent_step
from pallas_kernels.kda.step_kernel import kda_recurrent_scan_pallas, kda_recurrent_step_pallas

TOL = {"float32": 1e-5, "bfloat16": 1e-2}

# Interpret-mode kernels compile to large XLA loops: skip LLVM's expensive passes (compile ~2× faster).
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fast(f, **jit_kw):
    return jax.jit(f, compiler_options=FAST, **jit_kw)


def _inputs(seed, B, T, H, dk, dv, dtype=jnp.float32, valid=None, g_range=(-5.0, 0.0)):
    """Prepared KDA inputs as the model makes them; tokens at or beyond valid[b] are padding (g=β=0).

    Built with NumPy: eager jax.random / jnp ops would each compile (seconds on a loaded CPU)."""
    rng = np.random.default_rng(seed)

    def l2(x):
        return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    q = l2(rng.standard_normal((B, T, H, dk))) * dk ** -0.5
    k = l2(rng.standard_normal((B, T, H, dk)))
    v = rng.standard_normal((B, T, H, dv))
    g = rng.uniform(g_range[0], g_range[1], (B, T, H, dk))
    beta = 1 / (1 + np.exp(-2 * rng.standard_normal((B, T, H))))
    s0 = 0.5 * rng.standard_normal((B, H, dk, dv))
    if valid is not None:
        m = np.arange(T)[None, :] < np.asarray(valid)[:, None]
        g = np.where(m[..., None, None], g, 0.0)
        beta = np.where(m[..., None], beta, 0.0)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), f32(g), f32(beta), f32(s0))


CHUNK_CASES = [
    # B, T, H, dk, dv, dtype, chunk, valid, kernel kwargs
    (2, 150, 2, 32, 32, "float32", 64, [150, 97], {}),
    (2, 75, 2, 16, 32, "float32", 32, [75, 40], {"block_t": 64, "block_v": 16, "sub_chunk": 8}),
    (1, 37, 2, 16, 16, "bfloat16", 64, None, {}),
]


@pytest.mark.parametrize("B,T,H,dk,dv,dtype,chunk,valid,kw", CHUNK_CASES)
def test_chunk_scan_matches_twin(B, T, H, dk, dv, dtype, chunk, valid, kw):
    q, k, v, g, beta, s0 = _inputs(T, B, T, H, dk, dv, jnp.dtype(dtype), valid)
    o_ref, s_ref = fast(functools.partial(kda_chunk_scan, chunk_size=chunk))(q, k, v, g, beta, s0)
    o, s = fast(functools.partial(kda_chunk_scan_pallas, chunk_size=chunk, **kw))(q, k, v, g, beta, s0)
    assert o.shape == o_ref.shape and o.dtype == jnp.float32 and s.shape == s_ref.shape
    assert rel_err(o, o_ref) < TOL[dtype] and rel_err(s, s_ref) < TOL[dtype]
    if valid is not None:  # the padded row's state equals the state after its valid prefix
        b = 1
        n = valid[b]
        _, s_short = fast(kda_recurrent_scan)(*(a[b:b + 1, :n] for a in (q, k, v, g, beta)), s0[b:b + 1])
        assert rel_err(s[b:b + 1], s_short) < TOL[dtype]


@pytest.mark.parametrize("T,chunk,kw", [(150, 32, {}), (75, 16, {"block_t": 32, "block_v": 16, "sub_chunk": 8})])
def test_chunk_states_match_twin_and_recurrence(T, chunk, kw):
    """`return_chunk_states`: the state after every chunk, kernel = XLA twin = the token recurrence's
    state at that position (ceil(T/C) chunks, the last one the final state)."""
    B, H, dk, dv = 2, 2, 16, 32
    q, k, v, g, beta, s0 = _inputs(T + 1, B, T, H, dk, dv, valid=[T, T - 20])
    o_ref, s_ref, cs_ref = fast(functools.partial(kda_chunk_scan, chunk_size=chunk, return_chunk_states=True))(
        q, k, v, g, beta, s0)
    o, s, cs = fast(functools.partial(kda_chunk_scan_pallas, chunk_size=chunk, return_chunk_states=True, **kw))(
        q, k, v, g, beta, s0)
    n = -(-T // chunk)
    assert cs.shape == cs_ref.shape == (B, n, H, dk, dv)
    assert rel_err(cs, cs_ref) < 1e-5 and rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
    assert rel_err(cs_ref[:, -1], s_ref) < 1e-6
    _, _, every = fast(functools.partial(kda_recurrent_scan, return_all_states=True))(q, k, v, g, beta, s0)
    ends = [min((i + 1) * chunk, T) - 1 for i in range(n)]
    assert rel_err(cs_ref, every[:, ends]) < 1e-5


_chunk64 = fast(kda_chunk_scan_pallas)


@pytest.mark.parametrize("g_const", [-4.999, -1e-4])
def test_chunk_scan_extreme_decay(g_const):
    """Strongest decay (5 per step → exp(−Γ) would overflow over a chunk) and almost none."""
    B, T, H, d = 1, 128, 2, 16
    q, k, v, _, beta, s0 = _inputs(7, B, T, H, d, d)
    g = jnp.asarray(np.full((B, T, H, d), g_const, np.float32))
    o_ref, s_ref = fast(kda_recurrent_scan)(q, k, v, g, beta, s0)  # ground truth (§9.6)
    o, s = _chunk64(q, k, v, g, beta, s0)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    assert rel_err(o, o_ref) < TOL["float32"] and rel_err(s, s_ref) < TOL["float32"]


@pytest.mark.parametrize("dtype,kw", [("float32", {"block_h": 2, "block_v": 16}), ("bfloat16", {})])
def test_recurrent_step_matches_twin(dtype, kw):
    B, H, dk, dv = 3, 4, 16, 32
    q, k, v, g, beta, s0 = _inputs(3, B, 1, H, dk, dv, jnp.dtype(dtype))
    q, k, v, g, beta = (a[:, 0] for a in (q, k, v, g, beta))
    o_ref, s_ref = fast(kda_recurrent_step)(s0, q, k, v, g, beta)
    o, s = fast(functools.partial(kda_recurrent_step_pallas, **kw))(s0, q, k, v, g, beta)
    assert o.dtype == jnp.float32 and s.dtype == s0.dtype
    assert rel_err(o, o_ref) < TOL[dtype] and rel_err(s, s_ref) < TOL[dtype]


def test_recurrent_step_updates_state_in_place():
    B, H, d = 2, 2, 16
    q, k, v, g, beta, s0 = _inputs(5, B, 1, H, d, d)
    q, k, v, g, beta = (a[:, 0] for a in (q, k, v, g, beta))
    o_ref, s_ref = fast(kda_recurrent_step)(s0, q, k, v, g, beta)
    # the pallas_call declares the alias state → new state ...
    jaxpr = str(jax.make_jaxpr(kda_recurrent_step_pallas)(s0, q, k, v, g, beta))
    assert "input_output_aliases=((0, 1),)" in jaxpr
    # ... so a donated state buffer is reused for the result (no second state allocation)
    step = fast(kda_recurrent_step_pallas, donate_argnums=0)
    state = s0 + 0.0
    ptr = state.unsafe_buffer_pointer()
    o, s = step(state, q, k, v, g, beta)
    assert state.is_deleted() and s.unsafe_buffer_pointer() == ptr
    assert rel_err(o, o_ref) < TOL["float32"] and rel_err(s, s_ref) < TOL["float32"]


def test_recurrent_scan_pallas_matches_reference():
    B, T, H, d = 2, 3, 2, 16
    q, k, v, g, beta, s0 = _inputs(9, B, T, H, d, d, valid=[3, 2])
    for T_ in (1, T):
        xs = tuple(a[:, :T_] for a in (q, k, v, g, beta))
        o_ref, s_ref = fast(kda_recurrent_scan)(*xs, s0)
        o, s = fast(kda_recurrent_scan_pallas)(*xs, s0)
        assert o.shape == o_ref.shape
        assert rel_err(o, o_ref) < TOL["float32"] and rel_err(s, s_ref) < TOL["float32"]
