#!/usr/bin/env python3
"""Where an engine decode step's time goes, per XLA op (mid config, CPU, float32).

Fills `--slots` slots with 128-token prompts, then traces `--steps` decode steps with
`jax.profiler` (a Perfetto JSON trace), and sums the per-thunk times by the JAX operation each
fused op came from (the `op_name` metadata of the compiled HLO, digits folded), e.g.
`eid,edc->eic/dot_general` = the routed experts' gate/up batched matmuls.

  python tools/profile_serve_step.py [--slots 8] [--steps 3] [--top 25]
  python tools/profile_serve_step.py --prefill [--prefill-rows 2 --prefill-chunk 128]
      # prefill steps [rows, chunk / rows] instead (one long prompt per row)
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402

from ling_jax.commands.demo import cache_dir  # noqa: E402
from ling_jax.loader import load_model  # noqa: E402
from ling_jax.serve import Engine, RequestParams  # noqa: E402


def op_names(hlo_text: str) -> dict:
    """{HLO instruction name: its op_name metadata} from compiled HLO text."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]+)\"", line)
        if m and m.group(1) not in out:
            t = re.search(r'custom_call_target="([^"]+)"', line)  # a native kernel: name it
            out[m.group(1)] = m.group(2) + (f" {t.group(1)}" if t else "")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=os.path.join(cache_dir(), "bench-config.mid"),
                    help="the benchmark checkpoint (tools/bench_generate.py / bench_serve.py write it)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--active", type=int, default=None, help="decoding requests (default: --slots); fewer run "
                    "the smallest row bucket that holds them, gathered from the slots")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timed", type=int, default=8, help="untraced steps timed first")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prefill", action="store_true", help="profile prefill steps instead: one long prompt per "
                    "prefill row, fed [prefill rows, prefill chunk / rows] per step (default [2, 64]: "
                    "tools/bench_serve.py's engine), nothing decoding")
    ap.add_argument("--prefill-rows", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens per step (over the rows)")
    a = ap.parse_args()
    model = load_model(a.checkpoint, "float32", with_mtp=False, progress=False)
    S = a.slots
    if a.prefill:
        S = max(S, a.prefill_rows)
    per_row = a.prefill_chunk // a.prefill_rows
    prompt = per_row * (a.timed + a.steps + 2)  # long enough to be still prefilling after the profiled steps
    eng = Engine(model, max_slots=S, page_size=16,
                 num_pages=S * 24 + 8 + (a.prefill_rows * (-(-prompt // 16) + 1) if a.prefill else 0),
                 prefill_chunk=a.prefill_chunk if a.prefill else 128, prefill_rows=a.prefill_rows,
                 max_seq_len=384 if not a.prefill else prompt + 16, prefix_cache=False)
    eng.warmup()
    rng = np.random.default_rng(0)
    if a.prefill:
        return profile_prefill(eng, model, a, rng, prompt)
    N = a.active or S
    hs = [eng.submit(rng.integers(0, 32000, 128).tolist(), RequestParams(max_tokens=250, stop_ids=()))
          for _ in range(N)]
    while any(not h.generated for h in hs):
        eng.step()
    ts = timed_steps(eng, a.timed)
    print(f"# {model.exec}\n# decode step, {N} of {S} slots: median {1e3 * statistics.median(ts):.1f} ms, "
          f"min {1e3 * min(ts):.1f} ms ({N / statistics.median(ts):.1f} tok/s); load {os.getloadavg()[0]:.1f}")
    per_thunk = trace(eng, a.steps)
    widths = eng.runner.widths[0]
    R, rows, _ = eng.runner.decode_rows_for([h._req for h in hs])
    inp = eng.runner.inputs(rows, np.zeros((R, 1), np.int32), np.zeros(R, np.int32), [None] * R, widths)
    names = op_names(eng.runner.decode_fn.lower(eng.runner.params, eng.runner.pools, inp).compile().as_text())
    report(per_thunk, names, a)


def timed_steps(eng, n: int) -> list:
    """Seconds of each of `n` untraced engine steps."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    return ts


def trace(eng, steps: int) -> collections.Counter:
    """Per-thunk microseconds over `steps` engine steps (a Perfetto trace of jax.profiler)."""
    return trace_calls(eng.step, steps)


def trace_calls(fn, n: int) -> collections.Counter:
    """Per-thunk microseconds over `n` calls of `fn()` (a Perfetto trace of jax.profiler)."""
    d = tempfile.mkdtemp(prefix="ling-prof-")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(n):
            fn()
    ev = json.load(gzip.open(glob.glob(os.path.join(d, "**", "*.json.gz"), recursive=True)[0]))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    per_thunk = collections.Counter()
    for e in ev:
        if e.get("ph") == "X":
            per_thunk[e["name"]] += e.get("dur", 0)
    return per_thunk


def profile_prefill(eng, model, a, rng, prompt: int):
    """One `prompt`-token prompt per prefill row, fed [rows, chunk / rows] per step (every row full)."""
    from ling_jax.serve.multihost import OP_PREFILL
    R, T = a.prefill_rows, a.prefill_chunk // a.prefill_rows
    hs = [eng.submit(rng.integers(0, 32000, prompt).tolist(), RequestParams(max_tokens=1, stop_ids=()))
          for _ in range(R)]
    eng.step()
    ts = timed_steps(eng, a.timed)
    n = R * T
    print(f"# {model.exec}\n# prefill step [{R}, {T}] ({n} prompt tokens): median {1e3 * statistics.median(ts):.1f} ms, "
          f"min {1e3 * min(ts):.1f} ms ({n / statistics.median(ts):.1f} tok/s, "
          f"{1e3 * statistics.median(ts) / n:.2f} ms/token); load {os.getloadavg()[0]:.1f}")
    per_thunk = trace(eng, a.steps)
    assert not any(h.generated for h in hs), "the prompts finished inside the profile: shorten --timed/--steps"
    names = {}
    for w in eng.runner.widths:  # the steps ran at several widths: every program's names
        inp = eng.runner.padding_inputs(OP_PREFILL, R, T, w)
        names.update(op_names(eng.runner.prefill_fn.lower(eng.runner.params, eng.runner.pools, inp).compile().as_text()))
    report(per_thunk, names, a)


def report(per_thunk, names, a):
    by_op = collections.Counter()
    for n, us in per_thunk.items():
        if n in names:
            by_op[re.sub(r"\d+", "#", names[n].split("/", 1)[-1])] += us
    total = sum(by_op.values())
    print("\n| JAX op (fused XLA ops by origin) | ms / step | share |\n|---|---:|---:|")
    for k, us in by_op.most_common(a.top):
        print(f"| `{k[:90]}` | {us / 1e3 / a.steps:.2f} | {100 * us / total:.1f}% |")
    print(f"| all ops | {total / 1e3 / a.steps:.2f} | |")


if __name__ == "__main__":
    main()
