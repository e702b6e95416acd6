#!/usr/bin/env python3
"""The engine's one-row decode program at a long context, timed without prefilling the context
(issue 22: what a 256K decode step costs, and where, in a minute instead of a 6-minute prefill).

    python tools/time_long_decode.py [--tokens 262144] [--steps 100] [--profile] [--random-pools]
                                      [--layer-loop scan|unroll] [--model-config config.json]

Builds `tools/bench_long_context.py`'s small model of the real layer pattern (random weights,
float32; or the config.json of `--model-config`) and a 1-slot `Engine` sized for the context (pages
of 16), then calls the runner's decode program directly on one row whose block table covers
`--tokens` cached tokens (the pool's zero pages:
the same arithmetic and bytes as real keys), `--steps` times after 3 warm calls. Prints the median
and min step; `--profile` adds the per-op times of 10 traced steps (jax.profiler), by the JAX op
each fused XLA op came from. Compare code versions side by side in one sitting (run it from a
`git worktree` of the other version with `ROOT=... python ...` or PYTHONPATH): the machine's noise
between runs is ±20%.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench_long_context import model_kwargs  # noqa: E402
from profile_serve_step import op_names, trace_calls  # noqa: E402
from ling_jax.checkpoint.synthetic_config import synthetic_config  # noqa: E402
from ling_jax.exec_config import ExecConfig  # noqa: E402
from ling_jax.model import LingForCausalLM  # noqa: E402
from ling_jax.serve import Engine  # noqa: E402
from ling_jax.serve.multihost import OP_DECODE  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=262144)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--random-pools", action="store_true",
                    help="fill the pools with random values first (every page a written page of its own; zero "
                         "pages as allocated)")
    ap.add_argument("--layer-loop", choices=("scan", "unroll"), default=None,
                    help="the model's layer loop (default: ExecConfig.for_backend's choice for the model)")
    ap.add_argument("--model-config", default=None,
                    help="a config.json to build instead of the small model (e.g. ../shared/bench/config.mid.json)")
    a = ap.parse_args(argv)
    L, P = a.tokens, 16
    cfg = synthetic_config(**model_kwargs(a.model_config))
    model = LingForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), with_mtp=False,
                            exec=ExecConfig.for_backend(None, cfg, layer_loop=a.layer_loop))
    chunk = model.exec.prefill_chunk
    eng = Engine(model, max_slots=1, page_size=P, num_pages=-(-(L + 64) // P) + 1, prefill_chunk=chunk,
                 prefill_rows=1, max_seq_len=L + 64, decode_rows=(1,), buckets=(chunk,), prefix_cache=False)
    r = eng.runner
    pages = -(-(L + 1) // P)
    width = r.width_for(pages)
    table = np.zeros((1, width), np.int32)
    table[0, :pages] = np.arange(pages)
    inp = r.padding_inputs(OP_DECODE, 1, 1, width)._replace(
        rows=np.zeros(1, np.int32), lengths=np.full(1, L, np.int32), block_table=table, n_valid=np.ones(1, np.int32))

    if a.random_pools:
        rng = np.random.default_rng(0)
        r.pools = jax.tree.map(lambda x: jax.device_put(rng.standard_normal(x.shape).astype(x.dtype) * 0.1,
                                                        x.sharding)
                               if jnp.issubdtype(x.dtype, jnp.floating) else x, r.pools)

    def step():
        r.pools, tok, _ = r.decode_fn(r.params, r.pools, inp)
        np.asarray(tok)

    for _ in range(3):
        step()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    print(f"layer loop {model.exec.layer_loop}:", end=" ")
    print(f"decode step over {L:,} cached tokens (block table {width} pages): median {1e3 * np.median(times):.2f} ms, "
          f"min {1e3 * min(times):.2f} ms ({a.steps} steps; load {os.getloadavg()[0]:.1f})")
    if a.profile:
        per = trace_calls(step, 10)
        names = op_names(r.decode_fn.lower(r.params, r.pools, inp).compile().as_text())
        print("| XLA op | JAX op | ms / step |\n|---|---|---:|")
        for n, us in per.most_common():
            if n in names:
                print(f"| `{n}` | `{names[n].split('/')[-1]}` | {us / 10 / 1e3:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
