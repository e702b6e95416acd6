"""THE loader: a checkpoint directory (HF release layout or our Orbax conversion) → a model on a mesh.

    model = load_model("ckpt")                                   # one device, float32 on CPU
    model = load_model("ckpt", mesh=parse_mesh("expert=4,model=2"), dtype="bfloat16")
    model = load_model("ckpt", keep_quantized=True)              # FP8-stored matrices stay FP8

Every parameter is created with `jax.make_array_from_callback` on the NamedSharding its declared
logical axes give (`ling_jax.placement`, `sharding.rules`); the callback reads exactly the block a
device owns (`ling_jax.checkpoint.blocks`), so a process reads only what its own devices hold, and
a block shared by several local devices (replicated over `data`, or a replicated tensor) is read
once. Host memory is bounded by one parameter at a time: the distinct local blocks of the
parameter being built (for Ling-3.1-flash the largest is one layer's stacked expert projection,
512 x 4096 x 1280). A converted directory is restored by Orbax onto any mesh.

`keep_quantized=True` (`--keep-quantized`): every parameter whose checkpoint tensors are all stored
F8_E4M3 with a `weight_scale_inv` (read from the headers, tensor by tensor; for a converted
directory from its per-parameter dtypes) holds a `BlockFP8` value (float8 values + float32 block
scales, `ling_jax.checkpoint.blocks.fp8_block` layout) in its normal module; the rest loads as
`dtype`. Routed experts stored MXFP4 (`ling_jax.checkpoint.mxfp4`; the config declares them) hold
an `MXFP4Blocks` (the packed uint8 codes + uint8 E8M0 scales as stored) and are unpacked inside the
expert matmuls; without keep_quantized they are decoded at load (exactly, then cast to `dtype`).
Layers scanned together (ling_jax.layer_stack) must have the same structure, so a
parameter kept FP8 in only some layers of one scanned run is dequantised in all of them.
"""
from __future__ import annotations

import json
import math
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from ling_jax.checkpoint import blocks as B
from ling_jax.checkpoint import orbax as O
from ling_jax.checkpoint.layout import canonical_path, checkpoint_names, is_expert_path
from ling_jax.checkpoint.orbax_validate import check_param_shapes, storage_errors, validate_converted
from ling_jax.checkpoint.reader import CheckpointReader
from ling_jax.config import LingConfig
from ling_jax.exec_config import ExecConfig
from ling_jax.expert_panels import store_experts
from ling_jax.layer_stack import layer_plan
from ling_jax.model import LingForCausalLM
from ling_jax.ops import as_dtype, default_dtype
from ling_jax.placement import attach_mesh, variable_axes, variable_sharding
from ling_jax.quantized import BlockFP8, MXFP4Blocks, mxfp4_packed_shape, mxfp4_scale_shape, scale_grid
from sharding.distributed import is_primary
from sharding.mesh import make_mesh
from sharding.rules import path_str


class ShapeOnlyRngs:
    """Stands in for nnx.Rngs while building a shape-only model: `params()` returns a fixed key.

    With a real nnx.Rngs every `params()` call updates a counter Variable with a tracer, and each
    update makes flax query the tracer's `.sharding`, which builds an error message whose cost grows
    with the whole trace: O(n^2) in the parameter count (~110 s for the full 73-layer model, ~3 s
    this way). Values are irrelevant under eval_shape; only shapes and dtypes are used.
    """

    def params(self):
        return jax.random.key(0)

    def __call__(self):
        return self.params()


def one_device_mesh():
    """The default mesh: the first device alone (axes data, expert, model all of size 1)."""
    return make_mesh({"data": 1, "expert": 1, "model": 1}, jax.devices()[:1])


# ---------------------------------------------------------------------------------------------
# the shape-only model
# ---------------------------------------------------------------------------------------------
def _scan_group(path, cfg: LingConfig) -> tuple:
    """Parameters that must agree on being kept FP8: the same place in every layer of one scanned run
    of the layer plan, and the three routed-expert projections of a block together."""
    p = [str(x) for x in canonical_path(path)]
    if is_expert_path(path):
        p = p[:-1]
    if p[0] == "model" and p[1] == "layers":
        i = int(p[2])
        for b, block in enumerate(layer_plan(cfg)):
            for r in range(len(block.runs)):
                if any(i in row for row in block.layer_grid(r)):
                    return ("run", b, r) + tuple(p[3:])
    return tuple(p)


