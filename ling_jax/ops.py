"""Dtype names, the one matmul every projection goes through, and the right-padding mask.

`linear`, `einsum` and `precision` are defined in `pallas_kernels.matmul` (the kernels' XLA
references use the same policy and may not import the model) and re-exported here for the model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import einsum, linear, precision  # noqa: F401  (re-exported for the model)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def default_dtype() -> str:
    """float32 on CPU (XLA:CPU bf16 matmuls are ~20x slower), bfloat16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def as_dtype(name_or_dtype) -> jnp.dtype:
    if isinstance(name_or_dtype, str):
        if name_or_dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name_or_dtype!r}")
        return jnp.dtype(DTYPES[name_or_dtype])
    return jnp.dtype(name_or_dtype)


def real_tokens(n_valid: jax.Array, T: int) -> jax.Array:
    """[B,T] bool: position t of row b is a real token (t < n_valid[b]; right padding after)."""
    return jnp.arange(T)[None, :] < n_valid[:, None]
