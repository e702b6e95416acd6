"""python tools/measure_idle_prefill_row.py (mid-config benchmark checkpoint: tools/bench_serve.py writes it).

Cost of an idle prefill row: one long prompt fed 128 tokens per step through a [1,128] program
(prefill_rows=1) and through a [2,128] program with the second row idle (prefill_rows=2)."""
import os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np
from ling_jax.commands.demo import cache_dir
from ling_jax.loader import load_model
from ling_jax.serve import Engine, RequestParams
model = load_model(os.path.join(cache_dir(), "bench-config.mid"), "float32", with_mtp=False, progress=False)
rng = np.random.default_rng(0)
prompt = rng.integers(0, 32000, 128 * 10).tolist()
engs = {rows: Engine(model, max_slots=2, page_size=16, num_pages=200, prefill_chunk=128, prefill_rows=rows,
                     max_seq_len=1400, prefix_cache=False, buckets=(128,)) for rows in (1, 2)}
res = {1: [], 2: []}
for rep in range(2):
    for rows, eng in engs.items():
        h = eng.submit(prompt, RequestParams(max_tokens=1, stop_ids=()))
        eng.step()  # first chunk (compiles on the first rep)
        for _ in range(7):
            t = time.perf_counter(); eng.step(); res[rows].append(time.perf_counter() - t)
        eng.run_until_done()
for rows in (1, 2):
    print(f"prefill_rows={rows}: [{rows},128] step with one prompt: median {1e3 * statistics.median(res[rows]):.1f} ms")
