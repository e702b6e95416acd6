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


def test_native_kernel_register_tiles_and_tails():
    """The native kernel computes two weight rows against four tokens at a time, over 8-lane vectors:
    experts picked by 12, 6 and 7 tokens (full tiles, remainders 2 and 3), D and I not multiples of 8 and D
    odd (the last down row alone) equal float64."""
    rng = np.random.default_rng(11)
    x, idx, wts, (wg, wu, wd) = _case(rng, 13, 3, 2, D=27, I=13)
    idx[:7, 0], idx[7:, 0] = 0, 1  # expert 0 picked by 7 tokens, expert 1 by 6 + whoever drew it second
    idx[:, 1] = np.where(idx[:, 0] == 0, 2, 0)
    idx[12, 1] = 3  # outside [0, E): adds nothing
    ref = _reference(x, idx, wts, wg, wu, wd, 0.9, 3)
    got = jax.jit(IMPLS["native"])(f32(x), jnp.asarray(idx), f32(wts), f32(wg), f32(wu), f32(wd), 0.9)
    assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("D, I", [(27, 13), (64, 48)])
def test_native_kernel_gemm_path_equals_float64(D, I):
    """Experts picked by 12 tokens or more run the kernel's GEMM path (tokens across the vector lanes,
    tiles of six weight rows by 32 tokens): an expert picked by 45 tokens (one full token tile, a 16-token
    one), one by 17 (its padded lanes), one by 12 (the threshold), one by 11 (the dot path beside them);
    rows not a multiple of six, D and I with and without a tail past the last 8 -- equal float64."""
    rng = np.random.default_rng(12)
    x, idx, wts, (wg, wu, wd) = _case(rng, 85, 4, 1, D=D, I=I)
    idx[:45, 0], idx[45:62, 0], idx[62:74, 0], idx[74:, 0] = 0, 1, 2, 3
    for lim in (0.0, 0.9):
        ref = _reference(x, idx, wts, wg, wu, wd, lim if lim else np.inf, 4)
        got = jax.jit(IMPLS["native"])(f32(x), jnp.asarray(idx), f32(wts), f32(wg), f32(wu), f32(wd), lim)
        assert rel_err(got, ref) < 1e-5


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
        if impl == "native":  # each token's sums run in the same order whatever shares its tile
            np.testing.assert_array_equal(alone[0], batch[n])


