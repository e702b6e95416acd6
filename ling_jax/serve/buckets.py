"""The row and token counts the engine compiles its step programs for (host only: no jax), shared by
the runner (runner.py), the prefill policy's defaults (prefill_policy.py) and the load replay
(tools/simulate_load.py)."""
from __future__ import annotations


def row_buckets(max_slots: int) -> tuple[int, ...]:
    """Decode row counts compiled: 1, 2, 4, 8, then every power of two and 1.5x it (12, 16, 24, ...)
    below max_slots, and max_slots. Why: a decode step costs what its rows cost, so 3 requests on a
    32-slot engine should run 4 rows and 17 run 24, not 32 (`tools/simulate_load.py`: concurrency 32
    3-4% faster than with powers of two alone)."""
    out, r = [], 1
    while r < max_slots:
        out.append(r)
        if r >= 8 and r * 3 // 2 < max_slots:
            out.append(r * 3 // 2)
        r *= 2
    return tuple(out) + (max_slots,)


def token_buckets(top: int, smallest: int = 8) -> tuple[int, ...]:
    """Powers of two from `smallest` below `top`, and `top`: the prefill token widths compiled (top:
    the tokens one prompt is fed a step) and the decode block-table widths (`runner.decode_widths`)."""
    out, t = [], min(smallest, top)
    while t < top:
        out.append(t)
        t *= 2
    return tuple(out) + (top,)
