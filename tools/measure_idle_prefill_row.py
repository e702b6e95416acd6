#!/usr/bin/env python3
"""What an idle prefill row costs: one long prompt fed 128 tokens per step through a [1, 128] program
(prefill_rows=1) and through a [2, 128] program whose second row is idle (prefill_rows=2), interleaved.

Why: a prefill program computes every row it has (dense projections, the KDA scan over padding; only
the routed experts skip padding), so a prompt that arrives alone pays for the idle rows
(BENCHMARKS.md, "Concurrency 8 vs 32 again").

  python tools/measure_idle_prefill_row.py   # the mid-config checkpoint tools/bench_serve.py writes
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from ling_jax.commands.demo import cache_dir  # noqa: E402
from ling_jax.loader import load_model  # noqa: E402
from ling_jax.serve import Engine, RequestParams  # noqa: E402


def main() -> None:
    model = load_model(os.path.join(cache_dir(), "bench-config.mid"), "float32", with_mtp=False, progress=False)
    prompt = np.random.default_rng(0).integers(0, 32000, 128 * 10).tolist()
    engines = {rows: Engine(model, max_slots=2, page_size=16, num_pages=200, prefill_chunk=128, prefill_rows=rows,
                            max_seq_len=1400, prefix_cache=False, buckets=(128,)) for rows in (1, 2)}
    times: dict = {1: [], 2: []}
    for _ in range(2):
        for rows, eng in engines.items():
            eng.submit(prompt, RequestParams(max_tokens=1, stop_ids=()))
            eng.step()  # the first chunk (compiles in the first round)
            for _ in range(7):
                t = time.perf_counter()
                eng.step()
                times[rows].append(time.perf_counter() - t)
            eng.run_until_done()
    for rows, ts in times.items():
        print(f"prefill_rows={rows}: [{rows}, 128] step with one prompt: median {1e3 * statistics.median(ts):.1f} ms")


if __name__ == "__main__":
    main()
