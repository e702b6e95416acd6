#!/usr/bin/env python3
"""A scanned layer loop's weights read in place against sliced, through the engine (XLA:CPU).

Why: inside a scanned layer loop XLA:CPU copies each layer's slice of a weight stack before the dot
that reads it; `ExecConfig.native_linear` hands the layers their rows of the stacks instead
(`linear.TableRows`, read by `pallas_kernels/linear`). This times both in one process, sharing the
weights (the mid config loaded scanned), rounds interleaved: per round, `--rows` prompts of `--prompt`
tokens are prefilled (wall seconds until every row has its first token), then the median of
`--decode` all-slot decode steps. `--unrolled` adds a third engine on an unrolled copy (the CPU
default for the mid config; twice the weights in memory).

  python tools/bench_scan_weights.py [--prompt 256] [--rows 8] [--rounds 4] [--decode 8] [--unrolled]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ling_jax.loader import load_model  # noqa: E402
from ling_jax.serve import Engine, RequestParams  # noqa: E402
from bench_generate import DEFAULT_CONFIG, bench_checkpoint  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--unrolled", action="store_true")
    a = ap.parse_args(argv)
    model = load_model(bench_checkpoint(a.config, None), "float32", with_mtp=False, progress=False,
                       layer_loop="scan")
    variants = [("scan, in place", model, model.exec.replace(native_linear=True)),
                ("scan, slices", model, model.exec.replace(native_linear=False))]
    if a.unrolled:
        unrolled = nnx.clone(model).set_layer_loop("unroll")
        variants.append(("unroll", unrolled, unrolled.exec))
    engines = {}
    pages = -(-(a.prompt + a.decode + 8) // 16)
    for name, m, ex in variants:
        m.exec = ex  # the engine compiles its programs with the model's ExecConfig
        eng = Engine(m, max_slots=a.rows, page_size=16, num_pages=a.rows * pages + pages,
                     max_seq_len=pages * 16)
        t = time.perf_counter()
        eng.warmup()
        print(f"{name}: warm-up {time.perf_counter() - t:.0f} s", flush=True)
        engines[name] = eng
    rng = np.random.default_rng(0)
    res = {k: ([], []) for k in engines}
    for r in range(a.rounds):
        prompts = [rng.integers(0, 30000, a.prompt).tolist() for _ in range(a.rows)]
        for name, eng in engines.items():
            hs = [eng.submit(p, RequestParams(max_tokens=a.decode + 8, stop_ids=())) for p in prompts]
            t = time.perf_counter()
            while any(not h.generated for h in hs):
                eng.step()
            res[name][0].append(time.perf_counter() - t)
            steps = []
            for _ in range(a.decode):
                t = time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - t)
            res[name][1].append(statistics.median(steps))
            for h in hs:
                eng.cancel(h)
            while eng.stats()["slots_in_use"]:
                eng.step()
            print(f"round {r} {name}: prefill {a.rows}x{a.prompt} {res[name][0][-1]:.2f} s, decode step median "
                  f"{1e3 * res[name][1][-1]:.0f} ms", flush=True)
    print(f"\n| engine ({a.rows} rows) | prefill {a.rows} x {a.prompt} s, median (min) | decode step ms, median |")
    print("|---|---:|---:|")
    for name, (pre, dec) in res.items():
        print(f"| {name} | {statistics.median(pre):.2f} ({min(pre):.2f}) | {1e3 * statistics.median(dec):.0f} |")


if __name__ == "__main__":
    main()
