"""Loading a release (HF) checkpoint straight into sharded arrays.

Every parameter is created with `jax.make_array_from_callback`: the callback receives the index
block a device owns and reads exactly that block from the safetensors shards
(`ling_jax.checkpoint.load.read_param` / `CheckpointReader.get(name, index=...)`), so a process
reads only what its own devices hold - for routed experts, only the experts (and the slice of
their intermediate width) that live on its devices. Blocks shared by several local devices (e.g.
replicated over `data`) are read once.

Host memory is bounded by one parameter at a time: the distinct blocks this process owns of the
parameter being built (at most the full parameter on a single host; for Ling-3.1-flash the largest
is one layer's stacked routed-expert projection, 512 x 4096 x 1280). Nothing else is held.

`keep_fp8=True` keeps the routed experts as float8_e4m3fn + float32 scales on device
(`ling_jax.moe.FP8Experts`, dequantised inside the expert matmuls). Every other FP8 matrix
(attention, dense FFN, shared expert, eh_proj) is dequantised to `dtype` at load: their matmuls live
in kda.py / mla.py / model.py, which call `ops.linear` on a plain weight (see sharding/README.md).
"""
from __future__ import annotations

import math
import os
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from tqdm.auto import tqdm

from sharding.distributed import is_primary
from sharding.mesh import parse_mesh
from sharding.place import attach_mesh
from sharding.rules import resolve

FP8 = "F8_E4M3"
_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


def np_dtype(dtype) -> np.dtype:
    dt = jnp.dtype(dtype)
    if dt == jnp.bfloat16:
        return np.dtype(ml_dtypes.bfloat16)
    if dt == jnp.float8_e4m3fn:
        return np.dtype(ml_dtypes.float8_e4m3fn)
    return np.dtype(dt)


def resolve_dtype(dtype):
    from ling_jax.ops import as_dtype
    from ling_jax.runtime import default_dtype

    return as_dtype(dtype or default_dtype())


def abstract_model(cfg, dtype, with_mtp: bool = True, keep_fp8: bool = False):
    """Shape-only LingForCausalLM (routed experts as FP8Experts when keep_fp8)."""
    from ling_jax.checkpoint.load import abstract_model as base
    from ling_jax.moe import FP8Experts, MoE

    m = base(cfg, dtype, with_mtp)
    if keep_fp8:
        fp8 = nnx.eval_shape(lambda: FP8Experts(cfg))
        for moe in [x for _, x in nnx.iter_graph(m) if isinstance(x, MoE)]:
            moe.experts = nnx.clone(fp8)
    return m


def is_expert_param(path) -> bool:
    p = [str(x) for x in path]
    return len(p) >= 2 and p[-2] == "experts" and p[-1].removesuffix("_scale") in _EXPERT_PROJ


def _expert_names(path, cfg) -> list[str]:
    from ling_jax.checkpoint.load import checkpoint_names

    base = tuple(path[:-1]) + (str(path[-1]).removesuffix("_scale"),)
    return checkpoint_names(base, cfg)[1]


def read_fp8_expert(reader, path, cfg, index) -> np.ndarray:
    """Block `index` of an FP8Experts parameter: raw float8 weights, or scales expanded along I.

    Weight [E, a, b] = transposed checkpoint [b, a] matrices (raw float8_e4m3fn, no dequantisation).
    Scale: the checkpoint grid with its I axis (gate/up: rows, block bo; down: columns, block bi)
    repeated per element, then transposed like the weight: gate/up [E, ceil(D/bi), I], down [E, I, ceil(D/bo)].
    """
    names = _expert_names(path, cfg)
    e_sl, a_sl, b_sl = index if index is not None else (slice(None),) * 3
    proj = str(path[-1])
    out = []
    for e in range(len(names))[e_sl]:
        n = names[e]
        if not proj.endswith("_scale"):
            out.append(reader.get_raw(n, index=(b_sl, a_sl)).T)
            continue
        s = reader.get_scale(n)
        o, i = reader.info(n).shape
        bo, bi = reader.block
        if proj.startswith("down"):  # checkpoint [D, I]: I is the column axis
            s = np.repeat(s, bi, axis=1)[:, :i]
        else:                        # checkpoint [I, D]: I is the row axis
            s = np.repeat(s, bo, axis=0)[:o, :]
        out.append(s[b_sl, a_sl].T)
    return np.ascontiguousarray(np.stack(out))


def _stored_itemsize(reader, path, cfg) -> int:
    from ling_jax.checkpoint.load import checkpoint_names
    from ling_jax.checkpoint.safetensors_io import DTYPES

    try:
        names = _expert_names(path, cfg) if is_expert_param(path) else checkpoint_names(path, cfg)[1]
        return DTYPES[reader.info(names[0]).dtype].itemsize
    except Exception:  # readers without `info` (tests' DictReader)
        return 4


def _index_key(index, shape) -> tuple:
    return tuple(s.indices(n) if isinstance(s, slice) else s for s, n in zip(index, shape))


def _block_numel(index, shape) -> int:
    return math.prod(len(range(*s.indices(n))) if isinstance(s, slice) else 1 for s, n in zip(index, shape))


