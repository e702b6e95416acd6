#!/usr/bin/env python3
"""The HF peer's side of the serving benchmark: the same requests as tools/bench_serve.py (the
same workload JSON, `tools/serve_workload.py`) through transformers' `generate` in static batches
of 8, greedy, float32 — what serving looks like without continuous batching.

Runs in the peer's own virtual environment (torch + transformers, not the project's), made as
../shared/bench/bench_hf.py's docstring says:
  python3 -m venv /work/hfvenv && /work/hfvenv/bin/pip install torch==2.13.0 && \
      /work/hfvenv/bin/pip install transformers==5.23.0 numpy
  /work/hfvenv/bin/python tools/bench_serve_hf.py [--workload tools/results/serve_workload_full.json]

The model is built by bench_hf.py itself (imported, not copied: its config mapping, seeded random
init, float32, eager attention, and its machine-rate measurements), so this row and
bench_hf.py's rows measure one model. All requests arrive at t=0; batch j (requests 8j..8j+7,
in workload order) starts when batch j-1 has finished. Each batch left-pads its prompts to the
longest and generates max(max_tokens) of the batch for every row (eos disabled); a request's
tokens beyond its own max_tokens are wasted work and are not counted. Per request: TTFT = first
new token's time (a `generate` streamer) − 0, TPOT = (time of its max_tokens-th token − first) /
(max_tokens − 1); output tokens/s = Σ max_tokens / total time.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import serve_workload as W  # noqa: E402

BENCH_HF = os.path.join(HERE, "..", "..", "shared", "bench", "bench_hf.py")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=os.path.join(HERE, "results", "serve_workload_full.json"))
    ap.add_argument("--bench-hf", default=BENCH_HF, help="path of bench_hf.py (the peer's model construction)")
    ap.add_argument("--config", default=None, help="config in the release format (default: bench_hf.py's)")
    ap.add_argument("--batch", type=int, default=8, help="static batch size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="results (default tools/results/bench_serve_hf_mid_cpu_<workload>.json)")
    return ap.parse_args()


def import_bench_hf(path: str, config: str | None, threads: int):
    """Import bench_hf.py as a module. It parses its command line at import time (its thread
    settings must precede torch's import), so it is handed one made of our --config/--threads."""
    argv = sys.argv
    sys.argv = [path, "--threads", str(threads)] + (["--config", config] if config else [])
    try:
        spec = importlib.util.spec_from_file_location("bench_hf", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.argv = argv
    return mod


class StepTimes:
    """A `generate` streamer that records when each new-token batch comes out (the first `put` is
    the prompt, which is skipped)."""

    def __init__(self):
        self.times, self._prompt_seen = [], False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def main():
    a = parse_args()
    wl = W.load(a.workload)
    hf = import_bench_hf(os.path.abspath(a.bench_hf), a.config, a.threads)
    torch = hf.torch

    with open(hf.ARGS.config) as f:
        src = json.load(f)
    rates0 = {**hf.measure_bandwidth(), **hf.measure_matmul()}
    cfg = hf.build_config(src)
    torch.manual_seed(a.seed)
    model = hf.BailingHybridForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    hf.check_config(cfg, src, model)
    acc = hf.param_accounting(model, src)
    pad = model.config.pad_token_id
    print(f"# HF peer: torch {torch.__version__}, transformers {hf.transformers.__version__}, {a.threads} threads, "
          f"load {os.getloadavg()[0]:.1f}; rates {({k: round(v, 1) for k, v in rates0.items()})}; "
          f"experts_implementation={model.config._experts_implementation}; workload {a.workload}", flush=True)

    def gen(batch, record=None):
        L = max(len(q["prompt"]) for q in batch)
        ids = torch.full((len(batch), L), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for i, q in enumerate(batch):  # left padding, as batched generation of a decoder needs
            ids[i, L - len(q["prompt"]):] = torch.tensor(q["prompt"])
            mask[i, L - len(q["prompt"]):] = 1
        n = max(q["max_tokens"] for q in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           eos_token_id=None, pad_token_id=pad, use_cache=True, streamer=record)

    # untimed warm-up (first calls in a fresh process run slower: allocator / first touch)
    gen([{"prompt": list(range(1, 65)), "max_tokens": 4}] * a.batch)
    reqs = wl["requests"]
    ttft, tpot, batches = [], [], []
    t0 = time.perf_counter()
    for b in tqdm(range(0, len(reqs), a.batch), desc="HF static batches", unit="batch"):
        batch = reqs[b:b + a.batch]
        rec = StepTimes()
        tb = time.perf_counter()
        gen(batch, rec)
        batches.append({"start_s": tb - t0, "s": time.perf_counter() - tb, "steps": len(rec.times),
                        "padded_prompt": max(len(q["prompt"]) for q in batch)})
        for q in batch:
            ttft.append(rec.times[0] - t0)
            n = q["max_tokens"]
            if n > 1:
                tpot.append((rec.times[n - 1] - rec.times[0]) / (n - 1))
    wall = time.perf_counter() - t0
    rates1 = {**hf.measure_bandwidth(), **hf.measure_matmul()}
    out_tokens = sum(q["max_tokens"] for q in reqs)
    R = {"peer": "hf", "torch": torch.__version__, "transformers": hf.transformers.__version__,
         "workload": os.path.abspath(a.workload), "workload_name": wl["name"], "batch": a.batch,
         "wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
         "prompt_tokens": sum(len(q["prompt"]) for q in reqs),
         "padded_prompt_tokens": sum(x["padded_prompt"] * a.batch for x in batches),
         "generated_tokens_incl_waste": sum(x["steps"] * a.batch for x in batches),
         **W.latency_summary(ttft, tpot), "batches": batches, "rates_start": rates0, "rates_end": rates1,
         "params": {k: v for k, v in acc.items() if k != "by_kind"},
         "loadavg_end": os.getloadavg(), "experts_implementation": model.config._experts_implementation}
    print(f"| HF generate, static batches of {a.batch} | {R['output_tok_s']:.2f} tok/s | TTFT p50 / p99 "
          f"{R['ttft_p50_s']:.2f} / {R['ttft_p99_s']:.2f} s | TPOT p50 / p99 {1e3 * R['tpot_p50_s']:.0f} / "
          f"{1e3 * R['tpot_p99_s']:.0f} ms | wall {wall:.1f} s |", flush=True)
    out = a.json or os.path.join(HERE, "results", f"bench_serve_hf_mid_cpu_{wl['name']}.json")
    with open(out, "w") as f:
        json.dump(R, f, indent=1, default=str)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
