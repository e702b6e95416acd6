"""FP8 block-scaled matmul kernel (interpret mode) against its reference `pallas_kernels.fp8.reference.fp8_linear`
(= linear(x, block_dequant_fp8_jax(wq, scale))). Tolerances: float32 1e-5, bfloat16 1e-2 (relative)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from ling_jax.checkpoint.fp8 import block_quant_fp8
from pallas_kernels.fp8.kernel import fp8_linear_pallas
from pallas_kernels.fp8.reference import fp8_linear

TOL = {"float32": 1e-5, "bfloat16": 1e-2}

# Interpret-mode kernels compile to large XLA loops: skip LLVM's expensive passes (compile ~2× faster).
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fast(f, **jit_kw):
    return jax.jit(f, compiler_options=FAST, **jit_kw)

CASES = [
    # M, N, K, dtype, kernel kwargs
    (5, 300, 200, "float32", {}),  # N, K not multiples of 128; one K step
    (5, 300, 200, "bfloat16", {"block_n": 256, "block_k": 128}),  # accumulation over K grid steps
    (1, 128, 1200, "float32", {}),  # K/128 > 8: in-kernel fori_loop over K slices
]


@pytest.mark.parametrize("M,N,K,dtype,kw", CASES)
def test_fp8_linear_matches_twin(M, N, K, dtype, kw):
    rng = np.random.default_rng(M * N + K)
    w = rng.standard_normal((N, K)).astype(np.float32) * rng.uniform(0.05, 4.0, (N, 1)).astype(np.float32)
    wq, scale = block_quant_fp8(w)
    wq, scale = jnp.asarray(wq), jnp.asarray(scale)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.dtype(dtype))
    ref = fast(fp8_linear)(x, wq, scale)
    out = fast(lambda *a: fp8_linear_pallas(*a, **kw))(x, wq, scale)
    assert out.shape == (M, N) and out.dtype == x.dtype
    assert rel_err(out, ref) < TOL[dtype]
