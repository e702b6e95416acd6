#!/usr/bin/env python3
"""Prefill and decode speed of the MXFP4-resident model next to the FP8-resident and dequantised ones.

Writes an FP8 checkpoint of a small config (default: the synthetic config widened to hidden 512,
expert width 256, 32 experts), re-quantises its experts to MXFP4, and times on the local backend:

* dequantised   the MXFP4 checkpoint decoded at load (float32 experts)
* fp8 kept      the FP8 checkpoint with --keep-quantized (float8 + scales, dequantised in the matmul)
* mxfp4 kept    the MXFP4 checkpoint with --keep-quantized (uint8 codes + E8M0, unpacked in the matmul)

for a cache-free prefill [1, T] and one decode step (batch 1, through a cache), median of --reps
after a compile. It also prints the bytes a batch-1 decode step reads per token at FULL scale from
the real config's accounting (seed article: FP8 ~25.1 GB, MXFP4 experts ~21.1 GB).

  python tools/bench_mxfp4.py [--tokens 64] [--reps 3] [--config FILE]

On XLA:CPU the quantised paths dequantise in XLA before each expert matmul, so they trade memory
for time here; there is no fused low-precision kernel on this backend.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REAL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "spec",
                    "config.ling-3.1-flash.json")


def bytes_per_token(cfg_path: str) -> dict:
    """GB read by one batch-1 decode token at full scale: every dense matrix, the LM head, routers and
    norms, and k/E of the routed experts (their scales included); no MTP layer, no embedding rows."""
    from ling_jax import accounting as A
    from ling_jax.config import LingConfig

    cfg = LingConfig.from_json(cfg_path)
    out = {}
    for fmt in ("fp8", "mxfp4"):
        b = A.summary(cfg, fmt, include_mtp=False)["bytes"]
        routed = sum(t.nbytes for t in A.stored_tensors(cfg, fmt, include_mtp=False) if ".mlp.experts." in t.name)
        dense = sum(b[g] for g in ("kda_attention", "shared_experts", "mla_attention", "dense_ffn"))
        dense += b["scales"] - sum(t.nbytes for t in A.stored_tensors(cfg, fmt, include_mtp=False)
                                   if t.scale and ".mlp.experts." in t.name)
        head = b["embed_head"] / 2 + b["routers_norms"]
        experts = routed * cfg.num_experts_per_tok / cfg.num_experts
        out[fmt] = {"dense": dense / 1e9, "head_routers_norms": head / 1e9, "experts": experts / 1e9,
                    "total": (dense + head + experts) / 1e9}
    return out


def timed(fn, reps: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="config.json to benchmark (default: widened synthetic config)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ling_jax.checkpoint.synthetic_config import synthetic_config
    from ling_jax.checkpoint.writer import write_checkpoint
    from ling_jax.commands.quantize import quantize_checkpoint
    from ling_jax.config import LingConfig
    from ling_jax.forward import forward
    from ling_jax.loader import load_model
    from ling_jax.model import init_cache
    from ling_jax.quantized import is_quantized

    cfg = LingConfig.from_json(a.config) if a.config else synthetic_config(
        hidden_size=512, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4, n_group=4,
        intermediate_size=1024, moe_shared_expert_intermediate_size=256)
    tmp = tempfile.mkdtemp()
    fp8, mx = os.path.join(tmp, "fp8"), os.path.join(tmp, "mx")
    write_checkpoint(cfg, fp8, seed=0, tokenizer=False, progress=False)
    quantize_checkpoint(fp8, mx)
    ids = (np.arange(a.tokens) * 7 % (cfg.vocab_size - 3)).reshape(1, -1).astype(np.int32)
    step = nnx.jit(lambda m, t, c: m(t, cache=c)["logits"])
    print(f"backend {jax.default_backend()}, hidden {cfg.hidden_size}, {cfg.num_experts} experts x "
          f"{cfg.moe_intermediate_size}, {cfg.num_hidden_layers} layers; median of {a.reps}")
    print(f"{'model':14s} {'expert MiB':>10s} {'prefill 1x%d ms' % a.tokens:>16s} {'decode step ms':>15s}")
    for name, ck, keep in (("dequantised", mx, False), ("fp8 kept", fp8, True), ("mxfp4 kept", mx, True)):
        model = load_model(ck, "float32", with_mtp=False, progress=False, keep_quantized=keep)
        ex = [v.get_value() for p, v in nnx.to_flat_state(nnx.state(model)) if "experts" in map(str, p)
              and str(p[-1]).endswith("_proj")]
        mib = sum(sum(x.nbytes for x in jax.tree.leaves(w)) for w in ex) / 2**20
        assert keep == any(is_quantized(w) for w in ex)
        pre = timed(lambda: forward(model, ids)["logits"], a.reps)
        cache = init_cache(cfg, 1, a.tokens + 8, model.dtype, with_mtp=False)
        cache = nnx.jit(lambda m, t, c: m(t, cache=c)["cache"])(model, jnp.asarray(ids), cache)
        one = jnp.asarray(ids[:, :1])
        dec = timed(lambda: step(model, one, cache), max(a.reps, 5))
        print(f"{name:14s} {mib:10.2f} {pre * 1e3:16.1f} {dec * 1e3:15.2f}")
    if os.path.isfile(REAL):
        r = bytes_per_token(REAL)
        for fmt, x in r.items():
            print(f"full scale, {fmt:5s}: {x['total']:.1f} GB read per batch-1 token (dense {x['dense']:.1f}, head + "
                  f"routers + norms {x['head_routers_norms']:.1f}, experts {x['experts']:.1f}); seed: "
                  f"{'25.1' if fmt == 'fp8' else '21.1'}")


if __name__ == "__main__":
    main()
