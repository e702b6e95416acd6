#!/usr/bin/env python3
"""MXFP4 routed experts vs the FP8 release format on the shipped demo model: how much accuracy they cost.

Re-quantises the demo model's routed experts (`ling-jax quantize --experts mxfp4`, into a temporary
directory), then reports on the held-out text of tests/test_demo_model.py (stdlib textwrap.py):

* per-tensor relative (Frobenius) error of every re-quantised expert matrix vs its FP8 values;
* perplexity of the FP8 model and the MXFP4 model, each in float32 and in bfloat16, and of the
  MXFP4 model kept packed (`--keep-quantized`, float32: must equal the dequantised load);
* vs FP8 float32 over every scored position: the log-probabilities' relative error and the mean KL
  divergence KL(fp8 f32 || run) in nats per token, split into what the experts cost (MXFP4
  float32), what a bfloat16 run costs (FP8 bfloat16) and both (MXFP4 bfloat16);
* the FP8 latent cache (`--kv-cache-dtype fp8`): each window prefilled into a cache, float32 vs FP8
  storage, and the whole low-memory stack (MXFP4 experts, bfloat16, FP8 cache).

  python tools/measure_mxfp4.py [--checkpoint DIR] [--window 256] [--json]

Numbers in the README ("MXFP4 accuracy") come from this tool (float32 runs are deterministic on
XLA:CPU; the machine was shared, which affects only the time).
"""
import argparse
import json
import math
import os
import sys
import tempfile
import textwrap

import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def scored_logits(model, ids, window: int, batch: int = 4, kv_cache=None):
    """(float32 log-probabilities of the scored positions [n, vocab], targets [n]) over the windows
    of `ling_jax.commands.eval.window_batches` (the perplexity's own windows). kv_cache "auto" /
    "fp8": each window is a prefill into a fresh cache of that dtype (the MLA layers attend to the
    cached latent); None: the cache-free forward."""
    import jax
    import jax.numpy as jnp

    from ling_jax.commands.eval import window_batches
    from ling_jax.forward import forward
    from ling_jax.model import init_cache

    step = nnx.jit(lambda m, r, c, n: m(r, cache=c, n_valid=n)["logits"])
    out, tgts = [], []
    for rows, n_valid in window_batches(ids, window, batch):
        n = jnp.asarray(np.maximum(n_valid, 1))
        if kv_cache is None:
            logits = forward(model, rows, n_valid=n)["logits"]
        else:
            cache = init_cache(model.cfg, rows.shape[0], rows.shape[1], model.dtype, with_mtp=False,
                               kv_cache_dtype=kv_cache)
            logits = step(model, jnp.asarray(rows), cache, n)
        logp = np.asarray(jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1))
        m = np.arange(window)[None, :] + 1 < n_valid[:, None]
        out.append(logp[m])
        tgts.append(rows[:, 1:][m])
    return np.concatenate(out), np.concatenate(tgts)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def measure(src: str, window: int = 256) -> dict:
    from ling_jax.checkpoint import layout as L
    from ling_jax.checkpoint import mxfp4 as MX
    from ling_jax.checkpoint.reader import CheckpointReader
    from ling_jax.commands.quantize import quantize_checkpoint
    from ling_jax.loader import load_model
    from ling_jax.tokenizer import Tokenizer

    tmp = tempfile.mkdtemp()
    mx = os.path.join(tmp, "mxfp4")
    quantize_checkpoint(src, mx)
    with CheckpointReader(src) as a, CheckpointReader(mx) as b:
        errs = [rel(MX.dequantize_mxfp4(b.get_raw(n), b.get_raw(L.scale_name(n)), n), a.get(n))
                for n in a.names() if L.is_routed_expert_weight(n)]
    with open(textwrap.__file__, encoding="utf-8") as f:
        ids = Tokenizer.from_dir(src).encode(f.read())
    runs = {"fp8 float32": (src, "float32", False, None), "mxfp4 float32": (mx, "float32", False, None),
            "fp8 bfloat16": (src, "bfloat16", False, None), "mxfp4 bfloat16": (mx, "bfloat16", False, None),
            "mxfp4 float32 kept packed": (mx, "float32", True, None),
            "fp8 float32, float32 cache": (src, "float32", False, "auto"),
            "fp8 float32, fp8 cache": (src, "float32", False, "fp8"),
            "mxfp4 bfloat16, fp8 cache": (mx, "bfloat16", False, "fp8")}
    logp, res = {}, {}
    for name, (ck, dt, keep, kv) in runs.items():
        model = load_model(ck, dt, with_mtp=False, progress=False, keep_quantized=keep)
        lp, tgt = scored_logits(model, ids, window, kv_cache=kv)
        logp[name] = lp
        nll = -lp[np.arange(len(tgt)), tgt].mean()
        res[name] = {"perplexity": math.exp(float(nll)), "tokens": int(len(tgt))}
    ref = logp["fp8 float32"]
    p_ref = np.exp(ref.astype(np.float64))
    for name in runs:
        res[name]["logprob_rel_err_vs_fp8_float32"] = rel(logp[name], ref)
        res[name]["kl_vs_fp8_float32"] = float((p_ref * (ref - logp[name])).sum(-1).mean())  # nats/token
    return {
        "checkpoint": src, "held_out_file": os.path.basename(textwrap.__file__), "window": window,
        "expert_tensors": len(errs),
        "expert_rel_err": {"min": min(errs), "median": float(np.median(errs)), "max": max(errs)},
        "runs": res,
    }


def main():
    from ling_jax.commands.demo import SHIPPED

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=SHIPPED, help="an FP8 (or BF16) checkpoint (default: the demo model)")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = measure(a.checkpoint, a.window)
    if a.json:
        print(json.dumps(r, indent=1))
        return
    e = r["expert_rel_err"]
    print(f"{r['expert_tensors']} routed expert matrices, MXFP4 vs FP8 relative error: min {e['min']:.4f}, "
          f"median {e['median']:.4f}, max {e['max']:.4f}")
    print(f"held-out {r['held_out_file']}, {next(iter(r['runs'].values()))['tokens']} scored tokens, window {r['window']}")
    print(f"{'run':30s} {'perplexity':>10s} {'log-prob rel. err':>18s} {'KL nats/token':>14s}  (vs fp8 float32)")
    for name, x in r["runs"].items():
        print(f"{name:30s} {x['perplexity']:10.3f} {x['logprob_rel_err_vs_fp8_float32']:18.5f} "
              f"{x['kl_vs_fp8_float32']:14.6f}")


if __name__ == "__main__":
    main()
