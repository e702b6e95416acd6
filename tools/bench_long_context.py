"""Long prompts through `generate`, the engine and `ling-jax serve` (issue 22): peak resident memory,
prefill tokens/s and decode tokens/s after the prompt, each beside what the arithmetic predicts from the
shortest length.

    python tools/bench_long_context.py [--lengths 4096,16384,65536] [--paths generate,engine,serve]
                                       [--new 16] [--out FILE.json] [--model-config config.json]

Model: the real layer pattern at small width (`checkpoint.synthetic_config` with hidden 256, 4 heads,
8 layers = 7 KDA + 1 MLA, 8 experts; random weights, float32, max_position_embeddings 2^20), or the
config.json given by `--model-config` (the mid config: 16 layers, 2 MLA), one sequence. Each length and path runs in a fresh process (its own peak RSS:
its VmHWM, or the server process's; not `ru_maxrss`, which keeps the spawning parent's peak), and times a second request after a first one that compiled the same programs:
  generate  `generate` twice with the same compiled shapes (first on a two-chunk prefix of the prompt
            with the same cache length), timed through its stream callback;
  engine    an `Engine` (1 slot, pages of 16, prefill chunks of 2,048 tokens like `generate`, no prefix
            cache), `Engine.warmup()` (every program compiled on padding rows: one [1, 2048] prefill
            and one 1-row decode per block-table width), a 16-token request (the first real step of
            a process pays a one-time ~5 s the padding warm-up does not: the seventeenth session's
            tool timed it into the shortest length, inflating every prediction), then the prompt
            once, timed by step (until the seventeenth session the prompt ran twice: twice the time
            at 256K);
  serve     `ling-jax serve` on the same model written as a checkpoint (bf16 on disk, float32 compute,
            the same engine flags, `--warmup off`), the prompt as token ids through streamed
            /v1/completions, twice.
prefill = request start to the first token; decode tokens/s = 1 / the median time between tokens over
`--new` tokens (the mean, first to last token, is in the JSON as decode_s: a stray slow step, a
collection or a late program, moved it ±40% between runs of 64 tokens).

Predicted (the "pred" columns): counted FLOPs and bytes, at the rates this sitting measured.
Prefill FLOPs = L · 2 · active params + the causal MLA attention's arithmetic (absorbed form:
2·H·(2r + dr) per query per key it sees: L(L+1)/2 query-key pairs; the fifteenth session counted
the XLA blockwise form's visited 512-key blocks instead, a larger count), at the FLOP rate measured at
the shortest length. Decode: the shortest length's step time (the weights part of a step does not
change with L) plus the longer cache's extra attention, which costs the larger of its FLOPs at that
rate and its bytes (n_mla · L · (r + dr) float32 values read per step, the latent pool) at this host's
streaming read rate: all threads summing a buffer of that size out of cache (`stream_read_gbs`, best
of 20). The prefill's attention bytes are counted the same way (each 2,048-token chunk reads every key
before it). Until the thirty-eighth session the prediction counted the FLOPs only: a 256K step's
64 MiB of keys were read for free, which on a host with fast compute put the prediction above what
its memory can stream (the "ratio (FLOPs)" column keeps that figure). Memory: the predicted growth is linear, from
the two shortest lengths.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_generate import stream_read_gbs  # noqa: E402  (the tools' host-rate probes live there)

# prepended to each child script: this process's own peak RSS (its VmHWM; ru_maxrss keeps the spawning
# parent's peak across exec)
PEAK_RSS = textwrap.dedent("""
    def peak_rss_gib():
        return [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0] / 2**20
