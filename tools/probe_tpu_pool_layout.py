"""Do the engine's pools get copied inside a TPU step, and does letting the compiler choose their layout
remove the copies? (BENCHMARKS.md "The largest batch x context ...", the k_pe relayout.)

    python tools/probe_tpu_pool_layout.py [--slots 64] [--target v5e:2x2]

Compiles the engine's decode program of the small test config (tests/test_aot.py) for a compile-only
TPU twice: as the engine runs it (the pools in the device's default layout), and with
`Layout.AUTO` for the pools in and out. Prints temp memory, bytes accessed and the largest copy /
transpose ops of each optimised HLO (a pool-sized copy is a relayout of that pool).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import jax
from jax.experimental.layout import Format, Layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def report(label, compiled):
    m = compiled.memory_analysis()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    print(f"{label}: temp {m.temp_size_in_bytes / 2**20:.1f} MiB, args {m.argument_size_in_bytes / 2**20:.1f} MiB, "
          f"bytes accessed {ca.get('bytes accessed', 0) / 1e6:.1f} MB")
    ops = []
    for line in compiled.as_text().splitlines():
        mm = re.match(r"\s*%\S+ = (\w+)\[([\d,]*)\]\S* (copy|transpose)\(", line)
        if mm and mm.group(2):
            n = 1
            for d in mm.group(2).split(","):
                n *= int(d)
            op = re.search(r'op_name="([^"]*)"', line)
            ops.append((n, f"{mm.group(3)} {mm.group(1)}[{mm.group(2)}] {op.group(1)[-60:] if op else ''}"))
    for n, text in sorted(ops, reverse=True)[:6]:
        print(f"    {n:>9,} elements  {text}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--target", default="v5e:2x2")
    a = ap.parse_args()
    from sharding.mesh import make_mesh, parse_mesh_shape
    from test_aot import small_config_dict

    from ling_jax.aot.abstract import placed_abstract_model
    from ling_jax.aot.programs import engine_programs
    from ling_jax.aot.targets import resolve_target
    from ling_jax.config import LingConfig

    target = resolve_target(a.target)
    mesh = make_mesh(parse_mesh_shape("expert=4", 4), target.devices[:4])
    model = placed_abstract_model(LingConfig.from_dict(small_config_dict()), "bf16", mesh, target.platform,
                                  with_mtp=True)
    (prog,) = engine_programs(model, {"decode"}, plan=lambda *a, **k: 0, max_slots=a.slots, page_size=16,
                              rows=(1,), num_pages=256, max_seq_len=256, prefill_chunk=64, prefix_cache=False)
    params, pools, inp = prog.args
    report("as the engine runs it", prog.lower().compile())
    auto = jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), pools)
    shard = lambda t: jax.tree.map(lambda x: x.sharding, t)  # noqa: E731
    strip = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)  # noqa: E731
    f = jax.jit(prog.fn.__wrapped__, donate_argnums=(1,), in_shardings=(shard(params), auto, shard(inp)),
                out_shardings=(auto, None, None))
    report("pools with Layout.AUTO", f.lower(strip(params), strip(pools), strip(inp)).compile())
    return 0


if __name__ == "__main__":
    sys.exit(main())
