"""Peak host memory of `ling_jax.convert.convert` (used by tests/test_convert.py; also a manual tool).

    python tools/measure_convert_memory.py CKPT OUT [--warmup SMALL_CKPT] [--mesh expert=8] [--dtype bfloat16]

Prints one JSON line: RSS before the conversion, peak RSS during it (VmHWM, reset just before via
/proc/self/clear_refs), the tracemalloc peak (Python / NumPy allocations only), the converted
parameter bytes and the largest group's bytes. `--warmup` first converts a small checkpoint in the
same process so one-off costs (Orbax / TensorStore thread pools, XLA client) are in the baseline.
"""
import argparse
import json
import os
import shutil
import sys
import time
import tracemalloc

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--warmup", default=None)
    ap.add_argument("--mesh", default="expert=8")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()

    import jax.numpy as jnp
    import numpy as np

    import sharding as S
    from ling_jax.convert import convert
    from ling_jax.checkpoint.orbax import trim_host_memory

    mesh = S.parse_mesh(a.mesh)
    jnp.zeros(8).block_until_ready()
    if a.warmup:
        convert(a.warmup, a.out + ".warmup", mesh, dtype=a.dtype, progress=False)
        shutil.rmtree(a.out + ".warmup")
    trim_host_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    base = status()
    tracemalloc.start()
    t0 = time.time()
    meta = convert(a.checkpoint, a.out, mesh, dtype=a.dtype, progress=False)
    _, py_peak = tracemalloc.get_traced_memory()
    end = status()
    groups: dict = {}
    for p in meta["params"].values():
        n = int(np.prod(p["shape"])) * np.dtype(jnp.dtype(p["dtype"])).itemsize
        groups[p["group"]] = groups.get(p["group"], 0) + n
    print(json.dumps({"base_rss": base["VmRSS"], "peak_rss": end["VmHWM"], "hwm_reset": reset,
                      "tracemalloc_peak": py_peak, "param_bytes": sum(groups.values()),
                      "largest_group_bytes": max(groups.values()), "groups": len(groups),
                      "checkpoint_bytes": sum(os.path.getsize(os.path.join(a.checkpoint, f))
                                              for f in os.listdir(a.checkpoint) if f.endswith(".safetensors")),
                      "seconds": round(time.time() - t0, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
