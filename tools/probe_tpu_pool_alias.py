"""Does a donated MLA page pool stay in place on a TPU through the engine's paged write + gather?

The question behind issue 21's "temp <= 5% of arguments" on `tpu7x:2x2x1`: the real config's engine
decode there has ~9 GiB of temporaries, and they do not shrink with the layer count (a 16-layer cut
of the release config, unrolled: 9.67 GiB; the 72 scanned layers: 8.97 GiB), so they are sized by
the page pools (`--cache-memory 8`), not by weights. This compiles, compile-only for a TPU target,
the project's own `mla.paged_write` + `mla.paged_gather` over one donated pool
[layers, 1, pages, page_size, width] (the stacked layout of a scanned run) and prints the
compiler's temp beside the pool's size: temp ~ the gathered block (B x W·page_size x width) means
the pool is written in place; temp >= the pool means the compiler copied it.

    JAX_PLATFORMS=cpu python tools/probe_tpu_pool_alias.py --width 512 --pages 16384
    JAX_PLATFORMS=cpu python tools/probe_tpu_pool_alias.py --width 64 --pages 16384
    JAX_PLATFORMS=cpu python tools/probe_tpu_pool_alias.py --width 64 --pack-lanes   # 2 tokens per lane row
    JAX_PLATFORMS=cpu python tools/probe_tpu_pool_alias.py --width 512 --rows 2 --tokens 64   # a prefill chunk

Needs the libtpu wheel (`pip install -e ".[aot]"`); nothing is allocated.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from ling_jax.aot.targets import resolve_target  # noqa: E402
from ling_jax.mla import paged_gather, paged_write  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tpu7x:2x2x1")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pages", type=int, default=16384)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--width", type=int, default=512, help="values per token: 512 (latent c), 64 (k_pe)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=512, help="block-table width")
    ap.add_argument("--tokens", type=int, default=1, help="new tokens per row (a prefill chunk: 64)")
    ap.add_argument("--loop", choices=("one", "scan"), default="one", help="write one layer, or all in a loop")
    ap.add_argument("--pack-lanes", action="store_true",
                    help="width < 128: store 128/width tokens per 128-lane row ([pages, page_size·width/128, 128])")
    a = ap.parse_args(argv)
    target = resolve_target(a.target)
    mesh = Mesh(np.array(target.devices).reshape(-1), ("expert",))
    rep = NamedSharding(mesh, P())
    L, NP, PS, X, B, W, T = a.layers, a.pages, a.page_size, a.width, a.rows, a.blocks, a.tokens

    pack = 128 // X if a.pack_lanes and X < 128 else 1

    def step(pool, new, block_table, pos, valid):
        if pack == 1:
            def write(i, pool):
                return paged_write(pool, new, block_table, pos, valid, layer=(i, 0))
        else:  # token t of a page: row t // pack, lanes (t % pack)·X .. +X
            blk = jnp.take_along_axis(block_table, jnp.clip(pos // PS, 0, W - 1), axis=1)
            page, off = jnp.where(valid, blk, NP).reshape(-1), (pos % PS).reshape(-1)
            lanes = (off % pack)[:, None] * X + jnp.arange(X)[None, :]

            def write(i, pool):
                return pool.at[i, 0, page[:, None], (off // pack)[:, None], lanes].set(
                    new.reshape(-1, X).astype(pool.dtype), mode="drop")
        pool = jax.lax.fori_loop(0, L, write, pool) if a.loop == "scan" else write(0, pool)
        got = pool[0, 0, block_table] if pack > 1 else paged_gather(pool, block_table, layer=(0, 0))
        return pool, got.astype(jnp.float32).sum()

    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)  # noqa: E731
    args = (sd((L, 1, NP, PS // pack, X * pack), jnp.bfloat16), sd((B, T, X), jnp.bfloat16), sd((B, W), jnp.int32),
            sd((B, T), jnp.int32), sd((B, T), jnp.bool_))
    m = jax.jit(step, donate_argnums=0).lower(*args).compile().memory_analysis()
    mib = lambda n: n / 2**20  # noqa: E731
    pool = L * NP * PS * X * 2
    print(f"{a.target} pool [{L},1,{NP},{PS // pack},{X * pack}] bf16 {mib(pool):.1f} MiB: argument "
          f"{mib(m.argument_size_in_bytes):.1f}, alias {mib(m.alias_size_in_bytes):.1f}, temp "
          f"{mib(m.temp_size_in_bytes):.1f} MiB (gathered block {mib(B * W * PS * X * 2):.1f} MiB) -> "
          f"{'COPIED' if m.temp_size_in_bytes >= pool else 'in place'}")


if __name__ == "__main__":
    main()
