"""FP8 E4M3 block quantization / dequantization (spec §13)."""
import ml_dtypes
import numpy as np
import pytest

from ling_jax.checkpoint.fp8 import FP8_DTYPE, block_dequant_fp8, block_quant_fp8, scale_grid_shape
from pallas_kernels.fp8.reference import block_dequant_fp8_jax


def _bound(w, scale, block=(128, 128)):
    """|W - deq| <= half an E4M3 ulp: 2^-4 relative for normals, scale·2^-10 in the subnormal range."""
    s = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[: w.shape[0], : w.shape[1]]
    return np.abs(w) * 2.0 ** -4 + s * 2.0 ** -10 + 1e-12


@pytest.mark.parametrize("shape", [(256, 384), (576, 4096), (200, 300), (1, 1), (129, 127)])
def test_quant_dequant_error_bound(shape):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32) * np.exp(rng.uniform(-6, 2, size=(shape[0], 1))).astype(np.float32)
    wq, s = block_quant_fp8(w)
    assert wq.dtype == FP8_DTYPE and wq.shape == shape
    assert s.dtype == np.float32 and s.shape == scale_grid_shape(shape)
    deq = block_dequant_fp8(wq, s)
    assert deq.dtype == np.float32
    assert np.all(np.abs(deq - w) <= _bound(w, s))
    # every block's largest element maps to ±448 exactly (scale = amax / 448)
    assert np.isclose(np.abs(wq.astype(np.float32)).max(), 448.0)


def test_partial_edge_blocks_use_their_own_scale():
    assert scale_grid_shape((576, 4096)) == (5, 32)
    assert scale_grid_shape((200, 300)) == (2, 3)
    w = np.ones((200, 300), np.float32)
    w[128:, :] *= 10.0      # last (partial, 72-row) block row
    w[:, 256:] *= 3.0       # last (partial, 44-col) block column
    wq, s = block_quant_fp8(w)
    assert s.shape == (2, 3)
    np.testing.assert_allclose(s, np.array([[1, 1, 3], [10, 10, 30]], np.float32) / 448, rtol=1e-7)
    np.testing.assert_array_equal(block_dequant_fp8(wq, s), w)


def test_576_rows_kv_a_shape():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((576, 4096)).astype(np.float32)
    w[512:] *= 100.0  # the 64-row partial last block
    wq, s = block_quant_fp8(w)
    assert s.shape == (5, 32)
    np.testing.assert_allclose(s[4], np.abs(w[512:]).reshape(64, 32, 128).max(axis=(0, 2)) / 448, rtol=1e-6)
    assert np.all(np.abs(block_dequant_fp8(wq, s) - w) <= _bound(w, s))


def test_zero_blocks_are_safe():
    w = np.zeros((256, 256), np.float32)
    w[:128, :128] = np.arange(128 * 128, dtype=np.float32).reshape(128, 128) / 1000
    wq, s = block_quant_fp8(w)
    assert np.all(np.isfinite(s)) and np.all(s > 0)
    deq = block_dequant_fp8(wq, s)
    assert np.all(np.isfinite(deq))
    np.testing.assert_array_equal(deq[128:], 0)
    np.testing.assert_array_equal(deq[:, 128:], 0)


def test_dequant_multiplies_by_scale():
    wq = np.full((128, 128), 2.0, np.float32).astype(FP8_DTYPE)
    s = np.array([[0.5]], np.float32)
    np.testing.assert_array_equal(block_dequant_fp8(wq, s), np.full((128, 128), 1.0, np.float32))


def test_exactly_representable_roundtrip():
    rng = np.random.default_rng(2)
    vals = rng.standard_normal((300, 200)).astype(np.float32) * 100
    q = vals.clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    q[0, 0] = 448  # make every block's amax 448 so scale = 1 exactly
    q[0, 128] = 448
    q[128, 0] = q[128, 128] = q[256, 0] = q[256, 128] = 448
    w = q.astype(np.float32) * 0.25
    wq, s = block_quant_fp8(w)
    np.testing.assert_array_equal(s, 0.25)
    np.testing.assert_array_equal(wq.view(np.uint8), q.view(np.uint8))


def test_custom_block_and_errors():
    w = np.random.default_rng(3).standard_normal((10, 20)).astype(np.float32)
    wq, s = block_quant_fp8(w, block=(4, 8))
    assert s.shape == (3, 3)
    assert np.all(np.abs(block_dequant_fp8(wq, s, block=(4, 8)) - w) <= _bound(w, s, (4, 8)))
    with pytest.raises(ValueError, match="scale shape"):
        block_dequant_fp8(wq, s)
    with pytest.raises(ValueError, match="non-finite"):
        block_quant_fp8(np.array([[np.nan]], np.float32))
    with pytest.raises(ValueError, match="2-D"):
        block_quant_fp8(np.zeros((2, 2, 2), np.float32))


def test_jax_version_matches_numpy():
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(4)
    w = rng.standard_normal((200, 300)).astype(np.float32)
    wq, s = block_quant_fp8(w)
    ref = block_dequant_fp8(wq, s)
    out = block_dequant_fp8_jax(jnp.asarray(wq), jnp.asarray(s))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), ref)
    out = jax.jit(lambda a, b: block_dequant_fp8_jax(a, b, dtype=jnp.bfloat16))(jnp.asarray(wq), jnp.asarray(s))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out), ref.astype(ml_dtypes.bfloat16))
