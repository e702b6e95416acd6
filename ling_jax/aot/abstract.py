"""Shape-only parameters and state placed on compile-only devices: what `load_model` + `Engine` would hold.

Nothing is read or allocated. The parameters are the loader's own `abstract_model` (the stored dtypes
of the release, FP8 / MXFP4 kept resident as `BlockFP8` / `MXFP4Blocks`) with every value a
`jax.ShapeDtypeStruct` carrying the sharding the loader's placement rules give it
(`placement.variable_sharding`), so `jit(...).lower(params, ...)` compiles exactly what the loaded
model runs. The engine's pools are placed by the engine's own rule (`pools.placed_like`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.accounting import RELEASE_FP8_LAYOUT
from ling_jax.checkpoint.blocks import release_fp8, release_mxfp4
from ling_jax.config import LingConfig
from ling_jax.exec_config import ExecConfig
from ling_jax.loader import abstract_model
from ling_jax.layer_stack import is_stacked_path
from ling_jax.placement import attach_mesh, stack_format, variable_sharding
from ling_jax.quantized import BlockFP8, MXFP4Blocks

WEIGHTS = ("bf16", "fp8", "mxfp4")


def _placed(sds, sharding):
    return jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=sharding)


def placed_abstract_model(cfg: LingConfig, weights: str, mesh, platform: str, *, dtype=jnp.bfloat16,
                          with_mtp: bool = True, exec_overrides: dict | None = None):
    """The model `load_model(release checkpoint in `weights` format, mesh=mesh, keep_quantized=True)`
    builds, shape-only: bf16 = every tensor in `dtype`; fp8 = the release's FP8 matrices kept as
    BlockFP8 (layout A of spec §12.7, as `ling-jax plan`); mxfp4 = routed experts kept MXFP4 too. Its `exec` is `ExecConfig.for_backend(platform,
    cfg)` (every backend-dependent choice and kernel target for the *target*, not this host) on `mesh`.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    f8 = release_fp8(cfg, RELEASE_FP8_LAYOUT) if weights != "bf16" else None
    mx = release_mxfp4(cfg) if weights == "mxfp4" else None
    model = abstract_model(cfg, dtype, with_mtp and cfg.has_mtp, f8, mx)
    heads = cfg.num_attention_heads
    ex = ExecConfig.for_backend(platform, cfg, **(exec_overrides or {}))
    for path, var in nnx.to_flat_state(nnx.state(model)):  # Variables are shared with the model
        v = var.get_value()
        if isinstance(v, MXFP4Blocks) and ex.mxfp4_columns:  # stored as the loader stores them for the target
            v = v.as_columns()
            var.set_value(v)
        sh = variable_sharding(path, var, mesh, heads)
        stacked = ex.loop_stack_layouts and is_stacked_path(path)  # as the loader stacks them for the target
        if isinstance(v, BlockFP8):
            ssh = stack_format(v.scales.shape, v.scales.dtype, sh.scales, block_scales=True) if stacked else sh.scales
            var.set_value(BlockFP8(_placed(v.values, sh.values), _placed(v.scales, ssh), v.block))
        elif isinstance(v, MXFP4Blocks):
            var.set_value(MXFP4Blocks(_placed(v.packed, sh.packed), _placed(v.scales, sh.scales), v.columns))
        else:
            if stacked:
                sh = stack_format(v.shape, v.dtype, sh)
            var.set_value(_placed(v, sh))
    model.exec = ex
    return attach_mesh(model, mesh)


def replicated(tree, mesh):
    """Host arrays (program inputs) as ShapeDtypeStructs replicated on `mesh` (None leaves kept)."""
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=rep), tree)


def abstract_like(make, shardings):
    """ShapeDtypeStructs of `make()`'s outputs (never run) with `shardings` (a matching tree)."""
    return jax.tree.map(_placed, jax.eval_shape(make), shardings)
