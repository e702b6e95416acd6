"""Bias-free linear layer holding its weight in the checkpoint's `[out, in]` layout."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.ops import linear


def init_normal(rngs: nnx.Rngs, shape, dtype, fan_in: int | None = None):
    """N(0, 1/fan_in): keeps activations O(1) in randomly initialised models."""
    fan_in = fan_in or shape[-1]
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dtype)


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(init_normal(rngs, (out_features, in_features), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return linear(x, self.weight[...])
