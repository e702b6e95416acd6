"""`ling-jax logits`: full-sequence logits of a token list, written to an npz (CLI contract)."""
from __future__ import annotations

import os
import tempfile

import numpy as np


def parse_ids(text: str, what: str = "--input-ids") -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers like 1,2,3, got {text!r}") from None
    if not ids:
        raise ValueError(f"{what}: empty prompt (need at least one token id)")
    return ids


def add_parser(sub):
    p = sub.add_parser("logits", help="write full-sequence logits of --input-ids to an npz")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (HF release layout)")
    p.add_argument("--input-ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--out", required=True, help="output .npz (logits [T,vocab] float32, mtp_logits with --mtp)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute dtype (default float32 on CPU, bfloat16 on accelerators)")
    p.add_argument("--mtp", action="store_true", help="also write the MTP layer's logits")
    p.add_argument("--impl", choices=["xla", "pallas"], default=None, help="kernel implementation")
    p.add_argument("--keep-fp8", action="store_true",
                   help="keep FP8-stored matrices as float8 + block scales on device, dequantised inside the "
                        "matmul (the Pallas FP8 kernel with --impl pallas)")
    p.add_argument("--mesh", default=None, help="device mesh, e.g. expert=4,model=2 (or a converted Orbax dir's mesh)")
    from sharding import add_distributed_args
    add_distributed_args(p)
    return p


def write_npz_atomic(path: str, **arrays) -> None:
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise FileNotFoundError(f"--out: directory {d} does not exist")
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run(args) -> int:
    from ling_jax.commands.common import load_for_args
    from ling_jax.forward import forward
    from ling_jax.runtime import check_ids
    from sharding import is_primary

    ids = parse_ids(args.input_ids)
    model, _ = load_for_args(args, with_mtp=args.mtp)
    check_ids(ids, model.cfg)
    if args.mtp and model.mtp is None:
        raise ValueError(f"--mtp: checkpoint {args.checkpoint} has no MTP layer (num_nextn_predict_layers=0)")
    out = forward(model, np.asarray([ids], np.int32), mtp=args.mtp,
                  exec=model.exec.replace(kernels=args.impl or model.exec.kernels))
    if not is_primary():
        return 0
    arrays = {"logits": np.asarray(out["logits"][0], np.float32)}
    if args.mtp:
        arrays["mtp_logits"] = np.asarray(out["mtp_logits"][0], np.float32)
    write_npz_atomic(args.out, **arrays)
    return 0
