"""Routed experts stored the way the native CPU kernel runs them: `PanelOrdered`, and the load step.

Why: over `[out, in]` rows the native experts kernel (`pallas_kernels.experts.cpu_kernel`) packs
every 16-row weight panel into its GEMM's order in every call; over weights stored in that order
(`pallas_kernels.experts.panels.pack_panels`, same shape, same bytes) it reads them in place. One
mid-config MoE layer: 0.95x the time at 8 tokens, 0.91x at 32, 0.72x at 128, 0.87x at 512, the same
bits (BENCHMARKS.md "Thirty-fifth session"). So a model loaded to run on XLA:CPU stores them so
(`ExecConfig.expert_panels`, applied by `ling_jax.loader` once the layers are stored for their loop):
a load-time choice like the layer loop.

A stored weight is a `PanelOrdered` (a pytree of one array), not a bare array, so nothing can read
its values as `[out, in]` rows by mistake: the MoE block hands them to the kernel with `packed=True`
and every other path (the XLA loop, another ExecConfig at call time, gradients) reads `rows()` (a
permutation: its gradient comes back in panel order); the exporter reads `as_rows(value)`.
Only float32 routed experts on one device with D and I multiples of 16 are stored so; everything
else keeps rows (kept-quantised weights, meshes, other dtypes).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.experts import cpu_kernel
from pallas_kernels.experts.panels import pack_panels, packable, unpack_panels

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PanelOrdered:
    """A routed-expert weight `[..., E, O, K]` ([out, in] per expert) whose `values` hold each expert's
    elements in the native kernel's panel order (`pack_panels`): same shape, dtype and bytes."""
    values: jax.Array

    @property
    def shape(self) -> tuple:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes)

    def rows(self) -> jax.Array:
        """The weight as `[out, in]` rows (a copy: for the paths that are not the native kernel)."""
        return unpack_panels(self.values)

    def __getitem__(self, index):
        raise TypeError(_AS_ROWS)

    def __array__(self, *args, **kwargs):
        raise TypeError(_AS_ROWS)


_AS_ROWS = ("this routed-expert weight is stored in the native CPU kernel's panel order (a model loaded onto one "
            "CPU device, ExecConfig.expert_panels): read its [out, in] values with "
            "ling_jax.expert_panels.as_rows(value) or value.rows()")


def as_rows(w):
    """`w` as `[out, in]` rows when it is stored `PanelOrdered`, else `w` itself."""
    return w.rows() if isinstance(w, PanelOrdered) else w


def fits_panels(w) -> bool:
    """Whether expert weight `w` can be stored in panel order: a float32 array (not kept quantised),
    its last two dims [O, K] with O a multiple of 16 and K of 8."""
    return isinstance(w, jax.Array) and w.dtype == jnp.float32 and w.ndim >= 3 and packable(w.shape)


@jax.jit
def _pack(w):
    return pack_panels(w)


@jax.jit
def _unpack(w):
    return unpack_panels(w)


def _expert_modules(model):
    """The routed-expert modules of `model` (`moe.Experts`, each attribute `experts` of a MoE block;
    found by path, since `moe` imports this module)."""
    return [node for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Module) and path and path[-1] == "experts" and hasattr(node, "gate_proj")]


def store_experts(model, panels: bool) -> int:
    """Store every routed-expert weight of `model` in panel order (`panels`) or back as rows, in
    place, one array at a time (each old array deleted once its copy exists: memory peaks at the
    model plus one expert stack). With `panels`, a layer's three weights are converted together when
    all of them `fits_panels` and sit on one device, and only when the native kernel is built (it
    alone reads them in place).
    Returns how many weights were converted. Outside any program; split the model again after."""
    if panels and not cpu_kernel.available():
        return 0
    n = 0
    for experts in _expert_modules(model):
        ws = [getattr(experts, name).get_value() for name in EXPERT_WEIGHTS]
        # all three or none: the kernel reads one layout for the three
        if panels and not all(fits_panels(w) and len(w.devices()) == 1 for w in ws):
            continue
        for name, w in zip(EXPERT_WEIGHTS, ws):
            var = getattr(experts, name)
            if panels:
                var.set_value(PanelOrdered(_pack(w)))
            elif isinstance(w, PanelOrdered):
                var.set_value(_unpack(w.values))
                w = w.values
            else:
                continue
            w.delete()
            n += 1
    return n
