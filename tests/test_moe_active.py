"""The few-token routed experts (`ling_jax.moe_active`): the XLA loop over the experts in use and
the native CPU kernel beside it (`pallas_kernels.experts`) against a float64 per-assignment
product, the capacity path's gradients, batch invariance, and the dispatch that picks them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import np_reference as R
from conftest import rel_err
from ling_jax.exec_config import ExecConfig
from ling_jax.moe import auto_expert_path
from ling_jax.moe_active import uses_active_loop
from ling_jax.moe_capacity import experts_capacity
from pallas_kernels.experts import cpu_kernel
from pallas_kernels.experts.cpu_kernel import experts_decode_cpu
from pallas_kernels.experts.reference import experts_active_loop

IMPLS = {"xla": experts_active_loop, "native": experts_decode_cpu}

f32 = lambda a: jnp.asarray(a, jnp.float32)


def _case(rng, N, E, k, D=24, I=10):
    idx = np.stack([rng.permutation(E)[:k] for _ in range(N)]).astype(np.int32)
    wts = rng.random((N, k)) + 0.1
    x = rng.standard_normal((N, D))
    w = rng.standard_normal((E, I, D)), rng.standard_normal((E, I, D)), rng.standard_normal((E, D, I))
    return x, idx, wts, w


def _reference(x, idx, wts, wg, wu, wd, lim, E):
    """float64 Σ_j wts[n,j] · SwiGLU expert idx[n,j] (clamped at lim); ids outside [0, E) add nothing."""
    out = np.zeros(x.shape)
    for n in range(x.shape[0]):
        for j, e in enumerate(idx[n]):
            if 0 <= e < E:
                a = np.minimum(R.silu(wg[e] @ x[n]), lim) * np.clip(wu[e] @ x[n], -lim, lim)
                out[n] += wts[n, j] * (wd[e] @ a)
    return out


def test_native_kernel_builds():
    """The kernel compiles and registers here (CI has a C++ compiler): a failure is a failure, not
    a silent fallback."""
    assert cpu_kernel.available(), cpu_kernel.load_error()


@pytest.mark.parametrize("impl", ["xla", "native"])
@pytest.mark.parametrize("N,E,k", [(1, 64, 8), (3, 16, 4), (8, 64, 8), (2, 8, 3)])
def test_active_loop_equals_float64(N, E, k, impl):
    rng = np.random.default_rng(N * 100 + E)
    x, idx, wts, (wg, wu, wd) = _case(rng, N, E, k)
    idx[0, -1] = E  # another device's expert
    if N > 1:
        idx[1, 0] = -1  # masked
    lim = 0.7
    ref = _reference(x, idx, wts, wg, wu, wd, lim, E)
    run = jax.jit(IMPLS[impl])
    got = run(f32(x), jnp.asarray(idx), f32(wts), f32(wg), f32(wu), f32(wd), lim)
    assert got.shape == (N, x.shape[1]) and got.dtype == jnp.float32
    assert rel_err(got, ref) < 1e-5
    # without the clamp the result differs: the limit really reaches the experts
    assert rel_err(run(f32(x), jnp.asarray(idx), f32(wts), f32(wg), f32(wu), f32(wd), 0.0), ref) > 1e-3


@pytest.mark.parametrize("impl", ["xla", "native"])
def test_a_token_gets_the_same_output_alone_and_in_a_batch(impl):
    """Token n sums only its own experts (in id order): its neighbours change only the GEMMs'
    rounding (a 1-column product is a matrix-vector kernel, 8 columns a GEMM), not what is summed."""
    rng = np.random.default_rng(5)
    x, idx, wts, w = _case(rng, 8, 64, 8)
    run = jax.jit(IMPLS[impl])
    batch = np.asarray(run(f32(x), jnp.asarray(idx), f32(wts), *map(f32, w), 0.0))
    for n in (0, 5):
        alone = np.asarray(run(f32(x[n:n + 1]), jnp.asarray(idx[n:n + 1]), f32(wts[n:n + 1]), *map(f32, w), 0.0))
        assert rel_err(alone[0], batch[n]) < 1e-5


@pytest.mark.parametrize("impl", ["xla", "native"])
def test_active_loop_gradients_equal_capacity_path(impl):
    """The custom VJP (a scan over the same loop) gives the capacity path's gradients for the
    tokens, the routing weights, all three expert weights and the clamp."""
    rng = np.random.default_rng(11)
    N, E, k = 4, 16, 4
    x, idx, wts, (wg, wu, wd) = _case(rng, N, E, k)
    ct = f32(rng.standard_normal((N, x.shape[1])))
    lim = f32(0.8)
    ii = jnp.asarray(idx)

    def loop(x, w, g, u, d, l):
        return jnp.sum(ct * IMPLS[impl](x, ii, w, g, u, d, l))

    def capacity(x, w, g, u, d, l):
        y = experts_capacity(x, ii.reshape(-1), k, g, u, d, l, N).reshape(N, k, -1)
        return jnp.sum(ct * jnp.einsum("nkd,nk->nd", y, w, precision=jax.lax.Precision.HIGHEST))

    args = (f32(x), f32(wts), f32(wg), f32(wu), f32(wd), lim)
    got = jax.jit(jax.grad(loop, argnums=tuple(range(6))))(*args)
    ref = jax.jit(jax.grad(capacity, argnums=tuple(range(6))))(*args)
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-5


def test_dispatch_picks_the_loop_for_few_tokens(tiny_cfg, tiny_model):
    """On XLA:CPU (`grouped_matmul="capacity"`) with float weights, "auto" and "grouped" loop over
    the used experts while N·k ≤ E (a `while` in the program; the native kernel while N·k ≤ 2·E)
    and use the capacity buffers beyond;
    kept quantised, "auto" still gathers; TPU/GPU ("ragged") keep the 3·N·k ≤ E gather rule."""
    E, k = tiny_cfg.num_experts, tiny_cfg.num_experts_per_tok
    assert uses_active_loop(2, k, E) and not uses_active_loop(3, k, E)  # tiny: E = 8, k = 3
    assert auto_expert_path(2, k, E, "capacity", quantized=False) == "grouped"
    assert auto_expert_path(1, 8, 64, "capacity", quantized=True) == "gather"
    assert auto_expert_path(1, 8, 512, "ragged", quantized=False) == "gather"
    assert auto_expert_path(30, 8, 512, "ragged", quantized=False) == "grouped"
    moe = next(layer.mlp for layer in tiny_model.model.layers if hasattr(layer.mlp, "experts"))
    native = ExecConfig.for_backend("cpu", experts="auto")
    assert native.native_experts and not ExecConfig.for_backend("tpu").native_experts
    xla = native.replace(native_experts=False)
    assert uses_active_loop(5, k, E, native=True) and not uses_active_loop(6, k, E, native=True)  # N·k ≤ 2·E
    for n, few, few_native in ((2, True, True), (4, False, True), (6, False, False)):
        x = jnp.ones((1, n, tiny_cfg.hidden_size), jnp.float32)
        jaxpr = str(jax.make_jaxpr(lambda x: moe(x, xla)[0])(x))
        assert ("while" in jaxpr) == few, n  # the XLA loop
        jaxpr = str(jax.make_jaxpr(lambda x: moe(x, native)[0])(x))
        assert (cpu_kernel.TARGET in jaxpr) == few_native, n  # the native kernel's custom call
        a, b = (np.asarray(moe(x * 0.3, e)[0]) for e in (native, xla))
        assert rel_err(a, b) < 1e-5