@pytest.mark.parametrize("D, I", [(24, 10), (27, 13)])
def test_native_kernel_gemm_path_has_the_bits_of_the_token_alone(D, I):
    """A token whose experts ~27 tokens share (the GEMM path) gets exactly the bits it gets alone (the
    dot path): the GEMM runs each output's sums in the dot path's order (eight lane chains, added in
    lane order, then the tail), so batching a prefill never changes a token's experts output."""
    rng = np.random.default_rng(6)
    x, idx, wts, w = _case(rng, 40, 3, 2, D=D, I=I)
    run = jax.jit(IMPLS["native"])
    batch = np.asarray(run(f32(x), jnp.asarray(idx), f32(wts), *map(f32, w), 0.9))
    for n in (0, 17, 39):
        alone = np.asarray(run(f32(x[n:n + 1]), jnp.asarray(idx[n:n + 1]), f32(wts[n:n + 1]), *map(f32, w), 0.9))
        np.testing.assert_array_equal(alone[0], batch[n])


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
    """On XLA:CPU (`grouped_matmul="capacity"`) with float weights, "auto" and "grouped" run the
    native kernel at every token count (float32, `native_experts`), else loop over the used experts
    while N·k ≤ E (a `while` in the program) and use the capacity buffers beyond; kept quantised,
    "auto" still gathers; TPU/GPU ("ragged") keep the 3·N·k ≤ E gather rule."""
    E, k = tiny_cfg.num_experts, tiny_cfg.num_experts_per_tok
    assert uses_active_loop(2, k, E) and not uses_active_loop(3, k, E)  # tiny: E = 8, k = 3
    assert all(uses_active_loop(n, k, E, native=True) for n in (1, 6, 4096))
    assert auto_expert_path(2, k, E, "capacity", quantized=False) == "grouped"
    assert auto_expert_path(1, 8, 64, "capacity", quantized=True) == "gather"
    assert auto_expert_path(1, 8, 512, "ragged", quantized=False) == "gather"
    assert auto_expert_path(30, 8, 512, "ragged", quantized=False) == "grouped"
    moe = next(layer.mlp for layer in tiny_model.model.layers if hasattr(layer.mlp, "experts"))
    native = ExecConfig.for_backend("cpu", experts="auto")
    assert native.native_experts and not ExecConfig.for_backend("tpu").native_experts
    xla = native.replace(native_experts=False)
    for n, few in ((2, True), (4, False), (40, None)):
        x = jnp.ones((1, n, tiny_cfg.hidden_size), jnp.float32)
        jaxpr = str(jax.make_jaxpr(lambda x: moe(x, xla)[0])(x))
        if few is not None:  # (40 tokens: the capacity path's spill loop is a `while` too)
            assert ("while" in jaxpr) == few, n  # the XLA loop
        jaxpr = str(jax.make_jaxpr(lambda x: moe(x, native)[0])(x))
        assert cpu_kernel.TARGET in jaxpr and "while" not in jaxpr, n  # the native kernel's custom call
        bf16 = str(jax.make_jaxpr(lambda x: moe(x, native)[0])(x.astype(jnp.bfloat16)))
        assert cpu_kernel.TARGET not in bf16, n  # float32 only
        a, b = (np.asarray(moe(x * 0.3, e)[0]) for e in (native, xla))
        assert rel_err(a, b) < 1e-5


def test_training_forward_does_not_run_the_native_kernel(tiny_model):
    """The native kernel is forward-only (its VJP recomputes through the XLA reference, every used
    expert on every token): the training forward takes the XLA paths; inference on CPU runs it."""
    from ling_jax.train.step import forward as train_forward
    ids = jnp.ones((2, 6), jnp.int32)
    assert cpu_kernel.TARGET not in str(jax.make_jaxpr(lambda i: train_forward(tiny_model, i, mtp=False)[0])(ids))
    assert cpu_kernel.TARGET in str(jax.make_jaxpr(lambda i: tiny_model(i)["logits"])(ids))


@pytest.mark.parametrize("N", [3, 40])
def test_expert_table_reads_one_layers_experts(N):
    """`moe.ExpertTable`: a scanned run's experts as one table of 3 layers x E rows; layer 1's experts
    read from it at base E equal that layer alone (float64), padding ids (E, -1) add nothing (E would
    be the next layer's first expert in the table), and bit for bit the kernel over that layer's own
    arrays. 40 tokens (~15 an expert) take the kernel's GEMM path, 3 its dot path."""
    from ling_jax.moe import ExpertTable, experts_from_table
    E, k, L = 8, 3, 3
    rng = np.random.default_rng(N)
    x, idx, wts, _ = _case(rng, N, E, k)
    idx[0, -1] = E
    idx[1, 0] = -1
    layers = [rng.standard_normal(s) for s in ((L, E, 10, 24), (L, E, 10, 24), (L, E, 24, 10))]
    table = ExpertTable(tuple(f32(w.reshape((L * E,) + w.shape[2:])) for w in layers), jnp.int32(E))
    ref = _reference(x, idx, wts, *(w[1] for w in layers), 0.7, E)
    got = jax.jit(lambda *a: experts_from_table(*a, table, E, 0.7))(f32(x), jnp.asarray(idx), f32(wts))
    assert rel_err(got, ref) < 1e-5
    alone = experts_decode_cpu(f32(x), jnp.asarray(idx), f32(wts), *(f32(w[1]) for w in layers), 0.7)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(alone))  # the same sums in the same order
