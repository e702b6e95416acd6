"""Routed experts for a few tokens (XLA:CPU): a loop over the experts in use, each read once.

Why: the capacity path (`ling_jax.moe_capacity`) runs every expert on a buffer of min(N, 1.5× mean)
rows, so it streams all E experts' weights; the gather path copies each assignment's expert before
reading it. With N·k ≤ E most experts are idle in a step, so `experts_local` calls
`experts_for_few_tokens`, which visits only the used ones: the native CPU kernel
(`pallas_kernels.experts.cpu_kernel`, weights read once in place) when `native` and it is built,
else its pure-XLA reference (`pallas_kernels.experts.reference.experts_active_loop`).

Measured on one mid-config MoE layer (E=64, I=256, D=1024, k=8, random routing, interleaved, quiet
2-core machine), XLA loop: N=8 5.3–6.4 ms against the capacity path's 7.3–7.8 ms, N=4 3.0 against
5.8 ms, N=1 1.3 against the gather path's 1.6 ms; from N·k > E on (N=16: 9.3 against 8.4 ms) the
capacity path wins. The native kernel reads each used expert once without the loop's copies, so
it holds out to N·k ≤ 2·E (`NATIVE_ASSIGNMENTS_PER_EXPERT`); BENCHMARKS.md "Batched decode step on CPU".
"""
from __future__ import annotations

import logging

from pallas_kernels.experts import cpu_kernel
from pallas_kernels.experts.reference import experts_active_loop

log = logging.getLogger(__name__)
_warned = []


#: How many assignments per expert (N·k / E) the native kernel takes before the capacity path wins.
#: Measured (`tools/bench_moe_decode.py`, one mid-config MoE layer, 2-core machine, 2026-12-03):
#: N=8 native 10.0 ms vs capacity 19.9; N=16 17.9 vs 20.1; N=32 25.5 vs 22.6; N=64 40.5 vs 35.8.
NATIVE_ASSIGNMENTS_PER_EXPERT = 2


def uses_active_loop(n_tokens: int, k: int, n_experts: int, native: bool = False) -> bool:
    """The XLA loop pays off while the assignments cannot cover every expert: N·k ≤ E; the native
    kernel (each used expert read once, in place, for all its tokens) up to N·k ≤ 2·E."""
    return n_tokens * k <= n_experts * (NATIVE_ASSIGNMENTS_PER_EXPERT if native else 1)


def native_applies(native: bool, *arrays) -> bool:
    """Whether `experts_for_few_tokens` will run the native kernel: asked for, float32, built."""
    return native and all(a.dtype == "float32" for a in arrays) and cpu_kernel.available()


def experts_for_few_tokens(x, idx, wts, wg, wu, wd, limit, native: bool):
    """Σ_j wts[n,j] · expert_{idx[n,j]}(x[n]) → [N,D] float32 (contract of `experts_active_loop`);
    the native kernel when asked for, float32 and available (a warning once when it cannot be built)."""
    if native_applies(native, x, wg, wu, wd):
        return cpu_kernel.experts_decode_cpu(x, idx, wts, wg, wu, wd, limit)
    if native and not cpu_kernel.available() and not _warned:
        _warned.append(True)
        log.warning("native CPU experts kernel unavailable, using the XLA loop: %s", cpu_kernel.load_error())
    return experts_active_loop(x, idx, wts, wg, wu, wd, limit)
