"""Model parameters → a checkpoint directory in the release layout (spec §12, Layout B).

`export_checkpoint(model, out_dir)` writes what `write_checkpoint` writes for a random model, but
with the model's values: config.json (with `quantization_config` for fp8), generation_config.json,
model.safetensors.index.json and shards. Matrices that `layout.expected_tensors` marks quantizable
are stored FP8 E4M3 + float32 `weight_scale_inv` per 128×128 block (dtype='fp8') or BF16
(dtype='bf16'); A_log, dt_bias and expert_bias are F32; every other tensor BF16. Tokenizer files are
copied from `tokenizer_dir` when given. The directory is written under a temporary name next to
`out_dir` and renamed into place, so a failure never leaves a partial checkpoint.

The inverse of `checkpoint.layout.checkpoint_names`: stacked experts `[E, out, in]` become per-expert
`[out, in]` matrices, conv taps `[P, K]` become `[P, 1, K]`, the MTP layer's `mtp.*` / `mtp.block.*`
becomes `model.layers.{N}.*`.
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint.fp8 import DEFAULT_BLOCK, FP8_DTYPE as FP8_NP
from ling_jax.checkpoint.layout import checkpoint_names, is_expert_path
from ling_jax.checkpoint.atomic import prepare_out_dir, staged_dir
from ling_jax.checkpoint.safetensors_io import nbytes
from ling_jax.checkpoint.writer import (checkpoint_config_dict, plan_shards, stored_values, write_generation_config,
                                       write_shards, write_tensor)
from ling_jax.config import LingConfig, write_json
from ling_jax.expert_panels import as_rows
from ling_jax.layer_stack import per_layer_arrays
from ling_jax.loader import load_model
from ling_jax.quantized import is_quantized
from ling_jax.train.state import load_trained_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json")


def _checkpoint_tensors(path, a: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    """{checkpoint name: array} of one parameter value (the module docstring's inverse mapping)."""
    if is_expert_path(path):
        if a.shape[0] != len(names):
            raise ValueError(f"{'.'.join(map(str, path))}: {a.shape[0]} stacked experts, config has {len(names)}")
        return {n: np.ascontiguousarray(a[e]) for e, n in enumerate(names)}
    if str(path[-1]) in L.CONV_TAPS:
        return {names[0]: a.reshape(a.shape[0], 1, a.shape[1])}
    return {names[0]: a}


def model_tensors(model) -> dict[str, np.ndarray]:
    """{checkpoint name: float32 array in checkpoint layout} for every parameter of an NNX model."""
    cfg: LingConfig = model.cfg
    out: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = as_rows(var.get_value())  # experts stored in the CPU kernel's panel order: back to [out, in]
        if is_quantized(value) or np.dtype(value.dtype) == FP8_NP:
            raise ValueError("export needs a float model: this one keeps FP8 weights + block scales or MXFP4 "
                             "experts (loaded with --keep-quantized, alias --keep-fp8); load it without that option")
        for lp, a in per_layer_arrays(path, np.asarray(value, np.float32), cfg):
            out.update(_checkpoint_tensors(lp, a, checkpoint_names(lp, cfg)[1]))
    return out


def _copy_tokenizer(src: Optional[str], dst: str) -> list[str]:
    if not src:
        return []
    if not os.path.isfile(os.path.join(src, "tokenizer.json")):
        raise FileNotFoundError(f"{src}: no tokenizer.json (tokenizer directory)")
    copied = []
    for f in TOKENIZER_FILES:
        p = os.path.join(src, f)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(dst, f))
            copied.append(f)
    return copied


