"""Long prompts through `generate` (issue 22): peak resident memory, prefill tokens/s and decode
tokens/s after the prompt, each beside what the arithmetic predicts from the shortest length.

    python tools/bench_long_context.py [--lengths 4096,16384,65536] [--new 16] [--out FILE.json]

Model: the real layer pattern at small width (`checkpoint.synthetic_config` with hidden 256, 4 heads,
8 layers = 7 KDA + 1 MLA, 8 experts; random weights, float32, max_position_embeddings 2^20), one
sequence. Each length runs in a fresh process (its own peak RSS, `ru_maxrss`), which calls
`generate` twice with the same compiled shapes (first on a two-chunk prefix of the prompt with the
same cache length: it compiles) and times the second through its stream callback: prefill = call start → first token; decode = first → last token over `--new` tokens.

Predicted (the "pred" columns): counted FLOPs at the rate measured at the shortest length.
Prefill FLOPs = L · 2 · active params + the blockwise MLA attention as it runs (absorbed form:
2·H·(2r + dr) per query per key *computed*, i.e. per visited key block: chunk i of C queries
visits ceil((i+1)·C / block) blocks). Decode: the shortest length's step time plus the extra
attention FLOPs of the longer cache at the prefill rate (the weights part of a step does not
change with L). Memory: the predicted growth is linear, from the two shortest lengths.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent("""
    import json, resource, sys, time
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
    print(json.dumps({"tokens": L, "prefill_s": first - t0, "decode_tokens": n_dec, "decode_s": stamps[-1][0] - first,
                      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
""")

MODEL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=8, vocab_size=4096,
             pad_token_id=4094, eos_token_id=4095, max_position_embeddings=1 << 20)


def run_length(L: int, new: int) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-c", CHILD, str(L), str(new), json.dumps(MODEL)], env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def prefill_flops(cfg, L: int, chunk: int, block: int, active: int) -> float:
    """Counted FLOPs of prefilling L tokens (see the module docstring)."""
    H, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    n_mla = sum(t == "mla" for t in cfg.layer_types)
    per_pair = 2 * H * (2 * r + dr) * n_mla
    if L <= chunk:  # one call: the cache-free expanded form over L keys (the bench's lengths exceed a chunk)
        keys = L * (-(-L // block) * block if L > block else L)
    else:
        n = -(-L // chunk)
        keys = sum(chunk * -(-((i + 1) * chunk) // block) * block for i in range(n))
    return 2.0 * active * L + per_pair * keys


def decode_attn_flops(cfg, L: int) -> float:
    H, r, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return 2 * H * (2 * r + dr) * sum(t == "mla" for t in cfg.layer_types) * L


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="4096,16384,65536")
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    from ling_jax.accounting import param_counts
    from ling_jax.checkpoint.synthetic_config import synthetic_config
    from ling_jax.exec_config import ExecConfig

    cfg = synthetic_config(**MODEL)
    ex = ExecConfig()
    active = param_counts(cfg, include_mtp=False)["active"]
    rows = []
    for L in (int(x) for x in a.lengths.split(",")):
        row = run_length(L, a.new)
        row["prefill_tok_s"] = L / row["prefill_s"]
        row["decode_tok_s"] = row["decode_tokens"] / row["decode_s"]
        row["prefill_gflop"] = prefill_flops(cfg, L, ex.prefill_chunk, ex.attn_block, active) / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]
    rate = base["prefill_gflop"] / base["prefill_s"]  # GFLOP/s measured at the shortest length
    step0 = base["decode_s"] / base["decode_tokens"]
    slope = ((rows[1]["peak_rss_gib"] - base["peak_rss_gib"]) / (rows[1]["tokens"] - base["tokens"])
             if len(rows) > 1 else 0.0)
    print(f"\nprefill rate at {base['tokens']} tokens: {rate:.2f} GFLOP/s (counted)")
    print("| prompt | peak RSS GiB (linear pred) | prefill tok/s (pred) | ratio | decode tok/s (pred) | ratio |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        pre_pred = row["tokens"] / (row["prefill_gflop"] / rate)
        step_pred = step0 + (decode_attn_flops(cfg, row["tokens"]) - decode_attn_flops(cfg, base["tokens"])) / (rate * 1e9)
        mem_pred = base["peak_rss_gib"] + slope * (row["tokens"] - base["tokens"])
        row.update(prefill_tok_s_pred=pre_pred, decode_tok_s_pred=1 / step_pred, peak_rss_gib_pred=mem_pred)
        print(f"| {row['tokens']:,} | {row['peak_rss_gib']:.2f} ({mem_pred:.2f}) | {row['prefill_tok_s']:.0f} "
              f"({pre_pred:.0f}) | {row['prefill_tok_s'] / pre_pred:.2f} | {row['decode_tok_s']:.1f} "
              f"({1 / step_pred:.1f}) | {row['decode_tok_s'] * step_pred:.2f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": MODEL, "rows": rows, "gflop_per_s": rate}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