def quantized_paths(flat, cfg: LingConfig, stored_fp8: Callable) -> set:
    """Paths of the 2-D+ parameters of `flat` ([(path, Variable)]) that `stored_fp8(path)` says to hold
    quantised, each scan group (`_scan_group`) all or nothing."""
    cand = {tuple(p): stored_fp8(p) for p, v in flat if isinstance(v, nnx.Param) and len(v.get_value().shape) >= 2}
    ok: dict = {}
    for p, f in cand.items():
        g = _scan_group(p, cfg)
        ok[g] = ok.get(g, True) and f
    return {p for p in cand if ok[_scan_group(p, cfg)]}


def default_layer_loop(cfg: LingConfig, layer_loop: str | None = None) -> str:
    """The layer loop a loaded model stores its layers for: `layer_loop`, or this backend's default
    for the config (`ExecConfig.for_backend`)."""
    return layer_loop or ExecConfig.for_backend(None, cfg).layer_loop


def abstract_model(cfg: LingConfig, dtype=jnp.float32, with_mtp: bool = True,
                   stored_fp8: Callable | None = None, stored_mxfp4: Callable | None = None,
                   layer_loop: str | None = None) -> LingForCausalLM:
    """Shape-only LingForCausalLM: every variable a ShapeDtypeStruct, or a BlockFP8 of two for the
    parameters `stored_fp8(path)` says the checkpoint stores FP8, or an MXFP4Blocks of two (uint8)
    for the routed experts `stored_mxfp4(path)` says it stores MXFP4 (None: keep nothing quantised;
    `blocks.release_fp8(cfg)` / `blocks.release_mxfp4(cfg)` plan a checkpoint without reading one).

    layer_loop: how the layers are stored (`LayerStack`; default: this backend's for the config):
    "scan" stacks each run's parameters [repeats, n, ...] as a loaded model holds them; the loader
    itself builds "unroll" (one module per layer, the checkpoint's granularity) and stacks after."""
    loop = default_layer_loop(cfg, layer_loop)
    ex = ExecConfig.for_backend(None, cfg, layer_loop="unroll")
    model = nnx.eval_shape(lambda: LingForCausalLM(cfg, dtype=jnp.dtype(dtype), rngs=ShapeOnlyRngs(),
                                                   with_mtp=with_mtp, exec=ex))
    flat = list(nnx.to_flat_state(nnx.state(model)))  # Variables shared with the model
    mx = quantized_paths(flat, cfg, stored_mxfp4) if stored_mxfp4 is not None else set()
    for p, v in flat:
        if tuple(p) in mx:
            shape = tuple(v.get_value().shape)
            v.set_value(MXFP4Blocks(jax.ShapeDtypeStruct(mxfp4_packed_shape(shape), jnp.uint8),
                                    jax.ShapeDtypeStruct(mxfp4_scale_shape(shape), jnp.uint8)))
    if stored_fp8 is not None:
        keep = quantized_paths(flat, cfg, stored_fp8) - mx
        for p, v in flat:
            if tuple(p) in keep:
                shape, block = tuple(v.get_value().shape), B.fp8_block(p, cfg)
                v.set_value(BlockFP8(jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn),
                                     jax.ShapeDtypeStruct(scale_grid(shape, block), jnp.float32), block))
    return model.set_layer_loop(loop)


_LAYOUTS: dict = {}


