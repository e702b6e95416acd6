"""HF checkpoint → Orbax checkpoint of the (sharded) parameters, and loading either kind.

Layout of a converted directory:

    OUT/config.json, tokenizer*.json, generation_config.json, ...   (copied from the HF directory)
    OUT/params/<group>/                 one Orbax (OCDBT) checkpoint per group of parameters:
                                        `globals` (embeddings, final norm, lm_head), `layer_000` ...,
                                        `mtp`; keys are the NNX paths joined with "__"
    OUT/ling_jax_orbax.json             format marker + metadata, written LAST

The conversion streams group by group (read the group's blocks → save → drop), so host memory is
bounded by one layer's parameters, never the model. Everything is written into a sibling
`.OUT.converting` directory which is renamed to OUT only when complete; an interrupted conversion
leaves no OUT (and `load_any` rejects a directory without the marker). Restoring works on any mesh:
Orbax reads each process's blocks of the new layout.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
from flax import nnx

from sharding.distributed import barrier, is_primary
from sharding.load import (ParamSource, abstract_model, fill_params, is_param, iter_state, load_sharded,
                           open_validated, place_constants, reader_fp8, resolve_dtype)
from sharding.mesh import mesh_spec_string, parse_mesh
from sharding.place import attach_mesh
from sharding.rules import resolve

META = "ling_jax_orbax.json"
FORMAT = "ling-jax-orbax"
VERSION = 2  # v2: routed experts stored [E, out, in] (v1: [E, in, out]); a v1 directory must be reconverted
SKIP_SUFFIXES = (".safetensors",)
SKIP_FILES = ("model.safetensors.index.json",)


def group_of(path) -> str:
    p = [str(x) for x in path]
    if p[0] == "model" and p[1] == "layers":
        return f"layer_{int(p[2]):03d}"
    if p[0] == "mtp":
        return "mtp"
    return "globals"


def key_of(path) -> str:
    return "__".join(str(x) for x in path)


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


class _Orbax:
    """Synchronous PyTree checkpointer. Replica-parallel saving is off: with it, Orbax slices every
    replicated shard among its replicas with one jitted slice per shape and device, which costs far
    more than it saves for replicated weights; each block is written once by replica 0 instead."""

    def __init__(self):
        import orbax.checkpoint as ocp
        from orbax.checkpoint import type_handlers as th

        reg = th.create_type_handler_registry((jax.Array, th.ArrayHandler(use_replica_parallel=False)))
        self.ocp = ocp
        self.ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=reg))

    def save(self, path: str, tree: dict) -> None:
        self.ck.save(path, args=self.ocp.args.PyTreeSave(tree))

    def restore(self, path: str, target: dict) -> dict:
        ra = self.ocp.checkpoint_utils.construct_restore_args(target)
        return self.ck.restore(path, args=self.ocp.args.PyTreeRestore(item=target, restore_args=ra))


def _checkpointer():
    return _Orbax()


def _copy_side_files(src: str, dst: str) -> list[str]:
    out = []
    for name in sorted(os.listdir(src)):
        p = os.path.join(src, name)
        if not os.path.isfile(p) or name.endswith(SKIP_SUFFIXES) or name in SKIP_FILES or name == META:
            continue
        shutil.copy2(p, os.path.join(dst, name))
        out.append(name)
    return out


def trim_host_memory() -> None:
    """Hand freed heap back to the OS (glibc `malloc_trim`; no-op elsewhere). Without it the
    allocator keeps each group's freed buffers in per-thread arenas and RSS ratchets upwards."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def convert(checkpoint: str, out: str, mesh=None, dtype="bfloat16", keep_fp8: bool = False,
            with_mtp: bool = True, progress: bool = True, overwrite: bool = False, _after_group=None) -> dict:
    """Convert an HF checkpoint directory into a ling-jax Orbax directory `out` (see module doc).

    dtype: storage dtype of the parameters that are not kept FP8 (bfloat16 default, or float32).
    keep_fp8: store every F8_E4M3-stored matrix as float8_e4m3fn + float32 scales (`FP8Experts`,
    `FP8Linear`; the converted metadata records each parameter's dtype). The parameters are
    built sharded on `mesh` (default `parse_mesh(None)`) and every process writes its own blocks.
    Returns the metadata dict. `_after_group(name)` is a test hook.
    """
    out = os.path.abspath(out)
    if os.path.exists(out) and not overwrite and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"--out: {out} already exists (pass --force / overwrite=True to replace it)")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"--out: parent directory {parent} does not exist")
    mesh = parse_mesh(None) if mesh is None else mesh
    dtype = resolve_dtype(dtype)
    reader, cfg, with_mtp = open_validated(checkpoint, with_mtp, keep_fp8)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.converting")
    t0 = time.time()
    try:
        if is_primary():
            if os.path.exists(tmp):  # left over by an interrupted run
                shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, "params"))
        barrier("ling_jax_convert_start")
        _, flat = iter_state(abstract_model(cfg, dtype, with_mtp, keep_fp8, reader_fp8(reader, cfg)))
        source = ParamSource(reader, cfg, mesh, keep_fp8)
        groups: dict[str, list] = {}
        for path, var in flat:  # only parameters are stored; constants are recomputed from config.json
            if is_param(var):
                groups.setdefault(group_of(path), []).append((path, var))
        ckptr = _checkpointer()
        params_meta = {}
        for g, items in groups.items():
            sel = {tuple(p) for p, _ in items}
            for _ in fill_params(items, source, progress, desc=f"converting {g}", select=lambda p: tuple(p) in sel):
                pass
            tree = {key_of(p): v.get_value() for p, v in items}
            ckptr.save(os.path.join(tmp, "params", g), tree)
            for p, v in items:
                a = v.get_value()
                params_meta[key_of(p)] = {"group": g, "shape": list(a.shape), "dtype": str(a.dtype)}
                v.set_value(jax.ShapeDtypeStruct(a.shape, a.dtype))  # drop the arrays
            del tree
            trim_host_memory()
            if _after_group is not None:
                _after_group(g)
        barrier("ling_jax_convert_saved")
        meta = {"format": FORMAT, "version": VERSION, "dtype": str(jnp.dtype(dtype)), "keep_fp8": bool(keep_fp8),
                "with_mtp": bool(with_mtp), "source": os.path.abspath(checkpoint), "mesh": mesh_spec_string(mesh),
                "groups": list(groups), "params": params_meta, "seconds": round(time.time() - t0, 3)}
        if is_primary():
            meta["files"] = _copy_side_files(reader.dir, tmp)
            from ling_jax.checkpoint.orbax_validate import data_file_inventory  # lazy: sharding has no module-level ling_jax imports
            meta["data_files"] = data_file_inventory(os.path.join(tmp, "params"))  # sizes checked on load
            _write_json_atomic(os.path.join(tmp, META), meta)
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