""")

CHILD = PEAK_RSS + textwrap.dedent("""
    import json, sys, time
    import numpy as np, jax.numpy as jnp
    from flax import nnx
    from ling_jax.checkpoint.synthetic_config import synthetic_config
    from ling_jax.generate import cache_length, generate
    from ling_jax.model import LingForCausalLM
    L, new = int(sys.argv[1]), int(sys.argv[2])
    cfg = synthetic_config(**json.loads(sys.argv[3]))
    model = LingForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), with_mtp=False)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size - 2, size=L).tolist()

    stamps = []
    stream = lambda t, n: stamps.append((time.perf_counter(), int(n.sum())))  # one object: a static argument

    max_len = cache_length(L, new)

    def timed(p):
        stamps.clear()
        t0 = time.perf_counter()
        generate(model, [p], new, stop_ids=(), stream=stream, max_len=max_len)
        return t0, list(stamps)

    timed(prompt[:model.exec.prefill_chunk + 1])  # compiles the same programs (same cache) on two chunks
    t0, stamps = timed(prompt)
    first = stamps[0][0]
    n_dec = sum(n for _, n in stamps[1:])
    gaps = [(b[0] - a[0]) / b[1] for a, b in zip(stamps, stamps[1:]) if b[1] > 0]  # a call streams n tokens
    print(json.dumps({"tokens": L, "prefill_s": first - t0, "decode_tokens": n_dec, "decode_s": stamps[-1][0] - first,
                      "decode_step_median_s": float(np.median(gaps)),
                      "peak_rss_gib": peak_rss_gib()}))
""")

ENGINE_CHILD = PEAK_RSS + textwrap.dedent("""
    import json, sys, time
    import numpy as np, jax.numpy as jnp
    from flax import nnx
    from ling_jax.checkpoint.synthetic_config import synthetic_config
    from ling_jax.model import LingForCausalLM
    from ling_jax.serve import Engine, RequestParams
    L, new = int(sys.argv[1]), int(sys.argv[2])
    cfg = synthetic_config(**json.loads(sys.argv[3]))
    model = LingForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), with_mtp=False)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size - 2, size=L).tolist()
    chunk = model.exec.prefill_chunk
    eng = Engine(model, max_slots=1, page_size=16, num_pages=-(-(L + new) // 16) + 1, prefill_chunk=chunk,
                 prefill_rows=1, max_seq_len=L + new, decode_rows=(1,), buckets=(chunk,), prefix_cache=False)

    def timed():
        h = eng.submit(prompt, RequestParams(max_tokens=new, stop_ids=()))
        t0 = time.perf_counter()
        times = []  # when each new token appeared
        while eng.has_work():
            eng.step()
            now = time.perf_counter()
            times += [now] * (len(h.generated) - len(times))
        return t0, times

    eng.warmup()  # compiles every program the prompt needs (each block-table width), on padding rows
    # and one short real request: the process's first real step pays a one-time ~5 s on XLA:CPU that
    # the padding warm-up does not (not a compile: measured in the eighteenth session, BENCHMARKS.md)
    eng.submit(prompt[:16], RequestParams(max_tokens=2, stop_ids=()))
    while eng.has_work():
        eng.step()
    t0, times = timed()
    print(json.dumps({"tokens": L, "prefill_s": times[0] - t0, "decode_tokens": len(times) - 1,
                      "decode_s": times[-1] - times[0], "decode_step_median_s": float(np.median(np.diff(times))),
                      "peak_rss_gib": peak_rss_gib()}))
""")

SERVE_CHILD = textwrap.dedent("""
    import json, os, socket, subprocess, sys, tempfile, time, urllib.request
    import numpy as np
    from ling_jax.checkpoint.synthetic_config import synthetic_config
    from ling_jax.checkpoint.writer import write_checkpoint
    L, new = int(sys.argv[1]), int(sys.argv[2])
    cfg = synthetic_config(**json.loads(sys.argv[3]))
    ckpt = os.path.join(tempfile.mkdtemp(prefix="long-ctx-"), "ckpt")
    write_checkpoint(cfg, ckpt, dtype="bf16", include_mtp=False, progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ling_jax.cli", "serve", "--checkpoint", ckpt, "--port", str(port), "--dtype",
           "float32", "--max-slots", "1", "--page-size", "16", "--max-seq-len", str(L + new), "--prefill-chunk", "2048",
           "--cache-memory", "1", "--no-prefix-cache", "--warmup", "off", "--body-timeout", "600"]
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):  # bounded: up to 10 minutes for the server to come up
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(1)
    else:
        srv.kill()
        raise SystemExit("the server did not come up: " + srv.stderr.read()[-2000:])
    from openai import OpenAI
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    name = client.models.list().data[0].id
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size - 2, size=L).tolist()

    def timed():  # each streamed token id stamped when its chunk arrives
        t0, times = time.perf_counter(), []
        for chunk in client.completions.create(model=name, prompt=prompt, max_tokens=new, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True}):
            for c in chunk.choices:
                times += [time.perf_counter()] * len(getattr(c, "token_ids", None) or [])
        return t0, times

    def per_token_median(times):  # chunk gaps over their tokens (a chunk may carry several)
        chunks = sorted(set(times))
        return float(np.median([(b - a) / times.count(b) for a, b in zip(chunks, chunks[1:])]))

    timed()  # compiles what the prompt needs
    t0, times = timed()
    with open(f"/proc/{srv.pid}/status") as f:
        hwm = next(int(l.split()[1]) for l in f if l.startswith("VmHWM"))
    srv.terminate()
    srv.wait(timeout=120)
    print(json.dumps({"tokens": L, "prefill_s": times[0] - t0, "decode_tokens": len(times) - 1,
                      "decode_s": times[-1] - times[0], "decode_step_median_s": per_token_median(times),
                      "peak_rss_gib": hwm / 2**20}))
