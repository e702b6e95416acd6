"""Routed experts on XLA:CPU without capacity buffers: the native kernel, or a loop over the experts in use.

Why: the capacity path (`ling_jax.moe_capacity`) runs every expert on a buffer of min(N, 1.5× mean)
rows, so it streams all E experts' weights and computes its padding; the gather path copies each
assignment's expert before reading it. `experts_local` therefore calls `experts_for_tokens`:
the native CPU kernel (`pallas_kernels.experts.cpu_kernel`: each used expert's weights read once, in
place, for all its tokens, in register tiles) when `native`, float32 and built — at any token count,
decode and prefill alike — else, while N·k ≤ E (most experts idle in the step), its pure-XLA
reference (`pallas_kernels.experts.reference.experts_active_loop`), and the capacity path beyond.

Measured on one mid-config MoE layer (E=64, I=256, D=1024, k=8, random routing, interleaved, quiet
2-core machine; `tools/bench_moe_decode.py`, BENCHMARKS.md "Native experts kernel, fourteenth
session"): native against the capacity path N=8 9.2 / 21.7 ms, 32 17.6 / 23.4, 128 41.2 / 58.7,
256 76.7 / 103.1, 512 154 / 208, 2048 654 / 879 ms: the native kernel wins at every count, so it
has no token limit. The XLA loop: N=8 5.3–6.4 ms against the capacity path's 7.3–7.8 ms (an
earlier machine), N=16 9.3 against 8.4 ms: its limit stays N·k ≤ E.
"""
from __future__ import annotations

import logging

from pallas_kernels.experts import cpu_kernel
from pallas_kernels.experts.panels import unpack_panels
from pallas_kernels.experts.reference import experts_active_loop

log = logging.getLogger(__name__)
_warned = []


def uses_active_loop(n_tokens: int, k: int, n_experts: int, native: bool = False) -> bool:
    """Whether `experts_for_tokens` runs instead of the capacity path: always for the native
    kernel (it wins at every measured count, 8 to 2,048 tokens); the XLA loop while the assignments
    cannot cover every expert, N·k ≤ E."""
    return native or n_tokens * k <= n_experts


def native_applies(native: bool, *arrays) -> bool:
    """Whether `experts_for_tokens` will run the native kernel: asked for, float32, built."""
    return native and all(a.dtype == "float32" for a in arrays) and cpu_kernel.available()


def experts_for_tokens(x, idx, wts, wg, wu, wd, limit, native: bool, packed: bool = False):
    """Σ_j wts[n,j] · expert_{idx[n,j]}(x[n]) → [N,D] float32 (contract of `experts_active_loop`);
    the native kernel when asked for, float32 and available (a warning once when it cannot be built).
    packed: the weights are stored in the kernel's panel order (`expert_panels.PanelOrdered`'s values)."""
    if native_applies(native, x, wg, wu, wd):
        return cpu_kernel.experts_decode_cpu(x, idx, wts, wg, wu, wd, limit, packed=packed)
    if native and not cpu_kernel.available() and not _warned:
        _warned.append(True)
        log.warning("native CPU experts kernel unavailable, using the XLA loop: %s", cpu_kernel.load_error())
    if packed:
        wg, wu, wd = (unpack_panels(w) for w in (wg, wu, wd))
    return experts_active_loop(x, idx, wts, wg, wu, wd, limit)
