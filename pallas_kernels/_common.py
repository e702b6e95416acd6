"""Helpers shared by the kernels: backend detection, interpret default, compiler parameters."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

HIGHEST = jax.lax.Precision.HIGHEST
NEG = -1e30  # finite "minus infinity" for masked scores (keeps exp(m_old - m_new) free of NaN)


PLATFORMS = ("tpu", "gpu", "cpu")


def backend_platform(override: str | None = None) -> str:
    """'tpu', 'gpu' or 'cpu': `override` when given, else the default JAX backend.

    Every kernel entry point takes `platform=` and resolves it here once, so its block-size
    defaults, interpret default and compiler parameters all describe one target. An explicit
    target lets a CPU host lower a kernel ahead of time for another backend
    (`jax.jit(partial(kernel, platform="tpu")).trace(...).lower(lowering_platforms=("tpu",))`).
    """
    if override is not None:
        if override not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS} or None (the default backend), got {override!r}")
        return override
    p = jax.default_backend()
    return "gpu" if p in ("cuda", "rocm", "gpu") else p


def target(platform: str | None, interpret) -> tuple[str, bool]:
    """(platform, interpret) of one kernel call: `backend_platform(platform)`, and `interpret` None meaning
    interpret on CPU (no Pallas lowering there), compile on TPU/GPU."""
    plat = backend_platform(platform)
    return plat, (plat == "cpu" if interpret is None else bool(interpret))


def compiler_params(interpret: bool, plat: str, semantics=None, num_warps: int | None = None,
                    num_stages: int | None = None):
    """Backend-specific `compiler_params` for pallas_call (None in interpret mode).

    plat: 'tpu' | 'gpu' | 'cpu' (resolved by the caller, a static argument of its jit).
    semantics: TPU dimension semantics per grid axis ("parallel" / "arbitrary").
    """
    if interpret:
        return None
    if plat == "tpu":
        return pltpu.CompilerParams(dimension_semantics=tuple(semantics)) if semantics else None
    if plat == "gpu":  # always pass Triton params: they select the Triton backend (not Mosaic GPU)
        kw = {"num_warps": num_warps, "num_stages": num_stages}
        return pltriton.CompilerParams(**{k: v for k, v in kw.items() if v is not None})
    return None


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """2-D matmul with float32 accumulation; float32 operands run at HIGHEST (IEEE on Triton).

    trans_a / trans_b contract the first axis of `a` / the last axis of `b` as `a.T` / `b.T`,
    which Mosaic and Triton both lower without an explicit transpose of the operand in memory.
    """
    ca = 0 if trans_a else 1
    cb = 1 if trans_b else 0
    prec = HIGHEST if (a.dtype == jnp.float32 or b.dtype == jnp.float32) else None
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=prec,
                               preferred_element_type=jnp.float32)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())
