"""The largest batch x context each target's decode program fits, by the compiler (issue 20, item 5).

    python tools/aot_fit.py [--only NAME,...] [--out tools/results/aot]

For each row: one `ling-jax aot` compile of the engine's decode program at a base pool (the batch's
slots at 8K tokens, or a JSON already written by `tools/aot_sweep.py`), then the pool grown by what that
compile leaves free of the device's HBM, in whole pages (the MLA latent pool has one KV head, so every
device of a model replica holds all of it: each page costs its full bytes on every device), and a
second compile at that size with each slot's context as long as the pool allows (at most the model's
262,144 positions). The second compile is the answer: it fits (the compiler's total within the HBM)
or, if the longer block table's temporaries push it over (the TPU compiler names its need), the pool
is shrunk by 1.25x the excess and 1% more, and compiled again.
Results: OUT/fit_NAME.json and OUT/FIT.md (the table BENCHMARKS.md quotes).
"""
from __future__ import annotations

import json
import os
import re
import sys

# this folder is on sys.path when run as a script
from aot_sweep import REAL, row_parser, run_aot, run_rows, write_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GIB = 1 << 30
PAGE = 16
CONTEXT = 262144

#: name -> (weights, target, mesh, batch, base JSON in OUT or None: compile the base)
ROWS = {
    "h200x8_mxfp4_b64": ("mxfp4", "h200x8", "expert=8", 64, "h200x8_mxfp4_decode_b64_s20.json"),
    "h200x8_fp8_b64": ("fp8", "h200x8", "expert=8", 64, "h200x8_fp8_decode_b64_s20.json"),
    "h200x4_mxfp4_b8": ("mxfp4", "h200x4", "expert=4", 8, None),
    "tpu7x_mxfp4_b8": ("mxfp4", "tpu7x:2x2x1", "expert=8", 8, None),
    "v5p64_mxfp4_b64": ("mxfp4", "v5p:4x4x4", "expert=16,model=4", 64, "v5p64_mxfp4_decode_sort_free_s21.json"),
    "v5p64_fp8_b64": ("fp8", "v5p:4x4x4", "expert=16,model=4", 64, None),
    "v6e64_mxfp4_b64": ("mxfp4", "v6e:8x8", "expert=16,model=4", 64, None),
    "v6e64_fp8_b64": ("fp8", "v6e:8x8", "expert=16,model=4", 64, "v6e64_fp8_b1_64.json"),
}


def aot(weights, target, mesh, batch, seq, cache_gib) -> dict:
    r = run_aot(["--weights", weights, "--target", target, "--mesh", mesh, "--programs", "decode",
                 "--decode-rows", str(batch), "--max-slots", str(batch), "--max-seq-len", str(seq),
                 "--cache-memory", f"{cache_gib:.6f}"])
    r["cache_memory_gib"] = cache_gib
    return r


def decode_program(r: dict, batch: int) -> dict | None:
    for p in r.get("programs", []):
        if p["name"].startswith(f"decode[R={batch},"):
            return p
    return None


