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

`keep_fp8=True` keeps every matrix the checkpoint stores as F8_E4M3 (with its `weight_scale_inv`)
as float8_e4m3fn + float32 block scales on device, decided per tensor from the header dtype: routed
experts as `ling_jax.moe.FP8Experts`, every other projection as `ling_jax.linear.FP8Linear`
(dequantised inside the matmul; `impl="pallas"` uses the FP8 Pallas kernel). Tensors stored in a
float dtype load as `dtype` as usual, so one model holds a mix (see sharding/README.md).
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


def release_fp8(cfg) -> Callable:
    """`stored_fp8` predicate of a release checkpoint of `cfg` (what its header would say: the
    matrices `checkpoint.layout.release_tensors(cfg, "fp8")` stores as F8_E4M3). For shape planning
    without a checkpoint; loading always asks the checkpoint itself (`reader_fp8`)."""
    from ling_jax.checkpoint.layout import release_tensors

    f8 = {n for n, dt, _ in release_tensors(cfg, "fp8") if dt == FP8}
    return lambda path: all(n in f8 for n in _param_names(path, cfg))


def reader_fp8(reader, cfg) -> Callable:
    """`stored_fp8(path)`: every checkpoint tensor of the parameter at `path` is stored F8_E4M3 with a
    `weight_scale_inv` beside it (read from the safetensors headers)."""
    from ling_jax.checkpoint.layout import scale_name

    def stored(path) -> bool:
        names = _param_names(path, cfg)
        return all(n in reader and reader.info(n).dtype == FP8 and scale_name(n) in reader for n in names)
    return stored


def _param_names(path, cfg) -> list[str]:
    from ling_jax.checkpoint.load import checkpoint_names
    return checkpoint_names(tuple(path), cfg)[1]


def _scan_group(path, cfg) -> tuple:
    """Layers scanned together (ling_jax.layer_stack) must have the same structure: the key of the
    set of modules at the same place in every layer of one run of the layer plan."""
    from ling_jax.layer_stack import layer_plan

    p = [str(x) for x in path]
    if p[0] == "model" and p[1] == "layers":
        i = int(p[2])
        for b, block in enumerate(layer_plan(cfg)):
            for r in range(len(block.runs)):
                if any(i in row for row in block.layer_grid(r)):
                    return ("run", b, r) + tuple(p[3:])
    return tuple(p)


def fp8_modules(model, cfg, stored_fp8: Callable) -> tuple[list, list]:
    """(paths of `Linear` modules, paths of `MoE` blocks) of a (shape-only) model to keep FP8.

    A Linear is kept FP8 iff its weight is stored FP8; a MoE block's routed experts iff all their
    gate/up/down matrices are. Layers of one scanned run must agree (same structure): a module kept
    FP8 in only some of them is dequantised in all of them (never the case for a release checkpoint).
    """
    from ling_jax.linear import Linear
    from ling_jax.moe import MoE

    cand = {}
    for path, m in nnx.iter_graph(model):
        path = tuple(path)
        if isinstance(m, Linear):
            cand[path] = ("linear", stored_fp8(path + ("weight",)))
        elif isinstance(m, MoE):
            cand[path] = ("moe", all(stored_fp8(path + ("experts", n)) for n in _EXPERT_PROJ))
    ok: dict = {}
    for path, (_, f) in cand.items():
        g = _scan_group(path, cfg)
        ok[g] = ok.get(g, True) and f
    keep = [p for p in cand if ok[_scan_group(p, cfg)]]
    return [p for p in keep if cand[p][0] == "linear"], [p for p in keep if cand[p][0] == "moe"]


def _node(model, path):
    for k in path:
        model = getattr(model, k) if isinstance(k, str) else model[k]
    return model


def abstract_model(cfg, dtype, with_mtp: bool = True, keep_fp8: bool = False, stored_fp8: Callable | None = None):
    """Shape-only LingForCausalLM. keep_fp8: every module whose matrices `stored_fp8(param_path)` says
    are stored FP8 is swapped for its FP8 twin (Linear → `FP8Linear`, routed experts → `FP8Experts`);
    stored_fp8 default: the release layout (`release_fp8`)."""
    from ling_jax.checkpoint.fp8 import DEFAULT_BLOCK
    from ling_jax.checkpoint.load import abstract_model as base
    from ling_jax.linear import FP8Linear
    from ling_jax.moe import FP8Experts

    m = base(cfg, dtype, with_mtp)
    if keep_fp8:
        linears, moes = fp8_modules(m, cfg, stored_fp8 or release_fp8(cfg))
        block = tuple(cfg.weight_block_size or DEFAULT_BLOCK)
        for path in linears:
            out_f, in_f = _node(m, path).weight.get_value().shape
            setattr(_node(m, path[:-1]), str(path[-1]),
                    nnx.eval_shape(lambda i=in_f, o=out_f: FP8Linear(i, o, block)))
        if moes:
            fp8 = nnx.eval_shape(lambda: FP8Experts(cfg))
            for path in moes:
                _node(m, path).experts = nnx.clone(fp8)
    return m


def is_scale_param(path) -> bool:
    """An FP8 scale grid (`FP8Experts.*_scale`, `FP8Linear.weight_scale_inv`)."""
    last = str(path[-1])
    return last.endswith("_scale") or last == "weight_scale_inv"


