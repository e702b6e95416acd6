#!/usr/bin/env python3
"""HTTP overhead of `ling-jax serve` per request, like for like (issue 13).

One engine (the mid config by default, float32), warmed up once. The same requests (token-id
prompts, greedy, `ignore_eos`, fixed lengths) run one after another twice on it: straight through
`Engine.submit` / `step`, then through the OpenAI-compatible server on that same engine
(`ling_jax.server.start_server`, loopback, streamed completions with the `openai` client). Same
slots, same compiled programs, same tokens (checked), so the per-request difference is what HTTP,
JSON, SSE framing, detokenisation and the driver thread add.

  python tools/bench_http_overhead.py --checkpoint DIR [--slots 8] [--requests 8] [--max-tokens 16]
      [--json tools/results/bench_http_overhead.json]

The checkpoint needs a tokenizer (`ling-jax make-checkpoint --config ../shared/bench/config.mid.json
--out DIR --no-mtp` writes one).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import openai
from tqdm import tqdm

from ling_jax.loader import load_model
from ling_jax.serve import Engine, RequestParams
from ling_jax.server import start_server
from ling_jax.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = load_model(a.checkpoint, "float32", with_mtp=False, progress=False)
    eng = Engine(model, max_slots=a.slots, page_size=16, cache_memory_gib=1.0, prefill_chunk=128,
                 max_seq_len=a.prompt_len + a.max_tokens + 16, prefix_cache=False)
    eng.warmup()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, min(model.cfg.vocab_size, 32000), a.prompt_len).tolist() for _ in range(a.requests)]

    direct, direct_tokens = [], []
    for p in tqdm(prompts, desc="in-process"):
        t0 = time.perf_counter()
        h = eng.submit(p, RequestParams(max_tokens=a.max_tokens, stop_ids=()))
        eng.run_until_done()
        direct.append(time.perf_counter() - t0)
        direct_tokens.append(h.generated)

    srv = start_server(eng, Tokenizer.from_dir(a.checkpoint), model_name="m")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
    http, http_tokens = [], []
    try:
        for p in tqdm(prompts, desc="HTTP"):
            t0 = time.perf_counter()
            ids = []
            for chunk in client.completions.create(model="m", prompt=p, max_tokens=a.max_tokens, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True,
                                                                            "return_token_ids": True}):
                ids += getattr(chunk.choices[0], "token_ids", None) or [] if chunk.choices else []
            http.append(time.perf_counter() - t0)
            http_tokens.append(ids)
    finally:
        srv.stop()
    over = [h - d for h, d in zip(http, direct)]
    out = dict(slots=a.slots, requests=a.requests, prompt_len=a.prompt_len, max_tokens=a.max_tokens,
               in_process_s_median=statistics.median(direct), http_s_median=statistics.median(http),
               overhead_s_median=statistics.median(over), overhead_s_mean=statistics.fmean(over),
               overhead_per_token_ms=1e3 * statistics.median(over) / a.max_tokens,
               tokens_equal=direct_tokens == http_tokens, in_process_s=direct, http_s=http)
    print(f"| {a.slots} slots, {a.requests} requests of {a.prompt_len} + {a.max_tokens} tokens, one at a time | "
          f"in-process {out['in_process_s_median']:.3f} s | HTTP {out['http_s_median']:.3f} s | overhead "
          f"{out['overhead_s_median'] * 1e3:.0f} ms per request ({out['overhead_per_token_ms']:.1f} ms per token) | "
          f"tokens equal: {out['tokens_equal']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
