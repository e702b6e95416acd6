#!/usr/bin/env python3
"""Would MXFP4 expert codes stored transposed remove the TPU programs' relayouts? An experiment, not the
product path (twenty-eighth session; BENCHMARKS.md "A faster host, and what the compiled programs copy").

    python tools/probe_mxfp4_columns.py --config ../shared/spec/config.ling-3.1-flash.json --weights mxfp4 \
        --target tpu7x:2x2x1 --mesh expert=8 --max-slots 8 --max-seq-len 8192 --cache-memory 8 \
        --programs prefill --json          # or --programs decode --decode-rows 1,8

Runs `ling-jax aot` with every MXFP4 expert weight of the shape-only model stored as `[.., K/2, N]`
(the codes of two consecutive inputs a byte, as in the checkpoint, but the input axis second-minor:
the layout the grouped matmul reads) instead of the checkpoint's `[.., N, K/2]`, and the two expert
paths patched to read that: each chunk / each token's experts decoded as its even and odd inputs apart
(`halves_t`: no interleave) and contracted against the activations' even and odd columns. Compare the
report's `copies`, `temp_bytes` and `bytes_accessed` with plain `ling-jax aot` on the same flags (a mesh
that splits only the expert axis: the swapped arrays keep the plain ones' shardings). The
real config (tpu7x, 8 slots x 8,192): prefill temp 30.6 -> 2.7 GiB, bytes 173 -> 26 GB (the 26 GiB
relayout of the code stacks gone). Only the compile is measured: the patched paths' values are not
checked here (what a real implementation must test: equal to the checkpoint layout's).
"""
import sys

import jax
import jax.numpy as jnp

import ling_jax.aot.abstract as A
import ling_jax.moe as M
from ling_jax.checkpoint.mxfp4 import E8M0_NAN
from ling_jax.quantized import MXFP4Blocks


def halves_t(w, dtype):
    """packed [c, K/2, N], scales [c, K/32, N] -> even, odd [c, K/2, N] (rows 2m, 2m+1 of W^T)."""
    c, k2, n = w.packed.shape
    p = w.packed.astype(jnp.int32).reshape(c, k2 // 16, 16, n)
    e = w.scales.astype(jnp.int32)[:, :, None, :]

    def value(codes):
        idx = codes & 0x7
        e2, m = idx >> 1, idx & 1
        nn = jnp.where(e2 == 0, m, (2 + m) << jnp.maximum(e2 - 1, 0))
        nbits = jax.lax.bitcast_convert_type(nn.astype(jnp.float32), jnp.int32)
        exp_field = (nbits >> 23) + e - 128
        normal = nbits + ((e - 128) << 23)
        sub = nn << jnp.clip(e + 21, 0, 30)
        mag = jnp.where(exp_field >= 1, normal, sub)
        mag = jnp.where(exp_field >= 255, 0x7F800000, mag)
        mag = jnp.where(nn == 0, 0, mag)
        mag = jnp.where(e == E8M0_NAN, 0x7FC00000, mag)
        return jax.lax.bitcast_convert_type(mag | ((codes >> 3) << 31), jnp.float32).astype(dtype).reshape(c, k2, n)
    return value(p & 0x0F), value(p >> 4)


_orig = M.experts_ragged_in_chunks


def chunks_t(x, idx, weights, limit, chunk=M.EXPERT_CHUNK):
    if not isinstance(weights[0], MXFP4Blocks):
        return _orig(x, idx, weights, limit, chunk)
    E_l = weights[0].packed.shape[0]
    c = max(d for d in range(1, min(chunk, E_l) + 1) if E_l % d == 0)
    N, k = idx.shape

    def one(acc, start):
        ws = [halves_t(w.experts(start, c), x.dtype) for w in weights]
        rel = idx - start
        inside = (rel >= 0) & (rel < c)
        flat = jnp.where(inside, rel, c).reshape(-1)
        order = jnp.argsort(flat, stable=True)
        xs = x[order // k]
        sizes = jnp.bincount(flat, length=c).astype(jnp.int32)

        def rd(a, w):
            f = lambda a_, w_: jax.lax.ragged_dot(a_, w_, sizes, preferred_element_type=jnp.float32)
            return (f(a[:, 0::2], w[0]) + f(a[:, 1::2], w[1])).astype(a.dtype)
        ys = rd(M.swiglu_act(rd(xs, ws[0]), rd(xs, ws[1]), limit), ws[2])
        y = jnp.zeros((N * k, ys.shape[-1]), ys.dtype).at[order].set(ys).reshape(N, k, -1)
        return acc + jnp.where(inside[..., None], y, 0).astype(acc.dtype), None

    init = jnp.zeros(idx.shape + (x.shape[-1],), x.dtype)
    return jax.lax.scan(one, init, jnp.arange(0, E_l, c, dtype=jnp.int32))[0]



def gathered_t(x, idx, wg, wu, wd, limit):
    """The gathered decode path on transposed codes: per token its k experts' halves [k, K/2, N]."""
    def one(a):
        xn, ids = a
        g2, u2, d2 = (halves_t(MXFP4Blocks(w.packed[ids], w.scales[ids]), xn.dtype) for w in (wg, wu, wd))
        f = lambda w2, v: (jnp.einsum("kmn,m->kn", w2[0], v[0::2], preferred_element_type=jnp.float32)
                           + jnp.einsum("kmn,m->kn", w2[1], v[1::2], preferred_element_type=jnp.float32))
        h = M.swiglu_act(f(g2, xn).astype(xn.dtype), f(u2, xn).astype(xn.dtype), limit)
        return (jnp.einsum("kmn,km->kn", d2[0], h[:, 0::2], preferred_element_type=jnp.float32)
                + jnp.einsum("kmn,km->kn", d2[1], h[:, 1::2], preferred_element_type=jnp.float32)).astype(xn.dtype)
    if x.shape[0] == 1:
        return one((x[0], idx[0]))[None]
    return jax.lax.map(one, (x, idx))


_placed_orig = A.placed_abstract_model


def placed(*a, **k):
    from flax import nnx
    model = _placed_orig(*a, **k)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        v = var.get_value()
        if isinstance(v, MXFP4Blocks):
            sw = lambda s: jax.ShapeDtypeStruct(  # noqa: E731
                s.shape[:-2] + (s.shape[-1], s.shape[-2]), s.dtype, sharding=s.sharding)
            var.set_value(MXFP4Blocks(sw(v.packed), sw(v.scales)))
    return model


def patch() -> None:
    """The experiment's three replacements (module attributes, read at call time)."""
    M.experts_ragged_in_chunks = chunks_t
    M.experts_gathered = gathered_t
    A.placed_abstract_model = placed


if __name__ == "__main__":
    from ling_jax.cli import main
    patch()
    sys.exit(main(["aot"] + sys.argv[1:]))
