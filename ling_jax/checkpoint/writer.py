"""Write a synthetic, seeded checkpoint in the release format (spec §12; FP8 layout A or B of §12.7).

The output directory looks like the Hugging Face release: `config.json` (with the release
`quantization_config` for fp8), `generation_config.json`, `model.safetensors.index.json`,
`model-0000k-of-0000N.safetensors` shards, and a small byte-level BPE tokenizer
(`tokenizer_files.build_tokenizer`).

Tensors are generated and written one at a time, in row chunks, so memory stays bounded whatever
the config. Values are random but chosen so a forward pass is non-degenerate: linear weights
N(0, 1/fan_in) (activations stay O(1)), norm weights 1 + 0.1·N, embeddings N(0, 1), routers with a
larger gain so sigmoid scores spread, A_log = log U(1, 16), small dt_bias / expert_bias.
Each tensor has its own generator seeded by (seed, crc32(name)), so its values do not depend on
sharding, chunking or which other tensors exist (see `generate_chunks`).

Which matrices are FP8 is `layout.BF16_MATRICES[fp8_layout]` (the table `ling-jax plan` uses too);
the default stays layout B with BF16 conv taps (`layout.DEFAULT_FP8_LAYOUT`/`DEFAULT_CONV_DTYPE`).
Values do not depend on the layout: a layout-A and a layout-B checkpoint of the same seed differ
only in how MLA `kv_a_proj_with_mqa` and `g_proj` are rounded (BF16 vs FP8 blocks).
"""
from __future__ import annotations

import math
import os
import zlib
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
from tqdm import tqdm

from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint import mxfp4 as MX
from ling_jax.checkpoint.atomic import prepare_out_dir, staged_dir
from ling_jax.checkpoint.fp8 import DEFAULT_BLOCK, block_dequant_fp8, block_quant_fp8
from ling_jax.checkpoint.safetensors_io import INDEX_FILE, DTYPES, ShardWriter, nbytes
from ling_jax.checkpoint.tokenizer_files import build_tokenizer, write_tokenizer_files
from ling_jax.checks import check_int
from ling_jax.config import LingConfig, write_json

SHARD_TARGET_BYTES = 5_000_000_000  # default shard size (the HF "5GB" convention)
CHUNK_ELEMENTS = 1 << 23            # generate at most ~8M float32 values (32 MiB) at a time
FP8 = "F8_E4M3"


def shard_file_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


# ---------------------------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------------------------
def init_distribution(name: str, spec: L.TensorSpec) -> tuple[str, float, float]:
    """(kind, a, b) of a tensor's random init: ('normal', mean, std) or ('log_uniform', lo, hi)."""
    k = spec.kind
    if k == L.EMBEDDING:
        return ("normal", 0.0, 1.0) if "word_embeddings" in name else ("normal", 0.0, 1.0 / math.sqrt(spec.shape[1]))
    if k == L.NORM:
        return ("normal", 1.0, 0.1)
    if k == L.CONV:
        return ("normal", 0.0, 1.0 / math.sqrt(spec.shape[-1]))
    if k == L.PARAM:
        if name.endswith("A_log"):
            return ("log_uniform", 1.0, 16.0)
        if name.endswith("expert_bias"):
            return ("normal", 0.0, 0.01)
        return ("normal", 0.0, 0.1)  # dt_bias
    if k == L.ROUTER:
        # logits std ≈ 2 for O(1) inputs: sigmoid scores spread over roughly (0.1, 0.9)
        return ("normal", 0.0, 2.0 / math.sqrt(spec.shape[1]))
    # LINEAR. The KDA forget-gate projection gets a smaller gain: its output is multiplied by
    # exp(A_log) ∈ [1, 16] inside a sigmoid, and N(0, 1) pre-activations would saturate the gate
    # to exactly "keep" or "forget"; gain 0.25 keeps decays spread over (e^-5, 1).
    gain = 0.25 if name.endswith("attention.f_proj.weight") else 1.0
    return ("normal", 0.0, gain / math.sqrt(spec.shape[1]))


def _row_chunk(spec: L.TensorSpec, quantized: bool, block) -> int:
    row = max(1, math.prod(spec.shape[1:]))
    rows = max(1, CHUNK_ELEMENTS // row)
    if quantized:
        rows = max(block[0], rows // block[0] * block[0])
    return rows


def generate_chunks(name: str, spec: L.TensorSpec, seed: int, rows_per_chunk: Optional[int] = None
                    ) -> Iterator[np.ndarray]:
    """The tensor's float32 values as consecutive row chunks (identical values for any chunking)."""
    kind, a, b = init_distribution(name, spec)
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode("utf-8"))])
    shape = spec.shape
    rows, rest = (shape[0], tuple(shape[1:])) if shape else (1, ())
    per = rows_per_chunk or rows
    row_elems = math.prod(rest)
    for r0 in range(0, rows, per):
        n = min(per, rows - r0)
        if kind == "normal":
            x = rng.standard_normal(n * row_elems, dtype=np.float32)
            x *= np.float32(b)
            if a:
                x += np.float32(a)
        elif kind == "log_uniform":
            x = np.log(np.float32(a) + np.float32(b - a) * rng.random(n * row_elems, dtype=np.float32))
        else:  # pragma: no cover
            raise AssertionError(kind)
        yield x.reshape((n,) + rest) if shape else x.reshape(())


