"""Each Pallas kernel compiled for TPU (Mosaic) and NVIDIA (Triton) targets at Ling-3.1-flash widths, at the
engine's decode and prefill shapes: what the compiler says beside the kernel's roofline.

    JAX_PLATFORMS=cpu python tools/aot_kernels.py [--targets v5e:2x2,v5p:2x2x1,v6e:2x2,tpu7x:2x2x1,h100x1,h200x1]
                                                  [--out tools/results/aot/KERNELS.md]

Per kernel x shape x target, on one device with all 64 heads: compile time, bytes accessed and flops (the
compiler's cost analysis on TPU; XLA's HLO cost analysis on GPU), the roofline max(bytes / HBM bandwidth,
flops / peak), the TPU compiler's own time estimate where it gives one (Mosaic calls: none), the HBM
temporaries, and on GPU each Triton kernel's shared memory, grid and warps from XLA's thunk sequence.
TPU scoped VMEM is not reported by libtpu's compile-only client (left: compute it from the block specs).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
H, DK, R, DR = 64, 128, 512, 64


def cases(plat: str):
    import jax.numpy as jnp
    from jax import ShapeDtypeStruct as S

    from pallas_kernels.fp8.kernel import fp8_linear_pallas
    from pallas_kernels.kda.chunk_kernel import kda_chunk_scan_pallas
    from pallas_kernels.kda.step_kernel import kda_recurrent_step_pallas
    from pallas_kernels.mla.kernel import latent_attention_pallas
    F32, BF16, I32, F8 = jnp.float32, jnp.bfloat16, jnp.int32, jnp.float8_e4m3fn
    chunk = 64 if plat == "tpu" else 32
    return {
        ("kda_step", "decode R=8"): (lambda *a: kda_recurrent_step_pallas(*a, interpret=False, platform=plat),
                                     [S((8, H, DK, DK), F32)] + [S((8, H, DK), F32)] * 4 + [S((8, H), F32)]),
        ("kda_chunk", "prefill 2x64"): (lambda *a: kda_chunk_scan_pallas(*a, chunk, interpret=False, platform=plat),
                                        [S((2, 64, H, DK), F32)] * 4 + [S((2, 64, H), F32), S((2, H, DK, DK), F32)]),
        ("kda_chunk", "prefill 1x4096"): (lambda *a: kda_chunk_scan_pallas(*a, chunk, interpret=False, platform=plat),
                                          [S((1, 4096, H, DK), F32)] * 4 + [S((1, 4096, H), F32),
                                                                            S((1, H, DK, DK), F32)]),
        ("mla_latent", "decode R=8, 8K cache"): (
            lambda *a: latent_attention_pallas(*a, 192 ** -0.5, interpret=False, platform=plat),
            [S((8, 1, H, R), BF16), S((8, 1, H, DR), BF16), S((8, 8192, R), BF16), S((8, 8192, DR), BF16),
             S((8,), I32), S((8, 1), I32)]),
        ("mla_latent", "prefill 2x64, 8K cache"): (
            lambda *a: latent_attention_pallas(*a, 192 ** -0.5, interpret=False, platform=plat),
            [S((2, 64, H, R), BF16), S((2, 64, H, DR), BF16), S((2, 8192, R), BF16), S((2, 8192, DR), BF16),
             S((2,), I32), S((2, 64), I32)]),
        ("fp8_linear", "decode 8x4096->12288"): (lambda *a: fp8_linear_pallas(*a, interpret=False, platform=plat),
                                                 [S((8, 4096), BF16), S((12288, 4096), F8), S((96, 32), F32)]),
        ("fp8_linear", "prefill 128x4096->12288"): (lambda *a: fp8_linear_pallas(*a, interpret=False, platform=plat),
                                                    [S((128, 4096), BF16), S((12288, 4096), F8), S((96, 32), F32)]),
    }


def run_target(name: str) -> list[str]:
    import jax

    from ling_jax.aot.analysis import cost, kernel_calls
    from ling_jax.aot.targets import resolve_target
    t = resolve_target(name)
    sh = jax.sharding.SingleDeviceSharding(t.devices[0])
    rows = []
    for (kern, shape), (fn, args) in cases(t.platform).items():
        placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a in args]
        t0 = time.perf_counter()
        try:
            c = jax.jit(fn).lower(*placed).compile()
        except Exception as e:  # the compiler's refusal, in its words
            rows.append(f"| {kern} | {shape} | {name} | REJECTED: {str(e).splitlines()[0][:120]} |||||||")
            continue
        secs = time.perf_counter() - t0
        ca = cost(c, t.platform)
        m = c.memory_analysis()
        roof = max(ca["bytes_accessed"] / t.spec.hbm_bandwidth, ca["flops"] / t.spec.peak_flops)
        est = f"{ca['compiler_seconds'] * 1e6:.1f}" if ca["compiler_seconds"] else "-"
        rows.append(f"| {kern} | {shape} | {name} | {secs:.1f} | {kernel_calls(c.as_text())} | "
                    f"{ca['bytes_accessed'] / 2**20:.1f} | {ca['flops'] / 1e9:.2f} | {roof * 1e6:.1f} | {est} | "
                    f"{m.temp_size_in_bytes / 2**20:.1f} | SHMEM |")
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="v5e:2x2,v5p:2x2x1,v6e:2x2,tpu7x:2x2x1,h100x1,h200x1")
    ap.add_argument("--out", default=os.path.join(ROOT, "tools", "results", "aot", "KERNELS.md"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: one target
    a = ap.parse_args()
    if a.one:
        for r in run_target(a.one):
            print("ROW " + r, flush=True)
        return 0
    lines = ["| kernel | shape | target | compile s | kernels | MiB accessed | GFLOP | roofline us | compiler us | "
             "temp MiB | GPU shared memory, grid, threads |", "|" + "---|" * 11]
    for name in a.targets.split(","):
        env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        dump = None
        if name.startswith("h"):
            dump = tempfile.mkdtemp(prefix="aot-kernels-")
            env["XLA_FLAGS"] = f"--xla_dump_to={dump}"
        p = subprocess.run([sys.executable, __file__, "--one", name], env=env, capture_output=True, text=True)
        rows = [ln[4:] for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
        shm = []
        if dump:  # Triton kernels of each compiled module, in compile order
            for seq in sorted(glob.glob(os.path.join(dump, "*thunk_sequence.txt"))):
                txt = open(seq).read()
                k = re.findall(r"\] (\w+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: (\d+) bytes", txt)
                k = [x for x in k if "fusion" not in x[0]]
                shm.append("; ".join(f"{n} {int(b) // 1024} KiB grid [{g}] threads [{th}]" for n, g, th, b in k[:2]))
        for i, r in enumerate(rows):
            lines.append(r.replace("SHMEM", shm[i] if i < len(shm) else "-"))
        if not rows:
            lines.append(f"| - | - | {name} | failed: {(p.stderr.strip().splitlines() or ['?'])[-1][:150]} |||||||")
    text = "\n".join(lines) + "\n"
    with open(a.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
