"""Routed-expert weights stored in the native CPU kernel's panel order, and back (pure XLA).

The experts kernel (`experts_decode.cc`) multiplies in panels of 16 weight rows, each laid out
`[K][16]` with the K elements in lane-class order (element `8j + l` at position `l·K/8 + j`: the order
its 8-lane dot form sums, so both forms give the same bits). Over `[out, in]` rows it packs every panel
in every call; over weights already in that order it reads them in place (`experts_decode_cpu(...,
packed=True)`): one mid-config MoE layer 0.69x the time at 128 tokens, 0.85-0.88x at 512 (BENCHMARKS.md,
"Thirty-fifth session"). Same shape, same bytes: only the order inside each expert changes.

    wp = pack_panels(w)      # w [..., O, K], O % 16 == 0, K % 8 == 0  ->  wp [..., O, K]
    w == unpack_panels(wp)
"""
from __future__ import annotations

import jax.numpy as jnp

PANEL_ROWS = 16  # weight rows per panel (native_tiles.h PW)
LANES = 8  # float lanes of the kernel's vectors (native_tiles.h L)


def packable(shape) -> bool:
    """Whether a weight of `shape` can be stored in panel order: its last two dims [O, K] with O % 16 == 0
    and K % 8 == 0."""
    O, K = shape[-2:]
    return O % PANEL_ROWS == 0 and K % LANES == 0


def check_packable(shape, name: str = "w") -> None:
    """Raises ValueError naming `name` unless `packable(shape)`."""
    if not packable(shape):
        raise ValueError(f"{name}: panel order needs [out, in] with out a multiple of {PANEL_ROWS} and in a multiple "
                         f"of {LANES}, got {tuple(shape)}")


def pack_panels(w):
    """w [..., O, K] ([out, in]) -> the same values in panel order, same shape: panel p = rows 16p..16p+15,
    stored as [K][16] with K in lane-class order. A copy (once, where the weights are stored)."""
    return _regroup(w, PANEL_ROWS, LANES)


def unpack_panels(wp):
    """The inverse of `pack_panels`: [..., O, K] in panel order -> [out, in] rows."""
    return _regroup(wp, LANES, PANEL_ROWS)


def _regroup(w, a: int, b: int):
    """Each panel of 16·K values seen as [a, K/8, b] is rewritten as [b, K/8, a]: with (a, b) = (16, 8) the
    rows [r][j][l] become [l][j][r] (pack), with (8, 16) back (unpack)."""
    check_packable(w.shape)
    *lead, O, K = w.shape
    n = len(lead)
    t = w.reshape(*lead, O // PANEL_ROWS, a, K // LANES, b)
    return jnp.transpose(t, (*range(n), n, n + 3, n + 2, n + 1)).reshape(*lead, O, K)
