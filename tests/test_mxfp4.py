"""MXFP4 codec vs an independent, element-by-element implementation of OCP MX v1.0 written here.

The reference below uses only Python floats (float64, exact for every value involved) and the
spec's definitions: E2M1 = sign | 2-bit exponent (bias 1) | 1-bit mantissa, E8M0 = 2^(e - 127),
scale exponent floor(log2(amax)) - 2 clamped to [-127, 127] (zero blocks: -127), round to nearest
with ties to even, saturation to ±6, element 2j in the low nibble. It never calls the codec.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling_jax.checkpoint import mxfp4 as M
from ling_jax.checkpoint.safetensors_io import CheckpointError


# ---------------------------------------------------------------------------------------------
# independent reference
# ---------------------------------------------------------------------------------------------
def ref_code_value(c: int) -> float:
    s, e, m = (c >> 3) & 1, (c >> 1) & 3, c & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


GRID = [ref_code_value(c) for c in range(8)]  # 0, .5, 1, 1.5, 2, 3, 4, 6


def ref_encode_value(v: float) -> int:
    """E2M1 code of v (already divided by the block scale): RNE, ties to the even code, saturating."""
    sign = 8 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), 6.0)
    best = None
    for i, g in enumerate(GRID):
        d = abs(a - g)
        if best is None or d < best[0] or (d == best[0] and i % 2 == 0):
            best = (d, i)
    return sign | best[1]


def ref_scale_exp(block) -> int:
    amax = max(abs(float(x)) for x in block)
    if amax == 0:
        return -127
    m, ex = math.frexp(amax)          # amax = m 2^ex, m in [0.5, 1)
    return max(-127, min(127, ex - 1 - 2))


def ref_encode(w: np.ndarray):
    rows, k = w.shape
    packed = np.zeros((rows, k // 2), np.uint8)
    scales = np.zeros((rows, k // 32), np.uint8)
    for r in range(rows):
        codes = []
        for b in range(k // 32):
            blk = w[r, 32 * b: 32 * b + 32]
            e = ref_scale_exp(blk)
            scales[r, b] = e + 127
            codes += [ref_encode_value(math.ldexp(float(x), -e)) for x in blk]
        for j in range(k // 2):
            packed[r, j] = codes[2 * j] | (codes[2 * j + 1] << 4)
    return packed, scales


def ref_decode(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    rows, p = packed.shape
    out = np.zeros((rows, 2 * p), np.float32)
    for r in range(rows):
        for j in range(p):
            for t, c in enumerate((int(packed[r, j]) & 15, int(packed[r, j]) >> 4)):
                col = 2 * j + t
                v = ref_code_value(c) * 2.0 ** (int(scales[r, col // 32]) - 127)
                out[r, col] = math.copysign(math.inf, v) if abs(v) > 3.4028234663852886e38 else v
    return out


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
SCALE_BYTES = (0, 1, 2, 3, 100, 126, 127, 128, 200, 252, 253, 254)


def test_all_16_codes_every_scale_numpy_and_jax():
    """Every code x a range of scale bytes (subnormal results, 2^0, overflow to inf) decodes as the
    reference, bit for bit, in NumPy and in jitted JAX."""
    packed = np.array([[(c % 16) | (((c + 1) % 16) << 4) for c in range(16)]], np.uint8)  # 32 codes
    assert sorted({int(x) & 15 for x in packed[0]} | {int(x) >> 4 for x in packed[0]}) == list(range(16))
    jit_dec = jax.jit(M.dequantize_mxfp4_jax)
    for e in SCALE_BYTES:
        sc = np.array([[e]], np.uint8)
        want = ref_decode(packed, sc)
        assert np.array_equal(bits(M.dequantize_mxfp4(packed, sc, "t")), bits(want)), e
        assert np.array_equal(bits(jit_dec(jnp.asarray(packed), jnp.asarray(sc))), bits(want)), e
    # the code table itself: +-{0, .5, 1, 1.5, 2, 3, 4, 6}, sign in bit 3
    assert [ref_code_value(c) for c in range(16)] == list(M.E2M1_VALUES.astype(float))
    assert GRID == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def _edge_matrix():
    rng = np.random.default_rng(7)
    w = rng.standard_normal((12, 96)).astype(np.float32)
    w[0, :32] = 0.0                                              # zero block
    w[0, 32:64] = -0.0                                           # negative-zero block
    w[1, :32] = np.float32(1e-41) * np.arange(32)                # subnormal amax
    w[1, 32:64] = np.float32(2.0 ** -130)                        # subnormal, a power of two
    w[2, :32] = rng.uniform(-1, 1, 32); w[2, 5] = 8.0            # amax exactly a power of two
    w[2, 32:64] = rng.uniform(-0.2, 0.2, 32); w[2, 40] = -0.25       # negative power-of-two amax
    w[3, :32] = 7.5; w[3, 3] = 6.9; w[3, 4] = -7.99              # saturation beyond 6 * 2^s
    w[4, :32] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.0] * 4, np.float32)  # ties
    w[5, :32] = -np.array([0.1, 0.0, -0.0, 3.0] * 8, np.float32)   # -0.0 and tiny negatives
    w[6] *= np.float32(2.0 ** 100)                               # large scale bytes
    w[7] *= np.float32(2.0 ** -100)
    w[8, :32] = np.float32(3.0e38); w[8, 0] = np.float32(-3.4e38)  # near float32 max
    return w


def test_encode_matches_reference_on_every_scale_edge():
    w = _edge_matrix()
    p, s = M.quantize_mxfp4(w, "edge")
    rp, rs = ref_encode(w)
    assert np.array_equal(s, rs) and np.array_equal(p, rp)
    # spot checks of the documented rules
    assert s[0, 0] == 0 and s[0, 1] == 0 and s[1, 0] == 0           # zero / subnormal blocks -> 2^-127
    assert s[2, 0] == 127 + 3 - 2 and s[2, 1] == 127 - 2 - 2        # amax 8 -> 2^1; amax 0.25 -> 2^-4
    codes = np.stack([p & 15, p >> 4], -1).reshape(p.shape[0], -1)
    assert s[3, 0] == 127 and set(codes[3, :32]) <= {7, 15}          # 7.5, 6.9, -7.99 saturate to +-6
    assert list(codes[4, :8]) == [0, 2, 2, 4, 4, 6, 6, 6]            # ties to even; 4 exact
    assert codes[0, 32] == 8 and list(codes[5, :3]) == [8, 8, 0]  # -0 and tiny negatives keep the sign


def test_round_trip_bit_exact_and_idempotent():
    rng = np.random.default_rng(1)
    w = np.concatenate([_edge_matrix()[:, :64], rng.standard_normal((12, 64)).astype(np.float32)], axis=1)
    p, s = M.quantize_mxfp4(w, "w", rows_per_chunk=5)             # chunking must not matter
    p1, s1 = M.quantize_mxfp4(w, "w")
    assert np.array_equal(p, p1) and np.array_equal(s, s1)
    d = M.dequantize_mxfp4(p, s, "w", rows_per_chunk=3)
    assert np.array_equal(bits(d), bits(ref_decode(p, s)))
    p2, s2 = M.quantize_mxfp4(d, "w")                             # decoded values re-encode identically
    assert np.array_equal(p2, p) and np.array_equal(s2, s)


def test_rows_any_count_width_multiple_of_32_or_refused():
    """Rows (output dim) and leading dims are free; the input width must be a multiple of 32."""
    w = np.random.default_rng(2).standard_normal((3, 7, 64)).astype(np.float32)
    p, s = M.quantize_mxfp4(w, "x")
    assert p.shape == (3, 7, 32) and s.shape == (3, 7, 2)
    rp, rs = ref_encode(w.reshape(21, 64))
    assert np.array_equal(p.reshape(21, 32), rp) and np.array_equal(s.reshape(21, 2), rs)
    with pytest.raises(CheckpointError, match=r"layers\.0\.w: input width 48 is not a multiple of the MXFP4 block 32"):
        M.quantize_mxfp4(np.zeros((4, 48), np.float32), "layers.0.w")
    with pytest.raises(CheckpointError, match=r"w: cannot MXFP4-quantise a non-finite value \(row 1, column 3\)"):
        bad = np.zeros((2, 32), np.float32); bad[1, 3] = np.inf
        M.quantize_mxfp4(bad, "w")


def test_jax_decode_equals_numpy_bit_for_bit():
    rng = np.random.default_rng(3)
    p = rng.integers(0, 256, (2, 5, 64), dtype=np.uint8)
    s = rng.integers(0, 255, (2, 5, 4), dtype=np.uint8)              # every byte but 0xFF
    s[0, 0, :] = [0, 1, 253, 254]
    want = M.dequantize_mxfp4(p, s, "w")
    assert np.array_equal(bits(want), bits(ref_decode(p.reshape(10, 64), s.reshape(10, 4)).reshape(2, 5, 128)))
    got = jax.jit(M.dequantize_mxfp4_jax)(jnp.asarray(p), jnp.asarray(s))
    assert got.dtype == jnp.float32 and got.shape == (2, 5, 128)
    assert np.array_equal(bits(got), bits(want))
    bf = jax.jit(lambda a, b: M.dequantize_mxfp4_jax(a, b, jnp.bfloat16))(jnp.asarray(p), jnp.asarray(s[..., :]))
    assert bf.dtype == jnp.bfloat16
    normal = np.abs(want) >= 2.0 ** -126
    assert np.array_equal(np.asarray(bf, np.float32)[normal], want[normal])  # E2M1 x 2^k fits bf16 exactly
    with pytest.raises(ValueError, match="not an MXFP4 pair"):
        M.dequantize_mxfp4_jax(jnp.zeros((4, 16), jnp.uint8), jnp.zeros((4, 2), jnp.uint8))


def test_columns_decode_is_the_row_decode_transposed_bit_for_bit():
    """`dequantize_mxfp4_columns` (codes stored [..., K/2, N]) gives the even and the odd inputs of the
    weight, each exactly the row decode's columns 0::2 / 1::2 transposed (float32 and bfloat16), and
    `MXFP4Blocks` stored by columns decodes, slices and converts back to the same bytes."""
    from ling_jax.quantized import MXFP4Blocks
    rng = np.random.default_rng(5)
    p = rng.integers(0, 256, (2, 6, 64), dtype=np.uint8)
    s = rng.integers(0, 255, (2, 6, 4), dtype=np.uint8)
    s[0, 0, :] = [0, 1, 253, 254]
    rows = M.dequantize_mxfp4(p, s, "w")                                       # [2, 6, 128]
    pc, sc = jnp.asarray(np.swapaxes(p, -1, -2)), jnp.asarray(np.swapaxes(s, -1, -2))
    for dt in (jnp.float32, jnp.bfloat16):
        even, odd = jax.jit(lambda a, b: M.dequantize_mxfp4_columns(a, b, dt))(pc, sc)
        assert even.shape == odd.shape == (2, 64, 6) and even.dtype == dt
        want = jnp.asarray(rows, jnp.float32).astype(dt)
        for got, j in ((even, 0), (odd, 1)):
            assert np.array_equal(bits(np.asarray(got, np.float32)),
                                  bits(np.asarray(jnp.swapaxes(want[..., j::2], 1, 2), np.float32)))
    w = MXFP4Blocks(jnp.asarray(p), jnp.asarray(s))
    c = w.as_columns()
    assert c.columns and c.shape == w.shape == (2, 6, 128) and c.packed.shape == (2, 64, 6)
    assert np.array_equal(bits(np.asarray(c.dequantize())), bits(rows))
    assert np.array_equal(bits(np.asarray(c.take(jnp.array([1])).dequantize())), bits(rows[1:]))
    assert np.array_equal(bits(np.asarray(c.experts(1, 1).dequantize())), bits(rows[1:]))
    back = c.as_rows()
    assert not back.columns and np.array_equal(np.asarray(back.packed), p)
    assert np.array_equal(np.asarray(back.scales), s)
    with pytest.raises(ValueError, match="stored by rows"):
        w.halves(jnp.float32)
    with pytest.raises(ValueError, match="not an MXFP4 pair by columns"):
        M.dequantize_mxfp4_columns(jnp.zeros((16, 4), jnp.uint8), jnp.zeros((2, 4), jnp.uint8))


def test_gaussian_relative_error():
    """Stated accuracy: N(0, 1) weights [256, 4096] -> relative Frobenius error 0.1150 (±0.002),
    i.e. ~11.5% (MXFP4's 1 mantissa bit; the spec's floor-scale rule saturates a block's few largest
    values). Measured 2026-12-01 with this seed; a different seed moves it by < 0.001."""
    w = np.random.default_rng(4).standard_normal((256, 4096)).astype(np.float32)
    p, s = M.quantize_mxfp4(w, "g")
    d = M.dequantize_mxfp4(p, s, "g")
    rel = float(np.linalg.norm((d - w).astype(np.float64)) / np.linalg.norm(w.astype(np.float64)))
    assert abs(rel - 0.1150) < 0.002, rel


def test_malformed_pairs_refused_naming_the_tensor():
    p = np.zeros((4, 16), np.uint8)
    s = np.zeros((4, 1), np.uint8)
    with pytest.raises(CheckpointError, match=r"^e\.w: packed MXFP4 width 15 is odd"):
        M.dequantize_mxfp4(np.zeros((4, 15), np.uint8), s, "e.w")
    with pytest.raises(CheckpointError, match=r"^e\.w: packed MXFP4 width 24 is not a multiple of 16"):
        M.dequantize_mxfp4(np.zeros((4, 24), np.uint8), s, "e.w")
    with pytest.raises(CheckpointError, match=r"^e\.weight_scale_inv: MXFP4 scale shape \[4, 2\], expected \[4, 1\]"):
        M.dequantize_mxfp4(p, np.zeros((4, 2), np.uint8), "e.w", "e.weight_scale_inv")
    bad = s.copy(); bad[2, 0] = 0xFF
    with pytest.raises(CheckpointError, match=r"^e\.weight_scale_inv: 1 MXFP4 scale byte\(s\) are 0xFF \(E8M0 NaN\), "
                                              r"first at \[2, 0\]"):
        M.dequantize_mxfp4(p, bad, "e.w", "e.weight_scale_inv")
    with pytest.raises(CheckpointError, match=r"e\.w: MXFP4 codes must be uint8, got int8"):
        M.dequantize_mxfp4(p.astype(np.int8), s, "e.w")
    # header-level checks against the config shape (what inspect / quantize use)
    probs = M.mxfp4_problems("a.weight", (8, 40), "U8", "a.weight_scale_inv", (8, 3), "F32", logical=(8, 64))
    assert any("packed MXFP4 shape [8, 40], expected [8, 32]" in x for x in probs)
    assert any("MXFP4 scale stored F32" in x for x in probs)
    assert any("a.weight_scale_inv: MXFP4 scale shape [8, 3], expected [8, 2]" in x for x in probs)
    assert M.mxfp4_problems("a.weight", (8, 32), "U8", "a.s", (8, 2), "F8_E8M0", logical=(8, 64)) == []
    assert "without their scale tensor" in M.mxfp4_problems("a.weight", (8, 32), "U8", "a.s", None, None)[0]
