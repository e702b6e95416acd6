"""Quantised weights as their own pytree type, so code dispatches on what a weight *is*.

A parameter (`nnx.Param`) holds either a float array or a `BlockFP8`: the float8_e4m3fn values
exactly as an FP8 checkpoint stores them plus one float32 scale per block. Whoever reads a weight
asks `isinstance(w, BlockFP8)` (or calls `dequantize(w, dtype)`, which passes float arrays through),
so a model holds a mix of both kinds as the checkpoint stores them, with no module swapped.

Block convention: `values` is `[..., R, C]`, `scales` is `[..., ceil(R/br), ceil(C/bc)]` for
`block = (br, bc)`, and element (r, c) is `values[r, c] · scales[r // br, c // bc]` (the
checkpoint's `weight_scale_inv` is multiplied, despite its name; spec §13). A dense projection
`[out, in]` uses the checkpoint's 128×128 blocks. Routed experts keep the checkpoint's blocks
along the hidden size D but are expanded per element along the intermediate width I (gate/up
`[E, I, D]` with block (1, 128), down `[E, D, I]` with block (128, 1)), so a mesh axis may split I
at any divisor (1280 / 4 = 320 is not a multiple of 128); that costs 1/128 of the fp8 bytes.

`MXFP4Blocks` is the other kept-quantised value, for routed experts stored MXFP4
(`ling_jax.checkpoint.mxfp4`): the checkpoint's packed E2M1 codes `[..., R, C/2]` and E8M0 scale
bytes `[..., R, C/32]`, both uint8, the 32-element groups along the LAST (input) axis C. It has the
same small interface (`shape`, `take`, `dequantize`), so the expert matmuls unpack it exactly where
they dequantise a BlockFP8. `is_quantized(w)` is true for either.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ling_jax.checkpoint.mxfp4 import GROUP as MXFP4_GROUP, dequantize_mxfp4_columns, dequantize_mxfp4_jax
from pallas_kernels.fp8.reference import block_dequant_fp8_jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockFP8:
    """float8_e4m3fn `values` [..., R, C] with float32 block `scales` [..., ceil(R/br), ceil(C/bc)]."""
    values: jax.Array
    scales: jax.Array
    block: tuple = dataclasses.field(default=(128, 128), metadata=dict(static=True))

    @property
    def shape(self) -> tuple:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def nbytes(self) -> int:
        return int(self.values.size) * 1 + int(self.scales.size) * 4

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """values × expanded scales, formed in float32, then `dtype` (`block_dequant_fp8_jax`)."""
        return block_dequant_fp8_jax(self.values, self.scales, self.block, dtype)

    @property
    def primary(self):
        """The array whose leading axes are the weight's (values; for specs: the values' spec)."""
        return self.values

    def experts(self, start, n: int) -> "BlockFP8":
        """Experts start .. start+n-1 of the leading axis (start may be traced): a slice, not a copy of the rest."""
        return BlockFP8(jax.lax.dynamic_slice_in_dim(self.values, start, n), jax.lax.dynamic_slice_in_dim(
            self.scales, start, n), self.block)

    def take(self, idx) -> "BlockFP8":
        """Rows of the leading (expert) axis: `values[idx]`, `scales[idx]` (the gathered decode path)."""
        return BlockFP8(self.values[idx], self.scales[idx], self.block)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP4Blocks:
    """MXFP4 weight `[..., R, C]` (R outputs, C inputs). Stored by rows (the checkpoint's layout):
    uint8 `packed` [..., R, C/2] (input 2j in the low nibble of byte j) and uint8 E8M0 `scales`
    [..., R, C/32] (one per 32 consecutive inputs). Stored by columns (`columns=True`, what the
    TPU/GPU expert matmuls read, `ExecConfig.mxfp4_columns`): the same bytes with the last two axes
    swapped, packed [..., C/2, R], scales [..., C/32, R] (`dequantize_mxfp4_columns`)."""
    packed: jax.Array
    scales: jax.Array
    columns: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple:
        """The logical (decoded) shape [..., R, C]."""
        p = tuple(self.packed.shape)
        return p[:-2] + (p[-1], 2 * p[-2]) if self.columns else p[:-1] + (2 * p[-1],)

    @property
    def ndim(self) -> int:
        return len(self.packed.shape)

    @property
    def nbytes(self) -> int:
        return int(self.packed.size) + int(self.scales.size)

    @property
    def primary(self):
        return self.packed

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """E2M1 code × 2^(scale − 127), exact in float32 (`dequantize_mxfp4_jax`), then `dtype`: [..., R, C]."""
        if self.columns:
            even, odd = self.halves(dtype)
            lead, (c2, r) = even.shape[:-2], even.shape[-2:]
            return jnp.swapaxes(jnp.stack([even, odd], axis=-2).reshape(lead + (2 * c2, r)), -1, -2)
        return dequantize_mxfp4_jax(self.packed, self.scales, dtype)

    def halves(self, dtype) -> tuple:
        """(even, odd) inputs of a weight stored by columns, [..., C/2, R] each:
        W·x = evenᵀ·x[0::2] + oddᵀ·x[1::2]."""
        if not self.columns:
            raise ValueError("MXFP4Blocks.halves: the weight is stored by rows (as_columns() first)")
        return dequantize_mxfp4_columns(self.packed, self.scales, dtype)

    def as_columns(self) -> "MXFP4Blocks":
        """The same weight stored by columns (a transpose of the last two axes of both arrays; of the
        shapes, for a shape-only weight)."""
        return self if self.columns else MXFP4Blocks(_swap_minor(self.packed), _swap_minor(self.scales), True)

    def as_rows(self) -> "MXFP4Blocks":
        """The same weight stored by rows, the checkpoint's layout (what a converted checkpoint keeps)."""
        return self if not self.columns else MXFP4Blocks(_swap_minor(self.packed), _swap_minor(self.scales), False)

    def experts(self, start, n: int) -> "MXFP4Blocks":
        """Experts start .. start+n-1 of the leading axis (start may be traced)."""
        return MXFP4Blocks(jax.lax.dynamic_slice_in_dim(self.packed, start, n),
                           jax.lax.dynamic_slice_in_dim(self.scales, start, n), self.columns)

    def take(self, idx) -> "MXFP4Blocks":
        """Rows of the leading (expert) axis (the gathered decode path)."""
        return MXFP4Blocks(self.packed[idx], self.scales[idx], self.columns)


def _swap_minor(x):
    """x with its last two axes swapped; a ShapeDtypeStruct's shape (its sharding dropped: the caller
    places the result)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[:-2] + x.shape[:-3:-1], x.dtype)
    return jnp.swapaxes(x, -1, -2)


QUANTIZED = (BlockFP8, MXFP4Blocks)


def is_quantized(w) -> bool:
    """True for a kept-quantised weight value (BlockFP8 or MXFP4Blocks) or a spec tree of one."""
    return isinstance(w, QUANTIZED)


def dequantize(w, dtype) -> jax.Array:
    """A float array as `dtype`, or a BlockFP8 / MXFP4Blocks dequantised to `dtype`."""
    return w.dequantize(dtype) if is_quantized(w) else jnp.asarray(w).astype(dtype)


def mxfp4_scale_shape(shape) -> tuple:
    """Scale shape [..., R, C/32] of an MXFP4 weight of logical `shape` [..., R, C]."""
    return tuple(shape[:-1]) + (shape[-1] // MXFP4_GROUP,)


def mxfp4_packed_shape(shape) -> tuple:
    """Packed shape [..., R, C/2] of an MXFP4 weight of logical `shape` [..., R, C]."""
    return tuple(shape[:-1]) + (shape[-1] // 2,)


def scale_grid(shape, block) -> tuple:
    """Scale shape of a `shape` [..., R, C] matrix with `block` (br, bc)."""
    br, bc = block
    return tuple(shape[:-2]) + (-(-shape[-2] // br), -(-shape[-1] // bc))
