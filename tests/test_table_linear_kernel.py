"""The native CPU table-linear kernel (`pallas_kernels.linear.cpu_kernel`): one layer's linear layer
read in place as rows [base, base + rows) of its scanned run's stacked weights, against an independent
float64 NumPy product, and its equalities: kernel = XLA twin (`reference.table_linear`), the dot form
(< 12 rows) = the packed-panel GEMM form (>= 12 rows) bit for bit (a row's result does not depend on
the rows beside it), base clamped to [0, R - rows], a traced base inside a scan, and the VJP
is the reference's. The per-head form (`table_heads_cpu`: MLA's kv_b_proj as W_UK, rows contracted,
and W_UV, rows as outputs) the same way. Tolerance: float32 2e-6 relative to the largest output (sums
of <= 1,030 terms)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear import cpu_kernel
from pallas_kernels.linear.reference import table_heads, table_linear

TOL = 2e-6


def test_native_kernel_builds():
    """It compiles and registers here (CI has a C++ compiler): a failure is a failure, not a silent
    fallback to the XLA slice."""
    assert cpu_kernel.available(), cpu_kernel.load_error()


def _numpy(x, table, base, rows):
    R = table.shape[0]
    b = min(max(int(base), 0), R - rows)
    return np.asarray(x, np.float64) @ np.asarray(table[b:b + rows], np.float64).T


def _rel(got, want):
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("N,K,O,R", [(1, 64, 5, 20), (3, 100, 33, 99), (8, 1024, 256, 1024), (12, 96, 40, 80),
                                     (13, 1030, 17, 50), (64, 256, 96, 960), (2, 8, 1, 1), (200, 77, 50, 120),
                                     (20, 5, 3, 9)])
def test_kernel_equals_float64_and_the_xla_twin(N, K, O, R):
    rng = np.random.default_rng(N * 1000 + K)
    x = rng.standard_normal((N, K)).astype(np.float32)
    table = rng.standard_normal((R, K)).astype(np.float32)
    fn = jax.jit(lambda x, t, b: cpu_kernel.table_linear_cpu(x, t, b, O))
    twin = jax.jit(lambda x, t, b: table_linear(x, t, b, O))
    for base in {0, R - O, (R - O) // 2, R + 5, -3}:  # the last two are clamped
        got = fn(x, table, np.int32(base))
        want = _numpy(x, table, base, O)
        assert got.shape == (N, O) and got.dtype == jnp.float32
        assert _rel(got, want) < TOL, (base, _rel(got, want))
        assert _rel(got, np.asarray(twin(x, table, np.int32(base)), np.float64)) < TOL


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Each row alone (dot form) equals the same row inside 3, 11 (dot) and 12, 40, 101 rows (GEMM form),
    bit for bit: a decode row's output is the same whatever the batch."""
    rng = np.random.default_rng(7)
    K, O, R = 203, 70, 210
    x = rng.standard_normal((101, K)).astype(np.float32)
    table = rng.standard_normal((R, K)).astype(np.float32)
    fn = jax.jit(lambda x, t, b: cpu_kernel.table_linear_cpu(x, t, b, O))
    alone = np.stack([np.asarray(fn(x[i:i + 1], table, np.int32(70)))[0] for i in range(101)])
    for n in (3, 11, 12, 40, 101):
        np.testing.assert_array_equal(np.asarray(fn(x[:n], table, np.int32(70))), alone[:n])


def test_leading_dims_a_traced_base_in_a_scan_and_the_vjp():
    """x [B, T, K] keeps its leading dims; inside a scan the base is traced (a layer's rows of a
    stacked run, as `layer_stack` hands them over): every layer reads its own rows (checked in
    float64 layer by layer); gradients equal the XLA twin's."""
    rng = np.random.default_rng(3)
    L, K = 4, 40
    stack = (rng.standard_normal((L, K, K)) / np.sqrt(K)).astype(np.float32)
    table = jnp.asarray(stack.reshape(L * K, K))
    x = jnp.asarray(rng.standard_normal((2, 3, K)).astype(np.float32))

    def run(h):
        def body(h, i):
            y = cpu_kernel.table_linear_cpu(h, table, i * K, K)
            return jnp.tanh(y), (h, y)
        return jax.lax.scan(body, h, jnp.arange(L, dtype=jnp.int32))[1]

    hs, ys = jax.jit(run)(x)
    assert ys.shape == (L, 2, 3, K)
    for i in range(L):
        assert _rel(ys[i], np.asarray(hs[i], np.float64) @ stack[i].astype(np.float64).T) < TOL, i

    def loss(fn):
        return lambda x, t: jnp.sum(jnp.sin(fn(x, t, 2 * K, K)))
    gk = jax.grad(loss(cpu_kernel.table_linear_cpu), argnums=(0, 1))(x, table)
    gr = jax.grad(loss(table_linear), argnums=(0, 1))(x, table)
    for a, b in zip(gk, gr):
        assert _rel(a, np.asarray(b, np.float64)) < TOL


