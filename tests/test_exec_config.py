"""`ExecConfig`: one frozen, hashable execution config; backend defaults resolved in one place."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import pytest

import np_reference as R
from ling_jax.config import LingConfig
from ling_jax.exec_config import ExecConfig

SPEC = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "spec", "config.ling-3.1-flash.json")


def test_backend_defaults():
    cpu, tpu, gpu = (ExecConfig.for_backend(p) for p in ("cpu", "tpu", "gpu"))
    assert (cpu.kernels, cpu.grouped_matmul, cpu.kda_chunk) == ("xla", "capacity", 16)
    for accel, chunk in ((tpu, 64), (gpu, 32)):  # GPU: 32 (Triton's compile time, exec_config.GPU_KDA_CHUNK)
        assert (accel.kernels, accel.grouped_matmul, accel.kda_chunk) == ("pallas", "ragged", chunk)
    # the target platform reaches every kernel call (a compile-only run compiles for it on a CPU host)
    assert (cpu.platform, tpu.platform, gpu.platform) == ("cpu", "tpu", "gpu")
    # the k_pe page pools stored row-major on TPU only (elsewhere that is the default layout already)
    assert (cpu.pool_layout, tpu.pool_layout, gpu.pool_layout) == ("default", "token_rows", "default")
    assert ExecConfig.for_backend("cuda").platform == "gpu"
    with pytest.raises(ValueError, match="platform"):
        ExecConfig(platform="metal")
    assert ExecConfig.for_backend() == ExecConfig.for_backend(jax.default_backend())
    # None overrides mean "the default" (CLI flags left unset); other overrides win
    assert ExecConfig.for_backend("tpu", kernels=None, kda_chunk=None).kernels == "pallas"
    assert ExecConfig.for_backend("tpu", kernels="xla", kda_chunk=8) == dataclasses.replace(tpu, kernels="xla",
                                                                                            kda_chunk=8)


def test_layer_loop_follows_the_model_shape():
    """Shallow wide schedules unroll (XLA:CPU copies scanned weight slices), deep or narrow ones scan."""
    real = LingConfig.from_json(SPEC)
    assert ExecConfig.for_backend("cpu", real).layer_loop == "scan"          # 72 layers
    assert ExecConfig.for_backend("cpu", R.tiny_config()).layer_loop == "scan"  # narrow
    wide = R.tiny_config(num_hidden_layers=6, hidden_size=512, expert_swiglu_limit_list=[0.0] * 6,
                         share_expert_swiglu_limit_list=[0.0] * 6)
    assert ExecConfig.for_backend("cpu", wide).layer_loop == "unroll"
    assert ExecConfig.for_backend("cpu").layer_loop == "scan"  # no config: the safe default


@pytest.mark.parametrize("field,value", [("kernels", "cuda"), ("experts", "ep"), ("grouped_matmul", "dense"),
                                         ("mla_form", "mixed"), ("layer_loop", "auto"), ("pool_layout", "auto"),
                                         ("kda_chunk", 0), ("kda_chunk", 2.5), ("remat", "no_such_policy")])
def test_bad_values_are_refused_by_field_name(field, value):
    with pytest.raises(ValueError, match=rf"ExecConfig\.{field} "):
        ExecConfig(**{field: value})


def test_frozen_hashable_and_static_under_jit():
    ex = ExecConfig.for_backend("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ex.kernels = "pallas"
    assert hash(ex) == hash(ExecConfig.for_backend("cpu")) and ex == ExecConfig.for_backend("cpu")
    traces = []

    f = jax.jit(lambda x, ex: (traces.append(ex), x * ex.kda_chunk)[1], static_argnums=1)
    x = jnp.ones(3)
    assert float(f(x, ex)[0]) == 16.0 and float(f(x, ExecConfig.for_backend("cpu"))[0]) == 16.0
    assert len(traces) == 1  # an equal config reuses the compiled function
    assert float(f(x, ex.replace(kda_chunk=4))[0]) == 4.0 and len(traces) == 2


def test_model_carries_its_exec_config(tiny_model):
    assert tiny_model.exec == ExecConfig.for_backend(None, tiny_model.cfg)