""")

CHILDREN = {"generate": CHILD, "engine": ENGINE_CHILD, "serve": SERVE_CHILD}

CHUNK = 2048  # prefill chunk of the children (their scripts spell it out), generate's default too
MODEL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=8, vocab_size=4096,
             pad_token_id=4094, eos_token_id=4095, max_position_embeddings=1 << 20)


def model_kwargs(config_path: str | None) -> dict:
    """`synthetic_config` keywords: the small model (MODEL), or those of a config.json."""
    if not config_path:
        return MODEL
    with open(config_path) as f:
        return json.load(f)


def run_length(L: int, new: int, path: str = "generate", model: dict = MODEL) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-c", CHILDREN[path], str(L), str(new), json.dumps(model)], env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def prefill_flops(cfg, L: int, active: int) -> float:
    """Counted FLOPs of prefilling L tokens (see the module docstring)."""
    H, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    n_mla = sum(t == "mla" for t in cfg.layer_types)
    per_pair = 2 * H * (2 * r + dr) * n_mla
    return 2.0 * active * L + per_pair * L * (L + 1) / 2  # query p sees keys 0..p


def attn_geometry(cfg) -> tuple[int, int, int, int]:
    return (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
            sum(t == "mla" for t in cfg.layer_types))


def decode_attn_flops(cfg, L: int) -> float:
    H, r, dr, n_mla = attn_geometry(cfg)
    return 2 * H * (2 * r + dr) * n_mla * L


def decode_attn_bytes(cfg, L: int) -> float:
    """Latent pool bytes one decode step reads over L cached tokens (float32 pools)."""
    _, r, dr, n_mla = attn_geometry(cfg)
    return 4.0 * (r + dr) * n_mla * L


def prefill_attn_bytes(cfg, L: int, chunk: int = CHUNK) -> float:
    """Latent pool bytes a prefill in chunks of `chunk` reads: chunk k reads the keys of chunks 0..k."""
    n = -(-L // chunk)
    keys = sum(min(L, (k + 1) * chunk) for k in range(n))
    return decode_attn_bytes(cfg, keys)


def predicted(cfg, rows: list, read_gbs: float) -> None:
    """Adds the "pred" columns to one path's rows (see the module docstring) and prints its table.
    read_gbs: the host's streaming read rate (GB/s) for the attention's bytes."""
    base = rows[0]
    rate = base["prefill_gflop"] / base["prefill_s"]  # GFLOP/s measured at the shortest length
    step0 = base["decode_step_median_s"]
    slope = ((rows[1]["peak_rss_gib"] - base["peak_rss_gib"]) / (rows[1]["tokens"] - base["tokens"])
             if len(rows) > 1 else 0.0)
    print(f"\n{base['path']}: prefill rate at {base['tokens']} tokens: {rate:.2f} GFLOP/s (counted); "
          f"streaming reads {read_gbs:.1f} GB/s")
    print("| path | prompt | peak RSS GiB (linear pred) | prefill tok/s (pred) | ratio | decode tok/s (pred) | ratio "
          "| ratio (FLOPs) |")
    print("|---|---|---|---|---|---|---|---|")
    flops_s, bytes_s = (lambda f: f / (rate * 1e9)), (lambda b: b / (read_gbs * 1e9))  # noqa: E731
    for row in rows:
        L, L0 = row["tokens"], base["tokens"]
        attn_f = prefill_flops(cfg, L, 0)  # the attention part of the prefill's FLOPs
        pre_s = flops_s(row["prefill_gflop"] * 1e9 - attn_f) + max(flops_s(attn_f), bytes_s(prefill_attn_bytes(cfg, L)))
        d_flops = flops_s(decode_attn_flops(cfg, L) - decode_attn_flops(cfg, L0))
        step_flops = step0 + d_flops
        step_pred = step0 + max(d_flops, bytes_s(decode_attn_bytes(cfg, L) - decode_attn_bytes(cfg, L0)))
        mem_pred = base["peak_rss_gib"] + slope * (L - L0)
        row.update(prefill_tok_s_pred=L / pre_s, decode_tok_s_pred=1 / step_pred, peak_rss_gib_pred=mem_pred,
                   decode_tok_s_pred_flops_only=1 / step_flops, gflop_per_s=rate, read_gb_per_s=read_gbs)
        print(f"| {row['path']} | {L:,} | {row['peak_rss_gib']:.2f} ({mem_pred:.2f}) | "
              f"{row['prefill_tok_s']:.0f} ({L / pre_s:.0f}) | {row['prefill_tok_s'] * pre_s / L:.2f} | "
              f"{row['decode_tok_s']:.1f} ({1 / step_pred:.1f}) | {row['decode_tok_s'] * step_pred:.2f} | "
              f"{row['decode_tok_s'] * step_flops:.2f} |", flush=True)


def measure_read_gbs(cfg, rows: list) -> float:
    """This host's streaming read rate over the longest row's decode attention bytes."""
    return stream_read_gbs(int(decode_attn_bytes(cfg, max(r["tokens"] for r in rows))))


def reprint(path: str, read_gbs: float | None) -> int:
    """The tables of an earlier run (`--out` JSON) under this prediction; the streaming read rate is
    `read_gbs` when given, else the file's, else measured here (only right on the host that ran it)."""
    sys.path.insert(0, ROOT)
    from ling_jax.checkpoint.synthetic_config import synthetic_config

    with open(path) as f:
        out = json.load(f)
    cfg = synthetic_config(**out["model"])
    for rows in out["paths"].values():
        predicted(cfg, rows, read_gbs or out.get("read_gbs") or measure_read_gbs(cfg, rows))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="4096,16384,65536")
    p.add_argument("--paths", default="generate,engine,serve", help="comma list of generate, engine, serve")
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--out", default=None)
    p.add_argument("--model-config", default=None,
                   help="a config.json to run instead of the small model (e.g. ../shared/bench/config.mid.json)")
    p.add_argument("--rows", default=None,
                   help="an earlier run's --out JSON: print its tables again with this prediction, running nothing")
    p.add_argument("--read-gbs", type=float, default=None,
                   help="the streaming read rate (GB/s) to predict with instead of measuring it (e.g. the rate "
                        "probed on the host where --rows was measured)")
    a = p.parse_args(argv)
    if a.rows:
        return reprint(a.rows, a.read_gbs)
    paths = [x for x in a.paths.split(",") if x]
    if not paths or set(paths) - set(CHILDREN):
        p.error(f"--paths: a comma list of {', '.join(CHILDREN)} (got {a.paths!r})")
    sys.path.insert(0, ROOT)
    from ling_jax.accounting import param_counts
    from ling_jax.checkpoint.synthetic_config import synthetic_config

    model = model_kwargs(a.model_config)
    cfg = synthetic_config(**model)
    active = param_counts(cfg, include_mtp=False)["active"]
    out = {"model": model, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "paths": {}}
    for path in paths:
        rows = []
        for L in (int(x) for x in a.lengths.split(",")):
            row = dict(path=path, **run_length(L, a.new, path, model), loadavg=os.getloadavg()[0])
            row["prefill_tok_s"] = L / row["prefill_s"]
            row["decode_tok_s"] = 1.0 / row["decode_step_median_s"]  # the median step: robust to a stray slow one
            row["prefill_gflop"] = prefill_flops(cfg, L, active) / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
        if "read_gbs" not in out:  # measured once, after the first path's children, in this sitting
            out["read_gbs"] = a.read_gbs or measure_read_gbs(cfg, rows)
        predicted(cfg, rows, out["read_gbs"])
        out["paths"][path] = rows
        if a.out:  # partial results survive a later failure
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
