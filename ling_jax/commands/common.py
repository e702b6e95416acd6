"""CLI glue shared by the commands: loading the model a command's flags ask for."""
from __future__ import annotations

import sharding as S
from ling_jax.loader import load_model


def load_for_args(args, with_mtp: bool):
    """Model for a CLI command: on `--mesh` (or over every process of a multi-host run) when asked,
    else on one device; `--checkpoint` may be an HF or a converted directory.

    Returns (model, mesh or None). Multi-host: `jax.distributed` is initialised from the flags or the
    JAX_* environment variables before anything else touches the devices.
    """
    multi = S.init_from_args(args)
    keep = True if getattr(args, "keep_fp8", False) else None
    mesh = S.parse_mesh(args.mesh) if (getattr(args, "mesh", None) or multi) else None
    model = load_model(args.checkpoint, args.dtype, mesh=mesh, with_mtp=with_mtp, keep_quantized=keep,
                       progress=False)
    return model, mesh
