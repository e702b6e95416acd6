"""Value checks of tensors as they stream out of a checkpoint: no NaN/Inf weights, positive finite scales.

A NaN in one norm weight or one FP8 byte, or a zero block scale, does not fail any shape check; it
silently turns every logit into NaN (or zero). The reader runs these checks on each tensor (or each
block of one, for sharded reads) right after reading it, so the cost is one pass over bytes that were
just read: integer masks on the raw bit patterns, no float conversion.

Non-finite bit patterns: float32/float16/bfloat16 have an all-ones exponent; float8_e4m3fn has no
infinities and its only NaNs are S.1111.111 (0x7F / 0xFF); float8_e5m2 has an all-ones exponent.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

# (unsigned view dtype, sign-clearing mask, smallest non-finite magnitude pattern): with the sign bit
# cleared, a value is non-finite iff its bits are >= that pattern (exponent all ones; for e4m3fn the
# single NaN magnitude 0x7F). One masked copy and one max-reduction per block.
_NONFINITE = {
    "F32": (np.uint32, 0x7FFFFFFF, 0x7F800000),
    "F64": (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
    "F16": (np.uint16, 0x7FFF, 0x7C00),
    "BF16": (np.uint16, 0x7FFF, 0x7F80),
    "F8_E4M3": (np.uint8, 0x7F, 0x7F),
    "F8_E5M2": (np.uint8, 0x7F, 0x7C),
}


def first_nonfinite(a: np.ndarray, dtype: str) -> Optional[tuple[int, ...]]:
    """Index of the first NaN/Inf element of `a` (stored safetensors dtype `dtype`), or None.

    Integer dtypes are always finite. `a` may be any (sub-)block of the stored tensor.
    """
    spec = _NONFINITE.get(dtype)
    if spec is None or a.size == 0:
        return None
    view, sign_off, lowest_bad = spec
    mag = np.bitwise_and(np.ascontiguousarray(a).view(view), view(sign_off))
    if mag.max() < lowest_bad:
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(mag.reshape(-1) >= lowest_bad)), a.shape))


def first_nonpositive(a: np.ndarray) -> Optional[tuple[int, ...]]:
    """Index of the first element <= 0 of a float array (scales must be > 0), or None."""
    bad = ~(np.asarray(a, np.float32) > 0)
    if not bad.any():
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(bad.reshape(-1))), bad.shape))
