"""`ling-jax inspect DIR [--json]`: parameter and byte accounting of a checkpoint from its headers.

Reads only `model.safetensors.index.json` (or a single `model.safetensors`), the 8-byte length and
JSON header of each shard, and `config.json` if present (for `num_hidden_layers` and
`num_experts_per_tok`); no tensor data is read, so it also works on header-only checkpoints
(`write_checkpoint(..., header_only=True)`). Each shard's header is validated (offsets tile the
data, file size matches), as by the checkpoint reader.

Groups, the MTP rule (every tensor of layer index N = num_hidden_layers) and the definition of
active parameters are those of `ling_jax.accounting` (its module docstring documents them).
Without config.json the MTP layer is the layer holding `eh_proj`, and active counts are omitted.

MXFP4 routed experts (`checkpoint.mxfp4`: U8 packed codes `[out, in/2]` + U8/F8_E8M0 E8M0
`weight_scale_inv` `[out, in/32]`) are counted at their logical `[out, in]` parameters and their
stored bytes; the `mxfp4` entry sums them, and a pair whose shapes disagree (odd packed width,
scale shape) is refused naming the tensor. A header-only MXFP4 checkpoint of the real config
(`make-checkpoint ... --header-only --fp8-layout A --conv-dtype F32 --expert-format mxfp4`)
reports 313,151,411,712 B = 291.64 GiB, the seed article's figure.
`fp8_layout` names the spec §12.7 layout ("A"/"B") the stored dtypes follow (None: neither / no FP8).
The published release total (534.35 GiB) is reproduced from a header-only checkpoint in layout A
with FP32 conv taps (the recipe is in `ling_jax.commands.make_checkpoint`).
"""
from __future__ import annotations

import os

from ling_jax.commands.common import print_report
from ling_jax import accounting as A
from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint import mxfp4 as MX
from ling_jax.checkpoint.safetensors_io import open_shards
from ling_jax.checks import check_int
from ling_jax.config import read_json_file