def param_layout(cfg: LingConfig) -> dict[str, tuple]:
    """{checkpoint tensor name: (parameter path, logical axes, parameter shape)} of every parameter
    of `cfg`'s model (MTP layer included), from the axes its modules declare. Memoized per config."""
    key = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    if key not in _LAYOUTS:
        out = {}
        for path, var in nnx.to_flat_state(nnx.state(abstract_model(cfg, jnp.bfloat16, True, layer_loop="unroll"))):
            if isinstance(var, nnx.Param):
                entry = (canonical_path(path), variable_axes(path, var), tuple(var.get_value().shape))
                out.update(dict.fromkeys(checkpoint_names(tuple(path), cfg)[1], entry))
        if len(_LAYOUTS) > 8:
            _LAYOUTS.clear()
        _LAYOUTS[key] = out
    return _LAYOUTS[key]


def config_constant(path: tuple, cfg: LingConfig) -> float:
    """Value of a non-parameter variable: the per-layer SwiGLU clamp limits (spec §7.2)."""
    p = [str(x) for x in canonical_path(path)]
    layer = cfg.num_hidden_layers if p[0] == "mtp" else int(p[2])
    routed, shared = cfg.swiglu_limits(layer)
    if p[-1] == "routed_limit":
        return routed
    if p[-2:] == ["shared_experts", "limit"]:
        return shared
    raise ValueError(f"no config value for non-parameter variable {'/'.join(p)}")


# ---------------------------------------------------------------------------------------------
# building parameters block by block
# ---------------------------------------------------------------------------------------------
def _index_key(index, shape) -> tuple:
    return tuple(s.indices(n) if isinstance(s, slice) else s for s, n in zip(index, shape))


def _block_numel(index, shape) -> int:
    return math.prod(len(range(*s.indices(n))) if isinstance(s, slice) else 1 for s, n in zip(index, shape))


def _from_blocks(shape, dtype, sharding, read: Callable, what: str, on_read: Callable | None = None) -> jax.Array:
    """A global array whose local blocks `read(index)` supplies, each distinct block read once."""
    shape = tuple(shape)
    want = sharding.shard_shape(shape)
    memo: dict = {}

    def cb(index):
        key = _index_key(index, shape)
        if key not in memo:
            blk = read(index)
            if tuple(blk.shape) != tuple(want):
                raise ValueError(f"{what}: read a block of shape {tuple(blk.shape)}, expected {tuple(want)} "
                                 f"(parameter shape {shape} from config.json)")
            memo[key] = blk
            if on_read is not None:
                on_read(blk)
        return memo[key]

    return jax.make_array_from_callback(shape, sharding, cb, dtype=jnp.dtype(dtype))


class ParamSource:
    """Builds parameters of an abstract model from a checkpoint reader onto `mesh`."""

    def __init__(self, reader, cfg: LingConfig, mesh):
        self.reader, self.cfg, self.mesh = reader, cfg, mesh
        self.heads = cfg.num_attention_heads

    def _what(self, path) -> str:
        names = checkpoint_names(tuple(path), self.cfg)[1]
        return f"{names[0]} (parameter {path_str(path)})"

    def local_bytes(self, path, var) -> int:
        """Stored bytes this process reads for the parameter (its distinct local values blocks)."""
        sh, v = variable_sharding(path, var, self.mesh, self.heads), var.get_value()
        if isinstance(v, (BlockFP8, MXFP4Blocks)):
            sh, v = sh.primary, v.primary
        shape = tuple(v.shape)
        keys = {_index_key(i, shape): i for i in sh.addressable_devices_indices_map(shape).values()}
        return sum(_block_numel(i, shape) for i in keys.values()) * B.stored_itemsize(self.reader, path, self.cfg)

    def build(self, path, var, bar=None):
        """The global value of one parameter (an array or a BlockFP8 of two)."""
        sh, want = variable_sharding(path, var, self.mesh, self.heads), var.get_value()
        itemsize = B.stored_itemsize(self.reader, path, self.cfg)
        counted = (lambda blk: bar.update(blk.size * itemsize)) if bar is not None else None
        r, cfg, what = self.reader, self.cfg, self._what(path)
        if isinstance(want, BlockFP8):
            values = _from_blocks(want.values.shape, jnp.float8_e4m3fn, sh.values,
                                  lambda i: B.read_fp8_values(r, path, cfg, i), what, counted)
            scales = _from_blocks(want.scales.shape, jnp.float32, sh.scales,
                                  lambda i: B.read_fp8_scales(r, path, cfg, i), what + " scales")
            return BlockFP8(values, scales, want.block)
        if isinstance(want, MXFP4Blocks):
            packed = _from_blocks(want.packed.shape, jnp.uint8, sh.packed,
                                  lambda i: B.read_mxfp4_codes(r, path, cfg, i), what, counted)
            scales = _from_blocks(want.scales.shape, jnp.uint8, sh.scales,
                                  lambda i: B.read_mxfp4_scales(r, path, cfg, i), what + " scales")
            return MXFP4Blocks(packed, scales)
        # each tensor is cast to the target dtype as it is read (before stacking experts)
        npdt = B.np_dtype(want.dtype)
        return _from_blocks(want.shape, want.dtype, sh,
                            lambda i: np.asarray(B.read_param(r, path, cfg, i, npdt)), what, counted)


