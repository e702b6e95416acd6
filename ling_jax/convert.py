"""HF release checkpoint → a converted (Orbax) directory of the sharded parameters.

The conversion streams group by group (the group's parameters are built sharded on the conversion
mesh with the loader's block reads → saved, each process writing its own blocks → dropped), so
host memory is bounded by one layer's parameters, never the model. Everything is written into a
sibling `.OUT.converting` directory which is renamed to OUT only when complete; an interrupted
conversion leaves no OUT (and the loader rejects a directory without the marker). The format:
`ling_jax.checkpoint.orbax`. Load the result with `ling_jax.loader.load_model`, on any mesh.

A use of the loader (it builds the parameters with the loader's block reads), so it sits above it,
not in `ling_jax.checkpoint` (which the loader imports); the command is `ling-jax convert`.
"""
from __future__ import annotations

import os
import shutil
import time

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.checkpoint import orbax as O
from ling_jax.checkpoint.blocks import reader_fp8, reader_mxfp4
from ling_jax.checkpoint.orbax_validate import data_file_inventory
from ling_jax.loader import ParamSource, converted_entries, abstract_model, fill_params, open_validated
from ling_jax.ops import as_dtype, default_dtype
from sharding.distributed import barrier, is_primary
from sharding.mesh import mesh_spec_string, parse_mesh


def _shapes(value):
    """The value with its arrays replaced by ShapeDtypeStructs (drops the device buffers)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), value)


def convert(checkpoint: str, out: str, mesh=None, dtype="bfloat16", keep_quantized: bool = False,
            with_mtp: bool = True, progress: bool = True, overwrite: bool = False, _after_group=None) -> dict:
    """Convert an HF checkpoint directory into a converted directory `out` (see module doc).

    dtype: storage dtype of the parameters that are not kept quantised (bfloat16 default, or float32).
    keep_quantized (--keep-quantized): store every F8_E4M3-stored matrix as float8_e4m3fn values +
    float32 scales, and MXFP4-stored routed experts as their uint8 codes + uint8 E8M0 scales (the
    metadata records each entry's dtype, which is how the loader tells them apart, and the flag as its
    `keep_fp8` field, the format's name for it). The parameters are built sharded on `mesh` (default:
    `parse_mesh(None)`, every device on `expert`) and every process writes its own blocks. Returns the
    metadata dict. `_after_group(name)` is a test hook.
    """
    out = os.path.abspath(out)
    if os.path.exists(out) and not overwrite and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"--out: {out} already exists (pass --force / overwrite=True to replace it)")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"--out: parent directory {parent} does not exist")
    mesh = parse_mesh(None) if mesh is None else mesh
    dtype = as_dtype(dtype or default_dtype())
    reader, cfg, with_mtp = open_validated(checkpoint, with_mtp, keep_quantized)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.converting")
    t0 = time.time()
    try:
        if is_primary():
            if os.path.exists(tmp):  # left over by an interrupted run
                shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, "params"))
        barrier("ling_jax_convert_start")
        model = abstract_model(cfg, dtype, with_mtp, reader_fp8(reader, cfg) if keep_quantized else None,
                               reader_mxfp4(reader, cfg) if keep_quantized else None, layer_loop="unroll")
        source = ParamSource(reader, cfg, mesh)
        groups: dict[str, list] = {}
        for path, var in nnx.to_flat_state(nnx.state(model)):  # only parameters: constants come from config.json
            if isinstance(var, nnx.Param):
                groups.setdefault(O.group_of(path), []).append((path, var))
        ckptr = O.Checkpointer()
        params_meta = {}
        for g, items in groups.items():
            fill_params(items, source, progress, desc=f"converting {g}")
            tree = {k: a for p, v in items for k, a in converted_entries(p, v.get_value()).items()}
            ckptr.save(os.path.join(tmp, "params", g), tree)
            for k, a in tree.items():
                params_meta[k] = {"group": g, "shape": list(a.shape), "dtype": str(a.dtype)}
            for p, v in items:
                v.set_value(_shapes(v.get_value()))  # drop the arrays
            del tree
            O.trim_host_memory()
            if _after_group is not None:
                _after_group(g)
        barrier("ling_jax_convert_saved")
        meta = {"format": O.FORMAT, "version": O.VERSION, "dtype": str(jnp.dtype(dtype)),
                "keep_fp8": bool(keep_quantized),  # the format's name of the flag
                "with_mtp": bool(with_mtp), "source": os.path.abspath(checkpoint), "mesh": mesh_spec_string(mesh),
                "groups": list(groups), "params": params_meta, "seconds": round(time.time() - t0, 3)}
        if is_primary():
            meta["files"] = O.copy_side_files(reader.dir, tmp)
            meta["data_files"] = data_file_inventory(os.path.join(tmp, "params"))  # sizes checked on load
            O.write_json_atomic(os.path.join(tmp, O.META), meta)
            if os.path.exists(out):
                old = os.path.join(parent, f".{os.path.basename(out)}.old")
                if os.path.exists(old):
                    shutil.rmtree(old)
                os.rename(out, old)
                os.rename(tmp, out)
                shutil.rmtree(old)
            else:
                os.rename(tmp, out)
        barrier("ling_jax_convert_done")
        return meta
    except BaseException:
        if is_primary() and os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.close()
