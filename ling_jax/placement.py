"""Where each parameter lives on a mesh: its declared logical axes through `sharding.rules`.

Every `nnx.Variable` of the model carries `axes` metadata where it is created (one logical name
per dimension, e.g. `Linear(..., axes=("heads", "embed"))`); `sharding.rules.spec` maps them to a
PartitionSpec. A quantised value (`BlockFP8`) places its values like a float weight of the same
axes and its scales by `block_fp8_specs`. An `MXFP4Blocks` (routed experts kept MXFP4) places its
packed codes and its scales with ONE spec, `mxfp4_spec`. A Variable without `axes` fails loudly
with its path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P

from ling_jax.expert_panels import store_experts
from ling_jax.quantized import BlockFP8, MXFP4Blocks, mxfp4_scale_shape
from sharding.rules import UnknownParameterError, path_str, spec


def block_fp8_specs(values_spec: P, block, ndim: int) -> P:
    """Spec of a BlockFP8's scales [..., ceil(R/br), ceil(C/bc)] given its values' spec [..., R, C]:
    leading dims and the dims whose block is 1 (scale grid = values) follow the values; a blocked
    dim is replicated (a split of the values need not fall on block boundaries, and the grid is
    1/block of the bytes). So dense-weight scales are replicated, expert scales split like today."""
    vs = tuple(values_spec) + (None,) * (ndim - len(values_spec))
    lead, (r, c) = vs[:-2], vs[-2:]
    return P(*lead, r if block[0] == 1 else None, c if block[1] == 1 else None)


def mxfp4_spec(axes, shape, mesh, heads, where: str = "") -> P:
    """Spec of both arrays of an MXFP4 weight of logical `shape` [..., R, C] and `axes`.

    Decided on the scale grid [..., R, C/32]: a split of the input axis C is allowed only when the
    number of 32-groups divides by the mesh axis, so no device holds part of a group (packed C/2 and
    C then divide too). Gate/up `[E, I, D]`: C = D (embed, never split), I rows split freely; down
    `[E, D, I]`: C = I, so `model` splits I only in whole groups (real config: 1280/32 = 40 groups,
    model=2, 4, 8 split; model=16 replicates I, with a warning from `sharding.rules`).
    """
    return spec(axes, mxfp4_scale_shape(shape), mesh, heads, where=where)


#: logical axis of the two leading [repeats, n] axes of a stacked run's parameter (`ling_jax.layer_stack`):
#: never split (sharding/rules.py)
STACKED_AXIS = "layers"


def variable_axes(path, var) -> tuple:
    """The logical axes declared on `var` (an nnx.Variable at `path`), or UnknownParameterError."""
    # a stacked run's parameter ([repeats, n, ...], `ling_jax.layer_stack`) declares one layer's axes and
    # carries `stacked_axes`: the two leading "layers" axes (never split) go in front while it holds the
    # whole stack (inside the layer scan each layer's module holds its own slice)
    meta = var.get_metadata() if isinstance(var, nnx.Variable) else {}
    axes = meta.get("axes")
    k = int(meta.get("stacked_axes", 0) or 0)
    if axes is not None and k and len(getattr(var.get_value(), "shape", ())) == len(axes) + k:
        axes = (STACKED_AXIS,) * k + tuple(axes)
    if axes is None:
        raise UnknownParameterError(
            f"sharding: parameter {path_str(path)!r} has no logical axes; declare them where it is created, "
            f"e.g. nnx.Param(value, axes=(...)) (vocabulary: sharding/rules.py)")
    return tuple(axes)


def swap_minor_spec(s: P, ndim: int) -> P:
    """PartitionSpec `s` (over `ndim` axes, short specs padded with None) with its last two entries
    swapped: the spec of an MXFP4 weight stored by columns from its logical one, and back."""
    full = tuple(s) + (None,) * (ndim - len(s))
    return P(*full[:-2], full[-1], full[-2])


def value_specs(path, var, mesh, heads: int | None):
    """PartitionSpec of the Variable's value, or BlockFP8(values spec, scales spec) / MXFP4Blocks(spec, spec)
    for a quantised one."""
    axes, v = variable_axes(path, var), var.get_value()
    where = path_str(path)
    if isinstance(v, BlockFP8):
        vs = spec(axes, v.values.shape, mesh, heads, where=where)
        return BlockFP8(vs, block_fp8_specs(vs, v.block, v.ndim), v.block)
    if isinstance(v, MXFP4Blocks):
        s = mxfp4_spec(axes, v.shape, mesh, heads, where)
        if v.columns:  # stored [..., C/2, R]: the spec of the last two axes swapped
            s = swap_minor_spec(s, v.ndim)
        return MXFP4Blocks(s, s, v.columns)
    return spec(axes, v.shape, mesh, heads, where=where)


def _named(mesh, s):
    if isinstance(s, BlockFP8):
        return BlockFP8(NamedSharding(mesh, s.values), NamedSharding(mesh, s.scales), s.block)
    if isinstance(s, MXFP4Blocks):
        return MXFP4Blocks(NamedSharding(mesh, s.packed), NamedSharding(mesh, s.scales), s.columns)
    return NamedSharding(mesh, s)


def param_specs(model_or_state, mesh, heads: int | None = None) -> dict[tuple, object]:
    """{NNX path: PartitionSpec (or BlockFP8 of two)} for every Variable (parameters and constants).
    heads: head count of `heads` dims (default: the model's `cfg.num_attention_heads`)."""
    state = model_or_state
    if isinstance(state, nnx.Module):
        heads = heads if heads is not None else state.cfg.num_attention_heads
        state = nnx.state(state)
    return {tuple(p): value_specs(p, v, mesh, heads) for p, v in nnx.to_flat_state(state)}


#: The tiles XLA:TPU compiles a scanned layer loop's bfloat16 weight operands for, by device kind,
#: where they differ from jax's default entry layout of a bfloat16 array ((8, 128) tiles, two rows
#: packed per 32-bit word). Measured with the compile-only targets (tests/test_aot.py): TPU7x
#: relays such stacks out into (16, 128) tiles once per call; v5e, v5p and v6e use the default in
#: the loop and override (jax refuses) a (16, 128) input layout.
LOOP_BF16_TILES = {"TPU7x": ((16, 128), (2, 1))}
#: Weight stacks [repeats, n, cols] (float32 or bfloat16: the KDA dt_bias, A_log and norm weights) on a
#: TPU: its scanned loop reads them row-major, but the default on-device layout puts `repeats` inside
#: the tiles when that pads less (TPU7x lays the release's f32[8, 7, 8192] dt_bias stack out {2,0,1}:
#: the 8 repeats second-minor, the 7 not padded to 8), and every scanned program relaid such stacks out
#: once per call (2.8 MB a decode call on the real config; measured on TPU7x, v5e, v5p and v6e with the
#: compile-only targets, tests/test_aot.py). Not 4-dim stacks: row-major there made XLA:TPU copy a
#: float32 [8, 7, 512, 4096] stack (the router) every call.
LOOP_ROW_MAJOR_PLATFORM = "tpu"
#: The float32 block scales of an FP8 weight stack [repeats, n, R, C] (R, C: blocks of 128 rows and
#: columns) on a TPU: when R is more than the 8 sublanes of a float32 tile the scanned loop reads
#: each layer's scales with the R axis minor (`major_to_minor` (0, 1, 3, 2)), where the default layout
#: keeps the larger axis minor, and every scanned program relaid such stacks out once per call (the
#: real config's KDA o_proj [8, 7, 32, 64], the shared experts' [8, 7, 10, 32] / [8, 7, 32, 10]: 0.7 MB a
#: decode call on TPU7x). With R <= 8 the loop reads the default ([.., 8, 16], [.., 1, 16]: stored R-minor
#: those were copied back). Measured with the compile-only targets at hidden 1024, 2048 and the release's
#: 4096 (tests/test_aot.py).
LOOP_SCALES_MAJOR_TO_MINOR = (0, 1, 3, 2)
LOOP_SCALES_MIN_ROWS = 9


def stack_format(shape, dtype, sharding, block_scales: bool = False):
    """Where a stacked weight ([repeats, n, ...], `layer_stack`) goes under
    `ExecConfig.loop_stack_layouts`, on a TPU whose scanned loop reads it in another layout than jax's
    default: a bfloat16 stack [repeats, n, rows, cols] on a kind listed in `LOOP_BF16_TILES` whose
    per-device shard is whole tiles, as a row-major `Format` in those tiles (no padding: the same
    bytes); a float32 or bfloat16 stack [repeats, n, cols] on a TPU (`LOOP_ROW_MAJOR_PLATFORM`), as a
    row-major `Format` in the default tiles (the stacked axes outermost: at most one tile row of
    padding per repeat); the float32 block scales of a stacked FP8 matrix (`block_scales`: the
    `scales` of a `BlockFP8`, [repeats, n, rows, cols]) of more than 8 block rows on a TPU, in
    `LOOP_SCALES_MAJOR_TO_MINOR`;
    anything else `sharding` unchanged. Why: placed by default, every scanned program on TPU7x copied
    such stacks into the loop's layout once per call (the real config: the KDA b_proj and MLA
    kv_a_proj_with_mqa bfloat16 stacks, 67 MB per device a decode call; the KDA dt_bias float32 stack
    and the norm weights' bfloat16 ones, 2.8 MB; the FP8 scale stacks, 0.7 MB)."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    device, dt = next(iter(sharding.device_set)), jnp.dtype(dtype)
    row_major = tuple(range(len(shape)))
    if block_scales:
        if (dt == jnp.float32 and len(shape) == 4 and shape[2] >= LOOP_SCALES_MIN_ROWS
                and device.platform == LOOP_ROW_MAJOR_PLATFORM):
            return Format(Layout(major_to_minor=LOOP_SCALES_MAJOR_TO_MINOR), sharding)
        return sharding
    if dt in (jnp.float32, jnp.bfloat16) and len(shape) == 3 and device.platform == LOOP_ROW_MAJOR_PLATFORM:
        return Format(Layout(major_to_minor=row_major), sharding)
    if dt != jnp.bfloat16 or len(shape) < 4:
        return sharding
    tiles = LOOP_BF16_TILES.get(device.device_kind)
    if tiles is None:
        return sharding
    shard = sharding.shard_shape(tuple(shape))
    if shard[-2] % tiles[0][0] or shard[-1] % tiles[0][1]:
        return sharding
    return Format(Layout(major_to_minor=row_major, tiling=tiles), sharding)


def variable_sharding(path, var, mesh, heads: int | None):
    """NamedSharding (or BlockFP8 of two) of one Variable's value on `mesh`."""
    return _named(mesh, value_specs(path, var, mesh, heads))


def shard_model(model, mesh):
    """Place an already-built model's variables on `mesh` by their axes (updated in place; returned).

    Single-process only for arbitrary values (`jax.device_put` of host-visible arrays); multi-host
    runs load with `ling_jax.loader.load_model`, which reads only each process's slices. Routed experts
    a one-device load stored in the CPU kernel's panel order go back to rows first (placed by their
    logical axes; `ling_jax.expert_panels`).
    """
    if mesh is not None and mesh.devices.size > 1:
        store_experts(model, panels=False)
    heads = model.cfg.num_attention_heads
    for path, var in nnx.to_flat_state(nnx.state(model)):  # Variables are shared with the model
        var.set_value(jax.device_put(var.get_value(), variable_sharding(path, var, mesh, heads)))
    return attach_mesh(model, mesh)


#: The Variable metadata key that records the mesh a parameter was placed on.
MESH_KEY = "mesh"


def attach_mesh(model, mesh):
    """Record on every Variable of `model` the mesh its value was placed on (None: one device).

    Why metadata: the code that must know the mesh (expert parallelism in `moe`, Pallas kernels run
    per device by `kernel_mesh.on_mesh`) runs under `jit`, where a parameter is a tracer without a
    concrete sharding; Variable metadata is static and survives `nnx.split`/`merge`, so each module
    reads the mesh from its own parameter (`param_mesh`) and no execution config carries it. A
    one-device mesh is recorded as None (the single-device path)."""
    m = None if mesh is None or mesh.devices.size == 1 else mesh
    for _, var in nnx.to_flat_state(nnx.state(model)):
        var.set_metadata(MESH_KEY, m)
    return model


def param_mesh(var):
    """The mesh Variable `var` lives on (recorded by `attach_mesh` from its placement), or None."""
    return var.get_metadata().get(MESH_KEY)


def model_mesh(model):
    """The mesh `model`'s parameters live on (None: one device). `attach_mesh` records one mesh on
    every Variable, so the first Variable answers: no walk of the whole tree (`forward` asks on
    every call)."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable):
            return param_mesh(node)
    return None


def logits_sharding(model):
    """The NamedSharding of the model's [rows, V] logits as its LM head splits the vocabulary (the
    `vocab` rule), or None: one device, or a vocabulary left whole. Sampling takes it so that only
    each row's best candidates cross devices (`sampling.processed_logits_rows`)."""
    mesh = model_mesh(model)
    if mesh is None:
        return None
    s = spec((None, "vocab"), (1, model.cfg.vocab_size), mesh, where="logits")
    return None if s[1] is None else NamedSharding(mesh, s)