def converted_entries(path, value) -> dict:
    """{converted-checkpoint key: array or ShapeDtypeStruct} of one parameter value (a BlockFP8 or an
    MXFP4Blocks is two: values / packed codes under the key, scales under `scale_key`)."""
    if isinstance(value, BlockFP8):
        return {O.key_of(path): value.values, O.scale_key(path): value.scales}
    if isinstance(value, MXFP4Blocks):  # a converted checkpoint keeps the checkpoint's layout (by rows)
        value = value.as_rows()
        return {O.key_of(path): value.packed, O.scale_key(path): value.scales}
    return {O.key_of(path): value}


def fill_params(flat, source: ParamSource, progress: bool = True, desc: str = "loading") -> None:
    """Build every parameter (nnx.Param) of `flat` ([(path, Variable)]) in place from the checkpoint.
    Other Variables are left alone (see place_constants)."""
    todo = [(p, v) for p, v in flat if isinstance(v, nnx.Param)]
    total = sum(source.local_bytes(p, v) for p, v in todo)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not (progress and is_primary()))
    try:
        for path, var in todo:
            var.set_value(source.build(path, var, bar))
    finally:
        bar.close()


def place_constants(flat, mesh, cfg: LingConfig) -> None:
    """Put the non-parameter Variables of `flat` (config-derived constants: SwiGLU limits) on `mesh`.
    Every process holds the same value."""
    for path, var in flat:
        if isinstance(var, nnx.Param):
            continue
        v = np.asarray(config_constant(path, cfg), np.float32)
        sh = variable_sharding(path, var, mesh, cfg.num_attention_heads)
        var.set_value(jax.make_array_from_callback(v.shape, sh, lambda idx, v=v: v[idx]))


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------
def _finish(graphdef, flat, mesh, cfg: LingConfig, layer_loop: str | None) -> LingForCausalLM:
    """The loaded per-layer model, its layers then stored for the layer loop (stacked per run for
    "scan", each layer's arrays freed once stacked: device memory peaks at the model plus one
    stacked parameter) and, on one CPU device, its float32 routed experts in the native kernel's
    panel order (`ExecConfig.expert_panels`), on `mesh`."""
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))  # its exec: this backend's, layer loop "unroll"
    if model.exec.mxfp4_columns:
        store_mxfp4_by_columns(model, mesh)
    model.set_layer_loop(default_layer_loop(cfg, layer_loop), free=True)
    if model.exec.expert_panels and model.exec.native_experts:
        store_experts(model, panels=True)  # float32 experts on one device (it checks): in the kernel's order
    return attach_mesh(model, mesh)


def store_mxfp4_by_columns(model, mesh) -> None:
    """Every routed-expert weight kept MXFP4 stored by columns (`MXFP4Blocks.as_columns`, in place on
    its devices, one parameter at a time: `ExecConfig.mxfp4_columns`), placed by the rules."""
    heads = model.cfg.num_attention_heads
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        v = var.get_value()
        if isinstance(v, MXFP4Blocks) and not v.columns:
            var.set_value(jax.eval_shape(MXFP4Blocks.as_columns, v))  # its shape, to place it by the rules
            sh = variable_sharding(path, var, mesh, heads)
            var.set_value(jax.jit(MXFP4Blocks.as_columns, out_shardings=sh)(v))