def fit_row(name: str, out: str) -> dict:
    from ling_jax.config import LingConfig
    from ling_jax.serve.pools import plan_pools
    import jax.numpy as jnp

    weights, target, mesh, batch, base_json = ROWS[name]
    cfg = LingConfig.from_json(REAL)
    unit = plan_pools(cfg, jnp.bfloat16, max_slots=batch, page_size=PAGE, num_pages=1)
    page_b, slot_b = unit.page_bytes, unit.slot_bytes
    base = json.load(open(os.path.join(out, base_json))) if base_json and os.path.exists(os.path.join(out, base_json)) \
        else {}
    if decode_program(base, batch) is None:  # no such base yet (or one without this batch): compile it
        pages = batch * 8192 // PAGE
        base = aot(weights, target, mesh, batch, 8192, (pages * page_b + batch * slot_b) / GIB + 1e-3)
    prog = decode_program(base, batch)
    if prog is None or "total_bytes" not in prog:
        return {"row": name, "error": f"base did not compile: {base.get('error') or prog}"}
    free = base["hbm_bytes"] - prog["total_bytes"]
    pages = base["engine"]["num_pages"] + max(0, free) // page_b
    tries, base_pages = [], base["engine"]["num_pages"]
    for _ in range(6):
        if pages <= base_pages:  # the search fell back to the base, which compiled and fits: that is the answer
            tries.append({"pages": base_pages, "tokens": base_pages * PAGE, "fits": True, "program": prog["name"],
                          "max_seq_len": base["engine"]["max_seq_len"],
                          "total_gib": round(prog["total_bytes"] / GIB, 3),
                          "temp_gib": round(prog["temp_bytes"] / GIB, 3), "error": None, "compile_seconds": None})
            break
        tokens = pages * PAGE
        seq = min(CONTEXT, tokens // batch // PAGE * PAGE)
        r = aot(weights, target, mesh, batch, seq, (pages * page_b + batch * slot_b) / GIB + 1e-4)
        p = decode_program(r, batch)
        ok = p is not None and p.get("fits", False) and r["rc"] == 0
        tries.append({"pages": pages, "tokens": tokens, "max_seq_len": seq, "fits": ok,
                      "total_gib": None if p is None or "total_bytes" not in p else round(p["total_bytes"] / GIB, 3),
                      "temp_gib": None if p is None or "temp_bytes" not in p else round(p["temp_bytes"] / GIB, 3),
                      "program": None if p is None else p["name"],
                      "error": None if ok else (r.get("error") or (p or {}).get("error", ""))[:300],
                      "compile_seconds": None if p is None else p.get("compile_seconds")})
        print(f"{name}: {tries[-1]}", flush=True)
        if ok:
            break
        m = re.search(r"required for HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)",
                      tries[-1]["error"] or "")
        over = (float(m.group(1)) - float(m.group(2))) * GIB if m else 0.0
        # the pool is most of what grows; the block table's width adds temporaries: shrink by 1.25x the
        # excess (in whole pages) and 1% more
        pages = int(pages * 0.99) - int(1.25 * over // page_b)
    res = {"row": name, "weights": weights, "target": target, "mesh": mesh, "batch": batch,
           "hbm_gib": round(base["hbm_bytes"] / GIB, 2), "page_bytes": page_b, "slot_bytes": slot_b,
           "base": {"num_pages": base["engine"]["num_pages"], "total_gib": round(prog["total_bytes"] / GIB, 3),
                    "temp_gib": round(prog["temp_bytes"] / GIB, 3),
                    "argument_gib": round(prog["argument_bytes"] / GIB, 3)},
           "tries": tries}
    with open(os.path.join(out, f"fit_{name}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def table(out: str) -> str:
    lines = ["| row | target (mesh) | weights | HBM GiB | batch | base total GiB (temp) | pool tokens that fit | "
             "context per slot | at 262,144 tokens: sequences | compiled total GiB (temp) |",
             "|" + "---|" * 10]
    for name in ROWS:
        path = os.path.join(out, f"fit_{name}.json")
        if not os.path.exists(path):
            continue
        r = json.load(open(path))
        if "tries" not in r:
            lines.append(f"| {name} | | | | | {r.get('error')} | | | | |")
            continue
        ok = [t for t in r["tries"] if t["fits"]]
        t = ok[0] if ok else r["tries"][-1]
        lines.append(f"| {name} | {r['target']} ({r['mesh']}) | {r['weights']} | {r['hbm_gib']} | {r['batch']} | "
                     f"{r['base']['total_gib']} ({r['base']['temp_gib']}) | {t['tokens']:,} | {t['max_seq_len']:,} | "
                     f"{t['tokens'] // CONTEXT} | " + (f"{t['total_gib']} ({t['temp_gib']})" if ok else
                                                       f"**no**: {t['error']}") + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    a = row_parser(__doc__).parse_args()
    run_rows(a.only.split(",") if a.only else list(ROWS), lambda n: os.path.join(a.out, f"fit_{n}.json"),
             lambda n: fit_row(n, a.out), a.force)
    write_table(table(a.out), os.path.join(a.out, "FIT.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
