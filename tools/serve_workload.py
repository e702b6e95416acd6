"""The serving benchmark's workloads, shared by our side (tools/bench_serve.py) and the HF peer's
(tools/bench_serve_hf.py), as one JSON file both read.

Why a file of its own, in plain Python (no numpy, no jax): the peer runs in a separate virtual
environment with torch, and both sides must run exactly the same requests, so the requests are
drawn once (seeded) and written down, not re-drawn by two libraries' random generators.

A workload is a dict:
    {"name", "seed", "vocab", "requests": [{"prompt": [ids], "max_tokens": n}, ...],
     "prefix": {"prefix_len", "requests": [...]}}    # the shared-prefix workload (ours only)
Token ids are drawn below 32000 (the mid config's special ids start there), as bench_hf.py does.
"""
from __future__ import annotations

import argparse
import json
import math
import random

#: name: (requests, prompt length range, output length range), both ranges inclusive.
#: "full" is sized to take ~5-10 minutes per side on 2 cores; "quick" to check the tools run.
PRESETS = {
    "full": (32, (16, 256), (16, 128)),
    "quick": (12, (8, 48), (4, 16)),
}
#: shared-prefix workload: (requests, common prefix length, suffix length range, output tokens)
PREFIX_PRESETS = {
    "full": (16, 1024, (8, 32), 8),
    "quick": (6, 256, (4, 12), 4),
}
ID_LIMIT = 32000


def make_workload(preset: str = "full", seed: int = 0, vocab: int = 32768) -> dict:
    """Seeded random requests of `preset` (see PRESETS) plus the shared-prefix workload."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    rng = random.Random(seed)
    hi = min(vocab, ID_LIMIT)
    n, (p0, p1), (o0, o1) = PRESETS[preset]
    reqs = [{"prompt": [rng.randrange(hi) for _ in range(rng.randint(p0, p1))], "max_tokens": rng.randint(o0, o1)}
            for _ in range(n)]
    m, plen, (s0, s1), out = PREFIX_PRESETS[preset]
    prefix = [rng.randrange(hi) for _ in range(plen)]
    preqs = [{"prompt": prefix + [rng.randrange(hi) for _ in range(rng.randint(s0, s1))], "max_tokens": out}
             for _ in range(m)]
    return {"name": preset, "seed": seed, "vocab": vocab, "requests": reqs,
            "prefix": {"prefix_len": plen, "requests": preqs}}


def save(workload: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(workload, f)


def load(path: str) -> dict:
    with open(path) as f:
        w = json.load(f)
    for i, r in enumerate(w.get("requests", [])):
        if not r.get("prompt") or not isinstance(r.get("max_tokens"), int) or r["max_tokens"] < 1:
            raise ValueError(f"{path}: requests[{i}] needs a non-empty 'prompt' and an int 'max_tokens' >= 1")
    return w


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics (numpy's
    default), of a non-empty sequence; NaN for an empty one."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def latency_summary(ttft: list, tpot: list) -> dict:
    """p50 / p99 of time to first token and time per output token (seconds)."""
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99)}


def main(argv=None) -> None:
    """`python tools/serve_workload.py [--preset full] [--seed 0] OUT.json`: draw and write a workload."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("out")
    ap.add_argument("--preset", default="full", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=32768, help="the config's vocab_size (ids are drawn below 32000)")
    a = ap.parse_args(argv)
    save(make_workload(a.preset, a.seed, a.vocab), a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
