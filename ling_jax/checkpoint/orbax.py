"""The on-disk format of a converted (Orbax) checkpoint directory, and its raw I/O.

    OUT/config.json, tokenizer*.json, generation_config.json, ...   (copied from the HF directory)
    OUT/params/<group>/                 one Orbax (OCDBT) PyTree checkpoint per group of parameters:
                                        `globals` (embeddings, final norm, lm_head), `layer_000` ...,
                                        `mtp`; keys are the NNX paths joined with "__"
    OUT/ling_jax_orbax.json             format marker + metadata, written LAST

A parameter kept FP8 (a `BlockFP8` value) is stored as two entries: its float8 values under the
parameter's key and its float32 scales under `scale_key` (`...__weight_scale_inv` for a dense
matrix, `...__gate_proj_scale` for routed experts: the names of format v2). Routed experts kept
MXFP4 (an `MXFP4Blocks`) are stored the same way: uint8 packed codes under the key, uint8 E8M0
scales under `scale_key` (the recorded dtype uint8 says which kind it is). This module knows
nothing of the model: `ling_jax.convert` writes, `ling_jax.loader` restores after
`ling_jax.checkpoint.orbax_validate.validate_converted` checked the directory.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil

import jax

from ling_jax.checkpoint.layout import canonical_path

META = "ling_jax_orbax.json"
FORMAT = "ling-jax-orbax"
VERSION = 2  # v2: routed experts stored [E, out, in] (v1: [E, in, out]); a v1 directory must be reconverted
SKIP_SUFFIXES = (".safetensors",)
SKIP_FILES = ("model.safetensors.index.json",)


def group_of(path) -> str:
    p = [str(x) for x in canonical_path(path)]
    if p[0] == "model" and p[1] == "layers":
        return f"layer_{int(p[2]):03d}"
    if p[0] == "mtp":
        return "mtp"
    return "globals"


def key_of(path) -> str:
    """The stored key of one parameter: its per-layer path joined (the format is per layer whatever
    the layer loop the model runs with)."""
    return "__".join(str(x) for x in canonical_path(path))


def scale_key(path) -> str:
    """Key of the scales of the parameter at `path` when it is kept FP8."""
    p = [str(x) for x in canonical_path(path)]
    if p[-1] == "weight":
        return key_of(p[:-1] + ["weight_scale_inv"])
    return key_of(p[:-1] + [p[-1] + "_scale"])


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META))


class Checkpointer:
    """Synchronous PyTree checkpointer. Replica-parallel saving is off: with it, Orbax slices every
    replicated shard among its replicas with one jitted slice per shape and device, which costs far
    more than it saves for replicated weights; each block is written once by replica 0 instead."""

    def __init__(self):
        # imported here, not at module level: orbax takes ~0.6 s to import and only converted
        # directories need it (every `ling-jax logits` on an HF directory would pay for it)
        import orbax.checkpoint as ocp
        from orbax.checkpoint import type_handlers as th

        reg = th.create_type_handler_registry((jax.Array, th.ArrayHandler(use_replica_parallel=False)))
        self.ocp = ocp
        self.ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=reg))

    def save(self, path: str, tree: dict) -> None:
        self.ck.save(os.path.abspath(path), args=self.ocp.args.PyTreeSave(tree))

    def restore(self, path: str, target: dict) -> dict:
        """`target`: {key: ShapeDtypeStruct with sharding}; Orbax reads each process's blocks."""
        ra = self.ocp.checkpoint_utils.construct_restore_args(target)
        return self.ck.restore(os.path.abspath(path), args=self.ocp.args.PyTreeRestore(item=target, restore_args=ra))


def copy_side_files(src: str, dst: str) -> list[str]:
    """Copy config / tokenizer / generation files (everything but the safetensors and their index)."""
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
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
