"""`ling-jax quantize --checkpoint DIR --out DIR2 --experts mxfp4`: re-quantise the routed experts.

Streams a release-format checkpoint (FP8 blocks or BF16; an MXFP4-expert one is accepted too and
comes out unchanged, its experts decoded and re-encoded) shard by shard into `DIR2`:

* every routed expert matrix `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight` (the
  MTP layer's included) is dequantised (FP8: value × block scale; BF16 as stored; MXFP4 decoded)
  and MXFP4-encoded (`checkpoint.mxfp4`): U8 codes `[out, in/2]` replace the weight and U8 E8M0
  `weight_scale_inv` `[out, in/32]` replaces its FP8 scale grid;
* every other tensor is copied byte for byte (same name, dtype, shape, shard);
* config.json gets the `quantization_config` of Ling's recipe (`layout.mxfp4_quantization_config`),
  the index a new `total_size`, and every other file of DIR (tokenizer, generation config, ...) is
  copied.

Output shards keep the source's names and tensor membership. Host memory is about one expert matrix
plus one copy chunk (64 MiB), well under a shard. Everything is written into a temporary directory
next to DIR2 and renamed into place at the end: on any error (a malformed source tensor, a full
disk) nothing is left behind. A header-only source gives a header-only result (byte accounting).
"""
from __future__ import annotations

import os
import shutil
import sys

import numpy as np

from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint import mxfp4 as MX
from ling_jax.checkpoint.reader import CheckpointReader
from ling_jax.checkpoint.atomic import prepare_out_dir, staged_dir
from ling_jax.checkpoint.writer import write_mxfp4, write_shards
from ling_jax.config import read_json_file, write_json
from ling_jax.checkpoint.safetensors_io import INDEX_FILE, CheckpointError, ShardWriter, nbytes

COPY_CHUNK_BYTES = 64 << 20


def add_parser(subparsers):
    p = subparsers.add_parser("quantize", help="re-quantise a checkpoint's routed experts (MXFP4)",
                              description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="source checkpoint (FP8 or BF16 release format)")
    p.add_argument("--out", required=True, metavar="DIR2", help="output checkpoint directory")
    p.add_argument("--experts", required=True, choices=("mxfp4",), help="format of the routed experts")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _shard_order(r: CheckpointReader) -> dict[str, list[str]]:
    """shard file name -> its tensor names in data-offset order (the source's file order)."""
    by_file: dict[str, list] = {}
    for name in r.names():
        t = r.info(name)
        by_file.setdefault(os.path.basename(t.file), []).append((t.begin, name))
    return {f: [n for _, n in sorted(v)] for f, v in sorted(by_file.items())}


def _validate_source(r: CheckpointReader) -> None:
    """Structure of the source (`CheckpointReader.problems`: every tensor against config.json, MXFP4
    experts by the config keys, stored dtypes and shapes). First problem + count."""
    probs = r.problems()
    if probs:
        more = f" (and {len(probs) - 1} more)" if len(probs) > 1 else ""
        raise CheckpointError(probs[0] + more)


def expert_values(r: CheckpointReader, name: str) -> np.ndarray:
    """float32 values of a routed expert matrix as stored (FP8 dequantised, BF16, or MXFP4 decoded:
    `CheckpointReader.get`, which refuses NaN scale bytes naming the tensor)."""
    return r.get(name, np.float32)


def _out_entries(r: CheckpointReader, names: list[str]) -> list[tuple[str, str, tuple]]:
    """The output header entries of one source shard (codes followed by their scale)."""
    out = []
    for n in names:
        t = r.info(n)
        w = L.weight_of_scale(n)
        if w is not None and L.is_routed_expert_weight(w):
            continue  # the expert's old scale: replaced by the E8M0 one written after the codes
        if L.is_routed_expert_weight(n):
            logical = t.shape[:-1] + (2 * t.shape[-1],) if t.dtype == MX.PACKED_DTYPE else t.shape
            out.append((n, MX.PACKED_DTYPE, MX.packed_shape(logical, n)))
            out.append((L.scale_name(n), MX.SCALE_DTYPE, MX.scale_shape(logical, n)))
        else:
            out.append((n, t.dtype, t.shape))
    return out


