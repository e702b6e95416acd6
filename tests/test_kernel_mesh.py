"""Pallas kernels on a mesh run per device inside shard_map (`ling_jax.kernel_mesh`): sharded = unsharded.

Why: a Mosaic / Triton kernel is one custom call XLA cannot partition (the TPU compiler refused the
model's decode program on a pod: "Mosaic kernels cannot be automatically partitioned"). The wrappers
must give the unsharded kernel's numbers on every layout the placement rules produce. Run here in
interpret mode on the 8 simulated CPU devices; tests/test_aot.py compiles them for real targets.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding as S
from conftest import rel_err
from ling_jax.forward import forward
from ling_jax.kernel_mesh import fp8_linear_on_mesh
from ling_jax.loader import load_model
from pallas_kernels.fp8.kernel import fp8_linear_pallas
from pallas_kernels.fp8.reference import fp8_linear
from test_sharding import IDS, TOL, write_small


def _fp8_weight(rng, n, k):
    w = rng.standard_normal((n, k)).astype(np.float32)
    scales = rng.uniform(0.01, 0.05, ((n + 127) // 128, (k + 127) // 128)).astype(np.float32)
    full = np.repeat(np.repeat(scales, 128, 0), 128, 1)[:n, :k]
    return jnp.asarray((w / full).clip(-448, 448)).astype(jnp.float8_e4m3fn), jnp.asarray(scales)


@pytest.mark.parametrize("axes,mesh_spec", [(("mlp", "embed"), "model=2,expert=4"),    # columns split
                                            (("embed", "mlp"), "model=2,expert=4"),    # rows split: psum
                                            (("mlp", "embed"), "model=8")])
def test_fp8_linear_on_mesh_equals_one_device(axes, mesh_spec):
    rng = np.random.default_rng(0)
    n, k = (256, 512) if axes[0] == "mlp" else (512, 256)
    if mesh_spec == "model=8":
        n = 1024
    values, scales = _fp8_weight(rng, n, k)
    x = jnp.asarray(rng.standard_normal((2, 3, k)).astype(np.float32))
    mesh = S.parse_mesh(mesh_spec)
    kernel = functools.partial(fp8_linear_pallas, platform="cpu")
    want = np.asarray(fp8_linear(x, values, scales, (128, 128)), np.float64)
    got = jax.jit(lambda x, v, s: fp8_linear_on_mesh(kernel, fp8_linear, mesh, x, v, s, (128, 128), axes))(
        x, values, scales)
    assert rel_err(got, want) < 1e-5


def test_fp8_linear_on_mesh_falls_back_off_block_boundaries():
    """A shard that is not whole 128-blocks (N = 192 over model=2: 96 rows each) runs the XLA twin."""
    rng = np.random.default_rng(1)
    values, scales = _fp8_weight(rng, 192, 128)
    x = jnp.asarray(rng.standard_normal((4, 128)).astype(np.float32))
    calls = []

    def kernel(*a):
        calls.append(1)
        return fp8_linear_pallas(*a, platform="cpu")

    got = fp8_linear_on_mesh(kernel, fp8_linear, S.parse_mesh("model=2,expert=4"), x, values, scales, (128, 128),
                             ("mlp", "embed"))
    assert not calls
    assert rel_err(got, fp8_linear(x, values, scales, (128, 128))) < 1e-6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("kmesh") / "ckpt"
    write_small(d)
    return str(d)


def test_pallas_model_on_mesh_equals_one_device(ckpt):
    """The KDA chunk kernel (prefill), the KDA step kernel and the absorbed-MLA kernel (a cached
    decode step) on expert=4,model=2 (heads split over model) give the single-device XLA numbers."""
    from ling_jax.generate import generate

    one = load_model(ckpt, "float32", progress=False)
    want = np.asarray(forward(one, IDS)["logits"])
    want_tokens = generate(one, IDS.tolist(), 3).tokens
    mesh = S.parse_mesh("expert=4,model=2")
    model = load_model(ckpt, "float32", mesh=mesh, progress=False)
    model.exec = model.exec.replace(kernels="pallas", platform="cpu")
    assert rel_err(forward(model, IDS)["logits"], want) < TOL
    assert generate(model, IDS.tolist(), 3).tokens == want_tokens
