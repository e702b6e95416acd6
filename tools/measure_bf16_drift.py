#!/usr/bin/env python3
"""How far whole-model bfloat16 drifts from float32 on a random checkpoint, and why.

Writes a checkpoint with the writer (or uses --checkpoint), runs the cache-free forward in float32
and in bfloat16, and reports: the fraction of token×layer routing decisions that differ (the
selected expert sets), the logits' relative error unpinned, and with bf16 routing pinned to the
float32 decisions (the arithmetic alone).

  python tools/measure_bf16_drift.py [--config FILE] [--layers N] [--tokens T]
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--config", default=None, help="config.json for a written checkpoint (default: checkpoint.synthetic_config)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    from ling_jax.checkpoint.synthetic_config import synthetic_config
    from ling_jax.checkpoint.writer import write_checkpoint
    from ling_jax.config import LingConfig
    from ling_jax.forward import forward
    from ling_jax.loader import load_model

    ckpt = a.checkpoint
    if ckpt is None:
        cfg = LingConfig.from_json(a.config) if a.config else synthetic_config()
        ckpt = os.path.join(tempfile.mkdtemp(), "ckpt")
        write_checkpoint(cfg, ckpt, dtype="fp8", seed=a.seed, tokenizer=False, progress=False)
    m32 = load_model(ckpt, "float32", progress=False)
    m16 = load_model(ckpt, "bfloat16", progress=False)
    ids = np.random.default_rng(a.seed).integers(0, m32.cfg.vocab_size, (1, a.tokens))
    o32 = forward(m32, ids, mtp=True)
    o16 = forward(m16, ids, mtp=True)
    pinned = forward(m16, ids, mtp=True, forced_routing=o32["routing"])
    flips, total = 0, 0
    for layer, idx in o32["routing"].items():
        a32 = np.sort(np.asarray(idx), -1)
        a16 = np.sort(np.asarray(o16["routing"][layer]), -1)
        flips += int(np.sum(np.any(a32 != a16, -1)))
        total += a32.shape[0] * a32.shape[1]
    rel = lambda x, y: float(np.linalg.norm(np.asarray(x) - np.asarray(y)) / np.linalg.norm(np.asarray(y)))
    out = {"checkpoint": ckpt, "tokens": a.tokens, "moe_layers": len(o32["routing"]),
           "routing_decisions_flipped": flips / total,
           "logits_rel_err_unpinned": rel(o16["logits"], o32["logits"]),
           "logits_rel_err_pinned": rel(pinned["logits"], o32["logits"]),
           "mtp_logits_rel_err_pinned": rel(pinned["mtp_logits"], o32["mtp_logits"]),
           "argmax_agreement_unpinned": float(np.mean(np.argmax(o16["logits"], -1) == np.argmax(o32["logits"], -1)))}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
