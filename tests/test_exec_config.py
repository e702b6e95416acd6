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
    # bfloat16 weight stacks in the TPU loop's tiles: a TPU layout only
    assert (cpu.loop_stack_layouts, tpu.loop_stack_layouts, gpu.loop_stack_layouts) == (False, True, False)
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


def test_loop_stack_layouts_places_each_bfloat16_stack_by_the_rule_and_changes_no_value(tiny_cfg, tiny_params,
                                                                                    monkeypatch):
    """`ExecConfig.loop_stack_layouts` at load time: stacking the layers for the scan places every
    bfloat16 stack as `placement.stack_format` says (on a TPU7x, (16, 128) tiles: the TPU side is
    tests/test_aot.py), the arrays stacked by a program whose outputs carry that Format. On CPU the
    rule leaves every layout alone, so here a stand-in rule (row-major, CPU's own layout) records its
    calls: each 4-dim bfloat16 stack goes through it, nothing else does, and the logits are the
    untiled model's bit for bit."""
    from jax.experimental.layout import Format, Layout
    from flax import nnx

    from conftest import load_from_dict
    import ling_jax.layer_stack as LS

    model = load_from_dict(tiny_cfg, tiny_params, dtype="bfloat16").set_layer_loop("unroll")
    plain = nnx.clone(model).set_layer_loop("scan")
    seen = []

    def rule(shape, dtype, sharding, block_scales=False):
        seen.append((tuple(shape), jnp.dtype(dtype)))
        assert not block_scales  # no FP8 matrix kept here (the BlockFP8 case: the next test)
        if jnp.dtype(dtype) != jnp.bfloat16 or len(shape) < 4:
            return sharding
        return Format(Layout(major_to_minor=tuple(range(len(shape)))), sharding)

    monkeypatch.setattr(LS, "stack_format", rule)
    model.exec = model.exec.replace(loop_stack_layouts=True)
    model.set_layer_loop("scan")
    stacks = [v.get_value() for p, v in nnx.to_flat_state(nnx.state(model.model.layers))]
    assert seen and len(seen) == len([x for x in stacks if hasattr(x, "shape")])  # every stacked leaf asked
    bf16 = [x for x in stacks if getattr(x, "dtype", None) == jnp.bfloat16 and x.ndim >= 4]
    assert bf16 and all(x.format.layout.major_to_minor == tuple(range(x.ndim)) for x in bf16)
    ids = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], jnp.int32)
    assert jnp.array_equal(model(ids)["logits"], plain(ids)["logits"])


def test_loop_stack_layouts_tells_the_rule_which_stacks_are_fp8_block_scales(monkeypatch):
    """Stacking a run whose Linear weights are kept FP8 (`BlockFP8`) asks `placement.stack_format`
    with `block_scales=True` for the scales and only for them (recognised by the quantised value's
    structure), so on a TPU they get the layout the loop reads (tests/test_aot.py); the values and
    scales stack unchanged."""
    from flax import nnx

    import ling_jax.layer_stack as LS
    from ling_jax.linear import Linear
    from ling_jax.quantized import BlockFP8

    layers = []
    for i in range(4):
        lin = Linear(256, 384, axes=("mlp", "embed"), dtype=jnp.float32, rngs=nnx.Rngs(i))
        vals = jnp.full((384, 256), i, jnp.float8_e4m3fn)
        lin.weight.set_value(BlockFP8(vals, jnp.full((3, 2), float(i + 1), jnp.float32)))
        layers.append(lin)
    seen = []

    def rule(shape, dtype, sharding, block_scales=False):
        seen.append((tuple(shape), str(jnp.dtype(dtype)), block_scales))
        return sharding

    monkeypatch.setattr(LS, "stack_format", rule)
    stacked = LS.stack_modules(layers, 2, 2, loop_layouts=True)
    assert sorted(seen) == [((2, 2, 3, 2), "float32", True), ((2, 2, 384, 256), "float8_e4m3fn", False)]
    w = stacked.weight.get_value()
    assert isinstance(w, BlockFP8) and w.scales.shape == (2, 2, 3, 2)
    assert float(w.scales[1, 0, 0, 0]) == 3.0 and float(w.values[1, 1, 0, 0]) == 3.0
