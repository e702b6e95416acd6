"""Multi-process (multi-host) sharded logits: every process runs this same script.

    # two processes on one machine, 4 CPU devices each (what tests/test_multihost.py does):
    JAX_COORDINATOR_ADDRESS=127.0.0.1:12345 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \
        XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python tools/multihost_demo.py --checkpoint CKPT --mesh expert=4,model=2 --ids 1,2,3 --out logits.npz &
    JAX_COORDINATOR_ADDRESS=127.0.0.1:12345 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 ... (same command)

On real hosts drop XLA_FLAGS and point JAX_COORDINATOR_ADDRESS at process 0's host. Each process
reads only its devices' blocks of the checkpoint (HF or converted); only process 0 writes --out.
`--convert DIR` additionally converts the checkpoint cooperatively (every process writes its blocks).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--mesh", default=None)
    ap.add_argument("--ids", required=True, help="comma-separated token ids; ';' separates batch rows")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--mtp", action="store_true")
    ap.add_argument("--convert", default=None, metavar="DIR", help="also convert to DIR and load from it")
    import sharding
    sharding.add_distributed_args(ap)
    a = ap.parse_args()

    multi = sharding.init_from_args(a)  # before any other JAX call
    import jax
    import numpy as np

    from ling_jax.convert import convert
    from ling_jax.forward import forward
    from ling_jax.loader import load_model

    mesh = sharding.parse_mesh(a.mesh)
    sharding.primary_print(f"processes={jax.process_count()} (multi={multi}) devices={jax.device_count()} "
                           f"local={jax.local_device_count()} mesh={sharding.mesh_spec_string(mesh)}")
    src = a.checkpoint
    if a.convert:
        convert(a.checkpoint, a.convert, mesh, dtype=a.dtype, progress=False, overwrite=True)
        src = a.convert
    model = load_model(src, a.dtype, mesh=mesh, with_mtp=a.mtp, progress=False)
    ids = np.asarray([[int(t) for t in row.split(",")] for row in a.ids.split(";")], np.int32)
    out = forward(model, ids, mtp=a.mtp)  # NumPy on every process (the outputs span both)
    arrays = {k: np.asarray(out[k]) for k in (("logits", "mtp_logits") if a.mtp else ("logits",))}
    if sharding.is_primary():
        tmp = a.out + ".tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, a.out)
    sharding.barrier("multihost_demo_done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