def is_expert_param(path) -> bool:
    p = [str(x) for x in path]
    return len(p) >= 2 and p[-2] == "experts" and p[-1].removesuffix("_scale") in _EXPERT_PROJ


def _expert_names(path, cfg) -> list[str]:
    from ling_jax.checkpoint.load import checkpoint_names

    base = tuple(path[:-1]) + (str(path[-1]).removesuffix("_scale"),)
    return checkpoint_names(base, cfg)[1]


def read_fp8_expert(reader, path, cfg, index) -> np.ndarray:
    """Block `index` of an FP8Experts parameter: raw float8 weights, or scales expanded along I.

    Weight [E, out, in] = the checkpoint's per-expert matrices (raw float8_e4m3fn, no dequantisation).
    Scale: the checkpoint grid with its I axis (gate/up: rows, block bo; down: columns, block bi)
    repeated per element: gate/up [E, I, ceil(D/bi)], down [E, ceil(D/bo), I].
    """
    names = _expert_names(path, cfg)
    e_sl, a_sl, b_sl = index if index is not None else (slice(None),) * 3
    proj = str(path[-1])
    out = []
    for e in range(len(names))[e_sl]:
        n = names[e]
        if not proj.endswith("_scale"):
            out.append(reader.get_raw(n, index=(a_sl, b_sl)))
            continue
        s = reader.get_scale(n)
        o, i = reader.info(n).shape
        bo, bi = reader.block
        if proj.startswith("down"):  # checkpoint [D, I]: I is the column axis
            s = np.repeat(s, bi, axis=1)[:, :i]
        else:                        # checkpoint [I, D]: I is the row axis
            s = np.repeat(s, bo, axis=0)[:o, :]
        out.append(s[a_sl, b_sl])
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

        fp8 = jnp.dtype(want_dtype) == jnp.float8_e4m3fn or is_scale_param(path)  # an FP8-kept module's
        if fp8 and is_expert_param(path):
            return read_fp8_expert(self.reader, path, self.cfg, index)
        if fp8:  # FP8Linear: the stored float8 block as is, or (a block of) its float32 scale grid
            name = _param_names(path, self.cfg)[0]
            raw = self.reader.get_raw(name, index=index)
            return np.ascontiguousarray(raw if not is_scale_param(path) else raw.astype(np.float32))
        # each tensor is cast to the target dtype as it is read (before stacking experts): the float32
        # dequantised copy of a block never exists beyond one checkpoint tensor at a time
        return np.asarray(read_param(self.reader, path, self.cfg, index, np_dtype(want_dtype)))

    def local_bytes(self, path, shape) -> int:
        """Stored bytes this process reads for the parameter (its distinct local blocks)."""
        sh = self.sharding(path, shape)
        keys = {_index_key(i, shape): i for i in sh.addressable_devices_indices_map(tuple(shape)).values()}
        if is_scale_param(path):
            return 0
        return sum(_block_numel(i, shape) for i in keys.values()) * _stored_itemsize(self.reader, path, self.cfg)

    def build(self, path, shape, dtype, bar=None) -> jax.Array:
        """The global array of one parameter: each local device's block read once, nothing else."""
        shape = tuple(shape)
        sh = self.sharding(path, shape)
        memo: dict = {}
        itemsize = None if is_scale_param(path) else _stored_itemsize(self.reader, path, self.cfg)
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
    """(CheckpointReader, config, with_mtp) after checking every tensor against config.json (and, to
    keep FP8, that the checkpoint stores some F8_E4M3 tensor). The caller closes the reader."""
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
    if not any(reader.info(n).dtype == FP8 for n in reader.names()):
        raise ValueError(f"--keep-fp8: {reader.dir} stores no {FP8} tensor (nothing to keep; "
                         f"load without --keep-fp8)")


def load_sharded(checkpoint_dir: str, mesh=None, dtype=None, with_mtp: bool = True, keep_fp8: bool = False,
                 progress: bool = True):
    """HF checkpoint directory → LingForCausalLM whose parameters are global arrays sharded on `mesh`
    by the partition rules (default mesh: `parse_mesh(None)`), MoE blocks in expert-parallel mode.

    dtype: compute/storage dtype of the non-FP8-kept parameters (default: runtime.default_dtype()).
    keep_fp8: every F8_E4M3-stored matrix stays float8_e4m3fn + float32 scales (see module doc).
    Each process reads only the blocks of its own devices; a tqdm bar counts stored bytes read.
    """
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"{checkpoint_dir}: checkpoint directory not found")
    mesh = parse_mesh(None) if mesh is None else mesh
    dtype = resolve_dtype(dtype)
    reader, cfg, with_mtp = open_validated(checkpoint_dir, with_mtp, keep_fp8)
    try:
        graphdef, flat = iter_state(abstract_model(cfg, dtype, with_mtp, keep_fp8, reader_fp8(reader, cfg)))
        for _ in fill_params(flat, ParamSource(reader, cfg, mesh, keep_fp8), progress):
            pass
        place_constants(flat, mesh, cfg)
    finally:
        reader.close()
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return attach_mesh(model, mesh)