def load_converted(path: str, mesh=None, dtype=None, with_mtp: bool = True, keep_fp8: bool | None = None,
                   progress: bool = True):
    """A converted directory → sharded LingForCausalLM on `mesh` (any mesh; Orbax reshards on read).

    Parameters stored in another float dtype are cast to `dtype`; FP8-kept matrices stay FP8 (which
    ones: the per-parameter dtypes in the metadata; keep_fp8=None: as stored; True/False must match).
    """
    from tqdm.auto import tqdm

    from ling_jax.checkpoint.orbax_validate import check_param_shapes, storage_errors, validate_converted
    from ling_jax.config import LingConfig

    path = os.path.abspath(path)  # Orbax wants absolute paths
    meta = validate_converted(path)  # marker, manifest, commit markers, data file sizes: before any restore
    stored_fp8 = bool(meta["keep_fp8"])
    if keep_fp8 is not None and bool(keep_fp8) != stored_fp8:
        raise ValueError(f"{path}: converted {'with' if stored_fp8 else 'without'} --keep-fp8; "
                         f"reconvert {'without' if stored_fp8 else 'with'} it, or omit --keep-fp8")
    cfg = LingConfig.from_json(os.path.join(path, "config.json"))
    with_mtp = with_mtp and cfg.has_mtp
    if with_mtp and not meta["with_mtp"]:
        raise ValueError(f"{path}: converted without the MTP layer (load with with_mtp=False)")
    mesh = parse_mesh(None) if mesh is None else mesh
    dtype = resolve_dtype(dtype)
    f8 = str(jnp.dtype(jnp.float8_e4m3fn))
    stored = lambda p: meta["params"].get(key_of(p), {}).get("dtype") == f8  # noqa: E731
    graphdef, flat = iter_state(abstract_model(cfg, dtype, with_mtp, stored_fp8, stored))
    check_param_shapes(path, meta, {key_of(p): tuple(v.get_value().shape) for p, v in flat if is_param(v)},
                       subset=True)
    groups: dict[str, list] = {}
    for p, v in flat:
        if not is_param(v):
            continue
        k = key_of(p)
        if k not in meta["params"]:
            raise ValueError(f"{path}: parameter {k} is missing from the converted checkpoint")
        groups.setdefault(meta["params"][k]["group"], []).append((p, v))
    ckptr = _checkpointer()
    bar = tqdm(total=len(groups), unit="group", desc="restoring", disable=not (progress and is_primary()))
    for g, items in groups.items():
        target = {}
        for p, v in items:
            want = v.get_value()
            sh = jax.sharding.NamedSharding(mesh, resolve(p, want.shape, mesh, cfg.num_attention_heads))
            target[key_of(p)] = jax.ShapeDtypeStruct(want.shape, want.dtype, sharding=sh)
        with storage_errors(os.path.join(path, "params", g)):
            got = ckptr.restore(os.path.join(path, "params", g), target)
        for p, v in items:
            v.set_value(got[key_of(p)])
        bar.update(1)
    bar.close()
    place_constants(flat, mesh, cfg)
    return attach_mesh(nnx.merge(graphdef, nnx.from_flat_state(flat)), mesh)


def load_any(path: str, mesh=None, dtype=None, with_mtp: bool = True, keep_fp8: bool | None = None,
             progress: bool = True):
    """Load an HF checkpoint directory or a converted Orbax directory onto `mesh`."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: checkpoint directory not found")
    if is_converted(path):
        return load_converted(path, mesh, dtype, with_mtp, keep_fp8, progress)
    if os.path.isdir(os.path.join(path, "params")):
        raise ValueError(f"{path}: looks like an incomplete conversion (no {META}); convert again")
    return load_sharded(path, mesh, dtype, with_mtp, bool(keep_fp8), progress)