# ---------------------------------------------------------------------------------------------
# sharding
# ---------------------------------------------------------------------------------------------
def plan_shards(entries: list[tuple[str, str, tuple[int, ...]]], num_shards: Optional[int] = None
                ) -> dict[str, list[tuple[str, str, tuple[int, ...]]]]:
    """Split the ordered entries into `num_shards` contiguous, non-empty, byte-balanced shards
    ({shard file name: entries}).

    A weight and its `weight_scale_inv` always share a shard (the writer streams them together).
    """
    groups: list[list] = []
    for e in entries:
        if e[0].endswith(L.SCALE_SUFFIX) and groups and L.weight_of_scale(e[0]) == groups[-1][0][0]:
            groups[-1].append(e)
        else:
            groups.append([e])
    sizes = [sum(nbytes(d, s) for _, d, s in g) for g in groups]
    total = sum(sizes)
    if num_shards is None:
        num_shards = max(2, math.ceil(total / SHARD_TARGET_BYTES))
    check_int(num_shards, "num_shards", low=1, expected="a positive integer")
    num_shards = min(num_shards, len(groups))
    shards: list[list] = [[]]
    done = 0
    for i, (g, sz) in enumerate(zip(groups, sizes)):
        k = len(shards) - 1
        if shards[-1] and k < num_shards - 1:
            groups_left, shards_left = len(groups) - i, num_shards - 1 - k
            if done >= (k + 1) * total / num_shards or groups_left <= shards_left:
                shards.append([])
        shards[-1].extend(g)
        done += sz
    assert len(shards) == num_shards and all(shards)
    return {shard_file_name(k, num_shards): s for k, s in enumerate(shards, 1)}


# ---------------------------------------------------------------------------------------------
# writer
# ---------------------------------------------------------------------------------------------
def checkpoint_config_dict(cfg: LingConfig, dtype: str = "fp8", include_mtp: bool = True,
                           fp8_layout: str = L.DEFAULT_FP8_LAYOUT, experts: Optional[str] = None) -> dict:
    """The config.json content for a checkpoint of `cfg` in `dtype` (fp8: `fp8_layout`'s
    `quantization_config.modules_to_not_convert`; experts='mxfp4': plus the MXFP4 expert keys)."""
    d = {k: v for k, v in cfg.to_dict().items()  # an empty SwiGLU limit list (no clamp) is left out
         if k != "quantization_config" and not (k.endswith("swiglu_limit_list") and not v)}
    if not include_mtp:
        d["num_nextn_predict_layers"] = 0
    if dtype == "fp8":
        d["quantization_config"] = L.quantization_config(cfg, include_mtp, fp8_layout)
    if L.check_expert_format(experts) == "mxfp4":
        d["quantization_config"] = L.mxfp4_quantization_config(cfg, d.get("quantization_config"), include_mtp)
    return d


def write_generation_config(d: str, cfg: LingConfig) -> None:
    """generation_config.json with the config's eos (int or list), pad and bos ids."""
    c = cfg.to_dict()
    gen = {k: c[k] for k in ("eos_token_id", "pad_token_id", "bos_token_id") if c[k] is not None}
    write_json(os.path.join(d, "generation_config.json"), gen)


def write_shards(tmp: str, shards: dict[str, list], write: Callable, total: int, header_only: bool = False,
                 desc: str = "writing checkpoint", progress: bool = True) -> None:
    """Every shard `{file name: header entries}` into `tmp`, then the index (`total_size` = `total`).
    `write(w, name, dtype, bar)` streams one entry's data (a scale may be written with its weight);
    a header-only checkpoint gets no data."""
    weight_map: dict[str, str] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress or header_only, leave=False)
    try:
        for fname, entries in shards.items():
            with ShardWriter(os.path.join(tmp, fname), entries, {"format": "pt"}, header_only) as w:
                for name, dt, _ in entries:
                    weight_map[name] = fname
                    if not header_only:
                        write(w, name, dt, bar)
    finally:
        bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if header_only:
        index["metadata"]["ling_jax_header_only"] = True
    write_json(os.path.join(tmp, INDEX_FILE), index)


