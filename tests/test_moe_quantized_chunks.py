"""Kept-quantised routed experts on the grouped ("ragged", TPU/GPU) path are dequantised a chunk of experts
at a time (`moe.experts_ragged_in_chunks`): the same outputs as dequantising the whole stack, and no
program holds a dequantised copy of the whole stack (issue 21: no dequantised weight stack in a step)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from ling_jax.checkpoint.mxfp4 import quantize_mxfp4
from ling_jax.moe import experts_grouped, experts_local
from ling_jax.quantized import MXFP4Blocks

E, I, D, N, K = 16, 32, 64, 24, 4


def _mxfp4(rng, shape):
    packed, scales = quantize_mxfp4(rng.standard_normal(shape).astype(np.float32) * 0.1)
    return MXFP4Blocks(jnp.asarray(packed), jnp.asarray(scales))


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    weights = (_mxfp4(rng, (E, I, D)), _mxfp4(rng, (E, I, D)), _mxfp4(rng, (E, D, I)))
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E + 4, K, replace=False) for _ in range(N)]), jnp.int32)  # ids ≥ E: none
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (N, K)), jnp.float32)
    return x, idx, wts, weights


@pytest.mark.parametrize("chunk", [1, 3, 8, 16])
def test_chunked_dequantisation_equals_the_whole_stack(case, chunk):
    """Chunks of 1, 3 (→ 2: a divisor of 16), 8 and all 16 experts; ids past the local experts give 0."""
    from ling_jax import moe
    x, idx, wts, weights = case
    whole = tuple(w.dequantize(jnp.float32) for w in weights)
    want = experts_grouped(x, jnp.where(idx < E, idx, E), *whole, 4.0, "ragged")
    got = moe.experts_ragged_in_chunks(x, jnp.where(idx < E, idx, E), weights, 4.0, chunk=chunk)
    assert rel_err(got, want) < 1e-6


def test_grouped_quantised_step_holds_no_dequantised_stack(case):
    """experts_local on the ragged path with MXFP4 weights: the compiled program has no [16, ...] float
    array of a whole expert stack (only chunks of EXPERT_CHUNK = 8 experts)."""
    x, idx, wts, weights = case
    fn = jax.jit(lambda x, idx, wts, ws: experts_local(x, idx, wts, 0, ws, 4.0, "grouped", "ragged"))
    text = fn.lower(x, idx, wts, weights).compile().as_text()
    stacks = re.findall(rf"f32\[{E},(?:{I},{D}|{D},{I})\]", text)
    chunks = re.findall(rf"f32\[8,(?:{I},{D}|{D},{I})\]", text)
    assert not stacks and chunks
    want = experts_local(x, idx, wts, 0, tuple(w.dequantize(jnp.float32) for w in weights), 4.0, "grouped", "ragged")
    assert rel_err(fn(x, idx, wts, weights), want) < 1e-6
