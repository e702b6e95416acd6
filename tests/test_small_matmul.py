"""Weights-first linears over few rows (`ExecConfig.weights_first_rows`, XLA:CPU): the same values
as `x @ Wᵀ` in float64, for any leading shape, and the switch taken exactly inside its range."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from ling_jax.exec_config import CPU_WEIGHTS_FIRST_ROWS, ExecConfig
from ling_jax.linear import Linear
from pallas_kernels.matmul import linear


@pytest.mark.parametrize("lead", [(2,), (8,), (2, 4), (1, 1, 64), (3, 7)])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_weights_first_equals_float64(lead, dtype, tol):
    rng = np.random.default_rng(sum(lead))
    x, w = rng.standard_normal((*lead, 48)), rng.standard_normal((40, 48)) / 7
    dt = jnp.dtype(dtype)
    got = jax.jit(lambda x, w: linear(x, w, 64))(jnp.asarray(x, dt), jnp.asarray(w, dt))
    assert got.shape == (*lead, 40) and got.dtype == dt
    assert rel_err(got, x @ w.T) < tol


def test_switch_follows_the_row_count():
    """The barrier (weights-first form) appears for 2 … weights_first_rows rows only; the CPU
    default turns it on, TPU/GPU defaults leave it off."""
    assert ExecConfig.for_backend("cpu").weights_first_rows == CPU_WEIGHTS_FIRST_ROWS > 0
    assert ExecConfig.for_backend("tpu").weights_first_rows == 0
    layer = Linear(16, 8, axes=("heads", "embed"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    ex = ExecConfig(weights_first_rows=4)
    for rows, first in ((1, False), (2, True), (4, True), (5, False)):
        jaxpr = str(jax.make_jaxpr(lambda x: layer(x, ex))(jnp.ones((1, rows, 16))))
        assert ("optimization_barrier" in jaxpr) == first, rows
    with pytest.raises(ValueError, match="weights_first_rows must be an int >= 0"):
        ExecConfig(weights_first_rows=-1)
