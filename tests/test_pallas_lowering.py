"""Ahead-of-time lowering of every kernel for TPU (Mosaic) and GPU (Triton) at Ling-3.1-flash widths.

No accelerator is needed: `lower(lowering_platforms=...)` runs the Pallas → Mosaic / Triton lowering
in Python on this CPU host. That catches unsupported primitives, block shapes Triton rejects (sizes
must be powers of two) and lowering-rule errors; it does not run the device compilers (Mosaic's
layout passes in libtpu, ptxas), register/VMEM limits or numerics — those need the bench on a device.
"""
import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels._common import backend_platform
from pallas_kernels.fp8.kernel import fp8_linear_pallas
from pallas_kernels.kda.chunk_kernel import kda_chunk_scan_pallas
from pallas_kernels.kda.step_kernel import kda_recurrent_scan_pallas, kda_recurrent_step_pallas
from pallas_kernels.mla.kernel import latent_attention_pallas

S_ = jax.ShapeDtypeStruct
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
H, D = 64, 128

CASES = {
    "kda_chunk": (lambda *a, **kw: kda_chunk_scan_pallas(*a, 64, interpret=False, **kw),
                  [S_((1, 300, H, D), F32)] * 4 + [S_((1, 300, H), F32), S_((1, H, D, D), F32)]),
    "kda_step": (lambda *a, **kw: kda_recurrent_step_pallas(*a, interpret=False, **kw),
                 [S_((8, H, D, D), F32)] + [S_((8, H, D), F32)] * 4 + [S_((8, H), F32)]),
    "kda_scan": (lambda *a, **kw: kda_recurrent_scan_pallas(*a, interpret=False, **kw),  # T > 1: a lax.scan
                 [S_((2, 3, H, D), F32)] * 4 + [S_((2, 3, H), F32), S_((2, H, D, D), F32)]),
    "mla_decode": (lambda *a, **kw: latent_attention_pallas(*a, 192 ** -0.5, interpret=False, **kw),
                   [S_((2, 1, H, 512), BF16), S_((2, 1, H, 64), BF16), S_((2, 4096, 512), BF16),
                    S_((2, 4096, 64), BF16), S_((2,), I32), S_((2, 1), I32)]),
    "mla_verify": (lambda *a, **kw: latent_attention_pallas(*a, 192 ** -0.5, interpret=False, **kw),
                   [S_((1, 3, H, 512), BF16), S_((1, 3, H, 64), BF16), S_((1, 1000, 512), BF16),
                    S_((1, 1000, 64), BF16), S_((1,), I32), S_((1, 3), I32)]),
    "fp8_linear": (lambda *a, **kw: fp8_linear_pallas(*a, interpret=False, **kw),
                   [S_((8, 4096), BF16), S_((576, 4096), jnp.float8_e4m3fn), S_((5, 32), F32)]),
}
MARK = {"tpu": "tpu_custom_call", "gpu": "triton"}


@pytest.mark.parametrize("plat", ["tpu", "gpu"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_lowers(plat, name):
    fn, args = CASES[name]
    traced = jax.jit(functools.partial(fn, platform=plat)).trace(*args)
    text = traced.lower(lowering_platforms=("cuda" if plat == "gpu" else "tpu",)).as_text()
    assert MARK[plat] in text


def test_unknown_platform_is_rejected():
    with pytest.raises(ValueError, match="platform must be one of"):
        backend_platform("cuda")
    assert backend_platform("tpu") == "tpu"
