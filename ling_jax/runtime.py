"""Loading a checkpoint directory into a ready model, and the jit-compiled forward passes."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax.ops import as_dtype


def default_dtype() -> str:
    """float32 on CPU (XLA:CPU bf16 matmuls are ~20x slower), bfloat16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_model(checkpoint: str, dtype: str | None = None, with_mtp: bool = True, progress: bool = True,
               keep_fp8: bool = False):
    """Read, validate and load a checkpoint directory (HF release layout). Returns the model.

    keep_fp8: every F8_E4M3-stored matrix stays float8_e4m3fn + float32 block scales on device
    (`FP8Linear` / `FP8Experts`, dequantised inside the matmul) instead of being dequantised to
    `dtype`; loaded through the sharded loader on a one-device mesh (also reads converted dirs).
    """
    from ling_jax.checkpoint.load import load_params
    from ling_jax.checkpoint.reader import CheckpointReader

    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"{checkpoint}: checkpoint directory not found")
    import sharding as S
    converted = S.is_converted(checkpoint) or os.path.isdir(os.path.join(checkpoint, "params"))
    if keep_fp8 or converted:  # converted (Orbax) dirs, complete or not, go through the sharded loader
        one = S.make_mesh({"data": 1, "expert": 1, "model": 1}, jax.devices()[:1])
        model = S.load_any(checkpoint, one, as_dtype(dtype or default_dtype()), with_mtp=with_mtp,
                           keep_fp8=True if keep_fp8 else None, progress=progress)
        return S.attach_mesh(model, None)  # single device: the plain (non expert-parallel) MoE path
    reader = CheckpointReader(checkpoint)
    cfg = reader.config
    with_mtp = with_mtp and cfg.has_mtp
    reader.validate(include_mtp=with_mtp)
    return load_params(reader, cfg, as_dtype(dtype or default_dtype()), with_mtp=with_mtp, progress=progress)


def load_for_args(args, with_mtp: bool):
    """Model for a CLI command: sharded over `--mesh` (or several processes) when asked, else one device.

    Returns (model, mesh or None). Multi-host: `jax.distributed` is initialised from the flags or the
    JAX_* environment variables before anything else touches the devices.
    """
    import sharding as S
    multi = S.init_from_args(args)
    keep = bool(getattr(args, "keep_fp8", False))
    if getattr(args, "mesh", None) or multi:
        mesh = S.parse_mesh(args.mesh)
        return S.load_any(args.checkpoint, mesh, as_dtype(args.dtype or default_dtype()), with_mtp=with_mtp,
                          keep_fp8=keep or None), mesh
    return load_model(args.checkpoint, args.dtype, with_mtp=with_mtp, progress=False, keep_fp8=keep), None


@nnx.jit(static_argnames=("mtp", "exec"))
def _forward(model, ids, n_valid, forced_routing, mtp: bool, exec):
    out = model(ids, n_valid=n_valid, mtp=mtp, exec=exec, forced_routing=forced_routing)
    return {k: out[k] for k in ("logits", "mtp_logits", "hidden", "routing") if k in out}


def full_logits(model, ids, mtp: bool = False, n_valid=None, forced_routing=None, exec=None):
    """Cache-free forward of [B,T] ids (right-padded to n_valid[b]) → dict with logits [B,T,V] f32,
    hidden [B,T,D], routing {layer: [B,T,k]} and mtp_logits when mtp. `forced_routing` pins experts."""
    ids = jnp.asarray(ids, jnp.int32)
    n_valid = jnp.full((ids.shape[0],), ids.shape[1], jnp.int32) if n_valid is None else jnp.asarray(n_valid)
    return _forward(model, ids, n_valid, forced_routing, mtp, exec)
