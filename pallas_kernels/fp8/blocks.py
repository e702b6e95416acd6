"""The block-scale grid of an FP8 matrix (spec §13): its shape and the checks on it.

A quantised `[O, I]` matrix comes with a float32 scale grid `[ceil(O/bo), ceil(I/bi)]` (partial
edge blocks have their own entry). Pure Python, no jax: the checkpoint's NumPy quantiser
(`ling_jax.checkpoint.fp8`) and the jax references here share these, so a bad block or grid gets
the same error wherever it is caught.
"""
from __future__ import annotations

DEFAULT_BLOCK = (128, 128)  # the release's weight_block_size


def scale_grid_shape(shape, block=DEFAULT_BLOCK) -> tuple[int, int]:
    """Shape of the block-scale grid of a [O, I] matrix: (ceil(O/bo), ceil(I/bi))."""
    o, i = shape
    bo, bi = block
    return (-(-int(o) // int(bo)), -(-int(i) // int(bi)))


def check_block(block) -> tuple[int, int]:
    """`block` as two positive ints (rows, cols), or a ValueError naming it."""
    if len(block) != 2 or any(int(b) <= 0 for b in block):
        raise ValueError(f"block must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def check_scale_grid(shape, scale_shape, block) -> None:
    """ValueError unless `scale_shape` is the ceil grid of a `shape` matrix with `block`."""
    want = scale_grid_shape(shape, block)
    if tuple(scale_shape) != want:
        raise ValueError(f"scale shape {tuple(scale_shape)} does not match the ceil grid {want} "
                         f"of a {tuple(shape)} matrix with block {tuple(block)}")