def load_from_reader(reader, cfg: LingConfig, *, mesh=None, dtype=jnp.float32, with_mtp: bool = True,
                     keep_quantized: bool = False, progress: bool = True,
                     layer_loop: str | None = None) -> LingForCausalLM:
    """Build the model from a reader (`CheckpointReader`, or any object with its `get(name, dtype,
    index)`: tests read in-memory dicts) onto `mesh` (default: one device). keep_quantized needs a
    CheckpointReader (it reads the stored dtypes). layer_loop: see `abstract_model`."""
    mesh = one_device_mesh() if mesh is None else mesh
    stored = B.reader_fp8(reader, cfg) if keep_quantized else None
    stored_mx = B.reader_mxfp4(reader, cfg) if keep_quantized else None
    graphdef, state = nnx.split(abstract_model(cfg, as_dtype(dtype), with_mtp and cfg.has_mtp, stored, stored_mx,
                                               layer_loop="unroll"))
    flat = list(nnx.to_flat_state(state))
    fill_params(flat, ParamSource(reader, cfg, mesh), progress)
    place_constants(flat, mesh, cfg)
    return _finish(graphdef, flat, mesh, cfg, layer_loop)


def open_validated(checkpoint_dir: str, with_mtp: bool, keep_quantized: bool):
    """(CheckpointReader, config, with_mtp) after checking every tensor against config.json (and, to
    keep FP8, that the checkpoint stores some F8_E4M3 tensor). The caller closes the reader."""
    reader = CheckpointReader(checkpoint_dir)
    try:
        cfg = reader.config
        with_mtp = with_mtp and cfg.has_mtp
        reader.validate(include_mtp=with_mtp)
        if keep_quantized:
            B.check_keep_quantized(reader)
    except BaseException:
        reader.close()
        raise
    return reader, cfg, with_mtp


def load_model(checkpoint: str, dtype=None, *, mesh=None, with_mtp: bool = True, keep_quantized: bool | None = None,
               progress: bool = True, layer_loop: str | None = None) -> LingForCausalLM:
    """Load a checkpoint directory — HF release layout or a `ling-jax convert` output, detected by
    its marker — onto `mesh` (default: one device). Relative paths are fine; `"demo"` and Hugging
    Face Hub ids `ORG/NAME[@REVISION]` are resolved first (`ling_jax.checkpoint.locate`).

    dtype: storage/compute dtype of the parameters not kept quantised (default `ops.default_dtype()`:
    float32 on CPU, bfloat16 on accelerators). with_mtp: also load the MTP layer (if the config has
    one). keep_quantized: FP8-stored matrices stay BlockFP8, MXFP4 experts MXFP4Blocks (see module doc);
    None = as stored for a converted directory, False for an HF one. The model carries
    `model.exec` (ExecConfig for this backend, with the mesh when it has more than one device).
    layer_loop: "scan" | "unroll" | None (this backend's default for the config): how the layers
    are stored and run (`ling_jax.layer_stack`), a load-time choice (`model.set_layer_loop` converts).
    """
    from ling_jax.checkpoint.locate import resolve_checkpoint
    checkpoint = resolve_checkpoint(checkpoint, what="checkpoint")  # `demo`, a Hub id ORG/NAME[@REV]
    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"{checkpoint}: checkpoint directory not found")
    dtype = as_dtype(dtype or default_dtype())
    mesh = one_device_mesh() if mesh is None else mesh
    if O.is_converted(checkpoint):
        return restore_converted(checkpoint, mesh, dtype, with_mtp, keep_quantized, progress, layer_loop)
    if os.path.isdir(os.path.join(checkpoint, "params")):
        raise ValueError(f"{checkpoint}: looks like an incomplete conversion (no {O.META}); convert again")
    keep = bool(keep_quantized)
    reader, cfg, with_mtp = open_validated(checkpoint, with_mtp, keep)
    try:
        return load_from_reader(reader, cfg, mesh=mesh, dtype=dtype, with_mtp=with_mtp, keep_quantized=keep,
                                progress=progress, layer_loop=layer_loop)
    finally:
        reader.close()


