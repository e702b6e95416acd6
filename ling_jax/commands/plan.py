"""`ling-jax plan`: weight and cache memory of serving a config on a device mesh.

    ling-jax plan --config FILE --weights bf16|fp8|mxfp4 [--mesh SPEC] [--device-memory GiB]
                  [--reserve GiB] [--sequences N] [--no-mtp] [--fp8-layout A|B] [--json]

Weight formats (byte rules in `ling_jax.accounting`): bf16 = 2 bytes per parameter; fp8 = the
release format (FP8 matrices + one float32 scale per 128x128 block, the rest BF16 / FP32);
mxfp4 = routed experts at 4.25 bits per weight, everything else as fp8. For the real config
(MTP included) these are 1,065.66 / 534.35 / 291.64 GiB. The release's fp8 layout is taken to be
"Layout A" of spec §12.7 (MLA kv_a_proj_with_mqa BF16, FP32 conv taps), the one that reproduces the
published byte total; --fp8-layout B gives the writer's default layout (534.33 GiB with FP32 taps).
Both layouts come from one table, `ling_jax.checkpoint.layout.BF16_MATRICES`, which `ling-jax
make-checkpoint --fp8-layout A|B --conv-dtype BF16|F32` writes, so `ling-jax inspect` on a header-only
checkpoint written with `--fp8-layout A --conv-dtype F32` reports the same bytes as this command.

Sharding over `--mesh data=D,expert=E,model=M` (missing axes are 1; the same parser and the same
rules as loading onto a mesh, `sharding/rules.py`): every weight is placed by the logical axes its
parameter declares. Routed experts (main and MTP, with their scales) split over `expert` and their
intermediate width over `model`; attention heads, vocabulary and dense FFN widths over `model`;
the latent MLA down-projections, routers, norms and dense-matrix FP8 scales are replicated; everything
is replicated over `data`. A dimension that does not divide its axis (for head dimensions: a head
count that does not divide) is replicated along it, exactly as the loader does.

Cache: the MLA latent cache (BF16, kv_lora_rank + qk_rope_head_dim = 576 values per token per MLA
layer, MTP layer included unless --no-mtp) has a single KV head, so each device of a model replica
keeps all of it; the KDA recurrent state (FP32 [heads, 128, 128] per KDA layer) and the BF16 conv
state (3 x width x (kernel-1) per KDA layer) split by head/channel over the `model` axis.
--kv-cache-dtype fp8: the MLA cache as float8 + two float32 scales per token (584 B per layer).

Three per-device weight figures: "per device" (the stored bytes placed by the loader's rules: what
`tokens_fit` uses), "even split" (total / devices, every tensor split evenly: the seed article's
arithmetic, 291.64 / 4 = 72.91 GiB) and "resident" (the bytes of the device arrays the loaded model
holds with --keep-quantized in bfloat16: routers float32, FP8 expert scales expanded per element;
`accounting.resident_bytes_per_device`). With --device-memory, `tokens_fit` = floor((memory -
weights - reserve - sequences x KDA state and conv state) / MLA bytes per token) per device (= per
model replica; `tokens_fit_mesh` multiplies by the data axis); the even-split line repeats it with
the seed's arithmetic (weights and KDA state divided by the device count).
"""
from __future__ import annotations

import argparse
import math

from ling_jax.commands.common import print_report
from ling_jax import accounting as A
from ling_jax.checks import check_int
from ling_jax.config import LingConfig
from sharding.mesh import parse_mesh_shape

DEFAULT_RESERVE_GIB = 6.0  # per device: what the seed's verdict (4xH100, ~1 GiB free, ~96K tokens) holds back


