#!/usr/bin/env python3
"""Serving benchmark of the ling-jax engine (issue 12), next to physical limits and the HF peer.

On the mid config (`../shared/bench/config.mid.json`, float32, a random checkpoint written by the
project's writer in the release layout, cached like tools/bench_generate.py's):

* **Load rows**: seeded random prompt / output lengths (`tools/serve_workload.py`, one JSON file
  that the peer run `tools/bench_serve_hf.py` reads too), at concurrency 1, 8 and 32: a closed loop
  of c clients (each sends its next request when its previous one finishes; all start at t=0), through
  an in-process `Engine(max_slots=c)`. Output tokens/s, time to first token (TTFT, from the
  request's submission) and time per output token (TPOT, (last − first token time) / (n − 1)),
  p50 and p99 over requests. The prefix cache is off for these rows (random prompts share nothing).
* **Decode pair**: the engine's batched decode step on the workload of bench_hf.py's decode row
  (8 prompts of 128 tokens, 64 greedy steps): tokens/s of the steps that only decode, to compare with
  `bench_hf.py --decode-batches 8` run right before or after (the issue's "2x the peer in every pair").
* **Shared prefix**: 16 requests with a common 1,024-token prefix, sent one after another, with the
  prefix cache on vs off: TTFT of the hits (all but the first) vs the misses; the greedy tokens
  must be the same both ways (checked, reported).
* `--http URL`: the load rows through a running `ling-jax serve` (OpenAI completions API, streamed,
  token-id prompts, `ignore_eos`), with the `openai` client and c threads: the HTTP overhead row.

Every figure is printed next to its physical limit: decode = weight bytes one step reads (the
non-expert weights + the experts a batch of c tokens is expected to hit) / measured copy
bandwidth; prefill = FLOPs per token / measured float32 matmul rate (the roofline style of
BENCHMARKS.md).

  python tools/bench_serve.py [--quick] [--concurrency 1,8,32] [--json tools/results/bench_serve_mid_cpu.json]
  python tools/bench_serve.py --rows load --concurrency 8,32 --repeat 2 --compilation-cache /tmp/jcc
      # issue 21's ratio: c=8, c=32, c=8, c=32 in one process (this machine's run-to-run spread is ~±10%)
  python tools/bench_serve.py --http http://127.0.0.1:8000 --concurrency 1,8,32
  /work/hfvenv/bin/python tools/bench_serve_hf.py --workload tools/results/serve_workload_full.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402

import serve_workload as W  # noqa: E402  (tools/serve_workload.py, shared with the peer)
from bench_generate import (DEFAULT_CONFIG, active_weight_bytes, bench_checkpoint, flops_per_token,  # noqa: E402
                            measure_bandwidth, measure_matmul)
from ling_jax.commands.compilation_cache import enable_compilation_cache  # noqa: E402
from ling_jax.config import LingConfig  # noqa: E402
from ling_jax.loader import load_model  # noqa: E402
from ling_jax.serve import Engine, RequestParams  # noqa: E402
from ling_jax.serve.prefill_policy import resolve_prefill_policy  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--checkpoint", default=None, help="checkpoint dir (default: write one, cached)")
    ap.add_argument("--workload", default=None, help="workload JSON (default: tools/results/serve_workload_"
                    "<preset>.json, written if missing)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (when the workload is drawn here)")
    ap.add_argument("--quick", action="store_true", help="the small preset (a few minutes): checks the tool")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    ap.add_argument("--rows", default="load,decode,prefix", help="which parts: load, decode, prefix")
    ap.add_argument("--repeat", type=int, default=1, help="load rows: run the concurrency levels this many rounds, "
                    "alternating (a fresh engine each run: pass --compilation-cache so later warm-ups load), and "
                    "report each round's ratio and the medians'")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="with none of the four --prefill-* flags: the engine's default policy for this platform "
                         "(ling_jax/serve/prefill_policy.py; `ling-jax serve`'s default); with any, the others "
                         "default to 64 tokens over 2 rows")
    ap.add_argument("--prefill-rows", type=int, default=None)
    ap.add_argument("--prefill-row-tokens", type=int, default=None,
                    help="tokens one prompt is fed a step at most (Engine prefill_row_tokens; default the chunk)")
    ap.add_argument("--prefill-row-buckets", default=None,
                    help="prefill row counts compiled, comma list ending at --prefill-rows (default: that one)")
    ap.add_argument("--prefix-cache-memory", type=float, default=0.5, metavar="GIB",
                    help="shared-prefix rows: the prefix cache's budget (snapshots + cached pages)")
    ap.add_argument("--decode-steps", type=int, default=64, help="decode pair: steps after the 128-token prompts")
    ap.add_argument("--http", default=None, metavar="URL", help="drive a running `ling-jax serve` instead")
    ap.add_argument("--api-key", default=os.environ.get("LING_JAX_API_KEY", "none"))
    ap.add_argument("--compilation-cache", default=None, metavar="DIR", help="JAX persistent compilation cache")
    ap.add_argument("--layer-loop", choices=("scan", "unroll"), default=None,
                    help="how the layers are stored and run (default: ExecConfig.for_backend's choice)")
    ap.add_argument("--json", default=None, help="results file (default tools/results/bench_serve_mid_cpu[_quick].json)")
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# Physical limits
# ------------------------------------------------------------------------------------------------
def model_costs(model) -> dict:
    """Bytes and FLOPs the limits are computed from (float32 weights, MTP excluded)."""
    cfg = model.cfg
    b1 = active_weight_bytes(model)
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    n_mla = sum(t == "mla" for t in cfg.layer_types)
    return {"weight_bytes_b1": b1, "non_expert_bytes": b1 - n_moe * cfg.num_experts_per_tok * per_expert,
            "n_moe": n_moe, "per_expert_bytes": per_expert, "E": cfg.num_experts, "k": cfg.num_experts_per_tok,
            # per sequence and step: every KDA layer's f32 state [H, dk, dv] is read and written once
            "kda_state_bytes_per_seq": 2 * (cfg.num_hidden_layers - n_mla) * cfg.num_attention_heads
                                       * cfg.head_dim * cfg.head_dim * 4,
            # per sequence, step and cached token: every MLA layer reads its latent + rotated key
            "mla_bytes_per_seq_token": n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4}


def experts_hit(c: int, E: int, k: int) -> float:
    """Expected distinct experts per MoE layer for c tokens routed uniformly: E·(1 − (1 − k/E)^c)."""
    return E * (1 - (1 - k / E) ** c)


def step_bytes(costs: dict, c: int, ctx: float) -> float:
    """Bytes one decode step of c sequences (ctx cached tokens each) must move: the weights (each
    expert the batch hits once), every KDA state read + written, every MLA latent read."""
    weights = costs["non_expert_bytes"] + costs["n_moe"] * experts_hit(c, costs["E"], costs["k"]) * costs["per_expert_bytes"]
    return weights + c * (costs["kda_state_bytes_per_seq"] + ctx * costs["mla_bytes_per_seq_token"])


def decode_limit(costs, rates, model, c: int, ctx: float) -> dict:
    """Decode limits at batch c: bandwidth (step bytes / copy BW) and compute (c tokens' FLOPs / matmul rate)."""
    t_bw = step_bytes(costs, c, ctx) / rates["bw_Bps"]
    t_mm = c * flops_per_token(model, ctx) / rates["matmul_FLOPs"]
    t = max(t_bw, t_mm)
    return {"step_s": t, "tok_s": c / t, "bound": "bandwidth" if t_bw >= t_mm else "compute",
            "step_bytes": step_bytes(costs, c, ctx)}


def prefill_limit_s(model, rates, n_tokens: int) -> float:
    return n_tokens * flops_per_token(model, n_tokens / 2) / rates["matmul_FLOPs"]


# ------------------------------------------------------------------------------------------------
# In-process runs
# ------------------------------------------------------------------------------------------------
def prefill_policy(a, max_slots: int):
    """The --prefill-* flags' policy for an engine of `max_slots` (the platform's default when none is given)."""
    rb = [int(x) for x in a.prefill_row_buckets.split(",")] if a.prefill_row_buckets else None
    return resolve_prefill_policy(jax.default_backend(), max_slots, a.prefill_chunk, a.prefill_rows,
                                  a.prefill_row_tokens, rb)


def make_engine(model, c: int, max_seq_len: int, a, prefix_cache: bool = False):
    pages_per_seq = -(-max_seq_len // a.page_size)
    eng = Engine(model, max_slots=c, page_size=a.page_size, num_pages=c * pages_per_seq + 2 * pages_per_seq,
                 max_seq_len=max_seq_len, **prefill_policy(a, c).engine_kwargs(), prefix_cache=prefix_cache,
                 prefix_cache_memory_gib=a.prefix_cache_memory if prefix_cache else None)
    t = time.perf_counter()
    eng.warmup()
    return eng, time.perf_counter() - t


def run_closed_loop(eng, requests: list, c: int, desc: str) -> dict:
    """c clients, each submitting its next request when its previous one finishes; all at t=0.

    Returns per-request timings and the per-step log (duration, decoding rows, whether the step
    only decoded)."""
    rec = [dict(submit=None, times=[]) for _ in requests]
    nxt = [0]
    bar = tqdm(total=len(requests), desc=desc, unit="req", leave=False)

    def on_tokens(h, toks, i):
        now = time.perf_counter()
        rec[i]["times"].extend([now] * len(toks))
        if h.finished:
            bar.update(1)
            submit_next()

    def submit_next():
        if nxt[0] < len(requests):
            i = nxt[0]
            nxt[0] += 1
            r = requests[i]
            rec[i]["submit"] = time.perf_counter()
            eng.submit(r["prompt"], RequestParams(max_tokens=r["max_tokens"], stop_ids=()),
                       on_tokens=lambda h, t, i=i: on_tokens(h, t, i))

    t0 = time.perf_counter()
    for _ in range(min(c, len(requests))):
        submit_next()
    steps = []
    while eng.has_work():
        st = eng.stats()
        pure = st["prefilling"] == 0 and st["queue_depth"] == 0
        t = time.perf_counter()
        eng.step()
        steps.append((time.perf_counter() - t, st["decoding"], pure))
    wall = time.perf_counter() - t0
    bar.close()
    return {"wall_s": wall, "rec": rec, "steps": steps, "t0": t0}


def summarize(run: dict, requests: list) -> dict:
    ttft, tpot = [], []
    for r, q in zip(run["rec"], requests):
        if len(r["times"]) != q["max_tokens"]:
            raise RuntimeError(f"a request produced {len(r['times'])} tokens, expected {q['max_tokens']}")
        ttft.append(r["times"][0] - r["submit"])
        if len(r["times"]) > 1:
            tpot.append((r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1))
    out_tokens = sum(q["max_tokens"] for q in requests)
    pure = [(d, n) for d, n, p in run["steps"] if p and n > 0]
    return {"wall_s": run["wall_s"], "output_tokens": out_tokens, "prompt_tokens": sum(len(q["prompt"]) for q in requests),
            "output_tok_s": out_tokens / run["wall_s"], **W.latency_summary(ttft, tpot),
            "steps": len(run["steps"]), "pure_decode_steps": len(pure),
            "pure_decode_tok_s": (sum(n for _, n in pure) / sum(d for d, _ in pure)) if pure else None}


def load_rows(model, wl, levels, a, rates, costs, R):
    reqs = wl["requests"]
    max_seq = max(len(q["prompt"]) + q["max_tokens"] for q in reqs)
    mean_prompt = statistics.mean(len(q["prompt"]) for q in reqs)
    ctx = mean_prompt + statistics.mean(q["max_tokens"] for q in reqs) / 2
    for rnd, c in [(r, c) for r in range(a.repeat) for c in levels]:
        # one engine at a time (two warm engines' executables exhausted XLA:CPU's mapped memory); with
        # --repeat, --compilation-cache makes the later rounds' warm-ups loads instead of compiles
        eng, warm_s = make_engine(model, c, max_seq, a)
        run = run_closed_loop(eng, reqs, c, f"concurrency {c}" + (f", round {rnd + 1}" if a.repeat > 1 else ""))
        s = summarize(run, reqs)
        lim = decode_limit(costs, rates, model, c, ctx)
        s.update(concurrency=c, round=rnd + 1, warmup_s=warm_s, compiled_shapes=eng.compiled_shapes(),
                 decode_limit_tok_s=lim["tok_s"], decode_limit_bound=lim["bound"],
                 tpot_limit_s=lim["step_s"], ttft_limit_s=prefill_limit_s(model, rates, int(mean_prompt)),
                 preemptions=eng.stats()["preemptions"])
        R["load"].append(s)
        print(f"| {c} | {s['output_tok_s']:.2f} | {lim['tok_s']:.1f} ({lim['bound']}) | "
              f"{100 * s['output_tok_s'] / lim['tok_s']:.1f}% | {s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f} | "
              f"{s['ttft_limit_s']:.2f} | {1e3 * s['tpot_p50_s']:.0f} / {1e3 * s['tpot_p99_s']:.0f} | "
              f"{1e3 * lim['step_s']:.0f} | {s['pure_decode_tok_s'] or float('nan'):.2f} | {warm_s:.0f} |", flush=True)
        del eng
    if a.repeat > 1 and len(levels) > 1:  # the ratio of each round (same engines, one sitting) and of the medians
        by = {c: [r["output_tok_s"] for r in R["load"] if r["concurrency"] == c] for c in levels}
        lo, hi = levels[0], levels[-1]
        per = [h / l for l, h in zip(by[lo], by[hi])]
        R["load_ratio"] = {"levels": [lo, hi], "per_round": per,
                           "of_medians": statistics.median(by[hi]) / statistics.median(by[lo])}
        print(f"# c={hi} / c={lo}: per round {', '.join(f'{x:.2f}x' for x in per)}; "
              f"medians {R['load_ratio']['of_medians']:.2f}x", flush=True)


def decode_pair(model, a, rates, costs, R, batch: int = 8):
    """bench_hf.py's decode row through the engine: `batch` prompts of 128 tokens are prefilled,
    then `decode_steps` engine steps in which all `batch` slots decode are timed (then cancelled)."""
    rng = np.random.default_rng(2000 + batch)
    L = 128
    prompts = [rng.integers(0, W.ID_LIMIT, L).tolist() for _ in range(batch)]
    eng, warm_s = make_engine(model, batch, 2 * L + a.decode_steps, a)
    hs = [eng.submit(p, RequestParams(max_tokens=L + a.decode_steps, stop_ids=())) for p in prompts]
    while any(not h.generated for h in hs):  # prefill (and the first rows' early decodes)
        eng.step()
    full = []
    for _ in tqdm(range(a.decode_steps), desc=f"decode pair b{batch}", leave=False):
        if eng.stats()["decoding"] != batch:
            raise RuntimeError("a decode-pair request stopped early")
        t = time.perf_counter()
        eng.step()
        full.append(time.perf_counter() - t)
    for h in hs:
        eng.cancel(h)
    lim = decode_limit(costs, rates, model, batch, L + a.decode_steps)
    row = {"batch": batch, "prompt_len": L, "steps": len(full), "step_s_median": statistics.median(full),
           "step_s_min": min(full), "tok_s": batch / statistics.median(full), "tok_s_best": batch / min(full),
           "tok_s_mean": batch * len(full) / sum(full), "limit_tok_s": lim["tok_s"], "limit_bound": lim["bound"],
           "warmup_s": warm_s}
    R["decode_pair"].append(row)
    print(f"| engine decode, batch {batch} (after {L}) | {row['tok_s_mean']:.2f} (median step {row['tok_s']:.2f}, "
          f"best {row['tok_s_best']:.2f}) | {1e3 * row['step_s_median']:.0f} | {lim['tok_s']:.1f} ({lim['bound']}) | "
          f"{100 * row['tok_s_mean'] / lim['tok_s']:.1f}% |", flush=True)


def prefix_rows(model, wl, a, rates, R):
    """Shared-prefix requests one after another, prefix cache on vs off: TTFT of hits vs misses."""
    px = wl["prefix"]
    reqs = px["requests"]
    max_seq = max(len(q["prompt"]) + q["max_tokens"] for q in reqs)
    out = {}
    for on in (True, False):
        eng, warm_s = make_engine(model, 2, max_seq, a, prefix_cache=on)
        ttft, toks = [], []
        for q in tqdm(reqs, desc=f"shared prefix, cache {'on' if on else 'off'}", leave=False):
            t = time.perf_counter()
            h = eng.submit(q["prompt"], RequestParams(max_tokens=q["max_tokens"], stop_ids=()))
            first = None
            while not h.finished:
                eng.step()
                if first is None and h.generated:
                    first = time.perf_counter() - t
            ttft.append(first)
            toks.append(h.generated)
        out[on] = dict(ttft=ttft, tokens=toks, stats=eng.stats(), warmup_s=warm_s)
        del eng
    hit = out[True]["ttft"][1:]
    miss = out[False]["ttft"]
    n_prefix = px["prefix_len"]
    row = {"requests": len(reqs), "prefix_len": n_prefix,
           "ttft_hit_median_s": statistics.median(hit), "ttft_hit_min_s": min(hit),
           "ttft_first_with_cache_s": out[True]["ttft"][0],
           "ttft_miss_median_s": statistics.median(miss), "ttft_miss_min_s": min(miss),
           "speedup_median": statistics.median(miss) / statistics.median(hit),
           "prefix_hits": out[True]["stats"]["prefix_hits"],
           "prefix_tokens_saved": out[True]["stats"]["prefix_tokens_saved"],
           "tokens_equal": out[True]["tokens"] == out[False]["tokens"],
           "miss_limit_s": prefill_limit_s(model, rates, len(reqs[0]["prompt"]))}
    R["prefix"] = row
    print(f"| shared {n_prefix}-token prefix, {len(reqs)} requests in turn | miss {row['ttft_miss_median_s']:.3f} s "
          f"(limit {row['miss_limit_s']:.3f}) | hit {row['ttft_hit_median_s']:.3f} s | {row['speedup_median']:.1f}x | "
          f"hits {row['prefix_hits']}, tokens saved {row['prefix_tokens_saved']}, same tokens: {row['tokens_equal']} |",
          flush=True)


# ------------------------------------------------------------------------------------------------
# HTTP mode
# ------------------------------------------------------------------------------------------------
def http_rows(url, wl, levels, a, R):
    """The load rows through `ling-jax serve` (OpenAI completions, streamed), c client threads."""
    from openai import OpenAI  # only this mode needs the client (installed with the server's extras)
    base = url.rstrip("/")
    client = OpenAI(base_url=base if base.endswith("/v1") else base + "/v1", api_key=a.api_key, max_retries=0,
                    timeout=3600)
    name = client.models.list().data[0].id
    reqs = wl["requests"]

    def one(q):
        t0 = time.perf_counter()
        times, usage = [], None
        stream = client.completions.create(model=name, prompt=q["prompt"], max_tokens=q["max_tokens"], temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices:
                times.append(time.perf_counter())
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return t0, times, usage

    for c in levels:
        results = [None] * len(reqs)
        lock, nxt = threading.Lock(), [0]
        bar = tqdm(total=len(reqs), desc=f"http concurrency {c}", leave=False)

        def client_loop():
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= len(reqs):
                    return
                results[i] = one(reqs[i])
                bar.update(1)

        t0 = time.perf_counter()
        th = [threading.Thread(target=client_loop) for _ in range(min(c, len(reqs)))]
        [x.start() for x in th]
        [x.join() for x in th]
        wall = time.perf_counter() - t0
        bar.close()
        ttft = [ts[0] - s for s, ts, _ in results]
        tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for _, ts, _ in results if len(ts) > 1]
        n_out = sum(u if u is not None else len(ts) for _, ts, u in results)
        s = {"concurrency": c, "wall_s": wall, "output_tokens": n_out, "output_tok_s": n_out / wall,
             **W.latency_summary(ttft, tpot)}
        R["http"].append(s)
        print(f"| http {c} | {s['output_tok_s']:.2f} | {s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f} | "
              f"{1e3 * s['tpot_p50_s']:.0f} / {1e3 * s['tpot_p99_s']:.0f} |", flush=True)


# ------------------------------------------------------------------------------------------------
def main(argv=None):
    a = parse_args(argv)
    preset = "quick" if a.quick else "full"
    os.makedirs(RESULTS, exist_ok=True)
    wpath = a.workload or os.path.join(RESULTS, f"serve_workload_{preset}.json")
    if not os.path.isfile(wpath):
        W.save(W.make_workload(preset, a.seed, LingConfig.from_json(a.config).vocab_size), wpath)
        print(f"wrote workload {wpath}", file=sys.stderr)
    wl = W.load(wpath)
    levels = [int(x) for x in a.concurrency.split(",") if x]
    rows = set(a.rows.split(","))
    bad = rows - {"load", "decode", "prefix"}
    if bad or any(c < 1 for c in levels):
        raise SystemExit(f"--rows takes load,decode,prefix (got {sorted(bad)}); --concurrency positive ints")
    out = a.json or os.path.join(RESULTS, f"bench_serve_mid_cpu{'_quick' if a.quick else ''}"
                                          f"{'_http' if a.http else ''}.json")
    R = {"workload": os.path.abspath(wpath), "workload_name": wl["name"], "load": [], "decode_pair": [],
         "prefix": None, "http": [], "args": vars(a),
         "prefill_policy": {c: prefill_policy(a, int(c)).describe() for c in a.concurrency.split(",")},
         "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if a.http:
        http_rows(a.http, wl, levels, a, R)
        return _write(R, out)

    if a.compilation_cache:
        enable_compilation_cache(a.compilation_cache)  # what `ling-jax --compilation-cache` does
    ckpt = bench_checkpoint(a.config, a.checkpoint)
    model = load_model(ckpt, "float32", with_mtp=False, progress=False, layer_loop=a.layer_loop)
    bw1, bwn = measure_bandwidth()
    mm = measure_matmul()
    rates = {"bw_Bps": bwn, "matmul_FLOPs": mm}
    costs = model_costs(model)
    R.update(backend=jax.default_backend(), cpus=os.cpu_count(), exec=str(model.exec), bw_1thread_GBps=bw1 / 1e9,
             bw_2threads_GBps=bwn / 1e9, matmul_GFLOPs=mm / 1e9, costs=costs,
             loadavg_start=os.getloadavg())
    print(f"# ling-jax engine on {jax.default_backend()} ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}): "
          f"copy {bwn / 1e9:.1f} GB/s, f32 matmul {mm / 1e9:.0f} GFLOP/s; workload {wpath} "
          f"({len(wl['requests'])} requests); {model.exec}")
    if "decode" in rows:
        print("\n| decode pair row | tok/s (all timed steps, as bench_hf.py) | ms/step | limit tok/s | % of limit |\n|---|---:|---:|---:|---:|")
        decode_pair(model, a, rates, costs, R)
        _write(R, out, quiet=True)  # partial results survive a later failure
    if "load" in rows:
        print("\n| concurrency | output tok/s | decode limit tok/s | % | TTFT p50 / p99 s | TTFT limit s (mean prompt) "
              "| TPOT p50 / p99 ms | TPOT limit ms | pure-decode-step tok/s | warm-up s |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        load_rows(model, wl, levels, a, rates, costs, R)
        _write(R, out, quiet=True)
    if "prefix" in rows:
        print("\n| shared prefix | TTFT miss (no cache) | TTFT hit | miss / hit | cache stats |\n|---|---:|---:|---:|---|")
        prefix_rows(model, wl, a, rates, R)
    R["loadavg_end"] = os.getloadavg()
    _write(R, out)


def _write(R, path, quiet=False):
    with open(path, "w") as f:
        json.dump(R, f, indent=1, default=str)
    if not quiet:
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