def add_parser(subparsers):
    p = subparsers.add_parser(
        "inspect", help="parameter and byte counts of a checkpoint, from its safetensors headers",
        description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("dir", metavar="DIR", help="checkpoint directory (index + shards, or model.safetensors)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _config_fields(d: str) -> tuple[int | None, int | None]:
    """(num_hidden_layers, num_experts_per_tok) from DIR/config.json, or (None, None)."""
    p = os.path.join(d, "config.json")
    if not os.path.isfile(p):
        return None, None
    c = read_json_file(p, ValueError)

    def pos_int(k):
        v = c.get(k) if isinstance(c, dict) else None
        if v is None:
            return None
        return check_int(v, f"{p}: {k}", field=k, low=0, expected="a non-negative integer")

    return pos_int("num_hidden_layers"), pos_int("num_experts_per_tok")


def inspect_dir(d: str) -> dict:
    """The accounting summary of checkpoint directory `d` (what `--json` prints)."""
    if not os.path.exists(d):
        raise ValueError(f"{d}: checkpoint directory not found")
    if not os.path.isdir(d):
        raise ValueError(f"{d}: not a directory")
    files, infos, meta, _ = open_shards(d, ValueError)  # headers only, checked against the index
    tensors: list[A.Stored] = []
    dtype_bytes: dict[str, int] = {}
    mx_codes: dict[str, tuple] = {}   # routed expert weight stored as MXFP4 codes -> (shape, dtype, file)
    for name, t in infos.items():
        shape = tuple(t.shape)
        if t.dtype == MX.PACKED_DTYPE and L.is_routed_expert_weight(name):
            mx_codes[name] = (shape, t.dtype, os.path.basename(t.file))
            shape = shape[:-1] + (2 * shape[-1],) if shape else shape  # logical [out, in]
        tensors.append(A.Stored(name, shape, t.nbytes, t.dtype, A.is_scale_name(name)))
        dtype_bytes[t.dtype] = dtype_bytes.get(t.dtype, 0) + t.nbytes
    if not tensors:
        raise ValueError(f"{d}: the checkpoint holds no tensors")
    mx = _mxfp4_summary(d, mx_codes, infos)
    n_layers, k = _config_fields(d)
    if n_layers is None:  # no config: the MTP layer is the one with the eh_proj fusion
        mtp = [A._split_layer(t.name)[0] for t in tensors if t.name.endswith(".eh_proj.weight")]
        n_layers = min((i for i in mtp if i is not None), default=None)
    out = A.summarize(tensors, n_layers, k)
    out.update({
        "dir": os.path.abspath(d),
        "files": len(files),
        "header_only": any(sf.header_only for sf in files.values()),
        "header_bytes": sum(sf.data_start for sf in files.values()),
        "file_bytes": sum(sf.data_start + sf.data_size for sf in files.values()),
        "index_total_size": meta.get("total_size"),
        "num_hidden_layers": n_layers,
        "num_experts_per_tok": k,
        "dtype_bytes": dict(sorted(dtype_bytes.items())),
        "fp8_layout": A.detect_fp8_layout(tensors),
        "mxfp4": mx,
    })
    return out


def _mxfp4_summary(d: str, mx_codes: dict, infos: dict) -> dict | None:
    """Bytes of the MXFP4 experts (codes, scales); refuses a malformed pair (first problem + count)."""
    if not mx_codes:
        return None
    probs: list[str] = []
    code_bytes = scale_bytes = 0
    for name, (shape, dt, fname) in mx_codes.items():
        sn = L.scale_name(name)
        st = infos.get(sn) or infos.get(name[: -len(".weight")] + A.MXFP4_SCALE_SUFFIX)
        probs += [f"{os.path.join(d, fname)}: {p}" for p in
                  MX.mxfp4_problems(name, shape, dt, sn, None if st is None else st.shape,
                                    None if st is None else st.dtype)]
        code_bytes += infos[name].nbytes
        scale_bytes += 0 if st is None else st.nbytes
    if probs:
        more = f" (and {len(probs) - 1} more)" if len(probs) > 1 else ""
        raise ValueError(probs[0] + more)
    return {"experts": len(mx_codes), "group_size": MX.GROUP, "code_bytes": code_bytes,
            "scale_bytes": scale_bytes, "bytes": code_bytes + scale_bytes}


def format_table(r: dict) -> str:
    P, B = r["params"], r["bytes"]
    lines = [f"{r['dir']}: {r['files']} file(s), {r['num_tensors']:,} tensors "
             f"({r['num_scale_tensors']:,} block-scale tensors)"
             + (", header-only" if r["header_only"] else ""), ""]
    w, part = 22, r["bytes_by_part"]

    def row(title: str, params: str, b: int) -> str:
        return f"{title:<{w}} {params:>17} {b:>19,} {b / A.GiB:>10.2f}"

    lines.append(f"{'group':<{w}} {'parameters':>17} {'bytes':>19} {'GiB':>10}")
    for g in (*A.GROUPS, "scales"):
        n, b = P["by_group"].get(g), B[g]
        if n or b:
            lines.append(row(A.GROUP_TITLES[g], "-" if g == "scales" else f"{n:,}", b))
    lines.append("-" * (w + 49))
    lines.append(row("Main model", f"{P['main']:,}", part["main"]))
    if P["mtp"] or part["mtp"]:
        lines.append(row("MTP layer", f"{P['mtp']:,}", part["mtp"]))
    lines.append(row("Total", f"{P['total']:,}", B["total"]))
    lines.append("")
    if P["active"] is not None:
        lines.append(f"Active per token (main model): {P['active']:,} "
                     f"({r['num_experts_per_tok']} routed experts per layer + shared expert, attention, routers,"
                     f" norms, dense FFN, lm_head; input embedding excluded) — {P['active_with_embedding']:,}"
                     f" with the embedding")
    else:
        lines.append("Active per token: n/a (no config.json with num_experts_per_tok)")
    lines.append(f"Headers: {r['header_bytes']:,} B; files: {r['file_bytes']:,} B"
                 + (f"; index total_size: {r['index_total_size']:,} B" if r["index_total_size"] is not None
                    else ""))
    lines.append("Stored dtypes: " + ", ".join(f"{k} {v / A.GiB:.2f} GiB" for k, v in r["dtype_bytes"].items()))
    if r.get("fp8_layout"):
        lines.append(f"FP8 layout (spec §12.7): {r['fp8_layout']}")
    if r.get("mxfp4"):
        m = r["mxfp4"]
        lines.append(f"MXFP4 routed experts: {m['experts']:,} matrices, {m['code_bytes'] / A.GiB:.2f} GiB codes + "
                     f"{m['scale_bytes'] / A.GiB:.2f} GiB E8M0 scales (one per {m['group_size']} inputs)")
    return "\n".join(lines)


def run(args) -> int:
    return print_report(inspect_dir(args.dir), args.json, format_table)
