"""YaRN to 1M positions (issue 22): a factor-4 YaRN over 262,144 positions gives the float64 formula's
inverse frequencies and attention factor, rotary angles near position 1,048,576 are accurate to
float32 rounding of the result (a float32 product position × frequency is off by ~0.04 there), and
`--allow-long-context` goes up to the scaled length and no further."""
from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import np_reference as R
from ling_jax.commands.common import ArgumentValueError, check_context_length
from ling_jax.rope import MAX_ROPE_POSITION, apply_rope, context_limit, rope_angles, rope_parameters, softmax_scale

ONE_M = 1 << 20
YARN = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 262144}


def yarn_cfg(**extra):
    """The release's rotary shape (rope dim 64, theta 6e6, 262,144 positions) with a factor-4 YaRN."""
    return R.tiny_config(qk_rope_head_dim=64, qk_nope_head_dim=16, qk_head_dim=80, rope_theta=6e6,
                         max_position_embeddings=262144, rope_scaling=dict(YARN, **extra))


def yarn_formula_f64(d: int, base: float, s: float, L0: int, beta_fast=32.0, beta_slow=1.0):
    """The YaRN inverse frequencies and attention factor written out from the paper / HF's
    `_compute_yarn_parameters` (truncated correction range, mscale 0.1·ln s + 1), in float64."""
    i = np.arange(0, d, 2, dtype=np.float64)
    pos_freqs = base ** (i / d)
    extra, inter = 1.0 / pos_freqs, 1.0 / (s * pos_freqs)
    low = math.floor(d * math.log(L0 / (beta_fast * 2 * math.pi)) / (2 * math.log(base)))
    high = math.ceil(d * math.log(L0 / (beta_slow * 2 * math.pi)) / (2 * math.log(base)))
    low, high = max(low, 0), min(high, d - 1)
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor, 0.1 * math.log(s) + 1.0


def test_yarn_parameters_equal_float64_formula():
    cfg = yarn_cfg()
    inv, af = rope_parameters(cfg)
    want_inv, want_af = yarn_formula_f64(64, 6e6, 4.0, 262144)
    assert inv.dtype == np.float64
    np.testing.assert_allclose(inv, want_inv, rtol=1e-14, atol=0)
    assert abs(af - want_af) < 1e-15 and abs(af - 1.1386294361119891) < 1e-15
    ref_inv, ref_af = R.rope_inv_freq(cfg)
    np.testing.assert_allclose(inv, ref_inv, rtol=1e-14, atol=0)
    assert af == pytest.approx(ref_af, rel=1e-15)
    # both regimes present: high frequencies kept, low ones interpolated by exactly 1/4
    extra = 6e6 ** (-np.arange(0, 64, 2) / 64)
    assert inv[0] == extra[0] and inv[-1] == pytest.approx(extra[-1] / 4, rel=1e-15)
    # mscale_all_dim: the softmax scale carries mscale(s, mscale_all_dim)^2, in float64
    cfg2 = yarn_cfg(mscale=1.0, mscale_all_dim=1.0)
    assert softmax_scale(cfg2) == pytest.approx(80 ** -0.5 * (0.1 * math.log(4) + 1) ** 2, rel=1e-15)
    assert rope_parameters(cfg2)[1] == 1.0


@pytest.mark.parametrize("start", [ONE_M - 4096, ONE_M - 7, 777_777, 262_143])
def test_cos_sin_near_one_million_match_float64(start):
    """cos/sin of the jitted angles against float64 cos/sin of position × inv_freq: within a few
    float32 ulps (2e-6), where the float32 product is off by up to ~0.04 (checked too, so the test
    would catch a return to it)."""
    inv, _ = rope_parameters(yarn_cfg())
    pos = np.arange(start, start + 4096 if start + 4096 <= ONE_M else ONE_M + 1, dtype=np.int64)
    ang = np.asarray(jax.jit(lambda p: rope_angles(p, inv))(jnp.asarray(pos, jnp.int32)))
    c, s = np.asarray(jnp.cos(jnp.asarray(ang))), np.asarray(jnp.sin(jnp.asarray(ang)))
    ref = pos[:, None].astype(np.float64) * inv[None, :]
    assert np.max(np.abs(c - np.cos(ref))) < 2e-6
    assert np.max(np.abs(s - np.sin(ref))) < 2e-6
    naive = (pos[:, None].astype(np.float32) * inv[None, :].astype(np.float32)).astype(np.float64)
    if start > 500_000:
        assert np.max(np.abs(np.cos(naive) - np.cos(ref))) > 1e-2


def test_apply_rope_at_one_million_matches_float64_reference():
    """The model's rotation (int32 positions, attention factor) against np_reference's float64 one."""
    inv, af = rope_parameters(yarn_cfg())
    rng = np.random.default_rng(0)
    pos = np.array([[ONE_M - 1, ONE_M, 999_999, 3]], np.int32)
    x = rng.standard_normal((1, 4, 2, 64)).astype(np.float32)  # [B,T,H,dr]
    got = np.asarray(jax.jit(lambda x, p: apply_rope(x, p, inv, af))(x, pos))
    want = np.stack([R.apply_rope_interleaved(x[0, :, h], pos[0], inv, af) for h in range(2)], axis=1)
    assert np.max(np.abs(got[0] - want)) < 2e-5 * np.max(np.abs(want))


def test_context_limit_is_the_scaled_length():
    assert context_limit(yarn_cfg()) == ONE_M
    assert context_limit(R.tiny_config()) == MAX_ROPE_POSITION
    assert MAX_ROPE_POSITION > ONE_M and MAX_ROPE_POSITION <= np.iinfo(np.int32).max


def test_allow_long_context_accepts_up_to_scaled_length_and_no_further():
    cfg = yarn_cfg()
    check_context_length(262144, cfg, False, "--input-ids")
    with pytest.raises(ArgumentValueError, match="max_position_embeddings=262144"):
        check_context_length(262145, cfg, False, "--input-ids")
    check_context_length(ONE_M, cfg, True, "--input-ids")
    with pytest.raises(ArgumentValueError, match=r"scaled context length 1048576 \(YaRN factor 4"):
        check_context_length(ONE_M + 1, cfg, True, "--input-ids")


def test_engine_max_seq_len_accepts_up_to_scaled_length_and_no_further():
    """The server's `--max-seq-len` (its per-request limit): beyond max_position_embeddings only with
    --allow-long-context, and never beyond the scaled length."""
    from ling_jax.commands.engine_args import check_engine_args

    class Model:
        cfg, mtp = yarn_cfg(), object()

    def args(n, allow):
        return argparse.Namespace(speculative=0, max_seq_len=n, allow_long_context=allow, max_slots=1, page_size=16,
                                  prefill_chunk=64, cache_memory=None, prefix_cache_memory=None,
                                  no_prefix_cache=False, snapshot_interval=None, warmup=False)

    check_engine_args(args(ONE_M, True), Model)
    with pytest.raises(ArgumentValueError, match="--allow-long-context"):
        check_engine_args(args(262145, False), Model)
    with pytest.raises(ArgumentValueError, match="scaled context length 1048576"):
        check_engine_args(args(ONE_M + 1, True), Model)
