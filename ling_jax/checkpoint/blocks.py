"""Reading one device's block of one model parameter straight from a release checkpoint.

The sharded loader (`ling_jax.loader`) asks for `index`, a tuple of slices over the *parameter's*
shape (what `Sharding.devices_indices_map` gives), and only the bytes of that block are read:
stacked experts `[E, out, in]` read just the experts in index[0], each as the sub-block of its
`[out, in]` matrix; conv taps read rows of `[P, 1, K]`. A float parameter is dequantised as read
(`CheckpointReader.get`); a parameter kept FP8 reads its raw float8 values and its scales in the
layout of `ling_jax.quantized.BlockFP8` (`fp8_block`). Routed experts stored MXFP4 and kept so
(`ling_jax.quantized.MXFP4Blocks`) read their raw codes and scale bytes, blocks over the packed
`[E, out, in/2]` and scale `[E, out, in/32]` shapes (the checkpoint's per-expert layout, stacked).

`reader` is a CheckpointReader, or anything with its `get(name, dtype, index)` (tests read
in-memory dicts); the FP8 functions also need `get_raw`, `get_scale`, `info` and `block`.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from ling_jax.checkpoint.fp8 import DEFAULT_BLOCK
from ling_jax.checkpoint.layout import CONV_TAPS, checkpoint_names, is_expert_path, release_tensors, scale_name
from ling_jax.checkpoint.safetensors_io import DTYPES
from ling_jax.config import LingConfig

FP8 = "F8_E4M3"


def np_dtype(dtype) -> np.dtype:
    """The NumPy dtype of a jnp dtype (jax's bfloat16 / float8 types are ml_dtypes' own)."""
    return np.dtype(jnp.dtype(dtype))


def tensor_names(path, cfg: LingConfig) -> list[str]:
    return checkpoint_names(tuple(path), cfg)[1]


def read_param(reader, path: tuple, cfg: LingConfig, index=None, dtype=np.float32) -> np.ndarray:
    """Block `index` (None: all) of a float parameter, FP8-stored tensors dequantised, cast to `dtype`
    tensor by tensor (no float32 copy of a whole stacked block ever exists)."""
    names = tensor_names(path, cfg)
    p = [str(x) for x in path]
    if is_expert_path(path):
        e_sl, a_sl, b_sl = index if index is not None else (slice(None),) * 3
        sel = range(len(names))[e_sl]
        out = None
        for i, e in enumerate(sel):  # filled in place: one expert's block in flight, never a list + a stacked copy
            blk = reader.get(names[e], dtype=dtype, index=(a_sl, b_sl))
            if out is None:
                out = np.empty((len(sel),) + blk.shape, blk.dtype)
            out[i] = blk
        return out
    if p[-1] in CONV_TAPS:
        r_sl, k_sl = index if index is not None else (slice(None),) * 2
        a = reader.get(names[0], dtype=dtype, index=(r_sl, slice(None), k_sl))
        return a.reshape(a.shape[0], -1)
    return reader.get(names[0], dtype=dtype, index=index)


# ---------------------------------------------------------------------------------------------
# parameters kept FP8
# ---------------------------------------------------------------------------------------------
def fp8_block(path, cfg: LingConfig) -> tuple[int, int]:
    """`BlockFP8.block` of a parameter kept FP8: the checkpoint's (bo, bi) for a dense `[out, in]`
    matrix; routed experts keep the blocks along D and one scale per element along I, so a mesh
    axis may split I at any divisor: gate/up `[E, I, D]` (1, bi), down `[E, D, I]` (bo, 1)."""
    bo, bi = (int(b) for b in (cfg.weight_block_size or DEFAULT_BLOCK))
    if is_expert_path(path):
        return (bo, 1) if str(path[-1]) == "down_proj" else (1, bi)
    return (bo, bi)


def read_fp8_values(reader, path, cfg: LingConfig, index=None) -> np.ndarray:
    """Block `index` of the raw float8_e4m3fn values of a parameter kept FP8 (no dequantisation)."""
    names = tensor_names(path, cfg)
    if is_expert_path(path):
        e_sl, a_sl, b_sl = index if index is not None else (slice(None),) * 3
        return np.ascontiguousarray(np.stack([reader.get_raw(names[e], index=(a_sl, b_sl))
                                              for e in range(len(names))[e_sl]]))
    return np.ascontiguousarray(reader.get_raw(names[0], index=index))


def read_fp8_scales(reader, path, cfg: LingConfig, index=None) -> np.ndarray:
    """Block `index` of the float32 scales of a parameter kept FP8, in `fp8_block(path)` layout.

    Dense: the checkpoint's own grid. Experts: each expert's grid with its I axis (gate/up: rows,
    block bo; down: columns, block bi) repeated per element: gate/up [E, I, ceil(D/bi)], down
    [E, ceil(D/bo), I].
    """
    names = tensor_names(path, cfg)
    if not is_expert_path(path):
        s = reader.get_scale(names[0])
        return np.ascontiguousarray(s if index is None else s[index])
    e_sl, a_sl, b_sl = index if index is not None else (slice(None),) * 3
    bo, bi = reader.block
    out = []
    for e in range(len(names))[e_sl]:
        s = reader.get_scale(names[e])
        o, i = reader.info(names[e]).shape
        if str(path[-1]) == "down_proj":  # checkpoint [D, I]: I is the column axis
            s = np.repeat(s, bi, axis=1)[:, :i]
        else:                             # checkpoint [I, D]: I is the row axis
            s = np.repeat(s, bo, axis=0)[:o, :]
        out.append(s[a_sl, b_sl])
    return np.ascontiguousarray(np.stack(out).astype(np.float32))


def reader_fp8(reader, cfg: LingConfig) -> Callable:
    """`stored_fp8(path)`: every checkpoint tensor of the parameter at `path` is stored F8_E4M3 with a
    `weight_scale_inv` beside it (read from the safetensors headers, tensor by tensor)."""
    def stored(path) -> bool:
        names = tensor_names(path, cfg)
        return all(n in reader and reader.info(n).dtype == FP8 and scale_name(n) in reader for n in names)
    return stored


def release_fp8(cfg: LingConfig, fp8_layout: str | None = None) -> Callable:
    """`stored_fp8` of a release checkpoint of `cfg` (what its headers would say; `fp8_layout` None: the
    writer's default), for shape planning without a checkpoint; loading always asks the checkpoint
    itself (`reader_fp8`)."""
    f8 = {n for n, dt, _ in (release_tensors(cfg, "fp8") if fp8_layout is None
                             else release_tensors(cfg, "fp8", fp8_layout=fp8_layout)) if dt == FP8}
    return lambda path: all(n in f8 for n in tensor_names(path, cfg))


def read_mxfp4_codes(reader, path, cfg: LingConfig, index=None) -> np.ndarray:
    """Block `index` (over [E, out, in/2]) of the packed E2M1 codes of routed experts kept MXFP4."""
    e_sl, a_sl, b_sl = index if index is not None else (slice(None),) * 3
    names = tensor_names(path, cfg)
    return np.ascontiguousarray(np.stack([reader.get_mxfp4_codes(names[e], (a_sl, b_sl))
                                          for e in range(len(names))[e_sl]]))


def read_mxfp4_scales(reader, path, cfg: LingConfig, index=None) -> np.ndarray:
    """Block `index` (over [E, out, in/32]) of the E8M0 scale bytes of routed experts kept MXFP4."""
    e_sl, a_sl, b_sl = index if index is not None else (slice(None),) * 3
    names = tensor_names(path, cfg)
    return np.ascontiguousarray(np.stack([reader.get_mxfp4_scales(names[e], (a_sl, b_sl))
                                          for e in range(len(names))[e_sl]]))


def reader_mxfp4(reader, cfg: LingConfig) -> Callable:
    """`stored_mxfp4(path)`: the parameter is routed experts all stored MXFP4 (U8 codes; the reader's
    validation has checked the config declares them and the shapes)."""
    def stored(path) -> bool:
        names = tensor_names(path, cfg)
        return is_expert_path(path) and all(n in reader and reader.is_mxfp4(n) for n in names)
    return stored


def release_mxfp4(cfg: LingConfig) -> Callable:
    """`stored_mxfp4` of a checkpoint with MXFP4 routed experts (`quantize --experts mxfp4`), for
    shape planning without a checkpoint."""
    return lambda path: is_expert_path(path)


def check_keep_quantized(reader) -> None:
    """Keeping quantised weights needs a checkpoint that stores some F8_E4M3 or MXFP4 tensor."""
    if not any(reader.info(n).dtype == FP8 or reader.is_mxfp4(n) for n in reader.names()):
        raise ValueError(f"--keep-quantized: {reader.dir} stores no {FP8} or MXFP4 tensor (nothing to keep; "
                         f"load without --keep-quantized)")


def stored_itemsize(reader, path, cfg: LingConfig) -> int:
    """Bytes per stored element of the parameter's first tensor (4 for readers without headers)."""
    info = getattr(reader, "info", None)
    if info is None:
        return 4
    return DTYPES[info(tensor_names(path, cfg)[0]).dtype].itemsize
