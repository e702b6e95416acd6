"""The native CPU table-linear kernel (`pallas_kernels.linear.cpu_kernel`): one layer's linear layer
read in place as rows [base, base + rows) of its scanned run's stacked weights, against an independent
float64 NumPy product, and its equalities: kernel = XLA twin (`reference.table_linear`), the dot form
(< 12 rows) = the GEMM form (>= 12 rows) bit for bit (a row's result does not depend on the rows
beside it), base clamped to [0, R - rows], a traced base inside a scan, and the VJP
is the reference's. Tolerance: float32 2e-6 relative to the largest output (sums of <= 1,030 terms)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear import cpu_kernel
from pallas_kernels.linear.reference import table_linear

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
                                     (13, 1030, 17, 50), (64, 256, 96, 960), (2, 8, 1, 1)])
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
    """Each row alone (dot form) equals the same row inside 3, 11 (dot) and 12, 40 rows (GEMM form),
    bit for bit: a decode row's output is the same whatever the batch."""
    rng = np.random.default_rng(7)
    K, O, R = 203, 70, 210
    x = rng.standard_normal((40, K)).astype(np.float32)
    table = rng.standard_normal((R, K)).astype(np.float32)
    fn = jax.jit(lambda x, t, b: cpu_kernel.table_linear_cpu(x, t, b, O))
    alone = np.stack([np.asarray(fn(x[i:i + 1], table, np.int32(70)))[0] for i in range(40)])
    for n in (3, 11, 12, 40):
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