def restore_converted(path: str, mesh, dtype, with_mtp: bool = True, keep_quantized: bool | None = None,
                      progress: bool = True, layer_loop: str | None = None) -> LingForCausalLM:
    """A converted directory → model on `mesh` (any mesh: Orbax reads each process's blocks).

    Parameters stored in another float dtype are cast to `dtype`; FP8-kept matrices stay FP8 (which
    ones: the per-parameter dtypes in the metadata; keep_quantized None: as stored; True/False must
    match the conversion). The directory stores one entry per layer whatever the layer loop (the
    format of every earlier conversion too); the layers are stacked after the restore."""
    path = os.path.abspath(path)  # Orbax wants absolute paths
    meta = validate_converted(path)  # marker, manifest, commit markers, data file sizes: before any restore
    stored_q = bool(meta["keep_fp8"])
    if keep_quantized is not None and bool(keep_quantized) != stored_q:
        raise ValueError(f"{path}: converted {'with' if stored_q else 'without'} --keep-quantized; "
                         f"reconvert {'without' if stored_q else 'with'} it, or omit --keep-quantized")
    cfg = LingConfig.from_json(os.path.join(path, "config.json"))
    with_mtp = with_mtp and cfg.has_mtp
    if with_mtp and not meta["with_mtp"]:
        raise ValueError(f"{path}: converted without the MTP layer (load with with_mtp=False)")
    f8, u8 = str(jnp.dtype(jnp.float8_e4m3fn)), str(jnp.dtype(jnp.uint8))
    stored = (lambda p: meta["params"].get(O.key_of(p), {}).get("dtype") == f8) if stored_q else None  # noqa: E731
    stored_mx = (lambda p: meta["params"].get(O.key_of(p), {}).get("dtype") == u8) if stored_q else None  # noqa: E731
    graphdef, state = nnx.split(abstract_model(cfg, dtype, with_mtp, stored, stored_mx, layer_loop="unroll"))
    flat = list(nnx.to_flat_state(state))
    check_param_shapes(path, meta, {k: tuple(a.shape) for p, v in flat if isinstance(v, nnx.Param)
                                    for k, a in converted_entries(p, v.get_value()).items()}, subset=True)
    groups: dict[str, list] = {}
    for p, v in flat:
        if not isinstance(v, nnx.Param):
            continue
        k = O.key_of(p)
        if k not in meta["params"]:
            raise ValueError(f"{path}: parameter {k} is missing from the converted checkpoint")
        groups.setdefault(meta["params"][k]["group"], []).append((p, v))
    ckptr = O.Checkpointer()
    heads = cfg.num_attention_heads
    bar = tqdm(total=len(groups), unit="group", desc="restoring", disable=not (progress and is_primary()))
    for g, items in groups.items():
        target = {}
        for p, v in items:
            want, sh = v.get_value(), variable_sharding(p, v, mesh, heads)
            if isinstance(want, (BlockFP8, MXFP4Blocks)):
                target[O.key_of(p)] = jax.ShapeDtypeStruct(want.primary.shape, want.primary.dtype, sharding=sh.primary)
                target[O.scale_key(p)] = jax.ShapeDtypeStruct(want.scales.shape, want.scales.dtype, sharding=sh.scales)
            else:
                target[O.key_of(p)] = jax.ShapeDtypeStruct(want.shape, want.dtype, sharding=sh)
        with storage_errors(os.path.join(path, "params", g)):
            got = ckptr.restore(os.path.join(path, "params", g), target)
        for p, v in items:
            want = v.get_value()
            if isinstance(want, BlockFP8):
                v.set_value(BlockFP8(got[O.key_of(p)], got[O.scale_key(p)], want.block))
            elif isinstance(want, MXFP4Blocks):
                v.set_value(MXFP4Blocks(got[O.key_of(p)], got[O.scale_key(p)]))
            else:
                v.set_value(got[O.key_of(p)])
        bar.update(1)
    bar.close()
    place_constants(flat, mesh, cfg)
    return _finish(graphdef, flat, mesh, cfg, layer_loop)
