#!/usr/bin/env python3
"""Prefill and decode throughput of ling-jax on the mid-size benchmark config, next to rooflines.

Mirrors the workloads of ../shared/bench/bench_hf.py (HF transformers `bailing_hybrid` on CPU) so
the two can be run on the same machine and compared:
  prefill BxL in {1x128, 1x512, 1x2048, 8x128} (cache filled, last-token logits, as generate does);
  greedy decode of 64 tokens after a 128-token prompt at batch 1 and 8 (prefill excluded).
Rooflines: decode = active weight bytes per step / measured memory bandwidth (numpy copy, the same
measurement as bench_hf.py); prefill = FLOPs per token / measured float32 matmul rate.

  python tools/bench_generate.py [--config ../shared/bench/config.mid.json] [--json out.json] [--quick]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "bench", "config.mid.json")


def measure_bandwidth(gib=1.0, reps=7, threads=2):
    """numpy copy bandwidth (read + write bytes / s), 1 thread and `threads` threads."""
    n = int(gib * 2**30 / 8)
    a = np.ones(n)
    b = np.empty_like(a)
    np.copyto(b, a)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t)
    one = 2 * a.nbytes / statistics.median(ts)
    h = n // threads
    ts = []
    for _ in range(reps):
        th = [threading.Thread(target=np.copyto, args=(b[i * h:(i + 1) * h], a[i * h:(i + 1) * h]))
              for i in range(threads)]
        t = time.perf_counter()
        [x.start() for x in th]
        [x.join() for x in th]
        ts.append(time.perf_counter() - t)
    return one, 2 * a.nbytes / statistics.median(ts)


def stream_read_gbs(nbytes: int, threads: int | None = None, reps: int = 20) -> float:
    """GB/s this host reads a buffer of `nbytes` out of cache: `threads` (default: every CPU this process
    may run on) each summing its part, after 256 MiB written in between; the best of `reps`. Not
    `measure_bandwidth`: that one copies (read + write) 1 GiB, warm; a long-context decode step reads
    its latent pool, the size of the buffer, after the rest of the step evicted it."""
    from concurrent.futures import ThreadPoolExecutor

    threads = threads or len(os.sched_getaffinity(0))
    buf = np.ones(max(nbytes, 1 << 20) // 4, np.float32)
    flush = np.ones(256 << 18, np.float32)
    parts = np.array_split(buf, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as ex:  # numpy's reductions release the GIL
        for _ in range(reps):
            flush += 1.0
            t = time.perf_counter()
            list(ex.map(np.sum, parts))
            best = min(best, time.perf_counter() - t)
    return buf.nbytes / best / 1e9


def measure_matmul(n=2048, reps=10):
    import jax
    import jax.numpy as jnp
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x, y: jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST))
    f(a, a).block_until_ready()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        ts.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(ts)


def active_weight_bytes(model, bytes_per=4):
    """Weights one decode step reads per token: everything but the embedding table, with only
    top-k of the routed experts (plus shared experts and the LM head). MTP layer excluded."""
    from flax import nnx
    cfg = model.cfg
    total = 0
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        p = [str(x) for x in path]
        if p[0] == "mtp" or p[:2] == ["model", "word_embeddings"]:
            continue
        n = int(np.prod(v.get_value().shape))
        if "experts" in p and p[-1] in ("gate_proj", "up_proj", "down_proj"):
            n = n * cfg.num_experts_per_tok // cfg.num_experts
        total += n * bytes_per
    return total


def flops_per_token(model, ctx):
    """2 × active matmul parameters + attention (MLA over `ctx` keys, KDA per-token state update)."""
    cfg = model.cfg
    active = active_weight_bytes(model) // 4
    n_mla = sum(t == "mla" for t in cfg.layer_types)
    n_kda = cfg.num_hidden_layers - n_mla
    H = cfg.num_attention_heads
    mla = n_mla * 2 * H * ctx / 2 * (cfg.qk_head_dim + cfg.v_head_dim)
    kda = n_kda * H * 4 * 2 * cfg.head_dim * cfg.head_dim
    return 2 * active + mla + kda


def timed(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench_checkpoint(config_path: str, checkpoint: str | None = None) -> str:
    """The benchmark checkpoint: `checkpoint`, else a random one of `config_path` in the release
    layout (FP8), written once by the project's writer under the demo's cache folder and reused
    (tools/bench_serve.py shares it)."""
    from ling_jax.checkpoint.writer import write_checkpoint
    from ling_jax.commands.demo import cache_dir
    from ling_jax.config import LingConfig

    if checkpoint is not None:
        return checkpoint
    ckpt = os.path.join(cache_dir(), "bench-" + os.path.basename(config_path).replace(".json", ""))
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        print(f"writing benchmark checkpoint {ckpt}", file=sys.stderr)
        write_checkpoint(LingConfig.from_json(config_path), ckpt, dtype="fp8", seed=0, tokenizer=False,
                         progress=sys.stderr.isatty())
    return ckpt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--checkpoint", default=None, help="existing checkpoint dir (default: write one, cached)")
    ap.add_argument("--prefill-shapes", default="1x128,1x512,1x2048,8x128")
    ap.add_argument("--decode-batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 rep, no 2048 prompt")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.quick:
        a.reps = 1
        a.prefill_shapes = ",".join(s for s in a.prefill_shapes.split(",") if not s.endswith("2048"))

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ling_jax.config import LingConfig
    from ling_jax.generate import DecodeState, decode_loop, prefill
    from ling_jax.model import init_cache
    from ling_jax.loader import load_model
    from ling_jax.sampling import SamplingParams

    cfg = LingConfig.from_json(a.config)
    ckpt = bench_checkpoint(a.config, a.checkpoint)
    t0 = time.perf_counter()
    model = load_model(ckpt, "float32", with_mtp=False, progress=False)
    load_s = time.perf_counter() - t0
    graphdef, params = nnx.split(model)
    g = SamplingParams()
    R = {"backend": jax.default_backend(), "devices": str(jax.devices()), "config": os.path.abspath(a.config),
         "load_s": load_s, "prefill": [], "decode": []}
    bw1, bwn = measure_bandwidth()
    mm = measure_matmul()
    R.update(bw_1thread_GBps=bw1 / 1e9, bw_2threads_GBps=bwn / 1e9, matmul_GFLOPs=mm / 1e9)
    wbytes = active_weight_bytes(model)
    R["active_weight_bytes_per_token"] = wbytes
    print(f"# ling-jax on {jax.default_backend()} ({os.cpu_count()} cores): numpy copy {bw1/1e9:.1f} GB/s "
          f"(1 thread), {bwn/1e9:.1f} GB/s (2 threads); f32 matmul {mm/1e9:.1f} GFLOP/s; "
          f"active weights {wbytes/1e6:.1f} MB/token; load {load_s:.1f}s")

    def run_prefill(B, L):
        ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, L)), jnp.int32)
        lens = jnp.full((B,), L, jnp.int32)
        h0 = jnp.zeros((B, cfg.hidden_size), jnp.float32)

        def go():
            cache = init_cache(cfg, B, L + a.decode_steps + 8, jnp.float32, with_mtp=False)
            out = prefill(graphdef, params, cache, ids, lens, h0, sampling=g,
                          with_mtp=False)
            jax.block_until_ready(out)
            return out
        t = time.perf_counter()
        go()
        compile_s = time.perf_counter() - t
        return go, compile_s

    print("\n| prefill BxL | tok/s | roofline tok/s (FLOPs / matmul rate) | % of roofline | first call s (compile) |")
    print("|---|---:|---:|---:|---:|")
    for shp in filter(None, a.prefill_shapes.split(",")):  # "" = no prefill rows (as bench_hf.py)
        B, L = map(int, shp.split("x"))
        go, comp = run_prefill(B, L)
        s = timed(go, a.reps, 0)
        tok_s = B * L / s
        roof = mm / flops_per_token(model, L / 2)
        R["prefill"].append(dict(shape=shp, tok_s=tok_s, roofline_tok_s=roof, seconds=s, first_call_s=comp))
        print(f"| {shp} | {tok_s:.1f} | {roof:.1f} | {100 * tok_s / roof:.1f}% | {comp:.1f} |", flush=True)

    print("\n| decode batch | tok/s | roofline tok/s (active weight bytes / BW) | % of roofline | first call s (compile) |")
    print("|---|---:|---:|---:|---:|")
    for B in map(int, a.decode_batches.split(",")):
        go_p, _ = run_prefill(B, a.prompt_len)
        cache, _, tok, hid = go_p()

        def state():
            z = lambda: jnp.zeros((B,), jnp.int32)
            c = jax.tree.map(lambda x: x.copy(), cache)
            return DecodeState(c, tok.copy(), hid.copy(), jnp.zeros((B,), bool), jnp.zeros((B, a.decode_steps), jnp.int32),
                               z(), z(), z())

        def go():
            st = state()
            jax.block_until_ready(st)
            t = time.perf_counter()
            out = decode_loop(graphdef, params, st, sampling=g, stop_ids=(), max_new=a.decode_steps)
            jax.block_until_ready(out)
            return time.perf_counter() - t
        comp = go()
        s = statistics.median([go() for _ in range(a.reps)])
        # the first token comes from prefill; the loop runs decode_steps - 1 model steps
        steps = a.decode_steps - 1
        tok_s = B * steps / s
        # one step reads the active weights once for the whole batch (optimistic for B>1: the batch's
        # tokens route to a union of experts, so a step reads more than the batch-1 bytes)
        roof_tok = bwn / wbytes * B
        R["decode"].append(dict(batch=B, tok_s=tok_s, steps_per_s=steps / s, roofline_tok_s=roof_tok,
                                pct_of_roofline=100 * tok_s / roof_tok, first_call_s=comp))
        print(f"| {B} | {tok_s:.2f} | {roof_tok:.1f} | {100 * tok_s / roof_tok:.1f}% | {comp:.1f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(R, f, indent=1)
        print(f"\nwrote {a.json}")


if __name__ == "__main__":
    main()
