"""Flash-decoding MLA kernel (interpret mode) against `pallas_kernels.mla.reference.latent_attention` with the
model's mask `attention_mask(q_pos, S, kv_len)`. Tolerances: float32 1e-5, bfloat16 1e-2 (relative)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from pallas_kernels.mla.kernel import latent_attention_pallas
from pallas_kernels.mla.reference import attention_mask, latent_attention

TOL = {"float32": 1e-5, "bfloat16": 1e-2}

# Interpret-mode kernels compile to large XLA loops: skip LLVM's expensive passes (compile ~2× faster).
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fast(f, **jit_kw):
    return jax.jit(f, compiler_options=FAST, **jit_kw)
H, R, DR = 2, 32, 16


def _inputs(seed, B, T, S, dtype):
    rng = np.random.default_rng(seed)  # NumPy: eager jax.random ops would each compile
    dt = jnp.dtype(dtype)
    shapes = [(B, T, H, R), (B, T, H, DR), (B, S, R), (B, S, DR)]
    return tuple(jnp.asarray(rng.standard_normal(sh), dt) for sh in shapes)


CASES = [
    # T, S, kv_len per sequence, dtype, kernel kwargs
    (1, 300, [1, 300, 129], "float32", {"mode": "loop", "block_s": 64}),  # decode; S % block_s != 0
    (1, 300, [0, 300, 77], "float32", {"mode": "grid", "block_s": 64, "num_splits": 2}),  # empty sequence too
    (3, 256, [3, 256, 130], "float32", {"mode": "loop", "block_s": 32, "num_splits": 3}),  # verify chunk
    (3, 256, [3, 256, 130], "bfloat16", {"mode": "grid", "block_s": 128}),
]


@pytest.mark.parametrize("T,S,kv_len,dtype,kw", CASES)
def test_latent_attention_matches_twin(T, S, kv_len, dtype, kw):
    B = len(kv_len)
    q_hat, q_pe, c, k_pe = _inputs(T + S, B, T, S, dtype)
    q_pos = jnp.asarray(np.asarray(kv_len)[:, None] - T + np.arange(T)[None, :], jnp.int32)  # last T tokens
    kv_len = jnp.asarray(kv_len, jnp.int32)
    scale = 192 ** -0.5
    ref = fast(lambda qh, qp, c, kp, n, pos: latent_attention(qh, qp, c, kp, attention_mask(pos, S, n), scale))(
        q_hat, q_pe, c, k_pe, kv_len, q_pos)
    out = fast(lambda *a: latent_attention_pallas(*a, scale, **kw))(q_hat, q_pe, c, k_pe, kv_len, q_pos)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < TOL[dtype]
    if int(kv_len.min()) == 0:  # a sequence with no visible key gives zeros, as the twin
        assert not np.asarray(out[0], np.float32).any()