def add_parser(subparsers):
    p = subparsers.add_parser("plan", help="weight and cache memory per device for a config and mesh",
                              description=__doc__.split("\n\n", 2)[2],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, metavar="FILE",
                   help="config.json (or a checkpoint directory holding one)")
    p.add_argument("--weights", required=True, metavar="FORMAT", help="bf16, fp8 (release format) or mxfp4")
    p.add_argument("--mesh", metavar="SPEC", default=None,
                   help="mesh axes, e.g. data=1,expert=8,model=4 (axes data, expert, model; default one device)")
    p.add_argument("--device-memory", metavar="GiB", default=None,
                   help="memory per device in GiB (e.g. 80 for H100, 141 for H200); enables tokens_fit")
    p.add_argument("--reserve", metavar="GiB", default=str(DEFAULT_RESERVE_GIB),
                   help="memory per device held back for activations, workspaces, CUDA graphs (default "
                        f"{DEFAULT_RESERVE_GIB:g}: the seed's 4xH100 verdict, ~96K tokens, assumes it; 0 = none)")
    p.add_argument("--sequences", metavar="N", default="1",
                   help="concurrent sequences whose KDA state must fit next to the MLA cache (default 1)")
    p.add_argument("--no-mtp", action="store_true", help="leave out the MTP layer's weights and cache")
    p.add_argument("--fp8-layout", metavar="A|B", default=A.RELEASE_FP8_LAYOUT,
                   help="which MLA matrix the release keeps BF16: A = kv_a_proj_with_mqa (reproduces the "
                        "published byte total; default), B = head-wise g_proj (make-checkpoint's default)")
    p.add_argument("--kv-cache-dtype", metavar="bf16|fp8", default="bf16",
                   help="MLA latent cache storage: bf16 (default) or fp8 (1 byte per value + a float32 scale per "
                        "token for the latent and one for the rope key: 584 instead of 1,152 B per token per layer)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def _number(s, what: str, allow_zero: bool) -> float:
    try:
        v = float(s)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of GiB, got {s!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{what} must be a {'non-negative' if allow_zero else 'positive'} number of GiB, "
                         f"got {s!r}")
    return v


def plan_from_args(args) -> dict:
    fmt = str(args.weights).lower()
    if fmt not in A.FORMATS:
        raise ValueError(f"unknown --weights format {args.weights!r} (expected one of: {', '.join(A.FORMATS)})")
    layout = str(args.fp8_layout).upper()
    if layout not in A.FP8_LAYOUTS:
        raise ValueError(f"unknown --fp8-layout {args.fp8_layout!r} (expected A or B)")
    mesh = parse_mesh_shape(args.mesh)
    mem = None if args.device_memory is None else _number(args.device_memory, "--device-memory", False)
    reserve = _number(args.reserve, "--reserve", True)
    try:
        seqs = int(str(args.sequences))
    except ValueError:
        seqs = args.sequences  # refused by name below
    seqs = check_int(seqs, "--sequences", low=0, expected="a non-negative integer")
    kv = str(args.kv_cache_dtype).lower()
    if kv not in ("bf16", "fp8"):
        raise ValueError(f"unknown --kv-cache-dtype {args.kv_cache_dtype!r} (expected bf16 or fp8)")
    cfg = LingConfig.from_json(args.config)
    return A.plan(cfg, fmt, mesh, mem, include_mtp=not args.no_mtp, reserve_gib=reserve, sequences=seqs,
                  fp8_layout=layout, kv_cache_dtype=kv)


def format_text(r: dict) -> str:
    b = A.fmt_bytes
    mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
    fmt = r["weights"] + (f" (layout {r['fp8_layout']}, conv taps {r['conv_dtype']})" if r["fp8_layout"] else "")
    lines = [
        f"weights        {fmt}, MTP layer {'included' if r['include_mtp'] else 'excluded'}",
        f"parameters     {r['params']:,}",
        f"weight bytes   {r['weight_bytes']:,} ({r['weight_gib']:.2f} GiB)",
        f"mesh           {mesh} ({r['devices']} devices)",
        f"per device     {r['weight_bytes_per_device']:,} ({r['weight_gib_per_device']:.2f} GiB; routed experts "
        f"{b(r['routed_expert_bytes_per_device'])}; placed by the loader's rules)",
        f"even split     {r['even_split_bytes_per_device']:,} ({r['even_split_gib_per_device']:.2f} GiB = total / "
        f"{r['devices']} devices, every tensor split evenly: the seed article's arithmetic)",
        f"resident       {r['resident_bytes_per_device']:,} ({r['resident_gib_per_device']:.2f} GiB: the device arrays "
        f"of the loaded model, bfloat16, quantised weights kept; routers float32)",
        f"MLA cache      {r['kv_cache_dtype']}, {r['mla_cache_bytes_per_token']:,} B/token ({r['mla_cache_bytes_per_token_main']:,} main "
        f"layers + {r['mla_cache_bytes_per_token_mtp']:,} MTP), full copy on every device of a replica",
        f"KDA state      {r['kda_state_bytes_per_sequence']:,} B/sequence ({b(r['kda_state_bytes_per_sequence'])}; "
        f"{b(r['kda_state_bytes_per_sequence_per_device'])} per device)",
        f"KDA conv state {r['kda_conv_state_bytes_per_sequence']:,} B/sequence "
        f"({b(r['kda_conv_state_bytes_per_sequence_per_device'])} per device)",
    ]
    if r["device_memory_bytes"] is not None:
        lines += [
            f"device memory  {b(r['device_memory_bytes'])}, reserve {b(r['reserve_bytes'])}, "
            f"free after weights {b(r['free_bytes_per_device'])}",
            f"tokens fit     {r['tokens_fit']:,} tokens of MLA cache per replica with {r['sequences']} sequence(s) "
            f"of KDA state" + ("" if r["fits"] else "  -- DOES NOT FIT"),
            f"even split     free after weights {b(r['even_split_free_bytes_per_device'])}, "
            f"{r['even_split_tokens_fit']:,} tokens of MLA cache (KDA state split evenly too)",
        ]
    return "\n".join(lines)


def run(args) -> int:
    return print_report(plan_from_args(args), args.json, format_text)
