"""Pallas kernels on a device mesh: each runs per device inside `jax.shard_map` on its own shards.

Why: XLA partitions its own ops over a mesh, but a Mosaic (TPU) or Triton (GPU) kernel is one opaque
custom call that the compiler cannot split ("Mosaic kernels cannot be automatically partitioned"),
found by compiling the model for a TPU pod with `ling-jax aot`. Every kernel of the model works on
independent heads or output columns, so each device runs it on the heads / columns it already holds
(the placement rules split heads and widths over `model`, `sharding/rules.py`) and nothing is
gathered; a contraction over a split input width (row-parallel FP8 matmul) ends in one psum.

The specs come from the same logical axes and rules that placed the operands, so an operand that is
already where the kernel wants it is not moved. On one device (`mesh` None) the kernel is called as
it is. In interpret mode (CPU) the wrapper is the same: the tests run it on simulated meshes.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
from jax.sharding import PartitionSpec as P

from sharding.rules import spec


def on_mesh(kernel: Callable, mesh, in_axes: tuple, out_axes, args: tuple, heads: Optional[int] = None,
            reduce_axis: Optional[str] = None):
    """kernel(*args) with each argument laid out by its logical axes (`in_axes`, one tuple per argument,
    None for replicated) and the result by `out_axes` (a tuple, or a tuple of tuples for several
    outputs). reduce_axis: the logical name of a contracted dimension split over the mesh: the
    per-device results are summed over its mesh axis. mesh None or of one device: a plain call."""
    if mesh is None or mesh.devices.size == 1:
        return kernel(*args)
    in_specs = tuple(P() if ax is None else spec(ax, a.shape, mesh, heads, where="kernel operand")
                     for ax, a in zip(in_axes, args))
    out_shapes = jax.eval_shape(kernel, *args)
    multi = isinstance(out_shapes, (tuple, list))
    outs = tuple(out_shapes) if multi else (out_shapes,)
    oax = tuple(out_axes) if multi else (out_axes,)
    out_specs = tuple(spec(ax, o.shape, mesh, heads, where="kernel result") for ax, o in zip(oax, outs))
    red = None
    if reduce_axis is not None:
        from sharding.rules import RULES
        red = RULES.mesh_axis(reduce_axis, "kernel reduction")
        if dict(zip(mesh.axis_names, mesh.devices.shape)).get(red, 1) == 1 or not any(red == s for sp in in_specs
                                                                                          for s in sp):
            red = None

    def body(*local):
        out = kernel(*local)
        return jax.lax.psum(out, red) if red is not None else out

    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs if multi else out_specs[0],
                       check_vma=False)
    return fn(*args)


def fp8_linear_on_mesh(kernel: Callable, fallback: Callable, mesh, x, values, scales, block, axes: tuple):
    """x [..., K] @ dequant(values [N, K], scales [ceil(N/b0), ceil(K/b1)]).T with the FP8 kernel run per
    device on the weight shards the placement rules gave it (`axes`: the weight's logical (out, in)
    names): x split like K, the result like N, a psum when K is split. Dense FP8 scales are replicated
    (`placement.block_fp8_specs`), so each device slices the rows / columns of its own shard by its
    mesh index. A shard that does not fall on whole quantisation blocks runs `fallback` (the XLA twin,
    which XLA partitions itself)."""
    if mesh is None or mesh.devices.size == 1:
        return kernel(x, values, scales, block)
    vspec = tuple(spec(axes, values.shape, mesh, None, where="fp8 weight")) + (None, None)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    split = [(d, vspec[d], values.shape[d] // sizes[vspec[d]]) for d in (0, 1) if vspec[d] is not None]
    if any(local % block[d] for d, _, local in split):
        return fallback(x, values, scales, block)
    out_ax, in_ax = vspec[0], vspec[1]
    lead = (None,) * (x.ndim - 1)

    def body(xl, vl, s):
        for d, ax, local in split:
            n_blocks = local // block[d]
            s = jax.lax.dynamic_slice_in_dim(s, jax.lax.axis_index(ax) * n_blocks, n_blocks, axis=d)
        y = kernel(xl, vl, s, block)
        return jax.lax.psum(y, in_ax) if in_ax is not None else y

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(*lead, in_ax), P(out_ax, in_ax), P()),
                       out_specs=P(*lead, out_ax), check_vma=False)
    return fn(x, values, scales)