def test_named_refusals():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(TypeError, match="x must be float32"):
        cpu_kernel.table_linear_cpu(x.astype(jnp.bfloat16), jnp.zeros((4, 8), jnp.float32), 0, 2)
    with pytest.raises(ValueError, match="rows"):
        cpu_kernel.table_linear_cpu(x, jnp.zeros((4, 8), jnp.float32), 0, 5)
    with pytest.raises(ValueError, match="table"):
        cpu_kernel.table_linear_cpu(x, jnp.zeros((4, 9), jnp.float32), 0, 2)


def _numpy_heads(x, table, base, H, stride, offset, rows, contract):
    b = min(max(int(base), 0), table.shape[0] - H * stride)
    w = np.asarray(table[b:b + H * stride], np.float64).reshape(H, stride, -1)[:, offset:offset + rows]
    return np.einsum("nhd,hdk->nhk" if contract else "nhk,hdk->nhd", np.asarray(x, np.float64), w)


@pytest.mark.parametrize("N,H,dn,dv,K", [(1, 2, 8, 8, 16), (5, 3, 24, 20, 40), (13, 4, 16, 12, 100),
                                         (40, 8, 32, 32, 64)])
def test_heads_form_equals_float64_and_the_xla_twin(N, H, dn, dv, K):
    """Per head h, W_h = rows [base + h (dn+dv) + offset, + rows) of the table: W_UK (offset 0, dn rows,
    contracted: x_h @ W_h) and W_UV (offset dn, dv rows as outputs: x_h @ W_hᵀ), as the absorbed MLA
    attention applies kv_b_proj [H (dn+dv), K]; bases clamped like the plain form."""
    rng = np.random.default_rng(N * 100 + K)
    stride = dn + dv
    table = rng.standard_normal((3 * H * stride + 5, K)).astype(np.float32)
    R = table.shape[0]
    fn = jax.jit(cpu_kernel.table_heads_cpu, static_argnums=(3, 4, 5, 6, 7))
    twin = jax.jit(table_heads, static_argnums=(3, 4, 5, 6, 7))
    for base in {0, R - H * stride, H * stride + 3, R + 9, -2}:
        for offset, rows, contract in ((0, dn, True), (dn, dv, False)):
            x = rng.standard_normal((N, H, rows if contract else K)).astype(np.float32)
            got = fn(x, table, np.int32(base), H, stride, offset, rows, contract)
            want = _numpy_heads(x, table, base, H, stride, offset, rows, contract)
            assert got.shape == want.shape and got.dtype == jnp.float32
            assert _rel(got, want) < TOL, (base, contract, _rel(got, want))
            tw = twin(x, table, np.int32(base), H, stride, offset, rows, contract)
            assert _rel(got, np.asarray(tw, np.float64)) < TOL


def test_heads_form_rows_are_independent_and_the_vjp_is_the_twins():
    """A row alone equals the same row among 13 (both forms, bit for bit); leading dims are kept; the
    gradients equal the XLA twin's."""
    rng = np.random.default_rng(11)
    H, dn, dv, K = 3, 20, 12, 72
    table = jnp.asarray(rng.standard_normal((2 * H * (dn + dv), K)).astype(np.float32))
    for offset, rows, contract in ((0, dn, True), (dn, dv, False)):
        x = rng.standard_normal((13, H, rows if contract else K)).astype(np.float32)
        fn = jax.jit(lambda x: cpu_kernel.table_heads_cpu(x, table, 5, H, dn + dv, offset, rows, contract))
        alone = np.stack([np.asarray(fn(x[i:i + 1]))[0] for i in range(13)])
        np.testing.assert_array_equal(np.asarray(fn(x)), alone)
        x4 = jnp.asarray(x[:12].reshape(2, 6, H, -1))
        assert fn(x4).shape == (2, 6, H, K if contract else rows)

        def loss(f):
            return lambda x, t: jnp.sum(jnp.sin(f(x, t, 7, H, dn + dv, offset, rows, contract)))
        gk = jax.grad(loss(cpu_kernel.table_heads_cpu), argnums=(0, 1))(x4, table)
        gr = jax.grad(loss(table_heads), argnums=(0, 1))(x4, table)
        for a, b in zip(gk, gr):  # the cotangents cos(y) differ by y's float32 rounding: 1e-5 (measured 2.9e-6)
            assert _rel(a, np.asarray(b, np.float64)) < 1e-5


def test_heads_form_named_refusals():
    t = jnp.zeros((40, 8), jnp.float32)
    with pytest.raises(TypeError, match="x must be float32"):
        cpu_kernel.table_heads_cpu(jnp.zeros((1, 2, 8), jnp.bfloat16), t, 0, 2, 10, 0, 4, False)
    with pytest.raises(ValueError, match=r"expected x \[\.\.\., heads, 4\]"):
        cpu_kernel.table_heads_cpu(jnp.zeros((1, 2, 8), jnp.float32), t, 0, 2, 10, 0, 4, True)
    with pytest.raises(ValueError, match="offset"):
        cpu_kernel.table_heads_cpu(jnp.zeros((1, 2, 8), jnp.float32), t, 0, 2, 10, 8, 4, False)
    with pytest.raises(ValueError, match="heads \\* stride <= R"):
        cpu_kernel.table_heads_cpu(jnp.zeros((1, 5, 8), jnp.float32), t, 0, 5, 10, 0, 4, False)
