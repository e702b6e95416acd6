"""Sharding for ling-jax: meshes, the partition-rule table, sharded loading, conversion, multi-host.

    mesh  = sharding.parse_mesh("expert=4,model=2")         # axes (data, expert, model)
    model = sharding.load_any(ckpt_dir, mesh, "bfloat16")    # HF dir or converted Orbax dir
    model = sharding.shard_model(model, mesh)                # place an already-loaded model
    cache = jax.device_put(cache, sharding.cache_shardings(cache, mesh))

See sharding/README.md for the rules, the expert-parallel MoE design and the wiring.
"""
from sharding.mesh import AXES, default_mesh_shape, make_mesh, mesh_spec_string, parse_mesh, parse_mesh_spec
from sharding.rules import (RULES, EPPlan, UnknownParameterError, cache_shardings, cache_specs, ep_plan,
                            param_shardings, param_specs, resolve, rule_for)
from sharding.distributed import (add_distributed_args, barrier, distributed_init_from_args_or_env,
                                  init_from_args, is_primary, primary_print)
from sharding.place import (attach_mesh, batch_sharding, describe, global_batch, shard_cache, shard_model,
                            sharded_logits, to_host, use_mesh)
from sharding.load import load_sharded
from sharding.convert import convert, is_converted, load_any, load_converted

__all__ = [
    "AXES", "default_mesh_shape", "make_mesh", "mesh_spec_string", "parse_mesh", "parse_mesh_spec",
    "RULES", "EPPlan", "UnknownParameterError", "cache_shardings", "cache_specs", "ep_plan", "param_shardings",
    "param_specs", "resolve", "rule_for",
    "add_distributed_args", "barrier", "distributed_init_from_args_or_env", "init_from_args", "is_primary",
    "primary_print",
    "attach_mesh", "batch_sharding", "describe", "global_batch", "shard_cache", "shard_model", "sharded_logits",
    "to_host", "use_mesh",
    "load_sharded", "convert", "is_converted", "load_any", "load_converted",
]
