"""`ling-jax logits`: full-sequence logits of a token list, written to an npz (CLI contract).

Checked before the model is loaded: the ids (integers inside the vocabulary), the prompt length
against max_position_embeddings (`--allow-long-context` overrides), and `--out` (not inside, equal
to or containing the input checkpoint; its directory must exist). The npz is written under a hidden
`.ling-tmp-*` name beside `--out` and renamed into place when complete (`checkpoint.atomic`).
"""
from __future__ import annotations

import os

import numpy as np

from ling_jax.checkpoint.atomic import clean_stale_temps, temp_path
from ling_jax.commands.common import (add_kernel_flags, add_long_context_flag, add_value_check_flag,
                                      apply_value_check_flag, check_context_length, check_ids, check_output_path,
                                      checkpoint_config, parse_ids)

__all__ = ["parse_ids", "write_npz_atomic", "add_parser", "run"]


def add_parser(sub):
    p = sub.add_parser("logits", help="write full-sequence logits of --input-ids to an npz")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (HF release layout)")
    p.add_argument("--input-ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--out", required=True, help="output .npz (logits [T,vocab] float32, mtp_logits with --mtp)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute dtype (default float32 on CPU, bfloat16 on accelerators)")
    p.add_argument("--mtp", action="store_true", help="also write the MTP layer's logits")
    add_kernel_flags(p)
    p.add_argument("--mesh", default=None, help="device mesh, e.g. expert=4,model=2 (or a converted Orbax dir's mesh)")
    add_long_context_flag(p)
    add_value_check_flag(p)
    from sharding import add_distributed_args
    add_distributed_args(p)
    return p


def check_npz_out(path: str, checkpoint: str) -> str:
    """Validated absolute `--out`: outside the checkpoint, not a directory, in an existing directory."""
    check_output_path(path, [checkpoint])
    out = os.path.abspath(path)
    if os.path.isdir(out):
        raise ValueError(f"--out: {path} is a directory (expected a .npz file path)")
    d = os.path.dirname(out)
    if not os.path.isdir(d):
        raise FileNotFoundError(f"--out: directory {d} does not exist")
    return out


def write_npz_atomic(path: str, **arrays) -> None:
    """np.savez into a hidden temporary beside `path`, then rename (a crash never leaves `path` partial);
    stale temporaries of killed runs in that directory are removed first."""
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise FileNotFoundError(f"--out: directory {d} does not exist")
    clean_stale_temps(d)
    tmp = temp_path(path)
    try:
        with open(tmp, "xb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run(args) -> int:
    from ling_jax.commands.common import load_for_args
    from ling_jax.forward import forward
    from sharding import is_primary

    ids = parse_ids(args.input_ids)
    cfg = checkpoint_config(args.checkpoint)
    check_ids(ids, cfg)
    check_context_length(len(ids), cfg, args.allow_long_context, "--input-ids")
    out_path = check_npz_out(args.out, args.checkpoint)
    apply_value_check_flag(args)
    model, _, ex = load_for_args(args, with_mtp=args.mtp)
    check_ids(ids, model.cfg)
    if args.mtp and model.mtp is None:
        raise ValueError(f"--mtp: checkpoint {args.checkpoint} has no MTP layer (num_nextn_predict_layers=0)")
    out = forward(model, np.asarray([ids], np.int32), mtp=args.mtp, exec=ex)
    if not is_primary():
        return 0
    arrays = {"logits": np.asarray(out["logits"][0], np.float32)}
    if args.mtp:
        arrays["mtp_logits"] = np.asarray(out["mtp_logits"][0], np.float32)
    for k, a in arrays.items():  # never write NaN logits with exit 0
        if not np.isfinite(a).all():
            raise ValueError(f"{args.checkpoint}: the model produced non-finite {k} (NaN/Inf at position "
                             f"{int(np.argwhere(~np.isfinite(a))[0][0])}); nothing written to {args.out}")
    write_npz_atomic(out_path, **arrays)
    return 0