def _copy_tensor(r: CheckpointReader, w: ShardWriter, name: str, bar) -> None:
    t = r.info(name)
    if not t.shape or t.shape[0] == 0:
        w.write(name, r.get_raw(name))
        return
    rows = t.shape[0]
    per = max(1, COPY_CHUNK_BYTES // max(t.nbytes // rows, 1))
    for r0 in range(0, rows, per):
        chunk = r.get_raw(name, (slice(r0, min(rows, r0 + per)),))
        w.write(name, chunk)
        bar.update(chunk.nbytes)


def quantize_checkpoint(src: str, out_dir: str, experts: str = "mxfp4", overwrite: bool = False,
                        progress: bool = False) -> dict:
    """Write `src` with MXFP4 routed experts to `out_dir` (module docstring); returns a summary."""
    if experts != "mxfp4":
        raise ValueError(f"--experts must be mxfp4, got {experts!r}")
    r = CheckpointReader(src)
    if os.path.abspath(out_dir) == r.dir:
        raise ValueError(f"{out_dir}: --out must differ from --checkpoint")
    cfg = r.config
    _validate_source(r)
    order = _shard_order(r)
    plan = {f: _out_entries(r, names) for f, names in order.items()}
    total = sum(nbytes(d, s) for es in plan.values() for _, d, s in es)
    out_dir = prepare_out_dir(out_dir, overwrite, "--force")
    raw_cfg = read_json_file(os.path.join(r.dir, "config.json"), CheckpointError)
    has_mtp = any(n.startswith(f"model.layers.{cfg.num_hidden_layers}.") for n in r.names())
    base = raw_cfg.get("quantization_config") if r.names() and any(
        r.info(n).dtype == "F8_E4M3" for n in r.names()) else None
    raw_cfg["quantization_config"] = L.mxfp4_quantization_config(cfg, base, include_mtp=has_mtp)

    n_experts = 0

    def write(w: ShardWriter, name: str, dt: str, bar) -> None:
        nonlocal n_experts
        if L.is_routed_expert_weight(L.weight_of_scale(name) or ""):
            return  # an expert's E8M0 scale: written with its codes
        if L.is_routed_expert_weight(name):
            write_mxfp4(w, name, expert_values(r, name), bar, f"{r.info(name).file}: {name}")
            n_experts += 1
        else:
            _copy_tensor(r, w, name, bar)

    with staged_dir(out_dir) as tmp:
        write_shards(tmp, plan, write, total, r.header_only, "quantize", progress)
        write_json(os.path.join(tmp, "config.json"), raw_cfg)
        shards = set(order)
        for f in sorted(os.listdir(r.dir)):
            p = os.path.join(r.dir, f)
            if f in shards or f in (INDEX_FILE, "config.json") or f.startswith(".") or not os.path.isfile(p):
                continue
            shutil.copy2(p, os.path.join(tmp, f))  # tokenizer, generation config, ...
    return {"out_dir": out_dir, "total_size": total, "source_total_size": r.total_size,
            "num_shards": len(plan), "experts_quantized": n_experts if not r.header_only else
            sum(1 for n in r.names() if L.is_routed_expert_weight(n)), "header_only": r.header_only}


def run(args) -> int:
    s = quantize_checkpoint(args.checkpoint, args.out, args.experts, overwrite=args.force,
                            progress=not args.quiet and sys.stderr.isatty())
    gib = 1 << 30
    kind = "header-only " if s["header_only"] else ""
    print(f"wrote {kind}checkpoint {s['out_dir']}: {s['experts_quantized']:,} routed expert matrices as MXFP4, "
          f"{s['total_size']:,} tensor bytes ({s['total_size'] / gib:.2f} GiB, source "
          f"{s['source_total_size'] / gib:.2f} GiB) in {s['num_shards']} shards")
    return 0
