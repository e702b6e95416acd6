"""Sharding for ling-jax: meshes, the logical-axis rules, cache placement, multi-host start-up.

    mesh  = sharding.parse_mesh("expert=4,model=2")                   # axes (data, expert, model)
    pspec = sharding.spec(("heads", "embed"), (4096, 8192), mesh, heads=32)
    cache = sharding.shard_cache(cache, mesh)                         # by the cache rules

This package knows meshes and logical axis names, never the model: parameters declare their axes
where they are created, and `ling_jax.loader` loads a checkpoint onto a mesh with these rules.
See sharding/README.md for the rules, the expert-parallel MoE design and the wiring.
"""
from sharding.mesh import (AXES, default_mesh_shape, make_mesh, mesh_sizes, mesh_spec_string, parse_mesh,
                           parse_mesh_shape)
from sharding.rules import (CACHE_AXES, LOGICAL_AXES, RULES, LogicalRules, UnknownParameterError, cache_axes,
                            cache_shardings, cache_specs, spec)
from sharding.distributed import (add_distributed_args, barrier, distributed_init_from_args_or_env,
                                  init_from_args, is_primary, primary_print,
                                  process0_verdict)
from sharding.place import batch_sharding, global_batch, shard_cache, to_host

__all__ = [
    "AXES", "default_mesh_shape", "make_mesh", "mesh_sizes", "mesh_spec_string", "parse_mesh", "parse_mesh_shape",
    "CACHE_AXES", "LOGICAL_AXES", "RULES", "LogicalRules", "UnknownParameterError", "cache_axes",
    "cache_shardings", "cache_specs", "spec",
    "add_distributed_args", "barrier", "distributed_init_from_args_or_env", "init_from_args", "is_primary", "process0_verdict",
    "primary_print",
    "batch_sharding", "global_batch", "shard_cache", "to_host",
]
