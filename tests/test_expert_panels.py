"""Routed experts stored in the native CPU kernel's panel order (`pallas_kernels/experts/panels.py`):
the layout against its definition, the round trip, the kernel over packed weights against the same
kernel over `[out, in]` rows (bit for bit, both of its forms) and against float64, its gradients,
and the named refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_moe_active import _case, _reference
from pallas_kernels.experts.cpu_kernel import experts_decode_cpu
from pallas_kernels.experts.panels import pack_panels, unpack_panels

f32 = lambda a: jnp.asarray(a, jnp.float32)


def _packed_np(w):
    """The definition, element by element: panel p (rows 16p..16p+15) as [K][16], its K positions in
    lane-class order (position l·K/8 + j holds column 8j + l)."""
    O, K = w.shape[-2:]
    flat = np.empty(w.shape[:-2] + (O * K,), w.dtype)
    for p in range(O // 16):
        for pos in range(K):
            l, j = divmod(pos, K // 8)
            for r in range(16):
                flat[..., p * 16 * K + pos * 16 + r] = w[..., p * 16 + r, 8 * j + l]
    return flat.reshape(w.shape)


def test_pack_panels_is_the_layout_and_unpack_inverts_it():
    w = np.random.default_rng(0).standard_normal((3, 32, 24)).astype(np.float32)
    packed = np.asarray(pack_panels(jnp.asarray(w)))
    np.testing.assert_array_equal(packed, _packed_np(w))
    np.testing.assert_array_equal(np.asarray(unpack_panels(jnp.asarray(packed))), w)
    assert not np.array_equal(packed, w)


@pytest.mark.parametrize("lim", [0.0, 0.9])
def test_kernel_over_packed_weights_has_the_bits_of_the_rows(lim):
    """1-11 tokens an expert (the row form's dot tiles) and 12+ (its GEMM): the packed form runs the GEMM
    at every count with the same sums in the same order, so every bit agrees; and both equal float64."""
    rng = np.random.default_rng(1)
    for N, E, k in ((1, 8, 2), (5, 4, 3), (40, 3, 2), (23, 2, 2)):
        x, idx, wts, w = _case(rng, N, E, k, D=32, I=16)
        args = (f32(x), jnp.asarray(idx), f32(wts))
        rows = np.asarray(experts_decode_cpu(*args, *map(f32, w), lim))
        packed = np.asarray(experts_decode_cpu(*args, *(pack_panels(f32(a)) for a in w), lim, packed=True))
        np.testing.assert_array_equal(packed, rows)
        ref = _reference(x, idx, wts, *w, lim if lim else np.inf, E)
        assert np.abs(packed - ref).max() <= 1e-4 * np.abs(ref).max()


def test_gradients_through_packed_weights_are_the_rows_gradients_packed():
    rng = np.random.default_rng(2)
    x, idx, wts, w = _case(rng, 6, 4, 2, D=32, I=16)
    loss = lambda packed: lambda x, wts, g, u, d: jnp.sum(  # noqa: E731
        experts_decode_cpu(x, jnp.asarray(idx), wts, g, u, d, 0.0, packed=packed) ** 2)
    ws = tuple(map(f32, w))
    g_rows = jax.grad(loss(False), argnums=(0, 1, 2, 3, 4))(f32(x), f32(wts), *ws)
    g_packed = jax.grad(loss(True), argnums=(0, 1, 2, 3, 4))(f32(x), f32(wts), *(pack_panels(a) for a in ws))
    for a, b in zip(g_rows[:2], g_packed[:2]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
    for a, b in zip(g_rows[2:], g_packed[2:]):
        np.testing.assert_allclose(np.asarray(b), np.asarray(pack_panels(a)), rtol=1e-6, atol=1e-6)


def test_named_refusals():
    with pytest.raises(ValueError, match=r"w: panel order needs \[out, in\] with out a multiple of 16.*\(3, 24, 32\)"):
        pack_panels(jnp.zeros((3, 24, 32)))
    x, idx, wts, w = _case(np.random.default_rng(3), 2, 3, 2, D=32, I=24)
    with pytest.raises(ValueError, match="experts_decode_cpu: wg: panel order needs"):
        experts_decode_cpu(f32(x), jnp.asarray(idx), f32(wts), *map(f32, w), 0.0, packed=True)