def write_checkpoint(cfg: LingConfig, out_dir: str, dtype: str = "fp8", seed: int = 0,
                     num_shards: Optional[int] = None, header_only: bool = False, tokenizer: bool = True,
                     include_mtp: bool = True, overwrite: bool = False, progress: bool = True,
                     fp8_layout: str = L.DEFAULT_FP8_LAYOUT, conv_dtype: str = L.DEFAULT_CONV_DTYPE,
                     experts: Optional[str] = None) -> dict:
    """Write a seeded random checkpoint of `cfg` to `out_dir`; returns a summary dict.

    dtype: 'fp8' (FP8 E4M3 + float32 block scales) or 'bf16' (no quantization).
    fp8_layout: 'B' (default) or 'A', which matrices fp8 keeps BF16 (`layout.BF16_MATRICES`, spec §12.7;
    the `make-checkpoint` docstring says which is which). Ignored for dtype='bf16'.
    conv_dtype: storage dtype of the KDA conv taps, 'BF16' (default) or 'F32' (the spec leaves it open).
    experts: None (routed experts stored like the other matrices) or 'mxfp4': routed experts (MTP
    layer's included) as MXFP4 (`checkpoint.mxfp4`), encoded from their values after rounding to
    `dtype` -- exactly what `ling-jax quantize --experts mxfp4` makes of the `dtype` checkpoint.
    header_only: write shard headers and the index with the real shapes and offsets but no tensor
    bytes (each shard is truncated right after its header and marked in its metadata).
    Everything is written into a temporary directory next to `out_dir` and renamed into place at
    the end, so a failure never leaves a half-written checkpoint.
    """
    if dtype not in ("fp8", "bf16"):
        raise ValueError(f"dtype must be 'fp8' or 'bf16', got {dtype!r}")
    check_int(seed, "seed", expected="an integer")
    for i in (*cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id):
        if i is not None and not 0 <= int(i) < cfg.vocab_size:
            raise ValueError(f"special token id {i} is not a valid id for vocab_size={cfg.vocab_size}")
    fp8_layout = L.check_fp8_layout(fp8_layout)
    conv_dtype = L.check_conv_dtype(conv_dtype)
    experts = L.check_expert_format(experts)
    out_dir = prepare_out_dir(out_dir, overwrite)
    block = tuple(cfg.weight_block_size or DEFAULT_BLOCK)
    specs = L.expected_tensors(cfg, include_mtp, conv_dtype, fp8_layout)
    entries = L.release_tensors(cfg, dtype, include_mtp, conv_dtype, block, fp8_layout, experts)
    shards = plan_shards(entries, num_shards)
    total = sum(nbytes(d, s) for _, d, s in entries)
    tok = build_tokenizer(cfg) if tokenizer else None  # fails early on a too-small vocabulary

    def write(w: ShardWriter, name: str, dt: str, bar) -> None:
        if name.endswith(L.SCALE_SUFFIX):
            return  # written together with its weight
        if dt == MX.PACKED_DTYPE and L.is_routed_expert_weight(name):
            # a routed expert: its values rounded to `dtype` (FP8 blocks or BF16) as the release stores
            # them, then MXFP4-encoded; one expert matrix ([I, D] or [D, I]) is in memory at a time
            x = np.concatenate(list(generate_chunks(name, specs[name], seed)), axis=0)
            write_mxfp4(w, name, stored_values(x, FP8 if dtype == "fp8" else "BF16", block), bar)
        else:
            chunks = generate_chunks(name, specs[name], seed, _row_chunk(specs[name], dt == FP8, block))
            write_tensor(w, name, dt, chunks, block, bar)

    with staged_dir(out_dir) as tmp:
        write_shards(tmp, shards, write, total, header_only, progress=progress)
        write_json(os.path.join(tmp, "config.json"), checkpoint_config_dict(cfg, dtype, include_mtp, fp8_layout,
                                                                            experts))
        write_generation_config(tmp, cfg)
        if tok is not None:
            write_tokenizer_files(tmp, tok)
    return {"out_dir": out_dir, "num_tensors": len(entries), "total_size": total, "num_shards": len(shards),
            "dtype": dtype, "header_only": header_only,
            "fp8_layout": fp8_layout if dtype == "fp8" else None, "conv_dtype": conv_dtype, "experts": experts}


def write_tensor(w: ShardWriter, name: str, dt: str, chunks: Iterable[np.ndarray], block, bar) -> None:
    """One tensor from its float32 row chunks: cast to `dt`, or for F8_E4M3 quantised per block with
    its float32 scale grid written right after it (`fp8.block_quant_fp8`)."""
    scales = []
    for chunk in chunks:
        c, s = block_quant_fp8(chunk, block) if dt == FP8 else (chunk.astype(DTYPES[dt]), None)
        w.write(name, c)
        bar.update(c.nbytes)
        scales.append(s)
    if dt == FP8:
        s = np.concatenate(scales, axis=0)
        w.write(L.scale_name(name), s)
        bar.update(s.nbytes)


def write_mxfp4(w: ShardWriter, name: str, x: np.ndarray, bar, where: Optional[str] = None) -> None:
    """float32 matrix `x` MXFP4-encoded (`mxfp4.quantize_mxfp4`; `where` names it in errors): its
    codes as `name`, then the E8M0 `weight_scale_inv`."""
    packed, scales = MX.quantize_mxfp4(x, where or name)
    w.write(name, packed)
    w.write(L.scale_name(name), scales)
    bar.update(packed.nbytes + scales.nbytes)


def stored_values(x: np.ndarray, dt: str, block) -> np.ndarray:
    """float32 `x` as stored with safetensors dtype `dt` and read back (F8_E4M3: per-block FP8)."""
    if dt == FP8:
        return block_dequant_fp8(*block_quant_fp8(x, block), block)
    return x.astype(DTYPES[dt]).astype(np.float32)