class ParamSource:
    """Plan for building every parameter of an abstract model from a checkpoint on a mesh."""

    def __init__(self, reader, cfg, mesh, keep_fp8: bool = False):
        self.reader, self.cfg, self.mesh, self.keep_fp8 = reader, cfg, mesh, keep_fp8

    def sharding(self, path, shape) -> NamedSharding:
        return NamedSharding(self.mesh, resolve(path, shape, self.mesh, self.cfg.num_attention_heads))

    def read_block(self, path, index, want_dtype) -> np.ndarray:
        from ling_jax.checkpoint.load import read_param

        if self.keep_fp8 and is_expert_param(path):
            return read_fp8_expert(self.reader, path, self.cfg, index)
        # each tensor is cast to the target dtype as it is read (before stacking experts): the float32
        # dequantised copy of a block never exists beyond one checkpoint tensor at a time
        return np.asarray(read_param(self.reader, path, self.cfg, index, np_dtype(want_dtype)))

    def local_bytes(self, path, shape) -> int:
        """Stored bytes this process reads for the parameter (its distinct local blocks)."""
        sh = self.sharding(path, shape)
        keys = {_index_key(i, shape): i for i in sh.addressable_devices_indices_map(tuple(shape)).values()}
        if str(path[-1]).endswith("_scale"):
            return 0
        return sum(_block_numel(i, shape) for i in keys.values()) * _stored_itemsize(self.reader, path, self.cfg)

    def build(self, path, shape, dtype, bar=None) -> jax.Array:
        """The global array of one parameter: each local device's block read once, nothing else."""
        shape = tuple(shape)
        sh = self.sharding(path, shape)
        memo: dict = {}
        itemsize = None if str(path[-1]).endswith("_scale") else _stored_itemsize(self.reader, path, self.cfg)
        want = sh.shard_shape(shape)

        def cb(index):
            key = _index_key(index, shape)
            if key not in memo:
                blk = self.read_block(path, index, dtype)
                if tuple(blk.shape) != tuple(want):
                    raise ValueError(f"{'/'.join(map(str, path))}: read block {blk.shape}, expected {want}")
                memo[key] = blk
                if bar is not None and itemsize:
                    bar.update(blk.size * itemsize)
            return memo[key]

        return jax.make_array_from_callback(shape, sh, cb, dtype=jnp.dtype(dtype))


def iter_state(abstract) -> tuple:
    graphdef, state = nnx.split(abstract)
    return graphdef, list(nnx.to_flat_state(state))


def is_param(var) -> bool:
    return isinstance(var, nnx.Param)


def open_validated(checkpoint_dir: str, with_mtp: bool, keep_fp8: bool):
    """(CheckpointReader, config, with_mtp) after checking every tensor against config.json (and that
    the routed experts are FP8 when they are to be kept FP8). The caller closes the reader."""
    from ling_jax.checkpoint.reader import CheckpointReader

    reader = CheckpointReader(checkpoint_dir)
    try:
        cfg = reader.config
        with_mtp = with_mtp and cfg.has_mtp
        reader.validate(include_mtp=with_mtp)
        if keep_fp8:
            check_keep_fp8(reader, cfg)
    except BaseException:
        reader.close()
        raise
    return reader, cfg, with_mtp


def place_constants(flat, mesh, cfg) -> None:
    """Put the non-parameter Variables of `flat` (config-derived constants, e.g. SwiGLU limits, see
    `ling_jax.checkpoint.load.config_constant`) on `mesh` by the rules. Every process holds the same value."""
    for path, var in flat:
        if is_param(var):
            continue
        from ling_jax.checkpoint.load import config_constant
        v = np.asarray(config_constant(path, cfg), np.float32)
        sh = NamedSharding(mesh, resolve(path, v.shape, mesh, cfg.num_attention_heads))
        var.set_value(jax.make_array_from_callback(v.shape, sh, lambda idx, v=v: v[idx]))


def fill_params(flat, source: ParamSource, progress: bool = True, desc: str = "loading",
                select: Callable | None = None) -> Iterator:
    """Build (a selection of) the parameters (nnx.Param) of `flat` ([(path, Variable)]) in place from
    the checkpoint; yields each path. Other Variables are left alone (see place_constants)."""
    todo = [(p, v) for p, v in flat if is_param(v) and (select is None or select(p))]
    total = sum(source.local_bytes(p, v.get_value().shape) for p, v in todo)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not (progress and is_primary()))
    try:
        for path, var in todo:
            want = var.get_value()
            var.set_value(source.build(path, want.shape, want.dtype, bar))
            yield path
    finally:
        bar.close()


def check_keep_fp8(reader, cfg) -> None:
    from ling_jax.checkpoint.load import checkpoint_names

    probe = checkpoint_names(("model", "layers", next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)),
                              "mlp", "experts", "gate_proj"), cfg)[1][0]
    if reader.info(probe).dtype != FP8:
        raise ValueError(f"--keep-fp8: routed experts of {reader.dir} are stored {reader.info(probe).dtype}, "
                         f"not {FP8} (nothing to keep; load without --keep-fp8)")


def load_sharded(checkpoint_dir: str, mesh=None, dtype=None, with_mtp: bool = True, keep_fp8: bool = False,
                 progress: bool = True):
    """HF checkpoint directory → LingForCausalLM whose parameters are global arrays sharded on `mesh`
    by the partition rules (default mesh: `parse_mesh(None)`), MoE blocks in expert-parallel mode.

    dtype: compute/storage dtype of the non-FP8-kept parameters (default: runtime.default_dtype()).
    Each process reads only the blocks of its own devices; a tqdm bar counts stored bytes read.
    """
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"{checkpoint_dir}: checkpoint directory not found")
    mesh = parse_mesh(None) if mesh is None else mesh
    dtype = resolve_dtype(dtype)
    reader, cfg, with_mtp = open_validated(checkpoint_dir, with_mtp, keep_fp8)
    try:
        graphdef, flat = iter_state(abstract_model(cfg, dtype, with_mtp, keep_fp8))
        for _ in fill_params(flat, ParamSource(reader, cfg, mesh, keep_fp8), progress):
            pass
        place_constants(flat, mesh, cfg)
    finally:
        reader.close()
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return attach_mesh(model, mesh)
