#!/usr/bin/env python3
"""Engine steps with the routed experts stored in the native kernel's panel order against rows, interleaved.

Why: a model loaded onto one CPU device stores its float32 experts in the kernel's panel order
(`ling_jax/expert_panels.py`, `ExecConfig.expert_panels`); this measures what that buys a whole engine
step, not one MoE layer (`tools/bench_moe_decode.py` does that): two copies of the mid-config model,
one converted back to rows (`store_experts(model, panels=False)`), one engine each, their steps timed in
alternating blocks (the block order flips each round), median and min per side.

  python tools/bench_expert_panels.py --step decode --rows 8     # all slots decoding, 128-token prompts
  python tools/bench_expert_panels.py --step decode --rows 32
  python tools/bench_expert_panels.py --step prefill --rows 8 --chunk 512   # [8, 64] prefill steps

One step kind per process: XLA:CPU ran out of mapped memory for executables with six warm engines in one.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from ling_jax.commands.demo import cache_dir  # noqa: E402
from ling_jax.expert_panels import store_experts  # noqa: E402
from ling_jax.loader import load_model  # noqa: E402
from ling_jax.serve import Engine, RequestParams  # noqa: E402
from profile_serve_step import timed_steps  # noqa: E402  (tools/, this script's directory)


def decode_engine(model, rows: int, rng) -> Engine:
    """`rows` slots, each decoding after a 128-token prompt."""
    eng = Engine(model, max_slots=rows, page_size=16, num_pages=rows * 24 + 8, prefill_chunk=128, prefill_rows=2,
                 max_seq_len=384, prefix_cache=False)
    hs = [eng.submit(rng.integers(0, 32000, 128).tolist(), RequestParams(max_tokens=250, stop_ids=()))
          for _ in range(rows)]
    while any(not h.generated for h in hs):
        eng.step()
    eng.step()
    return eng


def prefill_engine(model, rows: int, chunk: int, steps: int, rng) -> Engine:
    """`rows` long prompts fed [rows, chunk / rows] a step, long enough to stay in prefill."""
    per_row = chunk // rows
    prompt = per_row * (steps + 4)
    eng = Engine(model, max_slots=rows, page_size=16, num_pages=rows * (prompt // 16 + 2) + 8, prefill_chunk=chunk,
                 prefill_rows=rows, max_seq_len=prompt + 16, prefix_cache=False)
    for _ in range(rows):
        eng.submit(rng.integers(0, 32000, prompt).tolist(), RequestParams(max_tokens=1, stop_ids=()))
    eng.step()
    eng.step()
    return eng


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=os.path.join(cache_dir(), "bench-config.mid"),
                   help="the benchmark checkpoint (tools/bench_generate.py / bench_serve.py write it)")
    p.add_argument("--step", choices=("decode", "prefill"), default="decode")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--chunk", type=int, default=512, help="prefill: prompt tokens a step over the rows")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--per-block", type=int, default=None, help="steps timed per block (default 8 decode, 4 prefill)")
    a = p.parse_args()
    n = a.per_block or (8 if a.step == "decode" else 4)
    panels = load_model(a.checkpoint, "float32", with_mtp=False, progress=False)
    rows = load_model(a.checkpoint, "float32", with_mtp=False, progress=False)
    converted = store_experts(rows, panels=False)
    if not converted:
        raise SystemExit("the loaded model does not store its experts in panel order (kernel not built, "
                         "or D / I not multiples of 16): nothing to compare")
    rng = np.random.default_rng(0)
    make = (lambda m: decode_engine(m, a.rows, rng)) if a.step == "decode" else \
        (lambda m: prefill_engine(m, a.rows, a.chunk, a.rounds * n + 2, rng))
    engines = {"panels": make(panels), "rows": make(rows)}
    times = {k: [] for k in engines}
    for r in range(a.rounds):
        for k in (("panels", "rows") if r % 2 == 0 else ("rows", "panels")):
            times[k] += timed_steps(engines[k], n)
    what = f"decode, {a.rows} rows" if a.step == "decode" else f"prefill [{a.rows}, {a.chunk // a.rows}]"
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"| {what} | {1e3 * med['panels']:.1f} (min {1e3 * min(times['panels']):.1f}) | "
          f"{1e3 * med['rows']:.1f} (min {1e3 * min(times['rows']):.1f}) | {med['panels'] / med['rows']:.3f} |")


if __name__ == "__main__":
    main()
