"""The full-scale compile-only report: `ling-jax aot` on the real 560B config for TPU pods and H200 nodes.

    python tools/aot_sweep.py [--only NAME,...] [--out tools/results/aot] [--temps]

Each row below is one `ling-jax aot` run (a subprocess: the compilers keep their own state), its JSON
written to OUT/NAME.json; then OUT/SUMMARY.md gathers every program's per-device memory (compiler vs
`plan`), roofline and collectives, the table BENCHMARKS.md quotes. `--temps` (GPU rows) also dumps
XLA's buffer assignment and lists the largest temporaries of each program (OUT/NAME.temps.txt): what the
temp memory is made of. Rows already written are skipped unless `--force`.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL = os.path.join(ROOT, "..", "shared", "spec", "config.ling-3.1-flash.json")
GIB = 1 << 30

ENGINE_8K = ["--max-slots", "8", "--max-seq-len", "8192", "--cache-memory", "8"]
ENGINE_262K = ["--max-slots", "8", "--max-seq-len", "262144", "--cache-memory", "24"]
ENGINE_64 = ["--max-slots", "64", "--max-seq-len", "8192", "--cache-memory", "24"]  # the planner counts whole slots
#: name -> aot arguments (config and --json added)
ROWS = {
    # the example, and the FP8 release on the same 4 chips
    "tpu7x_mxfp4_decode": ["--weights", "mxfp4", "--target", "tpu7x:2x2x1", "--mesh", "expert=8", "--programs",
                           "decode", *ENGINE_8K],
    "tpu7x_fp8_decode": ["--weights", "fp8", "--target", "tpu7x:2x2x1", "--mesh", "expert=8", "--programs", "decode",
                         *ENGINE_8K],
    # pods of 64 chips: experts over 16, heads and widths over 4
    "v5p64_mxfp4_decode": ["--weights", "mxfp4", "--target", "v5p:4x4x4", "--mesh", "expert=16,model=4",
                           "--programs", "decode", "--decode-rows", "1,8,64", *ENGINE_64],
    "v5p64_fp8_decode": ["--weights", "fp8", "--target", "v5p:4x4x4", "--mesh", "expert=16,model=4", "--programs",
                         "decode", "--decode-rows", "8", *ENGINE_64],
    "v6e64_mxfp4_decode": ["--weights", "mxfp4", "--target", "v6e:8x8", "--mesh", "expert=16,model=4",
                           "--programs", "decode", "--decode-rows", "8", *ENGINE_64],
    "v6e64_fp8_decode": ["--weights", "fp8", "--target", "v6e:8x8", "--mesh", "expert=16,model=4", "--programs",
                         "decode", "--decode-rows", "8", *ENGINE_64],
    # the same with a pool that holds exactly 64 x 8K (24 GiB buys 36% more pages: it did not fit)
    "v6e64_fp8_decode_22": ["--weights", "fp8", "--target", "v6e:8x8", "--mesh", "expert=16,model=4", "--programs",
                            "decode", "--decode-rows", "8", "--max-slots", "64", "--max-seq-len", "8192",
                            "--cache-memory", "22"],
    # NVIDIA: the seed's verdicts (MXFP4 on 4 x H200; the FP8 release on 8 x H200 with MTP)
    "h200x8_mxfp4_decode": ["--weights", "mxfp4", "--target", "h200x8", "--mesh", "expert=8", "--programs",
                            "decode", "--decode-rows", "1,8", *ENGINE_8K],
    "h200x4_mxfp4_decode": ["--weights", "mxfp4", "--target", "h200x4", "--mesh", "expert=4", "--programs",
                            "decode", *ENGINE_8K],
    "h200x8_fp8_decode": ["--weights", "fp8", "--target", "h200x8", "--mesh", "expert=8", "--programs", "decode",
                          *ENGINE_8K],
    "h200x8_fp8_verify": ["--weights", "fp8", "--target", "h200x8", "--mesh", "expert=8", "--programs", "verify",
                          "--speculative", "1", *ENGINE_8K],
    # batch 64 (64 slots x 8K) on 8 x H200, both formats
    "h200x8_mxfp4_b64": ["--weights", "mxfp4", "--target", "h200x8", "--mesh", "expert=8", "--programs", "decode",
                         "--decode-rows", "64", *ENGINE_64],
    "h200x8_fp8_b64": ["--weights", "fp8", "--target", "h200x8", "--mesh", "expert=8", "--programs", "decode",
                       "--decode-rows", "64", *ENGINE_64],
    # roofline decode at batch 1, 8 and 64 on the targets that had only batch 8 (twenty-first session)
    "tpu7x_mxfp4_b1_8_64": ["--weights", "mxfp4", "--target", "tpu7x:2x2x1", "--mesh", "expert=8", "--programs",
                            "decode", "--decode-rows", "1,8,64", *ENGINE_64],
    "tpu7x_mxfp4_b1": ["--weights", "mxfp4", "--target", "tpu7x:2x2x1", "--mesh", "expert=8", "--programs", "decode",
                       "--decode-rows", "1", *ENGINE_8K],
    "v5p64_fp8_b1_64": ["--weights", "fp8", "--target", "v5p:4x4x4", "--mesh", "expert=16,model=4", "--programs",
                        "decode", "--decode-rows", "1,64", *ENGINE_64],
    "v6e64_fp8_b1_64": ["--weights", "fp8", "--target", "v6e:8x8", "--mesh", "expert=16,model=4", "--programs",
                        "decode", "--decode-rows", "1,64", "--max-slots", "64", "--max-seq-len", "8192",
                        "--cache-memory", "22"],
    "v6e64_mxfp4_b1_64": ["--weights", "mxfp4", "--target", "v6e:8x8", "--mesh", "expert=16,model=4", "--programs",
                          "decode", "--decode-rows", "1,64", *ENGINE_64],
    "h200x8_fp8_b1": ["--weights", "fp8", "--target", "h200x8", "--mesh", "expert=8", "--programs", "decode",
                      "--decode-rows", "1", *ENGINE_8K],
    # MTP speculation, 2 drafts, 8 rows: 24 query tokens per step (the row that once did not compile on
    # XLA:GPU, BENCHMARKS.md "The speculative verify on H200")
    "h200x8_mxfp4_verify": ["--weights", "mxfp4", "--target", "h200x8", "--mesh", "expert=8", "--programs",
                            "verify,generate-decode", "--decode-rows", "8", "--speculative", "2", *ENGINE_8K],
    "h200x8_mxfp4_prefill": ["--weights", "mxfp4", "--target", "h200x8", "--mesh", "expert=8", "--programs",
                             "prefill", *ENGINE_8K],
    # long context (issue 22): the release's whole 262,144-token window per slot
    "h200x8_mxfp4_262k": ["--weights", "mxfp4", "--target", "h200x8", "--mesh", "expert=8", "--programs",
                          "decode,prefill", "--decode-rows", "1,8", *ENGINE_262K],
    "tpu7x_mxfp4_262k": ["--weights", "mxfp4", "--target", "tpu7x:2x2x1", "--mesh", "expert=8", "--programs",
                         "decode,prefill", "--decode-rows", "4", "--max-slots", "4", "--max-seq-len", "262144",
                         "--cache-memory", "12"],
    # the same window on 8 TPU7x chips (16 devices): the 4-chip prefill chunk did not fit (BENCHMARKS.md)
    "tpu7x16_mxfp4_262k": ["--weights", "mxfp4", "--target", "tpu7x:2x2x2", "--mesh", "expert=16", "--programs",
                           "decode,prefill", "--decode-rows", "8", "--max-slots", "8", "--max-seq-len", "262144",
                           "--cache-memory", "24"],
}


def run_aot(argv: list, env: dict | None = None) -> dict:
    """`ling-jax aot --config REAL ARGV --json` in a subprocess (the compilers keep their own state):
    its report, or {"error": its last stderr line}; with rc and wall_seconds."""
    cmd = [sys.executable, "-m", "ling_jax.cli", "aot", "--config", REAL, *argv, "--json"]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env or dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       cwd=ROOT)
    try:
        r = json.loads(p.stdout)
    except json.JSONDecodeError:
        r = {"error": (p.stderr.strip().splitlines() or ["no output"])[-1]}
    r.update(rc=p.returncode, wall_seconds=round(time.perf_counter() - t, 1))
    return r


def run_row(name: str, argv: list, out: str, temps: bool) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    dump = None
    if temps and any(a.startswith("h100") or a.startswith("h200") for a in argv):
        dump = tempfile.mkdtemp(prefix="aot-dump-")
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text "
                            "--xla_dump_hlo_module_re=.*lambda.*").strip()
    r = run_aot(argv, env)
    print(f"{name}: rc {r['rc']} in {r['wall_seconds']:.0f} s", flush=True)
    r.update(row=name, argv=argv)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(r, f, indent=1)
    if dump:
        with open(os.path.join(out, f"{name}.temps.txt"), "w") as f:
            for rep in sorted(glob.glob(os.path.join(dump, "*memory-usage-report.txt"))):
                f.write(f"# {os.path.basename(rep)}\n")
                with open(rep) as g:
                    f.write("".join(g.readlines()[:40]))
        shutil.rmtree(dump, ignore_errors=True)
    return r


def summary(out: str) -> str:
    lines = ["| row | program | weights | target (mesh) | args GiB | plan GiB | temp GiB | total GiB | HBM GiB | "
             "fits | roofline ms | tok/s | collectives | compile s |", "|" + "---|" * 14]
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        r = json.load(open(path))
        if "row" not in r:  # not a row of this sweep (a one-off run's raw JSON, aot_fit.py's)
            continue
        if "programs" not in r:
            lines.append(f"| {r.get('row')} | - | - | - | - | - | - | - | - | error: {r.get('error')} | | | | |")
            continue
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1)
        for p in r["programs"]:
            if "argument_bytes" not in p:
                m = re.search(r"HLO temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", p.get("error", ""))
                what = f"temp {m.group(1)} > HBM {m.group(2)}" if m else p.get("error", "")[:80]
                lines.append(f"| {r['row']} | {p['name']} | {r['weights']} | {r['target']} ({mesh}) | | "
                             f"{p['plan_bytes'] / GIB:.2f} | | | {r['hbm_bytes'] / GIB:.2f} | **no**: {what} | | | | "
                             f"{p['compile_seconds']:.0f} |")
                continue
            coll = "; ".join(f"{k} {v.get('per_step_count', v['count'])}/call "
                             f"{v.get('per_step_bytes', v['bytes']) / 2**20:.1f} MiB" for k, v in p["collectives"].items())
            lines.append(
                f"| {r['row']} | {p['name']} | {r['weights']} | {r['target']} ({mesh}) | {p['argument_bytes'] / GIB:.2f} | "
                f"{p['plan_bytes'] / GIB:.2f} | {p['temp_bytes'] / GIB:.2f} | {p['total_bytes'] / GIB:.2f} | "
                f"{r['hbm_bytes'] / GIB:.2f} | {'yes' if p['fits'] else '**no**'} | {p['roofline_seconds'] * 1e3:.2f} | "
                f"{p['roofline_tokens_per_second']:.0f} | {coll or 'none'} | {p['compile_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def row_parser(doc: str) -> argparse.ArgumentParser:
    """--only / --out / --force, the options of this tool and of aot_fit.py."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="comma list of row names (default: all)")
    ap.add_argument("--out", default=os.path.join(ROOT, "tools", "results", "aot"))
    ap.add_argument("--force", action="store_true", help="run rows whose results exist")
    return ap


def main() -> int:
    ap = row_parser(__doc__)
    ap.add_argument("--temps", action="store_true", help="GPU rows: list the largest temporaries (XLA dump)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    names = a.only.split(",") if a.only else list(ROWS)
    run_rows(names, lambda n: os.path.join(a.out, f"{n}.json"), lambda n: run_row(n, ROWS[n], a.out, a.temps),
             a.force)
    write_table(summary(a.out), os.path.join(a.out, "SUMMARY.md"))
    return 0


def run_rows(names, result_path, run, force: bool) -> None:
    """run(name) for each row whose result file is missing (every row with force)."""
    for n in names:
        if not force and os.path.exists(result_path(n)):
            print(f"{n}: kept", flush=True)
            continue
        run(n)


def write_table(text: str, path: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
