#!/usr/bin/env python3
"""First-call time of `generate` at the real model's full depth (72 layers + MTP), reduced width, on CPU.

The issue's target: compiling `generate` for the full 72-layer schedule must take under 60 s on CPU.
The real config (`../shared/spec/config.ling-3.1-flash.json`: layer schedule, dense/MoE split,
SwiGLU clamp lists, routing groups) is kept; only widths shrink (hidden 128, 16 experts, vocab 1024),
so the time measured is compilation, not arithmetic. Each row is a fresh process-level first call:
prefill compile + decode-loop compile + `--new` tokens.

  python tools/bench_compile.py [--json tools/results/bench_compile_72_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REAL = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "spec", "config.ling-3.1-flash.json")
NARROW = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64, intermediate_size=256,
              q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, qk_head_dim=48,
              v_head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
              moe_shared_expert_intermediate_size=64, vocab_size=1024, pad_token_id=1000, eos_token_id=1001,
              quantization_config=None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=REAL)
    ap.add_argument("--new", type=int, default=8, help="new tokens per call")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ling_jax.config import LingConfig
    from ling_jax.generate import generate
    from ling_jax.model import LingForCausalLM

    with open(a.config) as f:
        d = json.load(f)
    d.update(NARROW)
    d = {k: v for k, v in d.items() if v is not None}
    cfg = LingConfig.from_dict(d, "narrowed " + os.path.basename(a.config))
    t = time.perf_counter()
    model = LingForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), with_mtp=True)
    init_s = time.perf_counter() - t
    R = {"backend": jax.default_backend(), "config": os.path.abspath(a.config), "layers": cfg.num_hidden_layers,
         "overrides": NARROW, "init_s": init_s, "rows": []}
    print(f"# {cfg.num_hidden_layers} layers + MTP at hidden {cfg.hidden_size}, {cfg.num_experts} experts; "
          f"init {init_s:.1f}s\n\n| call | first call s (compile + {a.new} tokens) | second call s |\n|---|---:|---:|")
    prompt = [[5, 17, 42, 7, 99, 3, 12, 64]]
    for spec in (0, 2):
        times = []
        for _ in range(2):
            t = time.perf_counter()
            generate(model, prompt, a.new, speculative=spec)
            times.append(time.perf_counter() - t)
        name = "generate" + (f", speculative={spec}" if spec else "")
        R["rows"].append({"call": name, "first_call_s": times[0], "second_call_s": times[1]})
        print(f"| {name} | {times[0]:.1f} | {times[1]:.2f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(R, f, indent=1)
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