def export_checkpoint(model, out_dir: str, dtype: str = "fp8", tokenizer_dir: Optional[str] = None,
                      num_shards: Optional[int] = None, overwrite: bool = False, progress: bool = True,
                      include_mtp: Optional[bool] = None) -> dict:
    """Write `model` (a LingForCausalLM) to `out_dir` in the release layout; returns a summary dict.

    dtype: 'fp8' (quantizable matrices FP8 E4M3 + block scales; config gets quantization_config)
    or 'bf16'. include_mtp defaults to "the model has an MTP layer".
    """
    if dtype not in ("fp8", "bf16"):
        raise ValueError(f"dtype must be 'fp8' or 'bf16', got {dtype!r}")
    cfg: LingConfig = model.cfg
    has_mtp = getattr(model, "mtp", None) is not None
    include_mtp = has_mtp if include_mtp is None else bool(include_mtp)
    if include_mtp and not has_mtp:
        raise ValueError("include_mtp: the model has no MTP layer")
    tensors = model_tensors(model)
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    if not include_mtp:
        tensors = {k: v for k, v in tensors.items() if not k.startswith(mtp_prefix)}
    specs = L.expected_tensors(cfg, include_mtp)
    missing = [n for n in specs if n not in tensors]
    extra = [n for n in tensors if n not in specs]
    if missing or extra:
        raise ValueError(f"model parameters do not match the config's tensors: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")
    for n, s in specs.items():
        if tuple(tensors[n].shape) != tuple(s.shape):
            raise ValueError(f"{n}: shape {tuple(tensors[n].shape)}, config implies {tuple(s.shape)}")

    block = tuple(cfg.weight_block_size or DEFAULT_BLOCK)
    entries = L.release_tensors(cfg, dtype, include_mtp, block=block)
    shards = plan_shards(entries, num_shards)
    total = sum(nbytes(d, s) for _, d, s in entries)

    out_dir = prepare_out_dir(out_dir, overwrite, "--overwrite")

    def write(w, name: str, dt: str, bar) -> None:
        if not name.endswith(L.SCALE_SUFFIX):  # a scale is written right after its weight
            write_tensor(w, name, dt, [tensors[name]], block, bar)

    with staged_dir(out_dir) as tmp:
        write_shards(tmp, shards, write, total, desc="exporting", progress=progress)
        write_json(os.path.join(tmp, "config.json"), checkpoint_config_dict(cfg, dtype, include_mtp))
        write_generation_config(tmp, cfg)
        copied = _copy_tokenizer(tokenizer_dir, tmp)
    return {"out_dir": out_dir, "dtype": dtype, "num_tensors": len(entries), "total_size": total,
            "num_shards": len(shards), "tokenizer_files": copied, "include_mtp": include_mtp}


def quantize_like_export(model, dtype: str = "fp8"):
    """A copy of `model` whose parameters went through the export's storage rounding (FP8 blocks or
    BF16, F32 for A_log/dt_bias/expert_bias) and back: what loading the exported checkpoint gives."""
    cfg = model.cfg
    block = tuple(cfg.weight_block_size or DEFAULT_BLOCK)
    specs = L.expected_tensors(cfg, model.mtp is not None)
    graphdef, state = nnx.split(nnx.clone(model))  # split shares Variables with the model: work on a copy
    flat = list(nnx.to_flat_state(state))
    for path, var in flat:
        if not isinstance(var, nnx.Param):
            continue
        a = np.asarray(as_rows(var.get_value()), np.float32)
        out = np.empty_like(a)
        for (lp, x), (_, o) in zip(per_layer_arrays(path, a, cfg), per_layer_arrays(path, out, cfg)):
            parts = [stored_values(t, "F8_E4M3" if specs[n].quantizable and dtype == "fp8" else specs[n].dtype, block)
                     for n, t in _checkpoint_tensors(lp, x, checkpoint_names(lp, cfg)[1]).items()]
            o[...] = np.stack(parts) if is_expert_path(lp) else parts[0].reshape(x.shape)
        var.set_value(jnp.asarray(out, dtype=var.get_value().dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_source(path: str, dtype: str = "float32", step: Optional[int] = None):
    """A model from a checkpoint directory (config.json + safetensors) or an Orbax train directory
    (the `orbax/` manager root written by `ling-jax train`, or one of its step directories)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: directory not found")
    if os.path.isfile(os.path.join(path, "config.json")):
        return load_model(path, dtype, with_mtp=True, progress=False)
    base = os.path.basename(path)
    if base.isdigit() and step is None:
        return load_trained_model(os.path.dirname(path), int(base))
    if os.path.isdir(os.path.join(path, "orbax")):
        path = os.path.join(path, "orbax")
    return load_trained_model(path, step)


def find_tokenizer(path: str) -> Optional[str]:
    """A directory near a parameter source that holds tokenizer.json (itself, tokenizer/, parents)."""
    path = os.path.abspath(path)
    for d in (path, os.path.join(path, "tokenizer"), os.path.dirname(path),
              os.path.join(os.path.dirname(path), "tokenizer"),
              os.path.join(os.path.dirname(os.path.dirname(path)), "tokenizer")):
        if os.path.isfile(os.path.join(d, "tokenizer.json")):
            return d
    return None
